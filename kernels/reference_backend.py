"""`reference`: the oracle's own split-then-combine in float32 PyTorch, as a timeable backend.

It is no contender; it gives the CPU smoke sweep something real and quick to time, so the whole
pipeline (check, plan, stage timing, results, report) runs end to end without a GPU kernel.
"""
from __future__ import annotations

import torch

from ..roofline.dtypes import DType
from ..scenarios.reference import combine_partials, reference_partials
from ..scenarios.workload import Workload
from .base import Backend, Plan, register


@register("reference")
class ReferenceBackend(Backend):
    name = "reference"
    description = "float32 PyTorch split-then-combine through harness.reference (a baseline, not a contender)"
    dtypes = tuple(DType)

    def _plan(self, w: Workload) -> Plan:
        s = w.shape
        n = w.n_tokens
        dev = w.device
        out_dtype = torch.float32 if w.dtype == "fp32" else torch.bfloat16
        # Preallocated so both stages write in place: a captured graph replays into the same memory.
        o = torch.empty(n, s.hkv, s.topk, s.group, s.head_dim, dtype=torch.float32, device=dev)
        m = torch.empty(n, s.hkv, s.topk, s.group, dtype=torch.float32, device=dev)
        l = torch.empty_like(m)
        output = torch.empty(n, s.hq, s.head_dim, dtype=out_dtype, device=dev)
        lse = torch.empty(n, s.hq, dtype=torch.float32, device=dev)

        def attention():
            po, pm, pl = reference_partials(w, dtype=torch.float32)
            o.copy_(po)
            m.copy_(pm)
            l.copy_(pl)

        def combine():
            out, row_lse = combine_partials(o, m, l)
            output.copy_(out)
            lse.copy_(row_lse)

        return Plan(backend=self.name, stages={"attention": attention, "combine": combine}, output=output,
                    lse=lse, buffers={"partial_o": o, "partial_m": m, "partial_l": l},
                    info={"compute_dtype": "float32", "quantization": "none (float32 compute on the stored values)"})
