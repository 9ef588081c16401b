"""Result rows of earlier schemas, upgraded once where a run is loaded (results.load_run): the one place
that knows how earlier rows were written.

Schema 2 keeps, in each unit's plan_info, what its plan recorded for the model under "model"
(roofline/predict.py) and, in an `auto` unit's record of each candidate, the candidate's own. Schema 1
rows hold the same facts under the keys their backends wrote; this builds the record from them.
"""
from __future__ import annotations

import json

from ...kernels.auto import AUTO_RECORD
from ...kernels.base import backend_class, get_backend, registered_names
from ...kernels.q_packed.hybrid import HybridBackend
from ...kernels.kv_outer.config import launch_terms
from ...roofline.model import DEFAULT_TILE_TOKENS
from ...roofline.schedules import Schedule
from ...scenarios.stats import UNION_TILES

MODEL_RECORD_SCHEMA = 2


def upgrade(status: dict, schema: int) -> dict:
    """`status` (a unit's status.json) as schema MODEL_RECORD_SCHEMA writes it."""
    if schema >= MODEL_RECORD_SCHEMA or not isinstance(status.get("plan_info"), str):
        return status
    try:
        info = json.loads(status["plan_info"])
    except json.JSONDecodeError:
        return status
    if not isinstance(info, dict):
        return status
    info.setdefault("model", record_of(info, status))
    hybrid = (((info.get(AUTO_RECORD) or {}).get("used")) or {}).get(HybridBackend.name)
    if isinstance(hybrid, dict) and "record" not in hybrid:
        hybrid["record"] = {"split": _hybrid_split(hybrid, info[AUTO_RECORD].get("used") or {})}
    return {**status, "plan_info": json.dumps(info)}


def record_of(info: dict, status: dict) -> dict:
    """The model record of a schema-1 plan_info: the tile it ran, the tokens its MMAs covered, its critical
    walk, the launch terms of a KV-stationary plan, the dense path."""
    schedule = info.get("schedule") or _declared(status.get("backend", ""))
    record = {}
    if isinstance(info.get("tile_tokens"), int):
        record["tile_tokens"] = info["tile_tokens"]
    if schedule == Schedule.Q_PACKED:
        if info.get("mma_tokens"):
            record["mma_tokens"] = info["mma_tokens"]
        if record.get("tile_tokens", DEFAULT_TILE_TOKENS) not in UNION_TILES:
            record["traffic_tokens"] = DEFAULT_TILE_TOKENS     # the 12-token tile: the 8-token tiles' traffic
        if info.get("critical_union_ratio"):
            record["executed_union_ratio"] = info["critical_union_ratio"]
    elif schedule in (Schedule.KV_OUTER, Schedule.MSA_SCATTER):
        config = info.get("config") if isinstance(info.get("config"), dict) else None
        record["launch"] = launch_terms(int(status.get("hkv") or status.get("wl_hkv") or 4), status["dtype"], config)
    elif schedule == Schedule.DENSE_MASKED:
        record["paged"] = bool(info.get("paged", False))
    return record


def _declared(backend: str):
    try:
        return backend_class(backend).schedule
    except KeyError:
        return None


def _hybrid_split(hybrid: dict, used: dict) -> dict:
    """An `auto` unit's schema-1 record of the hybrid as recorded parts: each part's predicted time and the
    fraction it was divided by, which a replay divides by today's instead (predict.hybrid_time)."""
    parts = {}
    for part in ("packed", "kv_outer"):
        if f"{part}_s" not in hybrid:
            continue
        kernel = hybrid.get(part)
        name = kernel
        if part == "packed" and kernel in registered_names():       # its tile size's fraction
            name = dict(get_backend(kernel).tile_fractions).get(hybrid.get("tile_tokens"), kernel)
        parts[part] = {"predicted_s": float(hybrid[f"{part}_s"]), "fraction": name,
                       "divided_by": hybrid.get(f"{part}_achieved") or (used.get(kernel) or {}).get("achieved"),
                       "divided_by_name": kernel, "decode_share": hybrid.get(f"{part}_decode_share", 0.0)}
    return {"parts": parts, **{k: hybrid[k] for k in ("tile_tokens", "min_share", "packed_entry_share", "packed",
                                                       "kv_outer") if k in hybrid}}

