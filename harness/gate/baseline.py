"""What compare judges: a baseline (one run, or a set of K runs of one grid) and each run's samples
under a clock mode.

A baseline set is a folder whose sub-folders are K run folders of the same scenario and grid (K
separate `sweep` processes): between-run variance (clock steps under a power cap, placement) is
invisible to a within-run test, and the set measures it. sweep_set makes one (`msa-bench gate baseline`).

Clock modes (the per-sample SM clock from the spin probe, harness/measure/timing.py):
  raw        the measured seconds.
  normalize  cycles_seconds(): the time the sample would take at the unit's reference clock (NVML's
             maximum SM clock), for a compute-bound stage.
  floor      drop samples whose clock is below `floor` x the highest clock sampled in their unit's
             stage.
  both       a change counts only if raw and normalize both see it (compare.py; the default); the
             samples shown are normalize's. A stage bound by memory does not follow the SM clock
             (kv-outer-cute's bf16 attention on real prefill ran as fast at 1912 MHz as at 1840), so
             normalize read a new run's higher clock as its slowdown; raw reads a clock step as one.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from ...errors import UserError
from ..store.results import RUN_FILE, Run, load_run, read_meta
from ..measure.timing import TIMER_GPU

CLOCK_MODES = ("raw", "normalize", "floor", "both")
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


def clocked_samples(run: Run, mode: str, floor: float = DEFAULT_FLOOR) -> tuple[pd.DataFrame, int]:
    """(the run's samples under `mode`, how many samples the floor dropped). Host (CPU) runs are
    returned as they are: their timings are never judged."""
    if mode not in CLOCK_MODES:
        raise UserError(f"--clock must be one of {', '.join(CLOCK_MODES)}, got {mode!r}")
    mode = "normalize" if mode == "both" else mode
    s = run.samples
    if mode == "raw" or run.timer != TIMER_GPU or s.empty:
        return s, 0
    gpu = s["timer"] == TIMER_GPU
    if not has_clock(run):
        raise UserError(f"{run.path} has no per-sample SM clock (a run made before it was recorded): "
                        "use --clock raw")
    s = s[gpu].copy()
    if mode == "normalize":
        ref = run.status.set_index(["point_key", "backend"]).get("sm_clock_max_mhz")
        keys = pd.MultiIndex.from_frame(s[["point_key", "backend"]])
        refs = ref.reindex(keys).to_numpy(dtype=float) if ref is not None else np.full(len(s), np.nan)
        if not (np.isfinite(refs) & (refs > 0)).all():
            raise UserError(f"{run.path} has units without a reference clock (sm_clock_max_mhz): use --clock raw")
        s["seconds"] = cycles_seconds(s["seconds"], s["sm_clock_mhz"], refs)
        return s, 0
    # per stage: a stage timed wholly after a clock step keeps its best-clocked samples
    top = s.groupby(["point_key", "backend", "stage"])["sm_clock_mhz"].transform("max")
    keep = s["sm_clock_mhz"] >= floor * top
    return s[keep], int((~keep).sum())


def set_member(root: str | Path, i: int) -> Path:
    """The i-th run folder (1-based) of a baseline set, as scripts/gate-protocol.sh names it."""
    return Path(root) / f"run-{i:02d}"


def _complete(run_dir: Path) -> bool:
    return (run_dir / RUN_FILE).is_file() and read_meta(run_dir).get("complete") is True


def sweep_set(root: str | Path, k: int, sweep_args: list[str], say: Callable[[str], None] = print) -> list[Path]:
    """Make a baseline set: K separate `msa-bench sweep` processes into ROOT/run-01 .. run-K (a process
    each, so the set holds the between-run variance a sweep's own samples cannot), each with its log
    beside it (run-NN.log). A complete run is kept, an unfinished one resumed, so the command can be run
    again after a stop. UserError naming the log when a sweep does not exit 0."""
    runs = []
    for i in range(1, k + 1):
        run_dir = set_member(root, i)
        runs.append(run_dir)
        if _complete(run_dir):
            say(f"run {i}/{k}: {run_dir} is complete, kept")
            continue
        resume = ["--resume"] if (run_dir / RUN_FILE).is_file() else []
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        log = run_dir.with_name(run_dir.name + ".log")
        say(f"run {i}/{k}: msa-bench sweep {' '.join(sweep_args + resume)} --out {run_dir} (log {log})")
        with open(log, "a") as out:
            code = subprocess.run([sys.executable, "-m", "msa_bench.cli", "sweep", *sweep_args, *resume,
                                   "--out", str(run_dir)], stdout=out, stderr=subprocess.STDOUT).returncode
        if code != 0:
            tail = " ".join(log.read_text().strip().splitlines()[-1:])
            raise UserError(f"run {i}/{k}: the sweep exited {code} ({tail!r}; log {log}); the finished runs are "
                            "kept and the same command resumes")
    return runs
