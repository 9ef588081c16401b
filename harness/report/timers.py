"""Eager next to graph: a unit's module time as an engine without graphs pays it, beside the device's time.

`report RUN --beside OTHER` pairs a run of each timer (sweep --timer graph | eager) on one GPU; a run
timed eagerly alone gets the eager columns without the graph ones. Times in microseconds.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...errors import UserError
from ..measure.timing import EAGER, EAGER_MEDIANS, GRAPH, MODULE, PLAN_STEP, timer_mode
from ..store.results import Run
from ..store.rows import ok_units
from .axes import varying_fields

US = 1e6


def pair_runs(a: Run, b: Run) -> tuple[Run, Run]:
    """(the graph-timed run, the eager-timed run) of two runs of one GPU; UserError otherwise."""
    modes = {timer_mode(a.timer): a, timer_mode(b.timer): b}
    if set(modes) != {GRAPH, EAGER}:
        raise UserError(f"report --beside pairs a graph-timed and an eager-timed run: {a.path} and {b.path} were both "
                        f"timed by {a.timer!r}" if a.timer == b.timer else
                        f"report --beside pairs a graph-timed and an eager-timed run: {a.path} ({a.timer}) and "
                        f"{b.path} ({b.timer}) are not one of each")
    if a.device_name != b.device_name:
        raise UserError(f"report --beside pairs runs of one GPU: {a.path} ran on {a.device_name!r}, {b.path} on "
                        f"{b.device_name!r}")
    return modes[GRAPH], modes[EAGER]


def _column(t: pd.DataFrame, name: str) -> pd.Series:
    return t[name] * US if name in t else pd.Series(np.nan, index=t.index)


def eager_table(eager: Run, graph: Run | None = None) -> pd.DataFrame:
    """One row per unit the eager run timed (and, with `graph`, the graph run timed too): module_us under each
    timer and their ratio, the launch (host) and gap (device idle) time the eager module call spent, summed
    over its stages, the plan's per-step host work (plan_step, not in module_us eager) and the host launch
    probe (probe_us, one launch of a fixed op; NaN in runs made before it was recorded)."""
    t = ok_units(eager)
    if t.empty or f"{MODULE}.{EAGER_MEDIANS['launch_s']}" not in t:
        return pd.DataFrame()
    shown = [f for f in varying_fields(t) if f in t]
    eager_us = _column(t, f"{MODULE}.median_s")
    table = t[["backend", "dtype", *shown]].copy()
    if graph is not None:
        g = ok_units(graph)
        if g.empty:
            return pd.DataFrame()
        g = g[["point_key", "backend", f"{MODULE}.median_s"]].rename(columns={f"{MODULE}.median_s": "graph_s"})
        both = t[["point_key", "backend"]].merge(g, on=["point_key", "backend"], how="left")
        keep = both["graph_s"].notna().to_numpy()
        table, eager_us, t = table[keep], eager_us[keep], t[keep]
        table["module_us graph"] = both["graph_s"].to_numpy()[keep] * US
        table["module_us eager"] = eager_us
        table["eager/graph"] = table["module_us eager"] / table["module_us graph"]
    else:
        table["module_us eager"] = eager_us
    table["launch_us"] = _column(t, f"{MODULE}.{EAGER_MEDIANS['launch_s']}")
    table["gap_us"] = _column(t, f"{MODULE}.{EAGER_MEDIANS['gap_s']}")
    table["plan_step_us"] = _column(t, f"{PLAN_STEP}.median_s")
    table["probe_us"] = _column(t, f"{MODULE}.{EAGER_MEDIANS['host_probe_s']}")
    return table.sort_values(["dtype", "backend", *shown]).reset_index(drop=True)


def eager_markdown(eager: Run, graph: Run | None, markdown_table) -> list[str]:
    """summary.md's section of an eager run (with its graph twin where given); [] when there is none."""
    table = eager_table(eager, graph)
    if table.empty:
        return []
    head = (f"## Eager against graph ({eager.path.name} against {graph.path.name})" if graph is not None
            else "## Eager: the module launched from Python")
    text = ("module_us eager: host wall-clock from the first launch to completion (sweep --timer eager); "
            "module_us graph: CUDA-graph replay of the same unit; launch_us: host time in the stages' calls; "
            "gap_us: device idle between stages; plan_step_us: the plan's host work a serving engine repeats "
            "every step (FlashInfer's plan()), not in module_us; probe_us: one launch of a fixed op from Python "
            "right after each call, how fast the host was (compare it across runs before their launch_us). "
            "Medians, microseconds.")
    return [head, "", text, "", *host_state_line(table), markdown_table(table)]


SLOW_HOST = 1.2      # a unit whose probe reads this much over the run's median ran on a slower host


def host_state_line(table: pd.DataFrame) -> list[str]:
    """One line on how fast the host was across the run's units (the probe's spread), and which ran on a
    host over SLOW_HOST x the run's median probe; [] for a run without the probe."""
    probe = table["probe_us"].dropna() if "probe_us" in table else pd.Series(dtype=float)
    if probe.empty:
        return []
    mid = float(probe.median())
    slow = table[table["probe_us"] > SLOW_HOST * mid]
    text = (f"Host launch probe across the {len(probe)} units: median {mid:.2f} us a launch, "
            f"{probe.min():.2f}-{probe.max():.2f}. ")
    if slow.empty:
        text += f"No unit ran on a host over {SLOW_HOST:.1f}x the median: their host costs are comparable."
    else:
        text += (f"{len(slow)} unit(s) ran while the host was over {SLOW_HOST:.1f}x slower than that, so their "
                 "launch_us are the host's state as much as the code's (" + ", ".join(sorted(set(slow["backend"])))
                 + ").")
    return [text, ""]
