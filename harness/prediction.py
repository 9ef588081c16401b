"""The roofline's prediction for a measured point: glue between result rows and roofline.model.

Used by the sweep (model bytes stored next to measured counters) and by the report (curves, the
predicted crossover, which schedule the roofline picks per case). No byte or FLOP terms live here.
"""
from __future__ import annotations

import math

from ..roofline.devices import DeviceProfile, run_profile
from ..kernels.kv_outer.config import model_shape, q_live_heads, q_ranges  # noqa: F401  (the launch's model terms)
from ..roofline.model import (ALL_SCHEDULES, DEFAULT_TILE_TOKENS, ModelShape, Prediction, predict, predict_dense,
                              union_tokens)
from ..roofline.schedules import Schedule, is_schedule


def schedule_of(backend: str, plan_info=None) -> str | None:
    """The schedule a unit of `backend` ran, as a plain string: the one the backend declares
    (`Backend.schedule`; BASE@OPTION runs BASE's, "kv-outer-cute@v23" is KV-outer), else, for a backend
    that picks one per workload (`auto`), the one its plan_info records under "schedule". None for a
    backend that declares none and a name not registered here."""
    from ..kernels.base import declared_schedule
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


def union_ratio_for(stats, tile: int) -> float | None:
    """The union_ratio a token-packed kernel of `tile`-token tiles executes, from the workload's statistics
    (workload_stats keys, or a result row's wl_ columns): every tile counted as P tokens where recorded
    (runs made before 2026-12-02 record only the plain one); None when not measured at that P."""
    for key in (f"executed_union_ratio_p{tile}", f"wl_executed_union_ratio_p{tile}", f"union_ratio_p{tile}",
                f"wl_union_ratio_p{tile}"):
        value = stats.get(key) if hasattr(stats, "get") else None
        if _usable(value):
            return float(value)
    return None


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
    from ..kernels.kv_outer.config import tile_order_label
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


def _usable(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


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
    if schedule is None or not _usable(n_tokens) or nsb is None or not math.isfinite(nsb):
        return None
    if schedule == Schedule.Q_PACKED and not _usable(union_ratio):
        return None
    return predict(schedule, shape, n_tokens, nsb, device,
                   selected_per_query=selected_per_query if _usable(selected_per_query) else None,
                   flops=flops if _usable(flops) else None,
                   union_ratio=float(union_ratio) if _usable(union_ratio) and union_tokens(schedule) else None,
                   tile_tokens=tile,
                   executed_union_ratio=float(executed_union_ratio) if _usable(executed_union_ratio) else None,
                   shared_nsb=float(shared_nsb) if _usable(shared_nsb) or shared_nsb == 0 else None)


def predict_stats(schedule: str, shape: ModelShape, stats, device: DeviceProfile, plan_info=None) -> Prediction | None:
    """predict_point() from a workload's statistics: workload_stats() keys or a result row's wl_ columns;
    q-packed at the tile size the plan records (plan_info "tile_tokens", default 8), its MMAs at the tokens
    they cover where the plan records fewer ("mma_tokens": q-packed-cute since 2026-12-02; its earlier
    units ran whole tiles), or at its critical walk where it records one ("critical_union_ratio":
    q-packed-cute since 2026-12-04), Q-outer at its L2 window."""
    def get(key):
        value = stats.get(key) if key in stats else stats.get(f"wl_{key}")
        return value if _usable(value) or value == 0 else None
    tile = union_tokens(schedule, tile_tokens(plan_info)) or tile_tokens(plan_info)
    mma = _info(plan_info).get("mma_tokens") if schedule == Schedule.Q_PACKED else None
    if schedule == Schedule.DENSE_MASKED:
        blocks, keys, n = get("dense_kv_blocks"), get("dense_keys"), get("n_tokens")
        if not (_usable(blocks) and _usable(keys) and _usable(n)):
            return None
        paged = bool(_info(plan_info).get("paged", False))           # the path the plan ran (kernels/dense_masked.py)
        return predict_dense(shape, n, blocks, keys, device, flops=get("useful_flops"), gathered=not paged)
    union = union_ratio_for(stats, tile)
    executed = union_ratio_for(stats, mma) if mma else None
    recorded = _info(plan_info).get("executed_union_ratio")
    if union is None and schedule == Schedule.Q_PACKED:
        # a tile size the statistics do not hold (scenarios.stats.UNION_TILES): q-packed-cute's 12-token tiles,
        # predicted as `auto` predicts them live (QPackedCuteBackend.roofline): the traffic of the 8-token tiles,
        # which their rule lets them load no more than, and the MMAs of the entries their warpgroups walked
        # (recorded; where a plan's warpgroups skip, mma_tokens below the tile); without the 8-token
        # statistics, a plan whose warpgroups each walk the whole union (mma_tokens the tile: units before
        # 2026-12-04) at the ratio it measured itself
        p8, half = union_ratio_for(stats, DEFAULT_TILE_TOKENS), union_ratio_for(stats, DEFAULT_TILE_TOKENS // 2)
        if p8 is not None and half is not None:
            skips = mma is not None and mma < tile and _usable(recorded)
            tile, union, executed = DEFAULT_TILE_TOKENS, p8, float(recorded) if skips else half
        elif mma == tile and _usable(recorded):
            union = executed = float(recorded)
    critical = _info(plan_info).get("critical_union_ratio")
    if schedule == Schedule.Q_PACKED and union is not None and _usable(critical):
        executed = float(critical)           # the plan's critical walk (cute_backend.critical_ratio), where recorded
    return predict_point(schedule, shape, get("n_tokens") or float("nan"), get("nsb"), device,
                         flops=get("useful_flops"), selected_per_query=get("selected_blocks_per_query"),
                         union_ratio=union, tile=tile, executed_union_ratio=executed,
                         shared_nsb=get("nsb_shared"))
