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

Eager (`sweep --timer eager`): the module as an engine without graphs runs it. One sample is one call:
the plan's per-step host work first where it has some (`Plan.step`, FlashInfer's plan(): stage
`plan_step`, timer `host`, statistic `per_step` 1), then the L2 flush, a synchronize, and the stages
launched one after another from Python (a plan with one call for its module, `Plan.module`, makes that
call), host perf_counter around each call (its launch time), until a synchronize returns: the module's
sample is that host wall-clock from the first launch. The same call is then made again after another
flush with CUDA events around each stage: each stage's sample is its device time there, and its gap the
device's idle time between the previous stage's end and its start (with a `Plan.module`, each stage's
launch time is taken there, in its own call). The events have a call of their own because recording them
costs host time the wall-clock must not hold. Right after the timed call has ended, a fixed burst of
launches is timed from Python (kernels/clock.host_launch_probe): each sample carries how fast the host
was then, which the gate and the model read as the host's state (a shared host's launches ran up to 2.5x
apart between two runs on one GPU). Repetition and the CV rule are the graph timer's, on the module's
wall-clock.
On a CPU the stages run as they are called, so one call gives both (timer "cpu-eager").
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable

import numpy as np
import torch

from ...errors import UserError
from ...kernels.clock import host_launch_probe, probe_mhz, record_spin
from ...kernels.l2 import LEGACY_PROTOCOL, NO_FLUSH, PROTOCOL, L2Flush
from ...roofline.model import EAGER, GRAPH      # what `sweep --timer` chooses; the timer follows with the device

TIMER_GPU = "cuda-graph"
TIMER_CPU = "cpu"
TIMER_GPU_EAGER = "cuda-eager"
TIMER_CPU_EAGER = "cpu-eager"
TIMER_HOST = "host"          # the plan stages: host time to build the plan, on any device
TIMERS = {("cuda", GRAPH): TIMER_GPU, ("cpu", GRAPH): TIMER_CPU,
          ("cuda", EAGER): TIMER_GPU_EAGER, ("cpu", EAGER): TIMER_CPU_EAGER}
GPU_TIMERS = (TIMER_GPU, TIMER_GPU_EAGER)
MODULE = "module"
PLAN = "plan"
PLAN_STEP = "plan_step"      # eager: the host work of a plan a serving engine repeats every step
HOST_STAGES = (PLAN, PLAN_STEP)
PER_STEP = "per_step"        # the statistic (1) that marks a stage a serving engine repeats every step
# eager samples: host time in the stage's call, device idle before it, and the host launch probe's seconds
# per launch right after the call (kernels/clock.host_launch_probe: how fast the host was then)
EAGER_COLUMNS = ("launch_s", "gap_s", "host_probe_s")
# the statistic stats.parquet keeps of each: the median of the stage's samples
EAGER_MEDIANS = {column: column.removesuffix("_s") + "_median_s" for column in EAGER_COLUMNS}
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
    timer: str = GRAPH           # GRAPH (replay) or EAGER (the stages launched from Python)
    rounds: int = 1              # eager: a point's units take their samples in this many interleaved rounds

    @classmethod
    def from_dict(cls, values: dict | None, reps: int | None = None, timer: str | None = None,
                  rounds: int | None = None) -> "TimingConfig":
        """A scenario's `timing` table (reps, warmup, cold_l2, rounds) plus the CLI's --reps, --timer, --rounds.

        A scenario's or the CLI's rep and warm-up counts apply on the GPU and on the CPU alike: the
        scenario that asks for them (the CPU `smoke`, a GPU grid) knows where it is meant to run.
        """
        values = dict(values or {})
        if reps is not None:
            values["reps"] = reps
        kwargs = {}
        if rounds is not None:
            values["rounds"] = rounds
        for key, kind in (("reps", int), ("warmup", int), ("cold_l2", bool), ("cv_target", float), ("rounds", int)):
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
        if timer is not None:
            if timer not in (GRAPH, EAGER):
                raise UserError(f"--timer must be {GRAPH} or {EAGER}, got {timer!r}")
            kwargs["timer"] = timer
        cfg = cls(**kwargs)
        if cfg.warmup < 0 or cfg.cv_target <= 0:
            raise UserError("timing: warmup must be >= 0 and cv_target > 0")
        if cfg.rounds < 1:
            raise UserError(f"rounds must be at least 1, got {cfg.rounds}")
        if cfg.rounds > 1 and cfg.timer != EAGER:
            raise UserError("rounds interleave the eager timer's units (--timer eager); graph replay times the "
                            "device, which the host's state does not move")
        return cfg


