"""The run loop: grid of (point, backend) units -> time -> check -> telemetry -> counters -> results.

Each finished unit is written at once (results.write_unit), so an interrupted sweep keeps its work
and `--resume` skips what is done (and redoes a unit whose files are damaged); `--resume` without
`--out` continues the latest unfinished run of the same grid under results/runs. An interrupt
raises SweepInterrupted, which names the folder and the exact command that resumes it. Points
that cannot fit in memory are refused before anything is allocated. `--shard i/n` takes every n-th
point starting at i (0-based), so shards are disjoint, cover the grid and each builds only its own
workloads.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import counters as ncu_counters
from . import provenance, results
from ..errors import UserError, one_line
from ..roofline.model import ALL_SCHEDULES
from .prediction import model_shape, plan_config, predict_stats, schedule_of
from .telemetry import Poller, open_telemetry, point_telemetry
from .timing import MODULE, TIMER_CPU, TIMER_GPU, TimingConfig, summarize, time_plan

CPU_NOTE = ("CPU RUN: timings are host perf_counter timings of the CPU pipeline, NOT GPU timings; "
            "they only show that the pipeline works")
INTERRUPT_HOOK = "MSA_BENCH_INTERRUPT_AFTER_UNITS"   # test hook: KeyboardInterrupt after k units
RUNS_ROOT = Path("results") / "runs"                    # default home of run folders (relative to the cwd)
CHECK_ROWS = 512                                        # rows checked against the reference on big points
TFLOPS_STAGES = (MODULE, "attention")
COUNTERS_PENDING = "pending"
COUNTER_CHUNK = 8                                       # points per profiled ncu process


@dataclass
class SweepRequest:
    scenario: str | None = None
    reuse: list[float] | None = None
    tokens: list[int] | None = None
    context: list[int] | None = None
    skew: list[float] | None = None
    dtypes: list[str] | None = None
    backends: list[str] | None = None
    causal: bool | None = None
    generator: str | None = None
    share: list[float] | None = None
    share_group: list[int] | None = None
    out: str | None = None
    resume: bool = False
    shard: str | None = None
    counters: bool = False
    reps: int | None = None
    argv: list[str] = field(default_factory=list)


@dataclass
class SweepSummary:
    run_dir: Path
    counts: dict          # status -> number of units, this run folder as a whole
    skipped: int          # finished units found by --resume
    notes: list[str]      # every note of the run (printed when they arose)
    failures: list[tuple[str, str, str]]   # failed units: (point key, backend, reason)
    unavailable: dict = field(default_factory=dict)   # (backend, reason) -> units
    late_notes: list[str] = field(default_factory=list)   # notes that arose after the start


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C (or the test hook) during a sweep: what was finished is kept; `resume` continues it."""

    def __init__(self, run_dir: Path, finished: int, planned: int, resume: str):
        super().__init__(f"interrupted: {finished} of {planned} units finished in {run_dir}")
        self.run_dir, self.finished, self.planned, self.resume = run_dir, finished, planned, resume


