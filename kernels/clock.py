"""The SM clock, measured on the GPU: a fixed spin of `torch.cuda._sleep(SPIN_CYCLES)` between two
CUDA events. clock_mhz = cycles / elapsed_us. NVML's reported clock is a driver sample; this is the
clock the SMs actually ran at, at the moment of the sample, which is what a clock step changes.
SPIN_CYCLES is about 100 us at 1980 MHz, so the events' ~0.5 us resolution is under 1 %.
The host's counterpart, host_launch_probe, times a fixed burst of launches from Python.
"""
from __future__ import annotations

import time

import torch

SPIN_CYCLES = 200_000


def record_spin(cycles: int = SPIN_CYCLES) -> tuple:
    """Enqueue one probe on the current stream: (start event, end event, cycles). No sync."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    return start, end, cycles


def probe_mhz(probe: tuple) -> float:
    """The SM clock of a recorded probe (after its end event completed)."""
    start, end, cycles = probe
    return cycles / (start.elapsed_time(end) * 1e3)      # elapsed_time is ms; cycles per us = MHz


HOST_PROBE_LAUNCHES = 16


def host_launch_probe(buf: torch.Tensor, launches: int = HOST_PROBE_LAUNCHES) -> float:
    """Host seconds per launch of a one-element in-place multiply on `buf`'s device, by perf_counter: the
    Python dispatch and driver launch every eager stage pays, on a fixed amount of work, so a run can say how
    fast its host was when a sample was taken (the host's SM clock, as it were). No synchronize: on a GPU the
    multiplies run after the call returns."""
    start = time.perf_counter()
    for _ in range(launches):
        buf.mul_(1.0)
    return (time.perf_counter() - start) / launches
