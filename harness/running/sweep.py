"""The sweep: a request's units, run in this process or dealt to one worker per GPU, into one run folder.

Each finished unit is written at once (results.write_unit), so an interrupted sweep keeps its work
and `--resume` skips what is done (and redoes a unit whose files are damaged); `--resume` without
`--out` continues the latest unfinished run of the same grid under results/runs. Ctrl-C or SIGTERM
(what `timeout` and job schedulers send: harness/running/signals.py) raises SweepInterrupted, which names the
folder and the exact command that resumes it. In this process the points run in order (each workload built once,
its backends inside), then the counter pass; with `--gpus`, harness/running/pool.py deals the same units.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..store import results
from ...errors import UserError
from .progress import SweepProgress
from .request import Grid, SweepRequest, check_memory, resolve, resume_command
from .run_folder import CPU_NOTE, RUNS_ROOT, SweepSummary, close_run, open_run, run_dir_for, set_aside_damaged, summarize
from .runner import Runner, build_workload, free_device_memory, label, wants_counters
from .signals import EXIT_SIGINT, sigterm_interrupts

__all__ = ["SweepRequest", "SweepSummary", "SweepInterrupted", "run_sweep", "RUNS_ROOT", "INTERRUPT_HOOK"]

INTERRUPT_HOOK = "MSA_BENCH_INTERRUPT_AFTER_UNITS"   # test hook: KeyboardInterrupt after k units
COUNTER_CHUNK = 8                                       # points per profiled ncu process


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a sweep: what was finished is kept; `resume` continues it."""

    def __init__(self, run_dir: Path, finished: int, planned: int, resume: str, exit_code: int = EXIT_SIGINT,
                 why: str = "interrupted"):
        super().__init__(f"{why}: {finished} of {planned} units finished in {run_dir}")
        self.run_dir, self.finished, self.planned, self.resume = run_dir, finished, planned, resume
        self.exit_code = exit_code


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class _Loop:
    """This process's timing pass over its points, then the counter pass."""

    WORKER = "main"

    def __init__(self, runner: Runner, run_dir: Path, grid: Grid, done: set, progress: SweepProgress, device):
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
                and wants_counters(results.read_unit_status(self.run_dir, results.unit_id(key, b)))]

    def time_point(self, point, todo: list[str]) -> list[str]:
        """Build the point's workload and run its units; returns the backends that now want counters."""
        start = time.monotonic()
        self.progress.working(self.WORKER, f"{label(point)} · building workload")
        workload, wl_stats, why = build_workload(point, self.device)
        want = []
        if self.runner.timing.rounds > 1 and workload is not None:     # the point's units together
            self.progress.working(self.WORKER, f"{label(point)} · {len(todo)} backends in "
                                               f"{self.runner.timing.rounds} rounds")
            ran = self.runner.run_rounds(point, todo, workload, wl_stats)
            each = (time.monotonic() - start) / len(todo)
        else:
            ran, each = None, None
        for nth, b in enumerate(todo):
            if ran is None:
                self.progress.working(self.WORKER, f"{label(point)} · {b}")
                status = self.runner.run_unit(point, b, workload, wl_stats, why, nth)
            else:
                status = ran[nth]
            if wants_counters(status) and self.runner.ncu is not None:
                want.append(b)
            self.written += 1
            self.progress.finished(self.WORKER, b, status["status"], each or time.monotonic() - start)
            start = time.monotonic()
            if self.interrupt_after and self.written >= self.interrupt_after:
                raise KeyboardInterrupt
        del workload
        if self.device.type == "cuda":
            free_device_memory()
        return want

    def timing_pass(self) -> list[tuple]:
        counter_queue = []
        for point, backends in self.by_point():
            todo = [b for b in backends if results.unit_id(point.key(), b) not in self.done]
            need = self.pending_counters(point, backends)
            if todo:
                need += self.time_point(point, todo)
            if need:
                counter_queue.append((point, need))
        return counter_queue

    def counter_pass(self, queue: list[tuple]) -> None:
        """Counters after all timing: a time limit that stops the sweep here has lost no timing, and the
        units still `pending` get their counters from `--resume --counters`."""
        if not queue or self.runner.ncu is None:
            return
        self.progress.begin("ncu counters", [b for _, bs in queue for b in bs])
        for i in range(0, len(queue), COUNTER_CHUNK):
            if self.runner.ncu is None:
                break
            chunk = queue[i:i + COUNTER_CHUNK]
            self.progress.working(self.WORKER, f"ncu counters · {label(chunk[0][0])} (+{len(chunk) - 1} points)")
            start = time.monotonic()
            self.runner.collect_counters(chunk)
            for _, bs in chunk:
                for b in bs:
                    self.progress.finished(self.WORKER, b, "ok", (time.monotonic() - start) / len(bs) / len(chunk))


