"""Which CPU cores the timing process runs on: left to the OS, or pinned near its GPU.

The eager timer's samples are host time, and on a shared host they move with the host's state: launches
of one point read 1.6-2x apart from those of the next (docs/perf-log.md, 2026-12-07). If the states are
where the OS places the thread (a core on the far socket, a migration mid-call), pinning settles them.
NVML names the cores near a GPU (nvmlDeviceGetCpuAffinity: its NUMA node's), as nvidia-smi topo shows.

  none  the OS places the process (the default)
  numa  every core NVML names near the GPU that this process may use (its cgroup's cpuset, sched_getaffinity)
  core  the first of those alone: threads started later (the NVML poller) share it
"""
from __future__ import annotations

import os
from typing import Sequence

from ...errors import UserError

PINS = ("none", "numa", "core")
WORD_BITS = 64            # NVML's affinity mask is an array of unsigned longs


def check_pin(pin: str) -> str:
    if pin not in PINS:
        raise UserError(f"timing.pin must be one of {', '.join(PINS)}, got {pin!r}")
    return pin


def mask_cpus(words: Sequence[int]) -> list[int]:
    """The CPU ids set in NVML's affinity mask (CPU 0 the lowest bit of the first word)."""
    return [WORD_BITS * i + b for i, w in enumerate(words) for b in range(WORD_BITS) if (int(w) >> b) & 1]


def cpu_list(cpus: Sequence[int]) -> str:
    """Cores as ranges, the way taskset and /proc print them: [0, 1, 2, 3, 8] -> "0-3,8"."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def chosen_cpus(pin: str, near: Sequence[int], allowed: set[int]) -> tuple[list[int] | None, str]:
    """(the cores to pin to, None to leave the process as it is; why, where it is left)."""
    if check_pin(pin) == "none":
        return None, ""
    usable = sorted(set(near) & allowed)
    if not usable:
        return None, (f"pin {pin}: none of the {len(near)} cores NVML names near the GPU is among the "
                      f"{len(allowed)} this process may use; left unpinned")
    return (usable if pin == "numa" else usable[:1]), ""


def gpu_near_cpus(handle) -> list[int]:
    """The cores NVML names near the GPU of `handle` (nvmlDeviceGetCpuAffinity)."""
    import pynvml as nv
    words = -(-os.cpu_count() // WORD_BITS)
    return mask_cpus(nv.nvmlDeviceGetCpuAffinity(handle, words))


def pin_process(pin: str, handle) -> dict:
    """Pin the calling thread (and the threads it starts later) as `pin` says; the record a unit keeps:
    {"pin", "cpus"} (the cores it may run on afterwards) and "note" where it could not be done."""
    allowed = set(os.sched_getaffinity(0))
    record = {"pin": check_pin(pin)}
    if pin != "none":
        if handle is None:
            record["note"] = f"pin {pin}: no NVML handle for the GPU; left unpinned"
        else:
            try:
                cpus, why = chosen_cpus(pin, gpu_near_cpus(handle), allowed)
            except Exception as exc:             # an NVMLError: the driver does not say
                cpus, why = None, f"pin {pin}: NVML gave no CPU affinity ({exc}); left unpinned"
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            if why:
                record["note"] = why
    record["cpus"] = sorted(os.sched_getaffinity(0))
    return record
