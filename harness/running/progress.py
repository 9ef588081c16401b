"""The sweep's progress: units done of planned, elapsed time, ETA, and what each worker runs.

On a terminal one live display (rich) at the console's width: the count, a bar, elapsed time and ETA
first at fixed widths, then what runs, cut with an ellipsis; with several workers, one line per
worker below. Elsewhere (CI logs, nohup, a pipe) plain whole lines, never wrapped or cut: one after a
unit finishes when PLAIN_GAP_S have passed since the last, and at least one every PLAIN_INTERVAL_S.

The ETA counts the units that ran, not the ones answered at once: per backend, the mean seconds of
its timed (ok or failed) units times its units still to run, a backend seen only `unavailable` as
free, one not seen yet at the mean of all; divided over the live workers.
"""
from __future__ import annotations

import threading
import time
from collections import Counter

from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Column
from rich.text import Text

PLAIN_INTERVAL_S = 10.0
PLAIN_GAP_S = 2.0          # a 13 s smoke sweep shows its progress as it goes, a long one a line per 2 s at most
UNAVAILABLE = "unavailable"


class EtaModel:
    """Remaining seconds from the units that actually ran."""

    def __init__(self, remaining_backends: list[str]):
        self.remaining = Counter(remaining_backends)
        self.ran: dict[str, list[float]] = {}
        self.answered: set[str] = set()          # backends seen unavailable

    def finished(self, backend: str, status: str, seconds: float) -> None:
        if self.remaining[backend] > 0:
            self.remaining[backend] -= 1
        if status == UNAVAILABLE:
            self.answered.add(backend)
        else:
            self.ran.setdefault(backend, []).append(max(0.0, seconds))

    def requeued(self, backend: str) -> None:
        self.remaining[backend] += 1

    def seconds_left(self, workers: int) -> float | None:
        times = [t for ts in self.ran.values() for t in ts]
        if not any(self.remaining.values()):
            return 0.0
        if not times:
            return None
        overall = sum(times) / len(times)
        total = 0.0
        for backend, n in self.remaining.items():
            if backend in self.ran:
                total += n * sum(self.ran[backend]) / len(self.ran[backend])
            elif backend not in self.answered:
                total += n * overall
        return total / max(1, workers)


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _EtaColumn(ProgressColumn):
    def __init__(self, display: "SweepProgress"):
        super().__init__(table_column=Column(no_wrap=True))
        self.display = display

    def render(self, task) -> Text:
        return Text(f"ETA {clock(self.display.eta())}", style="progress.remaining")


class _Live(Progress):
    """rich's Progress with one line per worker under the count line."""

    def __init__(self, display: "SweepProgress", *columns, **kwargs):
        self.display = display          # before rich's init, which may render
        super().__init__(*columns, **kwargs)

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        if len(self.display.workers) > 1:
            for line in self.display.worker_lines():
                yield Text(line, no_wrap=True, overflow="ellipsis")


class SweepProgress:
    """One display for a sweep's units, run by one worker or many. Use as a context manager."""

    def __init__(self, console, workers: list[str], interval_s: float = PLAIN_INTERVAL_S,
                 gap_s: float = PLAIN_GAP_S):
        self.console = console
        self.workers = list(workers)
        self.state = {w: "starting" for w in self.workers}
        self.dead: set[str] = set()
        self.interval_s, self.gap_s = interval_s, gap_s
        self.lock = threading.RLock()
        self.title, self.done, self.total = "sweep", 0, 0
        self.model = EtaModel([])
        self.started = self.last_event = self.last_plain = time.monotonic()
        self.last_text = ""
        self.live = None
        self._stop = threading.Event()
        self._ticker = None

    # ---- what the sweep tells it
    def begin(self, title: str, backends: list[str]) -> None:
        """A pass over units of these backends (one entry per unit): the timing pass, the counter pass."""
        with self.lock:
            self.title, self.done, self.total = title, 0, len(backends)
            self.model = EtaModel(backends)
            self.started = self.last_event = time.monotonic()
            if self.live is not None:
                self.live.reset(self.task, total=self.total, completed=0, description=title)
                self.live.start_task(self.task)

    def working(self, worker: str, what: str) -> None:
        with self.lock:
            self.state[worker] = what
            self._refresh()

    def finished(self, worker: str, backend: str, status: str, seconds: float) -> None:
        with self.lock:
            self.done += 1
            self.model.finished(backend, status, seconds)
            self.last_event = time.monotonic()
            if self.live is not None:
                self.live.update(self.task, completed=self.done)
            elif self._ticker is not None and self.last_event - self.last_plain >= self.gap_s:
                self._print_plain()
            self._refresh()

    def requeued(self, backend: str) -> None:
        with self.lock:
            self.model.requeued(backend)

    def lost(self, worker: str, why: str) -> None:
        with self.lock:
            self.dead.add(worker)
            self.state[worker] = f"LOST: {why}"
            self._refresh()

    # ---- what it shows
    def eta(self) -> float | None:
        with self.lock:
            left = self.model.seconds_left(len(self.workers) - len(self.dead))
            return None if left is None else max(0.0, left - (time.monotonic() - self.last_event))

    def worker_lines(self) -> list[str]:
        with self.lock:
            width = max(len(w) for w in self.workers)
            return [f"{w:<{width}}  {self.state[w]}" for w in self.workers]

    def plain_line(self) -> str:
        with self.lock:
            elapsed = time.monotonic() - self.started
            head = f"{self.title}: {self.done}/{self.total} units, {clock(elapsed)} elapsed, ETA {clock(self.eta())}"
            if len(self.workers) == 1:
                return f"{head} · {self.state[self.workers[0]]}"
            return "\n".join([head] + [f"  {line}" for line in self.worker_lines()])

    def _refresh(self) -> None:
        if self.live is not None and len(self.workers) == 1:
            self.live.update(self.task, description=self.state[self.workers[0]])

    def _print_plain(self) -> None:
        self.last_plain, self.last_text = time.monotonic(), self.plain_line()
        for line in self.last_text.splitlines():
            self.console.print(Text(line), soft_wrap=True)         # a log's line is whole: no width to fit

    def _tick(self) -> None:
        """A line whenever PLAIN_INTERVAL_S pass without one (units that take long, or none finishing)."""
        while True:
            with self.lock:
                wait = self.interval_s - (time.monotonic() - self.last_plain)
                if wait <= 0:
                    self._print_plain()
                    continue
            if self._stop.wait(wait):
                return

    def __enter__(self):
        if self.console.is_terminal:
            self.live = _Live(self, MofNCompleteColumn(), BarColumn(bar_width=16), TimeElapsedColumn(),
                              _EtaColumn(self),
                              TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis",
                                                                                   ratio=1)),
                              console=self.console, transient=False, expand=True)
            self.task = self.live.add_task(self.title, total=self.total)
            self.live.start()
        else:
            self._ticker = threading.Thread(target=self._tick, name="sweep-progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.stop()
        else:
            self._stop.set()
            self._ticker.join()
            with self.lock:
                if self.plain_line() != self.last_text:        # the last unit's line said it already
                    self._print_plain()
