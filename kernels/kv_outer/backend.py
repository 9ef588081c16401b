"""The kv-outer backend: index_map -> schedule -> attention -> combine, all buffers allocated in plan().

The attention stage is pluggable: `KVOuterBackend(attention_impl="triton")` picks a factory from
ATTENTION_IMPLS. A factory is `factory(workload, buffers, config) -> stage` (config.num_ctas resolved);
`buffers` is the plan's dict (inputs csr_query, tile_key, tile_edge, tile_count, tile_ptr, cta_range; outputs o_part,
m_part, l_part, layouts in kv_outer/__init__.py) and `stage()` launches the work on the current
stream with no host sync. Another implementation (e.g. a CuTe DSL kernel) registers itself with
`register_attention_impl("cute")(factory)` and is compared stage-for-stage with the Triton one; a
subclass whose stage needs more than the factory's arguments overrides attention_stage().
"""
from __future__ import annotations

from typing import Callable

import torch

from ..base import Backend, BackendUnavailable, Plan, register
from ...roofline.schedules import Schedule
from ..triton_common import partial_dtype, triton_dtype_reason
from ...scenarios.workload import Workload
from .config import KVOuterConfig, default_config, resolve_num_ctas

AttentionFactory = Callable[[Workload, dict, KVOuterConfig], Callable[[], None]]
ATTENTION_IMPLS: dict[str, AttentionFactory] = {}


def register_attention_impl(name: str):
    def wrap(factory: AttentionFactory) -> AttentionFactory:
        ATTENTION_IMPLS[name] = factory
        return factory
    return wrap


@register_attention_impl("triton")
def triton_attention(workload: Workload, buffers: dict, config: KVOuterConfig):
    from .attention import STORE_TILES, Attention
    return Attention(workload, buffers, config.tile_q, config.num_ctas, config.attn_num_warps,
                     config.attn_num_stages, STORE_TILES, chunk=config.attn_chunk)


def check_shape(w: Workload, tile_q: int, name: str) -> None:
    """The Triton kernels tile with power-of-two extents and need every MMA dimension >= 16."""
    s = w.shape
    for what, v in (("GQA group", s.group), ("head_dim", s.head_dim), ("block", s.block), ("tile_q", tile_q)):
        if v & (v - 1):
            raise BackendUnavailable(f"{name} needs a power-of-two {what}, got {v}")
    if s.head_dim < 16 or s.block < 16 or tile_q * s.group < 16:
        raise BackendUnavailable(f"{name} needs head_dim, block and tile_q * group >= 16 "
                                 f"(got {s.head_dim}, {s.block}, {tile_q * s.group})")
    # fp8 MMAs on the GPU reduce over at least 32 elements (head_dim for Q K^T, block for P V); the
    # interpreter has no such limit. Seen on the H200: Triton refuses to compile K < 32.
    if w.dtype == "fp8" and w.device.type == "cuda" and (s.head_dim < 32 or s.block < 32):
        raise BackendUnavailable(f"{name} in fp8 on the GPU needs head_dim and block >= 32 "
                                 f"(got {s.head_dim}, {s.block})")


