"""A planted regression: `NAME@delayP` or `NAME@OPTION+delayP` runs NAME (with OPTION) plus one last
stage `delay` that costs P % of the module's time, so a regression gate can be shown to catch a known
slowdown of a known size.

At plan(), the module is timed eagerly a few times as the harness times it, after an L2 flush
(median T), and the spin probe (kernels/clock.py) reads the SM clock right after each run, while the
board is still in the state the module put it in (median f). On CUDA the `delay` stage spins
`torch.cuda._sleep(cycles)` with cycles = P/100 * T * f, so it is graph-capturable and scales with the
clock like a compute-bound kernel; the size it realizes in a sweep is what scripts/gate-power.py reports;
on CPU it busy-waits P/100 * T on the host. plan_info records `delay_percent`, `delay_seconds` and,
on CUDA, `delay_cycles`.
"""
from __future__ import annotations

import re
import statistics
import time

import torch

from .base import Backend, Plan
from .clock import probe_mhz, record_spin
from .l2 import L2Flush
from ..roofline.names import JOINERS

DELAY_STAGE = "delay"
CALIBRATION_RUNS = 5
_DELAY = re.compile(rf"(?:(.*)[{re.escape(JOINERS)}])?delay(.*)")     # a word that starts with 'delay'
_PERCENT = re.compile(r"\d+(?:\.\d+)?")
MAX_DELAY_PERCENT = 1000
DELAY_FORM = (f"a planted delay is delayP, P the percent of the module in (0, {MAX_DELAY_PERCENT}], as the "
              "option's last word (delay5, delay2.5, v28+delay5)")


def split_delay(option: str | None) -> tuple[str | None, float | None]:
    """'v28+delay5' -> ('v28', 5.0); 'delay10' -> (None, 10.0); 'v28' -> ('v28', None). A word that starts
    with 'delay' is the delay's, and a ValueError that says its form when it is not one."""
    m = _DELAY.fullmatch(option or "")
    if not m:
        return option, None
    text = m.group(2)
    percent = float(text) if _PERCENT.fullmatch(text) else None
    if percent is None or not 0 < percent <= MAX_DELAY_PERCENT:
        raise ValueError(f"'delay{text}': {DELAY_FORM}")
    return (m.group(1) or None), percent


def _module_seconds(plan: Plan, cuda: bool) -> tuple[float, float | None]:
    """(median module seconds, median SM clock in MHz right after each run; None on CPU)."""
    times, clocks = [], []
    plan.run()                                   # warm-up
    flush = L2Flush(torch.cuda.current_device()) if cuda else None
    for _ in range(CALIBRATION_RUNS):
        if cuda:
            flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            plan.run()
            end.record()
            probe = record_spin()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
            clocks.append(probe_mhz(probe))
        else:
            t = time.perf_counter()
            plan.run()
            times.append(time.perf_counter() - t)
    return statistics.median(times), (statistics.median(clocks) if clocks else None)


class DelayedBackend(Backend):
    def __init__(self, inner: Backend, percent: float):
        self.inner, self.percent = inner, percent
        self.description = f"{inner.description} + a planted delay of {percent:g} % of the module"
        self.dtypes = inner.dtypes
        self.full_context = inner.full_context

    def unavailable_reason(self, dtype, device):
        return self.inner.unavailable_reason(dtype, device)

    def workload_unavailable_reason(self, workload):
        return self.inner.workload_unavailable_reason(workload)

    def stage_checks(self, plan, workload, rows, tol):
        return self.inner.stage_checks(plan, workload, rows, tol)

    def _plan(self, workload) -> Plan:
        plan = self.inner._plan(workload)
        cuda = torch.device(workload.device).type == "cuda"
        module_s, clock_mhz = _module_seconds(plan, cuda)
        seconds = self.percent / 100 * module_s
        if cuda:
            cycles = max(1, round(seconds * clock_mhz * 1e6))

            def delay() -> None:
                torch.cuda._sleep(cycles)
            plan.info.update(delay_cycles=cycles)
        else:
            def delay() -> None:
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    pass
        plan.stages[DELAY_STAGE] = delay
        plan.info.update(delay_percent=self.percent, delay_seconds=seconds)
        return plan
