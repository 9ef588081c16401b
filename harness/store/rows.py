"""What a unit row says of its plan (its schedule, tile, launch, quantization), the device profile of a run,
and the roofline of a hypothetical point for the report's curves. No byte or FLOP terms live here, and no
module prediction: that is roofline/predict.py's.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ...kernels.base import get_backend
from ...roofline.devices import DeviceProfile, run_profile
from ...roofline.model import ALL_SCHEDULES, DEFAULT_TILE_TOKENS, ModelShape, Prediction, predict, union_tokens
from ...roofline.predict import usable
from ...roofline.schedules import Schedule, is_schedule
from .results import STATUS_OK, Run


def schedule_of(backend: str, plan_info=None) -> str | None:
    """The schedule a unit of `backend` ran, as a plain string: the one the backend declares
    (`Backend.schedule`; BASE@OPTION runs BASE's, "kv-outer-cute@v23" is KV-outer), else, for a backend
    that picks one per workload (`auto`), the one its plan_info records under "schedule". None for a
    backend that declares none and a name not registered here."""
    from ...kernels.base import declared_schedule
    declared = declared_schedule(backend)
    recorded = _info(plan_info).get("schedule")
    if declared is None and recorded:
        return str(recorded) if is_schedule(recorded) else None
    return None if declared is None else str(declared)


def _info(plan_info) -> dict:
    import json
    if isinstance(plan_info, str):
        try:
            plan_info = json.loads(plan_info)
        except json.JSONDecodeError:
            return {}
    return plan_info if isinstance(plan_info, dict) else {}


def tile_tokens(plan_info) -> int:
    """The token tile P a q-packed plan records under "tile_tokens" (default 8)."""
    value = _info(plan_info).get("tile_tokens")
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1 \
        else DEFAULT_TILE_TOKENS


def quantization(plan_info) -> str:
    """What the unit quantized, as its backend states it in plan.info["quantization"] ("" if unstated)."""
    return str(_info(plan_info).get("quantization") or "")


def plan_config(plan_info) -> dict | None:
    """The launch configuration recorded in a unit's plan_info (JSON text or dict), if any."""
    cfg = _info(plan_info).get("config")
    return cfg if isinstance(cfg, dict) else None


def launch_labels(plan_info) -> dict:
    """What a KV-stationary unit ran, from its plan_info: the scheduler's tile order (kv_outer's
    notation, "1:0" = key order) and the CuTe kernel, where recorded (runs made before 2026-12-01 record it
    as cute_variant)."""
    import json
    from ...kernels.kv_outer.config import tile_order_label
    try:
        info = json.loads(plan_info) if isinstance(plan_info, str) else plan_info
    except json.JSONDecodeError:
        return {}
    cfg = plan_config(info)
    out = {}
    if cfg is not None and "q_ranges" in cfg:
        out["tile order"] = tile_order_label(cfg)
    if isinstance(info, dict) and (info.get("cute_kernel") or info.get("cute_variant")):
        out["kernel"] = info.get("cute_kernel") or info["cute_variant"]
    return out


def device_for_run(meta: dict, override: DeviceProfile | None = None) -> DeviceProfile | None:
    """The device profile the run recorded, else its GPU's (roofline.devices.run_profile; None for CPU
    runs), unless one is given."""
    if override is not None:
        return override
    return run_profile(meta).profile


def predict_point(schedule: str, shape: ModelShape, n_tokens: float, nsb: float, device: DeviceProfile,
                  flops: float | None = None, selected_per_query: float | None = None,
                  union_ratio: float | None = None, tile: int = DEFAULT_TILE_TOKENS,
                  executed_union_ratio: float | None = None, shared_nsb: float | None = None) -> Prediction | None:
    """predict() for one measured point; `flops`, `selected_per_query` and `union_ratio` (at P = tile) from
    the workload's stats (scenarios.stats) when known, so causal masking and padding count as the workload
    has them; union_ratio at P = `tile` (model.union_tokens: q-packed's tile, Q-outer's L2 window). None for
    q-packed without a union_ratio: its cost is set by co-selection, never assumed."""
    if schedule not in ALL_SCHEDULES:       # hybrid: no one closed form (auto models it as a sum)
        return None
    if schedule is None or not usable(n_tokens) or nsb is None or not math.isfinite(nsb):
        return None
    if schedule == Schedule.Q_PACKED and not usable(union_ratio):
        return None
    return predict(schedule, shape, n_tokens, nsb, device,
                   selected_per_query=selected_per_query if usable(selected_per_query) else None,
                   flops=flops if usable(flops) else None,
                   union_ratio=float(union_ratio) if usable(union_ratio) and union_tokens(schedule) else None,
                   tile_tokens=tile,
                   executed_union_ratio=float(executed_union_ratio) if usable(executed_union_ratio) else None,
                   shared_nsb=float(shared_nsb) if usable(shared_nsb) or shared_nsb == 0 else None)


# ---- a run's rows ------------------------------------------------------------------------------

def unit_table(run: Run) -> pd.DataFrame:
    """One row per unit: status columns, nsb/N (`x`), and wide `<stage>.<statistic>` columns."""
    st = run.status.copy()
    if st.empty:
        return st
    if "wl_nsb_per_n" in st:
        st["x"] = st["wl_nsb_per_n"]
    elif {"wl_nsb", "wl_n_tokens"} <= set(st):
        st["x"] = st["wl_nsb"] / st["wl_n_tokens"]
    else:
        st["x"] = st.get("reuse", np.nan)
    if {"plan_info", "schedule", "backend"} <= set(st):      # `auto` units: the schedule their plan chose
        st["schedule"] = [s if s != "none" else (schedule_of(b, p) or "none")
                          for s, b, p in zip(st["schedule"], st["backend"], st["plan_info"])]
    if run.stats.empty:
        return st
    wide = run.stats.pivot_table(index=["point_key", "backend"], columns=["stage", "statistic"],
                                 values="value", aggfunc="first")
    wide.columns = [f"{a}.{b}" for a, b in wide.columns]
    return st.merge(wide.reset_index(), on=["point_key", "backend"], how="left")


def ok_units(run: Run) -> pd.DataFrame:
    t = unit_table(run)
    return t[t["status"] == STATUS_OK] if not t.empty else t


def row_record(row) -> dict:
    """What a unit's plan recorded for the model (plan_info "model"; harness/store/migrate.py upgrades older rows)."""
    return _info(row.get("plan_info")).get("model") or {}


def row_facts(row):
    """The model's facts of a unit row's backend, None for one not registered here."""
    try:
        return get_backend(row["backend"]).facts
    except KeyError:
        return None


def ran_stages(backend, row) -> list[str]:
    """The stages of `backend` (Backend.stage_names) a unit row timed: those with a finite median."""
    return [s for s in backend.stage_names
            if isinstance(row.get(f"{s}.median_s"), float) and math.isfinite(row.get(f"{s}.median_s"))]
