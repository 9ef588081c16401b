"""The msa-scatter backend: kv-outer's scheduler and attention main loop with a scatter epilogue."""
from __future__ import annotations

import torch

from ..base import Plan, register
from ...roofline.schedules import Schedule
from ...scenarios.workload import Workload
from ..kv_outer.backend import KVStationaryBackend
from ..triton_common import partial_dtype


@register("msa-scatter")
class MSAScatterBackend(KVStationaryBackend):
    name = "msa-scatter"
    schedule = Schedule.MSA_SCATTER
    description = ("KV-stationary like MiniMax MSA: partials normalized in the attention epilogue and "
                   "scattered to [topk, N, Hq, D] slots, merged by a contiguous-slot combine")

    def unavailable_reason(self, dtype, device):
        if self.attention_impl != "triton":
            return f"{self.name} has only the triton attention implementation"
        return super().unavailable_reason(dtype, device)

    def _plan(self, w: Workload) -> Plan:
        from ..kv_outer.attention import STORE_SCATTER, Attention
        from ..kv_outer.scheduler import Schedule
        from .combine import SlotCombine
        from .index_map import SlotIndexMap
        cfg = self.resolved_config(w)
        s, dev = w.shape, w.device
        index_map = SlotIndexMap(w.pages, w.num_pages, cfg.tile_q)
        schedule = Schedule(index_map, cfg.num_ctas, cfg.q_ranges, cfg.order_chunk, cfg.order_phases)
        buffers = dict(
            csr_ptr=index_map.csr_ptr, csr_query=index_map.csr_query, tile_ptr=index_map.tile_ptr,
            edge_slot=index_map.edge_slot, tile_key=schedule.tile_key, tile_edge=schedule.tile_edge,
            tile_count=schedule.tile_count, tile_run_end=schedule.tile_run_end, cta_range=schedule.cta_range,
            o_slot=torch.empty(s.topk, w.n_tokens, s.hq, s.head_dim, dtype=partial_dtype(w.dtype), device=dev),
            lse_slot=torch.empty(s.topk, w.n_tokens, s.hq, dtype=torch.float32, device=dev),
        )
        out = torch.empty(w.n_tokens, s.hq, s.head_dim, dtype=partial_dtype(w.dtype), device=dev)
        lse = torch.empty(w.n_tokens, s.hq, dtype=torch.float32, device=dev)
        attention = Attention(w, buffers, cfg.tile_q, cfg.num_ctas, cfg.attn_num_warps, cfg.attn_num_stages,
                              STORE_SCATTER, chunk=cfg.attn_chunk)
        combine = SlotCombine(w, buffers, out, lse, cfg.combine_pairs, cfg.combine_num_warps)
        stages = {"index_map": index_map, "schedule": schedule, "attention": attention, "combine": combine}
        info = dict(attention_impl="triton", store="scatter", config=dict(cfg.__dict__),
                    num_tiles_max=index_map.num_tiles_max, tile_rows=cfg.tile_q * s.group,
                    partial_dtype=str(partial_dtype(w.dtype)).replace("torch.", ""),
                    quantization="e4m3 Q/K/V/P on fp8 MMA" if w.dtype == "fp8" else f"none ({w.dtype} Q/K/V/P)")
        return Plan(backend=self.name, stages=stages, output=out, lse=lse, buffers=buffers, info=info)