@dataclass
class StageSamples:
    stage: str
    seconds: list[float]
    timer: str
    converged: bool              # CV within target when the loop stopped (always True for `plan`)
    sm_clock_mhz: list[float] | None = None          # GPU only: the spin-probed SM clock of each sample
    clock_event_reasons: list[int] | None = None     # GPU only: NVML reason mask of each sample's batch
    launch_s: list[float] | None = None              # eager only: host time in the stage's calls (module: all)
    gap_s: list[float] | None = None                 # eager only: device idle before the stage (module: all)
    host_probe_s: list[float] | None = None          # eager only: the host launch probe after the sample's call
    per_step: bool = False                           # host work a serving engine repeats every step


def timer_for(device_type: str, mode: str) -> str:
    """The timer of `mode` (GRAPH or EAGER) on a device of `device_type` ("cuda" or "cpu")."""
    return TIMERS[("cuda" if device_type == "cuda" else "cpu", mode)]


def timer_mode(timer: str) -> str:
    """GRAPH or EAGER: how a run's timer launched the module (a CPU run's "cpu" stands for GRAPH)."""
    return EAGER if timer in (TIMER_GPU_EAGER, TIMER_CPU_EAGER) else GRAPH


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


def reason_mask(read: Callable[[], int] | None) -> int:
    """NVML's clock-event reason mask now (0 without NVML)."""
    if read is None:
        return 0
    try:
        return int(read())
    except Exception:   # a failed NVML read must not kill the timing
        return 0


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
        return reason_mask(self.read_reasons)

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


def _repeat(batch: Callable[[int], tuple[list[float], list]], warmup: int, reps: int, max_reps: int,
            cv_target: float) -> tuple[list[float], list, bool]:
    """(seconds, what else each sample recorded, converged): `batch(n)` takes n samples; warm-up batches are
    dropped, then `reps` samples, then more while their CV exceeds `cv_target`, up to `max_reps`."""
    if warmup:
        batch(warmup)
    seconds, extra = batch(reps)
    while coefficient_of_variation(seconds) > cv_target and len(seconds) < max_reps:
        more = batch(min(len(seconds), max_reps - len(seconds)))
        seconds, extra = seconds + more[0], extra + more[1]
    return seconds, extra, coefficient_of_variation(seconds) <= cv_target


def _measure(clock, name: str, target, before, warmup: int, reps: int, max_reps: int,
             cv_target: float) -> StageSamples:
    def batch(n):
        seconds, mhz, reasons = clock.batch(target, before, n)
        return seconds, list(zip(mhz, reasons))
    seconds, extra, converged = _repeat(batch, warmup, reps, max_reps, cv_target)
    return StageSamples(name, seconds, clock.timer, converged, [m for m, _ in extra], [r for _, r in extra])


def _counts(config: TimingConfig, cuda: bool) -> tuple[int, int, int]:
    """(warm-up, reps, max reps) on a GPU (the protocol's floor of MIN_GPU_REPS) or on a CPU."""
    if cuda:
        reps = max(config.reps, MIN_GPU_REPS)
        return config.warmup, reps, max(config.max_reps, reps)
    return config.cpu_warmup, config.cpu_reps, max(config.cpu_max_reps, config.cpu_reps)


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

    warmup, reps, max_reps = _counts(config, cuda=False)
    for _ in range(warmup):
        rep(False)
    for _ in range(reps):
        rep(True)
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


@dataclass(frozen=True)
class EagerCall:
    """One eager call of a module, per stage in order: host time in its call, device time, device idle
    before it (0 for the first); the module's host wall-clock from the first launch to completion, and its
    host time in its calls (the stages' sum, or the one call of a plan with a `module`)."""
    wall_s: float
    launch_s: tuple[float, ...]
    device_s: tuple[float, ...]
    gap_s: tuple[float, ...]
    module_launch_s: float


def eager_call(t0: float, calls: list[tuple[float, float]], done: float,
               spans: list[tuple[float, float]], launches: list[float] | None = None) -> EagerCall:
    """The bookkeeping of one eager call from its stamps: `t0` the host time just before the first launch,
    `calls` the host (start, end) around each call the module took (one per stage, or one for a plan's
    `module`), `done` the host time the synchronize returned (one host clock); `spans` each stage's device
    (start, end) (one device clock); `launches` each stage's host seconds in its own call where `calls` does
    not give them (a module called once: they come from the pass that times the spans). ValueError on stamps
    out of order, which a working clock never gives."""
    stages = len(calls) if launches is None else len(launches)
    if not calls or stages != len(spans):
        raise ValueError(f"eager call: {len(calls)} calls, {len(spans)} device spans and "
                         f"{'no' if launches is None else len(launches)} stage launches")
    host = [t0] + [t for call in calls for t in call] + [done]
    device = [t for span in spans for t in span]
    for what, stamps in (("host", host), ("device", device)):
        if any(b < a for a, b in zip(stamps, stamps[1:])):
            raise ValueError(f"eager call: {what} stamps out of order: {stamps}")
    gaps = (0.0,) + tuple(spans[i][0] - spans[i - 1][1] for i in range(1, len(spans)))
    called = tuple(b - a for a, b in calls)
    per_stage = called if launches is None else tuple(launches)
    return EagerCall(done - t0, per_stage, tuple(b - a for a, b in spans), gaps, sum(called))


