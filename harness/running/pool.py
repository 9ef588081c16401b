"""`sweep --gpus`: one worker process per GPU, pinned with CUDA_VISIBLE_DEVICES, dealt units from one queue.

The parent resolves the grid, opens the run folder and deals unit ids one at a time over each
worker's stdin; a worker (harness/running/worker.py) runs the unit, writes its folder into the shared run
folder (renamed into place when complete, so workers never see each other's half-written units) and
answers on stdout. A worker is dealt the next unit of the point it holds, so a workload is built once
per worker and point; with none left there, a point no other worker holds; at the tail, any.

A worker that dies (its GPU lost, a crash) is reported and its unit goes back to the queue; a unit
that was running when two workers died is recorded failed instead of being dealt a third time. Dead
workers are not restarted. Ctrl-C or SIGTERM stops every worker (SIGTERM, then SIGKILL after
STOP_GRACE_S), and so does a worker ended by SIGTERM, as `scancel` sends it to every process of a
job; finished units stay and `--resume` deals only the missing ones. A run covers one GPU
model: --gpus over GPUs of different models is refused. Without a GPU, `--gpus N` starts N CPU
workers (for the CPU pipeline: their timings share the host's cores).
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..measure import provenance
from ..store import results
from ...errors import UserError
from ..store.rows import schedule_of
from .request import Grid, SweepRequest
from .runner import label
from .signals import Terminated

STOP_GRACE_S = 10.0
LOG_DIR = "logs"                         # RUN/logs/<worker>.log: each worker's stderr
MAX_DEATHS_PER_UNIT = 2


class PoolLost(KeyboardInterrupt):
    """Every worker died with units left: the run stops as an interrupted one, resumable."""
    exit_code = 1


@dataclass
class Gpu:
    name: str            # the worker's name: gpu<index> or cpu<k>
    index: int | None    # the GPU's index as this process sees it (CUDA ordinal)
    visible: str | None  # what the worker's CUDA_VISIBLE_DEVICES holds
    model: str
    uuid: str = ""


@dataclass
class _Worker:
    gpu: Gpu
    proc: subprocess.Popen
    buffer: bytes = b""
    ready: bool = False
    unit: str | None = None          # the unit it runs now
    point: str | None = None         # the point of the last unit it was dealt
    notes_seen: set = field(default_factory=set)


def parse_gpus(text: str, count: int) -> list[int]:
    """--gpus all | N (the first N) | LIST (indices, comma-separated, e.g. 0,2 or 3,) -> GPU indices."""
    text = text.strip()
    if text == "all":
        return list(range(count))
    try:
        if "," in text:
            picked = [int(t) for t in text.split(",") if t.strip()]
            bad = [i for i in picked if not 0 <= i < count]
            if bad or not picked or len(set(picked)) != len(picked):
                raise UserError(f"--gpus {text}: indices must be distinct and in 0..{count - 1} "
                                f"({count} GPU(s) visible here)")
            return picked
        n = int(text)
    except ValueError:
        raise UserError(f"--gpus must be all, a count N or a comma-separated list of indices, got {text!r}") from None
    if not 1 <= n <= count:
        raise UserError(f"--gpus {n}: {count} GPU(s) visible here")
    return list(range(n))


def visible_gpus() -> list[Gpu]:
    """The GPUs this process sees, in CUDA order, with what pins a worker to each."""
    import torch
    entries = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        uuid = str(getattr(props, "uuid", "") or "")
        out.append(Gpu(f"gpu{i}", i, entries[i] if i < len(entries) else str(i), props.name,
                       uuid if uuid.startswith(("GPU-", "MIG-")) or not uuid else f"GPU-{uuid}"))
    return out


def one_model(gpus: list[Gpu], text: str) -> None:
    """A run times one GPU model: refuse a mix, naming which GPU is which."""
    models: dict[str, list[int]] = {}
    for g in gpus:
        models.setdefault(g.model, []).append(g.index)
    if len(models) > 1:
        said = "; ".join(f"{', '.join(map(str, idx))}: {m}" for m, idx in models.items())
        first = ",".join(map(str, next(iter(models.values()))))
        raise UserError(f"--gpus {text} spans GPU models ({said}); a run times one model: pick its GPUs, "
                        f"e.g. --gpus {first}{',' if ',' not in first else ''}")


class WorkerPool:
    def __init__(self, gpus: list[Gpu]):
        self.gpus = gpus
        self.workers: dict[str, _Worker] = {}

    @classmethod
    def for_request(cls, req: SweepRequest, notes: list[str]) -> "WorkerPool":
        import torch
        if req.counters:
            raise UserError("--counters runs ncu after timing on one GPU: time with --gpus first, then add the "
                            "counters with `msa-bench sweep ... --out RUN --resume --counters` (no --gpus)")
        if not torch.cuda.is_available():
            text = req.gpus.strip()
            if not text.isdigit() or int(text) < 1:
                raise UserError(f"--gpus {text}: no CUDA GPU here; --gpus N starts N CPU workers")
            notes.append(f"no CUDA GPU here: {text} CPU worker(s) share this host's cores")
            return cls([Gpu(f"cpu{k}", None, None, "cpu") for k in range(int(text))])
        every = visible_gpus()
        gpus = [every[i] for i in parse_gpus(req.gpus, len(every))]
        one_model(gpus, req.gpus)
        return cls(gpus)

    def names(self) -> list[str]:
        return [g.name for g in self.gpus]

    def describe(self) -> list[dict]:
        return [{"worker": g.name, "gpu_index": g.index, "cuda_visible_devices": g.visible, "gpu_name": g.model,
                 "gpu_uuid": g.uuid} for g in self.gpus]

    # ---- the run
    def run(self, run_dir: Path, req: SweepRequest, grid: Grid, todo: list[str], progress, notes: list[str]) -> None:
        """Deal `todo` (unit ids, in run order) until every one is written, or every worker is gone."""
        if not todo:
            return
        units = grid.units()
        queue = list(todo)
        deaths: dict[str, int] = {}
        sel = selectors.DefaultSelector()
        try:
            for gpu in self.gpus:
                w = self._start(gpu, run_dir, req, grid)
                self.workers[gpu.name] = w
                sel.register(w.proc.stdout, selectors.EVENT_READ, w)
            left = set(todo)
            while left:
                if not any(w.proc.returncode is None for w in self.workers.values()):
                    raise PoolLost(f"every worker died with {len(left)} unit(s) left")
                for w in self.workers.values():
                    if w.ready and w.unit is None and w.proc.returncode is None and queue:
                        self._deal(w, queue, units, progress)
                for key, _ in sel.select(timeout=1.0):
                    w = key.data
                    chunk = os.read(w.proc.stdout.fileno(), 65536)
                    if not chunk:
                        sel.unregister(w.proc.stdout)
                        self._lost(w, run_dir, grid, units, queue, deaths, left, progress, notes)
                        continue
                    w.buffer += chunk
                    while b"\n" in w.buffer:
                        line, w.buffer = w.buffer.split(b"\n", 1)
                        self._message(w, json.loads(line), units, left, progress, notes)
        finally:
            self._stop_all()
            sel.close()

    def _start(self, gpu: Gpu, run_dir: Path, req: SweepRequest, grid: Grid) -> _Worker:
        env = dict(os.environ)
        if gpu.visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu.visible
            env[provenance.GPU_INDEX_ENV] = str(gpu.index)
        logs = run_dir / LOG_DIR
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{gpu.name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "msa_bench.harness.running.worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        options = {**req.grid_options(), "scenario": req.scenario or grid.scenario.name}
        config = {"run_dir": str(run_dir), "request": options, "grid_sha": grid.grid_sha, "worker": gpu.name}
        proc.stdin.write((json.dumps(config) + "\n").encode())
        proc.stdin.flush()
        return _Worker(gpu, proc)

    def _deal(self, w: _Worker, queue: list[str], units: dict, progress) -> None:
        held = {o.point for o in self.workers.values() if o is not w and o.unit is not None}
        keys = [units[uid][0].key() for uid in queue]
        pick = next((i for i, k in enumerate(keys) if k == w.point), None)
        if pick is None:
            pick = next((i for i, k in enumerate(keys) if k not in held), 0)
        uid = queue.pop(pick)
        point, backend = units[uid]
        w.unit, w.point = uid, point.key()
        progress.working(w.gpu.name, f"{label(point)} · {backend}")
        try:
            w.proc.stdin.write((json.dumps({"unit": uid}) + "\n").encode())
            w.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass                  # it died: its stdout's end of file hands the unit back

    def _message(self, w: _Worker, msg: dict, units: dict, left: set, progress, notes: list[str]) -> None:
        for note in msg.get("notes", []):
            if note not in notes:
                notes.append(note)
        if "ready" in msg:
            w.ready = True
            progress.working(w.gpu.name, "ready")
        elif "state" in msg:
            progress.working(w.gpu.name, msg["state"])
        elif "done" in msg:
            uid = msg["done"]
            left.discard(uid)
            w.unit = None
            progress.finished(w.gpu.name, units[uid][1], msg["status"], float(msg["seconds"]))
            progress.working(w.gpu.name, "idle")

    def _lost(self, w: _Worker, run_dir: Path, grid: Grid, units: dict, queue: list[str], deaths: dict,
              left: set, progress, notes: list[str]) -> None:
        code = w.proc.wait()
        if code == -signal.SIGTERM:
            raise Terminated()        # the scheduler stopping the job (scancel signals every process)
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        last = _last_line(run_dir / LOG_DIR / f"{w.gpu.name}.log")
        where = f" (CUDA_VISIBLE_DEVICES={w.gpu.visible}, {w.gpu.uuid or 'no UUID'})" if w.gpu.index is not None else ""
        said = f"worker {w.gpu.name}{where} died ({how})" + (f"; its log ends: {last}" if last else "")
        uid, w.unit = w.unit, None
        if uid is not None:
            point, backend = units[uid]
            deaths[uid] = deaths.get(uid, 0) + 1
            if deaths[uid] >= MAX_DEATHS_PER_UNIT:
                _write_killer(run_dir, grid, point, backend, deaths[uid])
                left.discard(uid)
                progress.finished(w.gpu.name, backend, results.STATUS_FAILED, 0.0)
                said += f"; {backend} at {point.key()} was running when {deaths[uid]} workers died: recorded failed"
            else:
                queue.insert(0, uid)
                progress.requeued(backend)
                said += f"; its unit ({backend} at {point.key()}) goes back to the queue"
        notes.append(said)
        progress.lost(w.gpu.name, how)
        progress.console.print(f"[bold yellow]note:[/] {_escape(said)}")

    def _stop_all(self) -> None:
        live = [w for w in self.workers.values() if w.proc.poll() is None]
        for w in live:
            try:
                w.proc.stdin.close()
            except OSError:
                pass
            try:
                w.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for w in live:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        for w in self.workers.values():
            if w.proc.stdout:
                w.proc.stdout.close()


def _write_killer(run_dir: Path, grid: Grid, point, backend: str, deaths: int) -> None:
    """Record as failed a unit that took its worker down twice, so no third GPU is lost to it."""
    status = {"point_key": point.key(), **point.as_dict(), "timer": results.read_meta(run_dir).get("timer"), "backend": backend,
              "schedule": schedule_of(backend) or "none", "status": results.STATUS_FAILED,
              "reason": f"its worker process died {deaths} times while running it (see {LOG_DIR}/)"}
    results.write_unit(run_dir, results.unit_id(point.key(), backend), status, [], [])


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


def _escape(text: str) -> str:
    from rich.markup import escape
    return escape(text)
