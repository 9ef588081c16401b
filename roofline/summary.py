"""What `msa-bench roofline` reports: crossover, per-token byte table, binding resource at a few reuse points."""
from __future__ import annotations

import math

from .devices import DeviceProfile
from .model import (DEFAULT_TILE_TOKENS, SCHEDULES, ModelShape, crossover, crossover_at, crossover_numeric,
                    packed_crossover, packed_crossover_by_dtype, predict, traffic, union_ratio_floor)
from .schedules import Schedule

DEFAULT_REUSE_POINTS = (0.0625, 0.25, 1.0, 2.0, 4.0, 16.0)
# the co-selection table: reuse rows x union_ratio columns, the winner among the three schedule families
# (the MSA-style scatter moves KV-outer's bytes through another store path; it is left out here)
CO_SELECTION_REUSE = (0.0625, 0.25, 1.0, 4.0, 16.0)
CO_SELECTION_UNION = (1.0, 1.5, 2.0, 4.0, 8.0)
CO_SELECTION_SCHEDULES = (Schedule.KV_OUTER, Schedule.Q_OUTER, Schedule.Q_PACKED)
CROSSOVER_REUSE = 0.25      # the reuse at which the q-packed / KV-outer crossover is quoted, per dtype


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
        "crossover_msa_scatter_nsb_per_n": _finite(crossover(shape, device, Schedule.MSA_SCATTER)),
        "n_tokens": n_tokens,
        "crossover_nsb_per_n_l2_capacity": _finite(crossover_at(shape, device, n_tokens)),
        "kv_block_bytes_per_unit_reuse": shape.kv_block_bytes,
        "per_query_token_bytes": per_token,
        "reuse_points": points,
        "co_selection": co_selection_summary(shape, device, n_tokens),
        "q_packed_beats_kv_outer_below_union_ratio": {
            "nsb_per_n": CROSSOVER_REUSE,
            "by_dtype": {d: _finite_or_inf(u) for d, u in packed_crossover_by_dtype(
                device, n_tokens, CROSSOVER_REUSE, shape=shape).items()}},
    }


def _finite_or_inf(u: float | None):
    """None: q-packed never wins; "always": it wins at every union_ratio a tile can have."""
    return None if u is None else "always" if math.isinf(u) else u


def co_selection_summary(shape: ModelShape, device: DeviceProfile, n_tokens: int = 16384,
                         reuse_points=CO_SELECTION_REUSE, union_points=CO_SELECTION_UNION,
                         tile_tokens: int = DEFAULT_TILE_TOKENS) -> dict:
    """Predicted winner (and its useful TFLOP/s) per (reuse, union_ratio at P = tile_tokens), L2-capacity
    aware at N = n_tokens, and per reuse the union_ratio below which q-packed beats KV-outer. A cell whose
    union_ratio the reuse does not allow (union_ratio_floor) has no winner."""
    rows = []
    for r in reuse_points:
        floor = union_ratio_floor(shape, r, tile_tokens)
        cells = []
        for u in union_points:
            cell = {"union_ratio": u, "feasible": floor <= u <= tile_tokens}
            if cell["feasible"]:
                preds = {s: predict(s, shape, n_tokens, r * n_tokens, device, union_ratio=u, tile_tokens=tile_tokens)
                         for s in CO_SELECTION_SCHEDULES}
                win = min(preds, key=lambda s: preds[s].time_s)
                cell.update(winner=win, tflops=preds[win].flops / preds[win].time_s / 1e12,
                            time_s={s: p.time_s for s, p in preds.items()},
                            binding={s: p.binding for s, p in preds.items()})
            cells.append(cell)
        cross = packed_crossover(shape, device, n_tokens, r, tile_tokens)
        verdict = "never" if cross is None else "always" if math.isinf(cross) else "below"
        rows.append({"nsb_per_n": r, "union_ratio_floor": floor, "cells": cells,
                     "q_packed_beats_kv_outer": verdict,
                     "q_packed_beats_kv_outer_below_union_ratio": _finite(cross) if cross is not None else None})
    return {"tile_tokens": tile_tokens, "n_tokens": n_tokens, "schedules": list(CO_SELECTION_SCHEDULES),
            "union_ratios": list(union_points), "rows": rows}
