"""The q-packed backend: schedule (tile unions on the GPU) -> attention (one Triton program per tile).

`q-packed` takes 8 tokens per tile (128 rows with G = 16); option `p8` / `p16` sets the tokens per tile
(`q-packed@p16`). A program runs 8 warps (16 past 128 rows) and two K/V load stages.
"""
from __future__ import annotations

import torch

from ..base import Backend, Plan, register
from ..kv_outer.backend import check_shape
from ..options import Number
from ..triton_common import partial_dtype, triton_dtype_reason
from ...roofline.schedules import Schedule
from ...scenarios.workload import Workload
from . import TILE_TOKENS

DEFAULT_TILE_TOKENS = 8


@register("q-packed")
class QPackedBackend(Backend):
    name = "q-packed"
    description = ("token-packed Q-outer: P tokens x G heads share a tile that walks the union of their "
                   "selected blocks with an online softmax; O written once, no partials, no combine")
    dtypes = ("bf16", "fp8", "fp16", "fp32")
    schedule = Schedule.Q_PACKED
    candidate = True
    stage_names = ("schedule", "attention")
    options = {"tokens_per_tile": Number("tile size", "p", TILE_TOKENS)}

    def __init__(self, tokens_per_tile: int = DEFAULT_TILE_TOKENS):
        self.tokens_per_tile = self.tile_tokens = tokens_per_tile

    def unavailable_reason(self, dtype, device):
        return super().unavailable_reason(dtype, device) or triton_dtype_reason(self.name, dtype, device)

    def _plan(self, w: Workload) -> Plan:
        from .attention import PackedAttention, packed_quantization
        from .schedule import PackedSchedule
        check_shape(w, self.tokens_per_tile, self.name)
        s, dev = w.shape, w.device
        out = torch.empty(w.n_tokens, s.hq, s.head_dim, dtype=partial_dtype(w.dtype), device=dev)
        lse = torch.empty(w.n_tokens, s.hq, dtype=torch.float32, device=dev)
        schedule = PackedSchedule(w, self.tokens_per_tile)
        rows = self.tokens_per_tile * s.group
        attention = PackedAttention(w, schedule, out, lse, num_warps=8 if rows <= 128 else 16)
        schedule()
        executed = float(schedule.tile_count.double() @ schedule.tile_ntok.double().repeat(s.hkv))
        selected = float((w.selection >= 0).sum())
        info = dict(schedule=Schedule.Q_PACKED, tile_tokens=self.tokens_per_tile, tiles=schedule.num_tiles,
                    union_capacity=schedule.union_cap,
                    executed_union_ratio=executed / selected if selected else 1.0,
                    attention=attention.describe(),
                    quantization=packed_quantization(w))
        return Plan(backend=self.name, stages={"schedule": schedule, "attention": attention}, output=out, lse=lse,
                    buffers=dict(schedule.buffers), info=info)