class _EagerClock:
    """Calls a plan as an engine without graphs does (module docstring): its `module` where it has one (one
    call), else its stages one by one, host perf_counter around each call. The device spans come from a pass
    of their own that calls each stage alone between CUDA events (on a CPU, from the calls; from that pass
    too for a plan called as one `module`, with each stage's host time)."""

    def __init__(self, plan, device: torch.device, cold_l2: bool = True,
                 read_reasons: Callable[[], int] | None = None, flush: L2Flush | None = None):
        self.cuda = device.type == "cuda"
        self.device = device
        self.timer = timer_for(device.type, EAGER)
        self.names, self.stages = list(plan.stages), list(plan.stages.values())
        self.module = plan.module
        self.step = plan.step
        self.read_reasons = read_reasons if self.cuda else None
        self.flush = (flush or L2Flush(device)) if cold_l2 and self.cuda else None
        self.probe_buf = torch.ones(1, device=device)
        if self.cuda:                       # compiles kernels and fills buffers before any sample
            plan.run()
            torch.cuda.synchronize(device)

    def _idle(self) -> None:
        """A cold L2 (GPU) and nothing left running before the first launch."""
        if self.flush is not None:
            self.flush()
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _stage_pass(self) -> tuple[list[tuple[float, float]], list[float]]:
        """Each stage called alone, in order: (device spans from the first one's start, host seconds per
        call); on a CPU the calls are the spans."""
        marks, launches = [], []
        for stage in self.stages:
            start = end = None
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            a = time.perf_counter()
            stage()
            b = time.perf_counter()
            if self.cuda:
                end.record()
            marks.append((start, end) if self.cuda else (a, b))
            launches.append(b - a)
        if not self.cuda:
            return [(a - marks[0][0], b - marks[0][0]) for a, b in marks], launches
        torch.cuda.synchronize(self.device)
        first = marks[0][0]
        return [(first.elapsed_time(a) / 1e3, first.elapsed_time(b) / 1e3) for a, b in marks], launches

    def call(self) -> tuple[EagerCall, float | None, float]:
        """One sample: (the call's bookkeeping, the per-step host work's seconds or None, the host launch
        probe's seconds per launch, taken after the call so that it costs the call nothing)."""
        step_s = None
        if self.step is not None:
            t = time.perf_counter()
            self.step()
            step_s = time.perf_counter() - t
        self._idle()
        calls = []
        t0 = time.perf_counter()
        for fn in ([self.module] if self.module is not None else self.stages):
            a = time.perf_counter()
            fn()
            calls.append((a, time.perf_counter()))
        if self.cuda:
            torch.cuda.synchronize(self.device)
        done = time.perf_counter()
        probe = host_launch_probe(self.probe_buf)
        if not self.cuda and self.module is None:
            return eager_call(t0, calls, done, calls), step_s, probe
        self._idle()
        spans, launches = self._stage_pass()
        return eager_call(t0, calls, done, spans, launches if self.module is not None else None), step_s, probe

    def _reasons(self) -> int:
        return reason_mask(self.read_reasons)

    def samples(self, extra: list, converged: bool) -> dict[str, StageSamples]:
        """The stages' and the module's samples of the calls `batch` gave (eager_samples)."""
        return eager_samples(self.names, self.timer, extra, converged, self.read_reasons is not None)

    def batch(self, n: int) -> tuple[list[float], list]:
        """(module wall seconds, [(EagerCall, step seconds, NVML reason mask, host probe seconds)]) of n
        calls."""
        mask = self._reasons()
        calls = [self.call() for _ in range(n)]
        mask |= self._reasons()
        return [c.wall_s for c, _, _ in calls], [(c, step, mask, probe) for c, step, probe in calls]


def eager_samples(names: list[str], timer: str, extra: list, converged: bool,
                  reasons: bool) -> dict[str, StageSamples]:
    """The eager calls' samples as stages: PLAN_STEP (where the plan has per-step work), each stage (device
    time, launch, gap) and MODULE (wall-clock; launch and gap summed over the stages); every stage's sample
    carries the host probe of the call it came from."""
    calls = [c for c, _, _, _ in extra]
    masks = [m for _, _, m, _ in extra] if reasons else None
    probes = [p for _, _, _, p in extra]
    out = {}
    steps = [s for _, s, _, _ in extra]
    if steps and all(s is not None for s in steps):
        out[PLAN_STEP] = StageSamples(PLAN_STEP, steps, TIMER_HOST, True, per_step=True)
    for i, name in enumerate(names):
        out[name] = StageSamples(name, [c.device_s[i] for c in calls], timer, converged,
                                 clock_event_reasons=masks, launch_s=[c.launch_s[i] for c in calls],
                                 gap_s=[c.gap_s[i] for c in calls], host_probe_s=probes)
    out[MODULE] = StageSamples(MODULE, [c.wall_s for c in calls], timer, converged, clock_event_reasons=masks,
                               launch_s=[c.module_launch_s for c in calls], gap_s=[sum(c.gap_s) for c in calls],
                               host_probe_s=probes)
    return out