class KVStationaryBackend(Backend):
    """Shared availability and configuration of the two KV-stationary schedules."""
    dtypes = ("bf16", "fp8", "fp16", "fp32")
    candidate = True
    stage_names = ("index_map", "schedule", "attention", "combine")

    def model_record(self, w: Workload, profile=None) -> dict:
        """With the launch terms of the configuration this backend plans `w` with (tile order, ranges)."""
        from .config import launch_terms
        return {**super().model_record(w, profile),
                "launch": launch_terms(w.shape.hkv, w.dtype, self.resolved_config(w).__dict__)}

    def __init__(self, attention_impl: str = "triton", config: KVOuterConfig | None = None):
        self.attention_impl = attention_impl
        self.config = config

    def unavailable_reason(self, dtype, device):
        reason = super().unavailable_reason(dtype, device)
        if reason:
            return reason
        if self.attention_impl not in ATTENTION_IMPLS:
            return (f"{self.name}: unknown attention implementation {self.attention_impl!r} "
                    f"(have {', '.join(sorted(ATTENTION_IMPLS))})")
        return triton_dtype_reason(self.name, dtype, device)

    def stage_checks(self, plan: Plan, workload: Workload, rows, tol: float) -> dict[str, tuple[bool, str]]:
        from .stage_checks import stage_checks
        return stage_checks(plan, workload, rows, tol)

    def resolved_config(self, w: Workload) -> KVOuterConfig:
        """The configuration to plan with, num_ctas resolved for the workload's device. Chunked launches
        run their programs in position order already: they take the grouped order without the
        round-robin deal or phases (order_chunk 0, order_phases off), which are for persistent CTAs over
        cta_range."""
        cfg = self.config or default_config(w.dtype, w.shape.group)
        check_shape(w, cfg.tile_q, self.name)
        return cfg.with_(num_ctas=resolve_num_ctas(cfg, w.device),
                         order_chunk=cfg.order_chunk if cfg.attn_chunk == 0 else 0,
                         order_phases=cfg.order_phases and cfg.attn_chunk == 0)


@register("kv-outer")
class KVOuterBackend(KVStationaryBackend):
    name = "kv-outer"
    schedule = Schedule.KV_OUTER
    description = ("KV-stationary: each selected (KV head, block) loaded once per CTA visit, raw partial "
                   "tiles stored contiguously, gathered and merged in a separate combine")

    def attention_stage(self, w: Workload, buffers: dict, cfg: KVOuterConfig):
        return ATTENTION_IMPLS[self.attention_impl](w, buffers, cfg)

    def _plan(self, w: Workload) -> Plan:
        from .combine import Combine
        from .index_map import IndexMap
        from .scheduler import Schedule
        cfg = self.resolved_config(w)
        num_ctas = cfg.num_ctas
        s, dev = w.shape, w.device
        index_map = IndexMap(w.pages, w.num_pages, cfg.tile_q)
        schedule = Schedule(index_map, num_ctas, cfg.q_ranges, cfg.order_chunk, cfg.order_phases)
        rows = index_map.num_tiles_max * cfg.tile_q * s.group
        buffers = dict(
            csr_ptr=index_map.csr_ptr, csr_query=index_map.csr_query, tile_ptr=index_map.tile_ptr,
            combine_index=schedule.combine_index, tile_key=schedule.tile_key,
            tile_edge=schedule.tile_edge, tile_count=schedule.tile_count, tile_run_end=schedule.tile_run_end,
            cta_range=schedule.cta_range,
            o_part=torch.empty(rows, s.head_dim, dtype=partial_dtype(w.dtype), device=dev),
            m_part=torch.empty(rows, dtype=torch.float32, device=dev),
            l_part=torch.empty(rows, dtype=torch.float32, device=dev),
        )
        out = torch.empty(w.n_tokens, s.hq, s.head_dim, dtype=partial_dtype(w.dtype), device=dev)
        lse = torch.empty(w.n_tokens, s.hq, dtype=torch.float32, device=dev)
        attention = self.attention_stage(w, buffers, cfg)
        combine = Combine(w, buffers, out, lse, cfg.combine_pairs, cfg.combine_num_warps)
        stages = {"index_map": index_map, "schedule": schedule, "attention": attention, "combine": combine}
        info = dict(attention_impl=self.attention_impl, config=dict(cfg.__dict__),
                    num_tiles_max=index_map.num_tiles_max, tile_rows=cfg.tile_q * s.group,
                    v_layout="d-major copy (plan time)" if w.dtype == "fp8" else "cache as is",
                    partial_dtype=str(partial_dtype(w.dtype)).replace("torch.", ""),
                    quantization="e4m3 Q/K/V/P on fp8 MMA" if w.dtype == "fp8" else f"none ({w.dtype} Q/K/V/P)")
        return Plan(backend=self.name, stages=stages, output=out, lse=lse,
                    buffers=buffers, info=info)
