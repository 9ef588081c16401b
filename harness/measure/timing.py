"""Timing protocol: every stage alone and the whole module, L2 cold, raw samples kept.

GPU: each stage is captured into its own CUDA graph and the whole module into one more. One timed
sample is: replay the preceding stages' graphs (so the stage's inputs are real), flush the L2
(kernels/l2.py: write a buffer of twice its size, then read it back, so the L2 is cold and clean),
record an event, replay the graph, record an event. Warm-up
replays first, then at least `reps` samples (never fewer than 20); while the coefficient of
variation exceeds `cv_target` more samples are taken, up to `max_reps`.

CPU: each sample runs the whole module once, stage by stage, with host perf_counter around every
stage and around the whole (no L2 flush, few reps, no warm-up by default: the sweep's check has
just run the plan). One module run thus gives a sample of every stage, with its real inputs, which
matters because the Triton interpreter makes each stage cost up to a second. Those numbers only
exercise the pipeline; they are labelled timer="cpu" everywhere.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable

import numpy as np
import torch

from ...errors import UserError
from ...kernels.clock import probe_mhz, record_spin
from ...kernels.l2 import LEGACY_PROTOCOL, NO_FLUSH, PROTOCOL, L2Flush

TIMER_GPU = "cuda-graph"
TIMER_CPU = "cpu"
TIMER_HOST = "host"          # the plan stage: host time to build the plan, on any device
MODULE = "module"
PLAN = "plan"
MIN_GPU_REPS = 20          # the protocol's floor on the GPU, whatever a scenario asks


@dataclass(frozen=True)
class TimingConfig:
    warmup: int = 5
    reps: int = 20
    max_reps: int = 200
    cv_target: float = 0.03
    cold_l2: bool = True
    # recorded with the run: how _GraphClock makes the cold L2 (kernels/l2.py); a record, not a setting
    l2_flush: str = field(default=PROTOCOL, init=False)
    cpu_warmup: int = 0
    cpu_reps: int = 5
    cpu_max_reps: int = 5        # no CV re-measurement on CPU by default: its numbers mean nothing anyway

    @classmethod
    def from_dict(cls, values: dict | None, reps: int | None = None) -> "TimingConfig":
        """A scenario's `timing` table (reps, warmup, cold_l2) plus the CLI's --reps.

        A scenario's or the CLI's rep and warm-up counts apply on the GPU and on the CPU alike: the
        scenario that asks for them (the CPU `smoke`, a GPU grid) knows where it is meant to run.
        """
        values = dict(values or {})
        if reps is not None:
            values["reps"] = reps
        kwargs = {}
        for key, kind in (("reps", int), ("warmup", int), ("cold_l2", bool), ("cv_target", float)):
            if key not in values:
                continue
            v = values[key]
            if kind is bool:
                if not isinstance(v, bool):
                    raise UserError(f"timing.{key} must be true or false, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)):
                raise UserError(f"timing.{key} must be a number, got {v!r}")
            kwargs[key] = kind(v)
        if "reps" in kwargs:
            if kwargs["reps"] < 1:
                raise UserError(f"reps must be at least 1, got {kwargs['reps']}")
            kwargs["cpu_reps"] = kwargs["reps"]
            kwargs["max_reps"] = max(cls.max_reps, kwargs["reps"])
            kwargs["cpu_max_reps"] = kwargs["reps"]
        if "warmup" in kwargs:
            kwargs["cpu_warmup"] = kwargs["warmup"]
        cfg = cls(**kwargs)
        if cfg.warmup < 0 or cfg.cv_target <= 0:
            raise UserError("timing: warmup must be >= 0 and cv_target > 0")
        return cfg


@dataclass
class StageSamples:
    stage: str
    seconds: list[float]
    timer: str
    converged: bool              # CV within target when the loop stopped (always True for `plan`)
    sm_clock_mhz: list[float] | None = None          # GPU only: the spin-probed SM clock of each sample
    clock_event_reasons: list[int] | None = None     # GPU only: NVML reason mask of each sample's batch


def summarize(seconds: list[float]) -> dict[str, float]:
    """Order statistics and spread of raw samples (seconds)."""
    a = np.asarray(seconds, dtype=np.float64)
    mean = float(a.mean())
    std = float(a.std(ddof=1)) if len(a) > 1 else 0.0
    p25, median, p75 = (float(x) for x in np.percentile(a, [25, 50, 75]))
    return {"median_s": median, "p25_s": p25, "p75_s": p75, "iqr_s": p75 - p25, "mean_s": mean,
            "min_s": float(a.min()), "max_s": float(a.max()), "std_s": std,
            "cv": std / mean if mean > 0 else 0.0, "n_reps": float(len(a))}


def l2_flush_of(meta: dict) -> str:
    """The L2 flush a run's timings followed (its run.json `timing`): a run recorded before the protocol
    was named wrote the buffer only."""
    timing = meta.get("timing") or {}
    if not timing.get("cold_l2", True):
        return NO_FLUSH
    return timing.get("l2_flush", LEGACY_PROTOCOL)


def coefficient_of_variation(seconds: list[float]) -> float:
    if len(seconds) < 2:
        return 0.0
    mean = statistics.fmean(seconds)
    return statistics.stdev(seconds) / mean if mean > 0 else 0.0


class _GraphClock:
    timer = TIMER_GPU

    def __init__(self, plan, device: torch.device, cold_l2: bool = True,
                 read_reasons: Callable[[], int] | None = None):
        self.read_reasons = read_reasons
        self.flush = L2Flush(device) if cold_l2 else None
        # Warm-up on a side stream, as PyTorch's CUDA-graph docs advise: compiles kernels, creates
        # library handles/workspaces and fills every intermediate buffer once before capture.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            plan.run()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        self.targets: dict[str, Callable[[], None]] = {}
        self._graphs = []               # keep graphs alive
        for name, fn in plan.stages.items():
            self.targets[name] = self._capture(fn)
        self.targets[MODULE] = self._capture(plan.run)
        torch.cuda.synchronize(device)

    def _capture(self, fn) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        self._graphs.append(graph)
        return graph.replay

    def _reasons(self) -> int:
        if self.read_reasons is None:
            return 0
        try:
            return int(self.read_reasons())
        except Exception:   # a failed NVML read must not kill the timing
            return 0

    def batch(self, target, before, n: int) -> tuple[list[float], list[float], list[int]]:
        """(seconds, sm_clock_mhz, clock_event_reasons) of n samples."""
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        probes = []
        mask = self._reasons()
        for i in range(n):
            for replay in before:
                replay()
            if self.flush is not None:
                self.flush()
            pre = record_spin()
            starts[i].record()
            target()
            ends[i].record()
            probes.append((pre, record_spin()))
        torch.cuda.synchronize()
        mask |= self._reasons()
        clocks = [(probe_mhz(a) + probe_mhz(b)) / 2 for a, b in probes]
        return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)], clocks, [mask] * n


def _measure(clock, name: str, target, before, warmup: int, reps: int, max_reps: int,
             cv_target: float) -> StageSamples:
    if warmup:
        clock.batch(target, before, warmup)
    seconds, mhz, reasons = clock.batch(target, before, reps)
    while coefficient_of_variation(seconds) > cv_target and len(seconds) < max_reps:
        more = clock.batch(target, before, min(len(seconds), max_reps - len(seconds)))
        seconds, mhz, reasons = seconds + more[0], mhz + more[1], reasons + more[2]
    return StageSamples(name, seconds, clock.timer, coefficient_of_variation(seconds) <= cv_target, mhz, reasons)


def _time_host(plan, config: TimingConfig) -> dict[str, StageSamples]:
    """CPU: every rep runs the module once, timing each stage and the whole; more reps while the
    module's CV exceeds the target, up to cpu_max_reps."""
    names = list(plan.stages)
    seconds: dict[str, list[float]] = {name: [] for name in names + [MODULE]}

    def rep(keep: bool) -> None:
        start = time.perf_counter()
        for name in names:
            t = time.perf_counter()
            plan.stages[name]()
            if keep:
                seconds[name].append(time.perf_counter() - t)
        if keep:
            seconds[MODULE].append(time.perf_counter() - start)

    for _ in range(config.cpu_warmup):
        rep(False)
    for _ in range(config.cpu_reps):
        rep(True)
    max_reps = max(config.cpu_max_reps, config.cpu_reps)
    while coefficient_of_variation(seconds[MODULE]) > config.cv_target and len(seconds[MODULE]) < max_reps:
        rep(True)
    converged = coefficient_of_variation(seconds[MODULE]) <= config.cv_target
    return {name: StageSamples(name, s, TIMER_CPU, converged) for name, s in seconds.items()}


