"""A trace run's verdict per layer: which backend is fastest on how much of the engine's calls (each call
counted at its index weight, the calls it stands for), and `auto` against the fastest, weighted alike."""
from __future__ import annotations

import pandas as pd

from ...kernels.auto import AutoBackend
from ..store.rows import ok_units

TRACE = "trace"       # the generator of a trace's points (scenarios/grid.py)


def trace_winners(run) -> pd.DataFrame:
    """Per layer and dtype: calls, their weight, the fastest backend's share of that weight (every backend
    that is fastest somewhere, largest share first) and auto's weighted time over the fastest's."""
    t = ok_units(run)
    if t.empty or "module.median_s" not in t or "layer" not in t or not (t["generator"] == TRACE).any():
        return pd.DataFrame()
    t = t[t["generator"] == TRACE]
    rows = []
    for (layer, dtype), g in t.groupby(["layer", "dtype"], sort=True):
        wins: dict[str, float] = {}
        auto_s = best_s = 0.0
        auto_all = True
        for _, point in g.groupby("point_key"):
            others = point[point["backend"] != AutoBackend.name]
            if others.empty:
                continue
            w = float(point["weight"].iloc[0])
            best = others.loc[others["module.median_s"].idxmin()]
            wins[best["backend"]] = wins.get(best["backend"], 0.0) + w
            auto = point[point["backend"] == AutoBackend.name]
            auto_all &= not auto.empty
            if not auto.empty:
                auto_s += w * float(auto["module.median_s"].iloc[0])
                best_s += w * float(best["module.median_s"])
        total = sum(wins.values())
        if not total:
            continue
        ranked = sorted(wins.items(), key=lambda kv: -kv[1])
        rows.append({"layer": int(layer), "dtype": dtype, "calls": int(g["point_key"].nunique()),
                     "call weight": total, "fastest (share of the weight)": ", ".join(
                         f"{b} {w / total:.0%}" for b, w in ranked),
                     "auto / fastest (weighted)": auto_s / best_s if auto_all and best_s else None})
    return pd.DataFrame(rows)