@dataclass
class _Grid:
    """What a request resolves to before any run folder exists."""
    scenario: object
    overrides: dict
    backends: list[str]
    shard: tuple[int, int] | None
    every: list          # (point, backend) of the whole grid
    mine: list           # (point, backend) this shard runs, in run order
    mine_ids: list[str]
    grid_sha: str
    timing: TimingConfig


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--shard must look like i/n (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise UserError(f"--shard i/n needs n >= 1 and 0 <= i < n, got {text!r}")
    return i, n


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_scenario(req: SweepRequest, device: torch.device, notes: list[str]):
    from ..scenarios.grid import load_scenario, with_overrides
    name = req.scenario
    if name is None:
        name = "default" if device.type == "cuda" else "smoke"
        if device.type != "cuda":
            notes.append("no CUDA GPU here: running the small `smoke` scenario (pass --scenario to choose)")
    scenario = load_scenario(name)
    overrides = {k: v for k, v in dict(reuse=req.reuse, tokens=req.tokens, context=req.context, skew=req.skew,
                                       dtypes=req.dtypes, backends=req.backends, causal=req.causal,
                                       generator=req.generator, share=req.share,
                                       share_group=req.share_group).items() if v is not None}
    if overrides:
        scenario = with_overrides(scenario, **overrides)
    return scenario, overrides


def validate_backends(names) -> list[str]:
    from ..kernels.base import get_backend
    names = list(dict.fromkeys(names))
    for name in names:
        try:
            get_backend(name)              # unknown names and bad @options raise KeyError with the reason
        except KeyError as exc:
            raise UserError(exc.args[0]) from None
    if not names:
        raise UserError("no backends to run: the scenario and --backend leave none")
    return names


def plan_units(points, backends, shard: tuple[int, int] | None):
    """All units of the grid and the ones this shard runs, in run order (points outer)."""
    every = [(p, b) for p in points for b in backends]
    mine_points = points if shard is None else points[shard[0]::shard[1]]
    mine = [(p, b) for p in mine_points for b in backends]
    return every, mine


def _scalar_stats(stats: dict) -> dict:
    out = {}
    for key, value in stats.items():
        if isinstance(value, bool):
            out[f"wl_{key}"] = value
        elif isinstance(value, (int, float)) and math.isfinite(float(value)):
            out[f"wl_{key}"] = float(value)
    return out


class _Runner:
    """State shared by the units of one sweep (device, telemetry, timing, counters)."""

    def __init__(self, run_dir: Path, device, timing: TimingConfig, want_counters: bool, notes: list[str]):
        self.run_dir = run_dir
        self.device = device
        self.timing = timing
        self.timer = TIMER_GPU if device.type == "cuda" else TIMER_CPU
        self.telemetry = open_telemetry(device)
        if not self.telemetry.available:
            notes.append(self.telemetry.reason)
        self.ncu = None
        self.notes = notes
        self.counter_failures = 0
        if want_counters:
            if device.type != "cuda":
                notes.append("--counters needs a CUDA GPU: continuing without hardware counters")
            else:
                self.ncu = ncu_counters.find_ncu()
                if self.ncu is None:
                    notes.append("--counters: ncu not found (PATH, /opt/nvidia/nsight-compute/*/ncu, "
                                 "/usr/local/cuda/bin/ncu): continuing without hardware counters")
        from ..roofline.devices import profile_for_gpu
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        self.profile = profile_for_gpu(gpu) if gpu else None

    def unit(self, point, backend_name: str, workload, wl_stats: dict, base: dict) -> tuple[dict, list, list]:
        """Status, tidy stat rows and sample rows of one unit. Never raises for a backend's failure.

        The plan's outputs are poisoned with NaN, it is timed, and the output its last timed run left is
        compared with the float64 reference: the numbers kept are those of a run that was checked, and a
        unit whose output disagrees is recorded as failed with its timings discarded."""
        from ..kernels.base import BackendUnavailable, get_backend
        from .check import compare_output, poison
        status = dict(base)
        backend = get_backend(backend_name)
        rows = None
        if workload.n_tokens > 4 * CHECK_ROWS:
            rows = torch.linspace(0, workload.n_tokens - 1, CHECK_ROWS).round().long().unique()
        try:
            plan = backend.plan(workload)          # BackendUnavailable when it cannot run this workload here
            poison(plan)
            before = self.telemetry.sample()
            poller = Poller(self.telemetry.sample).start() if self.telemetry.available else None
            try:
                samples = time_plan(plan, self.timing, self.device)
            finally:
                during = poller.stop() if poller else []
            after = self.telemetry.sample()
        except BackendUnavailable as exc:
            return {**status, "status": results.STATUS_UNAVAILABLE, "reason": str(exc)}, [], []
        except Exception as exc:
            return {**status, "status": results.STATUS_FAILED, "reason": f"timing raised {one_line(exc)}"}, [], []
        try:
            err, tol, _ = compare_output(plan, workload, rows, backend_name)
        except Exception as exc:
            return {**status, "status": results.STATUS_FAILED, "reason": f"check raised {one_line(exc)}"}, [], []
        status.update(max_rel_err=float(err), tol=float(tol))
        if not err <= tol:
            return {**status, "status": results.STATUS_FAILED,
                    "reason": f"output disagrees with the reference (max rel err {err:.3g} > tol {tol:.3g}); "
                              "its timings are discarded"}, [], []
        status.update(point_telemetry(before, after, during))
        status.update(plan_info=json.dumps(plan.info, default=str, sort_keys=True))
        config, info = plan_config(plan.info), plan.info
        status["schedule"] = schedule_of(backend_name, info) or "none"
        del plan
        stats, sample_rows = self._timing_rows(point, backend_name, samples, wl_stats)
        stats += self._model_rows(point, backend_name, wl_stats, config, info)
        if self.ncu is not None:
            status["counters"] = COUNTERS_PENDING
        return {**status, "status": results.STATUS_OK, "reason": ""}, stats, sample_rows

    def collect_counters(self, items: list[tuple]) -> None:
        """ncu counters for timed units, [(point, backends)], from one profiled process for all of them.

        Each unit's folder gets the counter rows and `counters: ncu`, or `counters: failed: <why>`.
        """
        try:
            measured = ncu_counters.collect(self.ncu, [(p.as_dict(), bs) for p, bs in items])
        except ncu_counters.CountersError as exc:
            for p, bs in items:
                for b in bs:
                    results.update_unit(self.run_dir, results.unit_id(p.key(), b), {"counters": f"failed: {exc}"}, [])
            self.counter_failures += 1
            if self.counter_failures >= 2:   # e.g. no permission to read counters: stop asking
                self.ncu = None
                self.notes.append(f"hardware counters disabled after two failed ncu runs; last: {exc}")
            return
        self.counter_failures = 0
        for i, (p, bs) in enumerate(items):
            for b in bs:
                uid = results.unit_id(p.key(), b)
                got = measured.get((i, b))
                if not got or "error" in got:
                    why = got["error"] if got else "the unit is missing from the ncu output"
                    results.update_unit(self.run_dir, uid, {"counters": f"failed: {why}"}, [])
                    continue
                rows = [self._row(p, b, stage, k, v) for stage, values in got.items() for k, v in values.items()]
                results.update_unit(self.run_dir, uid, {"counters": "ncu"}, rows,
                                    replace_statistics=ncu_counters.COUNTER_STATISTICS)

    def _row(self, point, backend, stage, statistic, value, timer: str | None = None) -> dict:
        return {"point_key": point.key(), "backend": backend, "schedule": schedule_of(backend) or "none",
                "dtype": point.dtype, "stage": stage, "statistic": statistic, "value": float(value),
                "timer": timer or self.timer}

    def _timing_rows(self, point, backend, samples, wl_stats):
        stats, raw = [], []
        flops = wl_stats.get("wl_useful_flops", 0.0)
        for stage, s in samples.items():
            summary = summarize(s.seconds)
            if stage in TFLOPS_STAGES and flops > 0 and summary["median_s"] > 0:
                summary["tflops"] = flops / summary["median_s"] / 1e12
            summary["converged"] = float(s.converged)
            stats += [self._row(point, backend, stage, k, v, s.timer) for k, v in summary.items()]
            raw += [{"point_key": point.key(), "backend": backend, "dtype": point.dtype, "stage": stage,
                     "rep": i, "seconds": float(x), "timer": s.timer} for i, x in enumerate(s.seconds)]
        return stats, raw

    def _model_rows(self, point, backend, wl_stats, config: dict | None = None, info: dict | None = None):
        schedule = schedule_of(backend, info)
        if self.profile is None or schedule not in ALL_SCHEDULES or "wl_nsb" not in wl_stats:
            return []
        sh = point.shape
        pred = predict_stats(schedule, model_shape(sh.hq, sh.hkv, sh.head_dim, sh.block, sh.topk, point.dtype, config),
                             wl_stats, self.profile, info)
        if pred is None:
            return []
        values = {"model_time_s": pred.time_s, "model_hbm_bytes": pred.hbm_bytes,
                  "model_l2_bytes": pred.l2_bytes, "model_flops": pred.flops}
        return [self._row(point, backend, MODULE, k, v) for k, v in values.items()]


def _label(point) -> str:
    """A short label of the point for the progress line: what differs between the points of a grid."""
    d = point.as_dict()
    if d["generator"] == "real-prefill":
        return f"{d['case_id']} {d['dtype']}"
    parts = [d["generator"], f"N{d['tokens']}", f"T{d['context']}"]
    if d.get("reuse") is not None:
        parts.append(f"r{d['reuse']:g}")
    if d.get("skew"):
        parts.append(f"z{d['skew']:g}")
    parts += ["causal"] if d.get("causal") else []
    return " ".join(parts + [d["dtype"]])


def _progress(console):
    """Count, bar, elapsed time and ETA first, at fixed widths; the point's label takes what is left of
    the line and is cut with an ellipsis, so all of them stay visible at 80 columns."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    from rich.table import Column
    return Progress(MofNCompleteColumn(), BarColumn(bar_width=16), TimeElapsedColumn(), TextColumn("ETA"),
                    TimeRemainingColumn(),
                    TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis",
                                                                         ratio=1)),
                    console=console, transient=False, expand=True)


# ---- the request -> grid, run folder and metadata -------------------------------------------------

def _resolve(req: SweepRequest, device, notes: list[str]) -> _Grid:
    shard = parse_shard(req.shard)
    scenario, overrides = resolve_scenario(req, device, notes)
    backends = validate_backends(scenario.backends)
    points = list(scenario.points)
    if not points:
        raise UserError(f"the grid of scenario {scenario.name!r} is empty after overrides; nothing to run")
    every, mine = plan_units(points, backends, shard)
    if not mine:
        raise UserError(f"shard {req.shard} of scenario {scenario.name!r} holds no points "
                        f"(the grid has {len(points)})")
    every_ids = [results.unit_id(p.key(), b) for p, b in every]
    if len(set(every_ids)) != len(every_ids):
        raise UserError(f"scenario {scenario.name!r} has duplicate points (same key twice)")
    timing = TimingConfig.from_dict(getattr(scenario, "timing", None), reps=req.reps)
    return _Grid(scenario, overrides, backends, shard, every, mine,
                 [results.unit_id(p.key(), b) for p, b in mine], results.grid_digest(every_ids), timing)


def _check_memory(grid: _Grid, device) -> None:
    """Refuse, before anything is allocated, a point whose workload and partials cannot fit on `device`."""
    from ..scenarios.grid import check_point_fits
    seen = set()
    for p, _ in grid.mine:
        if p.key() not in seen:
            seen.add(p.key())
            check_point_fits(p, device)


def _latest_unfinished(grid: _Grid) -> Path:
    """The most recently started unfinished run of this very grid (and shard) under results/runs."""
    found = []
    if RUNS_ROOT.is_dir():
        for d in RUNS_ROOT.iterdir():
            try:
                meta = results.read_meta(d)
            except UserError:
                continue
            if (not meta.get("complete") and meta.get("grid_sha256") == grid.grid_sha
                    and sorted(meta.get("units_planned", [])) == sorted(grid.mine_ids)):
                found.append((str(meta.get("started_utc", "")), d))
    if not found:
        raise UserError(f"nothing to resume: no unfinished run of scenario {grid.scenario.name!r} with these options "
                        f"under {RUNS_ROOT}; pass --out RUN to name one")
    return max(found)[1]


def _run_dir(req: SweepRequest, grid: _Grid) -> Path:
    if req.out:
        return Path(req.out)
    if req.resume:
        return _latest_unfinished(grid)
    stamp = f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%d-%H%M%S}"
    shard = f"-shard{grid.shard[0]}of{grid.shard[1]}" if grid.shard else ""
    return RUNS_ROOT / f"{grid.scenario.name}-{stamp}{shard}"


def _open_run(run_dir: Path, req: SweepRequest, grid: _Grid, device) -> dict:
    """The run's metadata: the existing run's for --resume (same grid, same GPU), else a new one."""
    if (run_dir / results.RUN_FILE).exists():
        if not req.resume:
            raise UserError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --out")
        old = results.read_meta(run_dir)
        if old.get("grid_sha256") != grid.grid_sha or sorted(old.get("units_planned", [])) != sorted(grid.mine_ids):
            raise UserError(f"{run_dir} was started with a different grid (scenario, overrides or shard); "
                            "resume it with the same options or choose another --out")
        here = provenance.device_info(device)["device_name"]
        there = (old.get("provenance") or {}).get("device_name")
        if here != there:
            raise UserError(f"{run_dir} was measured on {there!r}; this machine is {here!r}: "
                            "resume it there or choose another --out")
        results.clear_partial_units(run_dir)
        return old
    if req.resume:
        raise UserError(f"nothing to resume at {run_dir} (no {results.RUN_FILE})")
    sc = grid.scenario
    return {
        "schema": results.SCHEMA_VERSION,
        "scenario": sc.name,
        "scenario_description": getattr(sc, "description", ""),
        "scenario_source": str(getattr(sc, "source", "") or ""),
        "overrides": grid.overrides,
        "backends": grid.backends,
        "grid_sha256": grid.grid_sha,
        "grid_units": sorted(results.unit_id(p.key(), b) for p, b in grid.every),
        "units_planned": grid.mine_ids,
        "shard": {"index": grid.shard[0], "count": grid.shard[1]} if grid.shard else None,
        "timing": grid.timing.__dict__,
        "timer": TIMER_GPU if device.type == "cuda" else TIMER_CPU,
        "provenance": provenance.collect(device, sc.name, _scenario_file(sc), req.argv or None),
        "started_utc": _now(),
    }


def resume_command(req: SweepRequest, scenario_name: str, run_dir: Path) -> str:
    """The exact command that continues this sweep: the same grid options, --out and --resume."""
    def listed(values):
        return ",".join(str(v) for v in values)
    args = ["msa-bench", "sweep", "--scenario", req.scenario or scenario_name]
    for option, values in (("--reuse", req.reuse), ("--tokens", req.tokens), ("--context", req.context),
                           ("--skew", req.skew), ("--dtype", req.dtypes), ("--backend", req.backends),
                           ("--share", req.share), ("--share-group", req.share_group)):
        if values is not None:
            args += [option, listed(values)]
    if req.causal is not None:
        args.append("--causal" if req.causal else "--no-causal")
    if req.generator is not None:
        args += ["--generator", req.generator]
    if req.shard is not None:
        args += ["--shard", req.shard]
    if req.counters:
        args.append("--counters")
    if req.reps is not None:
        args += ["--reps", str(req.reps)]
    return shlex.join(args + ["--out", str(run_dir), "--resume"])


# ---- the units --------------------------------------------------------------------------------

def _build(point, device) -> tuple[object, dict, str]:
    """(workload, its scalar stats, "") or (None, {}, why it could not be built)."""
    from ..scenarios.grid import make_workload
    from ..scenarios.stats import workload_stats
    try:
        workload = make_workload(point, device)
        return workload, _scalar_stats(workload_stats(workload)), ""
    except UserError as exc:
        return None, {}, f"workload could not be built: {exc}"
    except Exception as exc:  # recorded, and the sweep goes on with the next point
        return None, {}, f"workload could not be built: {one_line(exc)}"


class _Loop:
    """The timing pass over this shard's points, then the counter pass; one progress line for each."""

    def __init__(self, runner: _Runner, run_dir: Path, grid: _Grid, done: set, progress, device):
        self.runner, self.run_dir, self.grid, self.done = runner, run_dir, grid, done
        self.progress, self.device = progress, device
        self.written = 0
        self.interrupt_after = int(os.environ.get(INTERRUPT_HOOK, "0") or 0)

    def by_point(self) -> list[tuple[object, list[str]]]:
        order: dict[str, tuple[object, list[str]]] = {}
        for p, b in self.grid.mine:
            order.setdefault(p.key(), (p, []))[1].append(b)
        return list(order.values())

    def pending_counters(self, point, backends) -> list[str]:
        """Finished units still waiting for counters (an interrupted or counter-less earlier run)."""
        if self.runner.ncu is None:
            return []
        key = point.key()
        return [b for b in backends if results.unit_id(key, b) in self.done
                and _wants_counters(results.read_unit_status(self.run_dir, results.unit_id(key, b)))]

    def time_point(self, task, point, todo: list[str]) -> list[str]:
        """Build the point's workload and run its units; returns the backends that now want counters."""
        key = point.key()
        self.progress.update(task, description=f"{_label(point)} · building workload")
        workload, wl_stats, why = _build(point, self.device)
        base = {"point_key": key, **point.as_dict(), "timer": self.runner.timer}
        want = []
        for b in todo:
            self.progress.update(task, description=f"{_label(point)} · {b}")
            head = {**base, **wl_stats, "backend": b, "schedule": schedule_of(b) or "none"}
            if workload is None:
                status, stats, samples = {**head, "status": results.STATUS_FAILED, "reason": why}, [], []
            else:
                status, stats, samples = self.runner.unit(point, b, workload, wl_stats, head)
            results.write_unit(self.run_dir, results.unit_id(key, b), status, stats, samples)
            if _wants_counters(status) and self.runner.ncu is not None:
                want.append(b)
            self.written += 1
            self.progress.advance(task)
            if self.interrupt_after and self.written >= self.interrupt_after:
                raise KeyboardInterrupt
        del workload
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return want

    def timing_pass(self, total: int) -> list[tuple]:
        task = self.progress.add_task("sweep", total=total)
        counter_queue = []
        for point, backends in self.by_point():
            todo = [b for b in backends if results.unit_id(point.key(), b) not in self.done]
            need = self.pending_counters(point, backends)
            if todo:
                need += self.time_point(task, point, todo)
            if need:
                counter_queue.append((point, need))
        return counter_queue

    def counter_pass(self, queue: list[tuple]) -> None:
        """Counters after all timing: a time limit that stops the sweep here has lost no timing, and the
        units still `pending` get their counters from `--resume --counters`."""
        if not queue or self.runner.ncu is None:
            return
        task = self.progress.add_task("ncu counters", total=sum(len(bs) for _, bs in queue))
        for i in range(0, len(queue), COUNTER_CHUNK):
            if self.runner.ncu is None:
                break
            chunk = queue[i:i + COUNTER_CHUNK]
            self.progress.update(task, description=f"ncu counters · {_label(chunk[0][0])} (+{len(chunk) - 1} points)")
            self.runner.collect_counters(chunk)
            self.progress.advance(task, sum(len(bs) for _, bs in chunk))


def _summary(run_dir: Path, skipped: int, notes: list[str], start_notes: int) -> SweepSummary:
    run = results.load_run(run_dir)
    counts = run.status["status"].value_counts().to_dict() if len(run.status) else {}
    failures, unavailable = [], {}
    for r in run.status.itertuples():
        if r.status == results.STATUS_FAILED:
            failures.append((r.point_key, r.backend, r.reason))
        elif r.status == results.STATUS_UNAVAILABLE:
            unavailable[(r.backend, r.reason)] = unavailable.get((r.backend, r.reason), 0) + 1
    return SweepSummary(run_dir, counts, skipped, notes, failures, unavailable, notes[start_notes:])


def run_sweep(req: SweepRequest, console=None) -> SweepSummary:
    from rich.console import Console
    console = console or Console(stderr=True)
    notes: list[str] = []
    device = _device()
    grid = _resolve(req, device, notes)
    _check_memory(grid, device)
    run_dir = _run_dir(req, grid)
    meta = _open_run(run_dir, req, grid, device)
    if device.type != "cuda":
        notes.insert(0, CPU_NOTE)
        meta["note"] = CPU_NOTE
    meta.update(counters_requested=req.counters, complete=False)
    results.write_meta(run_dir, meta)

    runner = _Runner(run_dir, device, grid.timing, req.counters, notes)
    from rich.markup import escape
    for note in notes:
        console.print(f"[bold yellow]note:[/] {escape(note)}")
    start_notes = len(notes)
    damaged = results.damaged_units(run_dir)
    for uid in damaged:                   # kept as units/.damaged-<uid>; their units are run again
        results.set_aside(run_dir, uid)
    done = results.finished_units(run_dir)
    skipped = sum(1 for uid in grid.mine_ids if uid in done)
    if skipped or damaged:
        console.print(escape(f"resuming {run_dir}: {skipped} of {len(grid.mine_ids)} units already finished"
                             + (f"; set aside {len(damaged)} damaged unit folder(s) as units/.damaged-*, their "
                                f"units run again: {'; '.join(damaged.values())}" if damaged else "")))
    try:
        with _progress(console) as progress:
            loop = _Loop(runner, run_dir, grid, done, progress, device)
            loop.counter_pass(loop.timing_pass(len(grid.mine_ids) - skipped))
    except KeyboardInterrupt:
        finished = len(results.finished_units(run_dir) & set(grid.mine_ids))
        raise SweepInterrupted(run_dir, finished, len(grid.mine_ids),
                               resume_command(req, grid.scenario.name, run_dir)) from None
    finally:
        meta["notes"] = notes
        finished = results.finished_units(run_dir)
        meta["complete"] = all(uid in finished for uid in grid.mine_ids)
        meta["finished_utc" if meta["complete"] else "interrupted_utc"] = _now()
        results.write_meta(run_dir, meta)
    return _summary(run_dir, skipped, notes, start_notes)


def _wants_counters(status: dict) -> bool:
    """A timed unit whose counters are not in yet (pending, or failed on an earlier try)."""
    return status.get("status") == results.STATUS_OK and status.get("counters") != "ncu"


def _scenario_file(scenario) -> str | None:
    """The TOML the scenario came from: a user's file, or the shipped one inside the package."""
    src = getattr(scenario, "source", None)
    if src and Path(str(src)).is_file():
        return str(src)
    shipped = Path(__file__).resolve().parents[1] / "scenarios" / f"{scenario.name}.toml"
    return str(shipped) if shipped.is_file() else None


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
