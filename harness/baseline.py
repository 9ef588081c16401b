"""What compare judges: a baseline (one run, or a set of K runs of one grid) and each run's samples
under a clock mode.

A baseline set is a folder whose sub-folders are K run folders of the same scenario and grid (K
separate `sweep` processes): between-run variance (clock steps under a power cap, placement) is
invisible to a within-run test, and the set measures it.

Clock modes (the per-sample SM clock from the spin probe, harness/timing.py):
  raw        the measured seconds.
  normalize  cycles_seconds(): the time the sample would take at the unit's reference clock (NVML's
             maximum SM clock), for a compute-bound stage.
  floor      drop samples whose clock is below `floor` x the highest clock sampled in their unit.
  fit        the time at the reference clock with the stage's own sensitivity to the clock: seconds x
             (clock / ref)^beta, beta fitted on the baseline's samples of that (point, backend, dtype,
             stage) (clock_exponents). normalize is beta 1, raw beta 0; a stage bound by memory moves
             less than its clock (kv-outer-cute's bf16 attention on real prefill: beta about 0.2-0.6),
             and normalize made it a false regression where the new run's clock was the higher.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import UserError
from .results import RUN_FILE, Run, load_run
from .timing import TIMER_GPU

CLOCK_MODES = ("raw", "normalize", "floor", "fit")
KEY = ["point_key", "backend", "dtype", "stage"]
DEFAULT_FLOOR = 0.97


def cycles_seconds(seconds, sm_clock_mhz, ref_clock_mhz):
    """The time a sample measured at `sm_clock_mhz` would take at `ref_clock_mhz` if it were
    compute-bound (its cycle count is what stays fixed)."""
    return np.asarray(seconds, dtype=float) * np.asarray(sm_clock_mhz, dtype=float) / ref_clock_mhz


def load_baseline(path: str | Path) -> list[Run]:
    """[the run] for a run folder, or the K runs of a baseline set; UserError when the set's runs are
    of different scenarios or grids, or the folder holds no run."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"no run folder or baseline set at {path}")
    if (path / RUN_FILE).is_file():
        return [load_run(path)]
    members = sorted(d for d in path.iterdir() if d.is_dir() and (d / RUN_FILE).is_file())
    if not members:
        raise UserError(f"{path} is neither a run folder nor a baseline set (no sub-folder holds a {RUN_FILE})")
    runs = [load_run(d) for d in members]
    first = runs[0]
    for run in runs[1:]:
        for key, what in (("scenario", "scenario"), ("grid_sha256", "grid")):
            if run.meta.get(key) != first.meta.get(key):
                raise UserError(f"baseline set {path}: {run.path.name} has a different {what} than "
                                f"{first.path.name}; a set holds runs of one scenario and grid")
    return runs


def has_clock(run: Run) -> bool:
    """Whether every GPU-timed sample of the run carries its SM clock (runs made before the probe do not)."""
    s = run.samples
    if run.timer != TIMER_GPU or s.empty:
        return True
    gpu = s["timer"] == TIMER_GPU
    return "sm_clock_mhz" in s.columns and not s.loc[gpu, "sm_clock_mhz"].isna().any()


def clock_exponents(runs: list[Run]) -> dict:
    """beta per (point_key, backend, dtype, stage) for --clock fit: minus the least-squares slope of log
    seconds on log SM clock over the GPU samples of `runs` (a baseline's K runs pooled), clipped to
    [0, 1]. A stage whose samples all share one clock gets 1 (normalize's assumption)."""
    s = pd.concat([r.samples for r in runs if r.timer == TIMER_GPU and not r.samples.empty and has_clock(r)])
    if s.empty:
        return {}
    s = s[s["timer"] == TIMER_GPU]
    out = {}
    for key, g in s.groupby(KEY, sort=False):
        x, y = np.log(g["sm_clock_mhz"].to_numpy(float)), np.log(g["seconds"].to_numpy(float))
        x = x - x.mean()
        sxx = float(x @ x)
        out[key] = 1.0 if sxx < 1e-12 else float(np.clip(-(x @ (y - y.mean())) / sxx, 0.0, 1.0))
    return out


def clocked_samples(run: Run, mode: str, floor: float = DEFAULT_FLOOR,
                    exponents: dict | None = None) -> tuple[pd.DataFrame, int]:
    """(the run's samples under `mode`, how many samples the floor dropped). Host (CPU) runs are
    returned as they are: their timings are never judged. exponents: clock_exponents() of the
    baseline, for mode fit (a stage it lacks takes beta 1)."""
    if mode not in CLOCK_MODES:
        raise UserError(f"--clock must be one of {', '.join(CLOCK_MODES)}, got {mode!r}")
    s = run.samples
    if mode == "raw" or run.timer != TIMER_GPU or s.empty:
        return s, 0
    gpu = s["timer"] == TIMER_GPU
    if not has_clock(run):
        raise UserError(f"{run.path} has no per-sample SM clock (a run made before it was recorded): "
                        "use --clock raw")
    s = s[gpu].copy()
    if mode in ("normalize", "fit"):
        ref = run.status.set_index(["point_key", "backend"]).get("sm_clock_max_mhz")
        keys = pd.MultiIndex.from_frame(s[["point_key", "backend"]])
        refs = ref.reindex(keys).to_numpy(dtype=float) if ref is not None else np.full(len(s), np.nan)
        if not (np.isfinite(refs) & (refs > 0)).all():
            raise UserError(f"{run.path} has units without a reference clock (sm_clock_max_mhz): use --clock raw")
        if mode == "normalize":
            s["seconds"] = cycles_seconds(s["seconds"], s["sm_clock_mhz"], refs)
        else:
            exps = exponents or {}
            beta = np.array([exps.get(k, 1.0) for k in s[KEY].itertuples(index=False, name=None)], dtype=float)
            s["seconds"] = s["seconds"].to_numpy(float) * (s["sm_clock_mhz"].to_numpy(float) / refs) ** beta
        return s, 0
    top = s.groupby(["point_key", "backend"])["sm_clock_mhz"].transform("max")
    keep = s["sm_clock_mhz"] >= floor * top
    return s[keep], int((~keep).sum())
