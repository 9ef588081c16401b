"""The cold L2 every GPU timing starts from (the harness timer, the planted delay's calibration).

Writing a buffer of twice the L2 evicts whatever a stage would find there, but leaves the L2 full of
dirty lines, and the timed kernel's misses then wait for their write-back: about 10 us of a 150 us
HBM-bound decode kernel on the H200 (docs/perf-log.md, 2026-12-02), none of it the kernel's own traffic.
Reading the buffer back before the timed kernel pays that write-back outside the timing and leaves the
L2 clean, the state ncu's cache control leaves.
"""
from __future__ import annotations

import torch

PROTOCOL = "write+read"
LEGACY_PROTOCOL = "write"        # what a run recorded before the protocol was named used
NO_FLUSH = "none"


class L2Flush:
    """Calling it enqueues the flush on the current stream: a write of 2 x L2, then a read of it."""

    def __init__(self, device):
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        self.buffer = torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)
        self.sink = torch.empty((), dtype=torch.int64, device=device)

    def __call__(self) -> None:
        self.buffer.zero_()
        torch.sum(self.buffer, dim=0, out=self.sink)