def warm_plan(backend, workload, config: TimingConfig, device: torch.device | str):
    """A fresh plan of `backend` for `workload`, after one plan of it was timed with the fewest samples and
    dropped. Whoever times first on a built workload calls this: on large decode points the first plan
    timed there ran 10 % slower than those after it, whichever backend it was, and a plan dropped after one
    eager run did not help, a timed one did (docs/perf-log.md, 2026-12-02)."""
    few = replace(config, warmup=0, reps=1, max_reps=1, cpu_warmup=0, cpu_reps=1, cpu_max_reps=1)
    plan = backend.plan(workload)
    time_plan(plan, few, device)
    del plan
    return backend.plan(workload)


def time_plan(plan, config: TimingConfig, device: torch.device | str,
              read_reasons: Callable[[], int] | None = None) -> dict[str, StageSamples]:
    """Samples for `plan` (host planning time), each stage in order, and `module` (all stages).
    `read_reasons` returns NVML's clock-event reason mask (GPU only; none: 0)."""
    device = torch.device(device)
    results = {PLAN: StageSamples(PLAN, [plan.plan_seconds], TIMER_HOST, True)}
    if device.type != "cuda":
        return results | _time_host(plan, config)
    clock = _GraphClock(plan, device, config.cold_l2, read_reasons)
    reps = max(config.reps, MIN_GPU_REPS)
    warmup, max_reps = config.warmup, max(config.max_reps, reps)
    names = list(plan.stages)
    for i, name in enumerate(names):
        before = [clock.targets[n] for n in names[:i]]
        results[name] = _measure(clock, name, clock.targets[name], before, warmup, reps, max_reps,
                                 config.cv_target)
    results[MODULE] = _measure(clock, MODULE, clock.targets[MODULE], [], warmup, reps, max_reps,
                               config.cv_target)
    return results