def time_rounds(plans: dict, config: TimingConfig, device: torch.device | str,
                read_reasons: Callable[[], int] | None = None) -> dict[str, dict[str, StageSamples] | Exception]:
    """Eager samples of several plans of one workload (backend -> plan), taken in `config.rounds` interleaved
    rounds: each round every plan takes its share of the samples, in an order rotated by one each round, so
    that every backend's samples spread over the same stretch of host time (the host's launch rate moved
    1.6-2x between states that last about a point: docs/perf-log.md, 2026-12-07). Warm-up calls are
    interleaved alike. While a plan's module CV exceeds the target, further rounds take its samples, up to
    the max. Backend -> its samples as time_plan gives them, or the exception its clock raised (that plan
    drops out of the rounds; the others go on)."""
    device = torch.device(device)
    out: dict[str, dict[str, StageSamples] | Exception] = {}
    clocks = {}
    flush = L2Flush(device) if config.cold_l2 and device.type == "cuda" else None    # one buffer for all
    for name, plan in plans.items():
        try:
            clocks[name] = _EagerClock(plan, device, config.cold_l2, read_reasons, flush)
        except Exception as exc:
            out[name] = exc
    warmup, reps, max_reps = _counts(config, device.type == "cuda")
    share = -(-reps // config.rounds)
    taken: dict[str, list] = {name: [] for name in clocks}

    order = list(plans)

    def one_round(r: int, names: list[str], n: int, keep: bool) -> None:
        k = r % len(order)
        for name in order[k:] + order[:k]:
            if name not in names or name not in clocks:
                continue
            try:
                _, extra = clocks[name].batch(n)
            except Exception as exc:
                out[name] = exc
                del clocks[name]
                continue
            if keep:
                taken[name] += extra

    def module_cv(name: str) -> float:
        return coefficient_of_variation([c.wall_s for c, _, _, _ in taken[name]])

    if warmup:
        one_round(0, list(clocks), warmup, keep=False)
    for r in range(config.rounds):
        one_round(r, list(clocks), share, keep=True)
    r = config.rounds
    while todo := [n for n in clocks if module_cv(n) > config.cv_target and len(taken[n]) < max_reps]:
        one_round(r, todo, min(share, max_reps - max(len(taken[n]) for n in todo)), keep=True)
        r += 1
    for name, clock in clocks.items():
        out[name] = _plan_samples(plans[name]) | clock.samples(taken[name], module_cv(name) <= config.cv_target)
    return {name: out[name] for name in plans}


def _time_eager(plan, config: TimingConfig, device: torch.device,
                read_reasons: Callable[[], int] | None) -> dict[str, StageSamples]:
    clock = _EagerClock(plan, device, config.cold_l2, read_reasons)
    _, extra, converged = _repeat(clock.batch, *_counts(config, clock.cuda), config.cv_target)
    return clock.samples(extra, converged)


def _plan_samples(plan) -> dict[str, StageSamples]:
    """The plan's host planning time, as stage PLAN."""
    return {PLAN: StageSamples(PLAN, [plan.plan_seconds], TIMER_HOST, True)}


def time_plan(plan, config: TimingConfig, device: torch.device | str,
              read_reasons: Callable[[], int] | None = None) -> dict[str, StageSamples]:
    """Samples for `plan` (host planning time), each stage in order, and `module` (all stages); eager
    (config.timer): `plan_step` first where the plan has per-step host work.
    `read_reasons` returns NVML's clock-event reason mask (GPU only; none: 0)."""
    device = torch.device(device)
    results = _plan_samples(plan)
    if config.timer == EAGER:
        return results | _time_eager(plan, config, device, read_reasons)
    if device.type != "cuda":
        return results | _time_host(plan, config)
    clock = _GraphClock(plan, device, config.cold_l2, read_reasons)
    warmup, reps, max_reps = _counts(config, cuda=True)
    names = list(plan.stages)
    for i, name in enumerate(names):
        before = [clock.targets[n] for n in names[:i]]
        results[name] = _measure(clock, name, clock.targets[name], before, warmup, reps, max_reps,
                                 config.cv_target)
    results[MODULE] = _measure(clock, MODULE, clock.targets[MODULE], [], warmup, reps, max_reps,
                               config.cv_target)
    return results
