"""The SM clock, measured on the GPU: a fixed spin of `torch.cuda._sleep(SPIN_CYCLES)` between two
CUDA events. clock_mhz = cycles / elapsed_us. NVML's reported clock is a driver sample; this is the
clock the SMs actually ran at, at the moment of the sample, which is what a clock step changes.
SPIN_CYCLES is about 100 us at 1980 MHz, so the events' ~0.5 us resolution is under 1 %.
"""
from __future__ import annotations

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

