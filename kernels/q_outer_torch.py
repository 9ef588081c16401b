"""`q-outer-torch`: the Q-outer schedule in PyTorch float32, a Q-outer arm that runs anywhere.

Each chunk of consecutive query tokens gathers the blocks its tokens selected and attends them in one
pass (scenarios/reference.py's oracle, in float32), so only one chunk's blocks are live and no partials
outlive it. No contender: the Q-outer rival of the CPU pipeline. `@c1`, `@c4`, `@c16` (the default):
query tokens per chunk.
"""
from __future__ import annotations

import torch

from ..roofline.dtypes import DType
from ..roofline.schedules import Schedule
from ..scenarios.reference import CHUNK_ROWS, reference_attention
from ..scenarios.workload import Workload
from .base import Backend, Plan, register
from .options import Number


@register("q-outer-torch")
class QOuterTorch(Backend):
    description = "Q-outer in PyTorch float32: each chunk of query tokens attends its own selected blocks"
    dtypes = tuple(DType)
    schedule = Schedule.Q_OUTER
    stage_names = ("attention",)
    options = {"chunk": Number("chunk size", "c", (1, 4, CHUNK_ROWS))}

    def __init__(self, chunk: int = CHUNK_ROWS):
        self.chunk = chunk

    def _plan(self, w: Workload) -> Plan:
        s, n = w.shape, w.n_tokens
        out = torch.empty(n, s.hq, s.head_dim, dtype=torch.float32 if w.dtype == "fp32" else torch.bfloat16,
                          device=w.device)
        lse = torch.empty(n, s.hq, dtype=torch.float32, device=w.device)
        chunks = [(a, torch.arange(a, min(a + self.chunk, n), device=w.device)) for a in range(0, n, self.chunk)]

        def attention():
            for a, rows in chunks:
                o, row_lse = reference_attention(w, rows, dtype=torch.float32)
                out[a:a + len(rows)].copy_(o)
                lse[a:a + len(rows)].copy_(row_lse)

        return Plan(backend=self.name, stages={"attention": attention}, output=out, lse=lse,
                    info={"chunk_tokens": self.chunk, "compute_dtype": "float32",
                          "quantization": "none (float32 compute on the stored values)"})
