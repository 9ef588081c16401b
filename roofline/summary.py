"""What `msa-bench roofline` reports: crossover, per-token byte table, binding resource at a few reuse points."""
from __future__ import annotations

import math

from .devices import DeviceProfile
from .model import SCHEDULES, ModelShape, crossover, crossover_at, crossover_numeric, predict, traffic

DEFAULT_REUSE_POINTS = (0.0625, 0.25, 1.0, 2.0, 4.0, 16.0)


def _finite(x: float):
    return x if math.isfinite(x) else None


def roofline_summary(shape: ModelShape, device: DeviceProfile, n_tokens: int = 16384,
                     reuse_points=DEFAULT_REUSE_POINTS) -> dict:
    per_token = {}
    for sched in SCHEDULES:
        hbm0, l20 = traffic(sched, shape, 1.0, 0.0)
        per_token[sched] = {"hbm": hbm0, "l2": l20}
    points = []
    for r in reuse_points:
        row = {"nsb_per_n": r}
        for sched in SCHEDULES:
            p = predict(sched, shape, n_tokens, r * n_tokens, device)
            row[sched] = {"time_s": p.time_s, "binding": p.binding, "tflops": p.flops / p.time_s / 1e12,
                          "hbm_bytes": p.hbm_bytes, "l2_bytes": p.l2_bytes}
        row["faster"] = min(SCHEDULES, key=lambda s: row[s]["time_s"])
        points.append(row)
    return {
        "device": device.name,
        "device_source": device.source,
        "shape": {"hq": shape.hq, "hkv": shape.hkv, "head_dim": shape.head_dim, "block": shape.block,
                  "topk": shape.topk, "dtype": shape.dtype, "partial_dtype": shape.partial_dtype},
        "hbm_bytes_per_s": device.hbm_bytes_per_s,
        "l2_bytes_per_s": device.l2_bytes_per_s,
        "crossover_nsb_per_n": _finite(crossover(shape, device)),
        "crossover_nsb_per_n_numeric": _finite(crossover_numeric(shape, device)),
        "crossover_msa_scatter_nsb_per_n": _finite(crossover(shape, device, "msa-scatter")),
        "n_tokens": n_tokens,
        "crossover_nsb_per_n_l2_capacity": _finite(crossover_at(shape, device, n_tokens)),
        "kv_block_bytes_per_unit_reuse": shape.kv_block_bytes,
        "per_query_token_bytes": per_token,
        "reuse_points": points,
    }