def use_profile(req: SweepRequest, device, console):
    """Resolve the profile this sweep uses (roofline.devices.resolve_profile: --device, this GPU's
    calibration, its preset), pass --device on to `auto` and the workers ($MSA_BENCH_PROFILE) and say
    the one line where there is no calibration."""
    from ...roofline.devices import PRESETS, PROFILE_ENV, resolve_profile
    if req.device:
        resolve_profile(req.device, None)               # a bad --device is refused before anything runs
        os.environ[PROFILE_ENV] = req.device.lower() if req.device.lower() in PRESETS else str(Path(req.device).resolve())
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    choice = resolve_profile(None, gpu)
    choice.say((lambda line: console.print(line, markup=False, highlight=False)) if console else None)
    return choice


def record_profile(meta: dict, choice, grid, notes: list) -> None:
    """The run's provenance names the profile it used (path and sha256); a resumed run that now resolves
    another says so in a note. A GPU without a profile cannot run `auto`: refused before any unit."""
    from ...kernels.auto import AutoBackend
    from ...kernels.base import split_name
    if choice.profile is None and torch.cuda.is_available() and \
            any(split_name(b)[0] == AutoBackend.name for b in grid.backends):
        raise UserError(f"`auto` needs a device profile: {choice.note}")
    prov = meta.setdefault("provenance", {})
    had = prov.get("profile")
    now = choice.provenance()
    if had is None:
        prov["profile"] = now
    elif (had.get("path"), had.get("sha256")) != (now["path"], now["sha256"]):
        notes.append(f"resumed with profile {now['path']} (sha256 {str(now['sha256'])[:12]}); the run started "
                     f"with {had.get('path')} (sha256 {str(had.get('sha256'))[:12]})")


def run_sweep(req: SweepRequest, console=None) -> SweepSummary:
    from ...roofline.devices import PROFILE_ENV
    before = os.environ.get(PROFILE_ENV)
    try:
        return _run_sweep(req, console)
    finally:            # --device holds for this sweep (its `auto` and its workers) only
        if before is None:
            os.environ.pop(PROFILE_ENV, None)
        else:
            os.environ[PROFILE_ENV] = before


def _run_sweep(req: SweepRequest, console=None) -> SweepSummary:
    from rich.console import Console
    from rich.markup import escape
    console = console or Console(stderr=True)
    if not console.is_terminal:
        console.soft_wrap = True        # a log or pipe has no width: notes stay whole lines, not cut at 80
    notes: list[str] = []
    device = _device()
    choice = use_profile(req, device, console)
    pool = None
    if req.gpus is not None:
        from .pool import WorkerPool
        pool = WorkerPool.for_request(req, notes)      # refuses bad --gpus and mixed GPU models
    grid = resolve(req, device, notes)
    if pool is not None and grid.timing.rounds > 1:
        raise UserError("--rounds times a point's units together in one process; --gpus deals them one by one "
                        "to workers: drop one of the two")
    check_memory(grid, device, notes)
    run_dir = run_dir_for(req, grid)
    meta = open_run(run_dir, req, grid, device)
    record_profile(meta, choice, grid, notes)
    if device.type != "cuda":
        notes.insert(0, CPU_NOTE)
        meta["note"] = CPU_NOTE
    meta.update(counters_requested=req.counters, complete=False,
                resume_command=resume_command(req, grid.scenario.name, run_dir))   # what `report` tells a killed run
    if pool is not None:
        meta["workers"] = pool.describe()
    results.write_meta(run_dir, meta)

    runner = None if pool else Runner(run_dir, device, grid.timing, req.counters, notes)
    for note in notes:
        console.print(f"[bold yellow]note:[/] {escape(note)}")
    start_notes = len(notes)
    damaged = set_aside_damaged(run_dir)      # kept as units/.damaged-<uid>; their units run again
    done = results.finished_units(run_dir)
    skipped = sum(1 for uid in grid.mine_ids if uid in done)
    if skipped or damaged:
        console.print(escape(f"resuming {run_dir}: {skipped} of {len(grid.mine_ids)} units already finished"
                             + (f"; set aside {len(damaged)} damaged unit folder(s) as units/.damaged-*, their "
                                f"units run again: {'; '.join(damaged.values())}" if damaged else "")))
    todo = [(uid, b) for uid, (_, b) in grid.units().items() if uid not in done]
    try:
        with sigterm_interrupts():
            progress = SweepProgress(console, pool.names() if pool else [_Loop.WORKER])
            progress.begin("sweep", [b for _, b in todo])
            with progress:
                if pool:
                    pool.run(run_dir, req, grid, [uid for uid, _ in todo], progress, notes)
                else:
                    loop = _Loop(runner, run_dir, grid, done, progress, device)
                    loop.counter_pass(loop.timing_pass())
    except KeyboardInterrupt as exc:
        finished = len(results.finished_units(run_dir) & set(grid.mine_ids))
        raise SweepInterrupted(run_dir, finished, len(grid.mine_ids), meta["resume_command"],
                               getattr(exc, "exit_code", EXIT_SIGINT), str(exc) or "interrupted") from None
    finally:
        close_run(run_dir, meta, grid, notes)
    return summarize(run_dir, skipped, notes, start_notes)
