"""kv-outer-cute: the kv-outer stages (index_map, schedule, combine) with the CuTe DSL attention stage.

The attention stage is registered as kv-outer's attention implementation "cute"; it reads the plan's
buffers (kernels/kv_outer/__init__.py) and writes o_part, m_part, l_part exactly as the Triton stage
does, so the combine is shared. It needs a CUDA GPU of a built arch and a prebuilt library (see
kernels/cute/manifest.py, `msa-bench build-kernels`), or the DSL installed to compile on the spot.
"""
from __future__ import annotations

import torch

from ..base import BackendUnavailable, register
from ..kv_outer.backend import KVOuterBackend, check_shape, register_attention_impl
from ...scenarios.stats import selected_pairs
from ...scenarios.workload import element_bytes
from ..kv_outer.config import KVOuterConfig, default_config, grouped_tile_order, resolve_num_ctas, tile_order
from .manifest import (DTYPES, FP8_V_KEY_PERMUTED, KNOCKOUT_VARIANTS, P_SHIFT, SUPPORTED_ARCHS, TRACE_VARIANTS,
                       VARIANT_CTAS, VARIANTS, CuteConfig, device_arch, find_library, fp8_v_key_order)

# the generation per dtype (H200 2026-11-29; docs/perf-log.md), with the grouped tile order where Q outgrows
# L2 (resolved_config). fp8: v28 (v23 with L2 evict-first O stores and K/V loads), at N 16384 attention 655
# TFLOP/s against v23's 613 in five interleaved burst rounds at 1980 MHz (s10-call4), +5-6 % in the harness
# and on real prefill's long cases, level at high reuse. bf16: v23 stays; v28 was +2.5 % in those bursts
# but -3 to -9 % in two other same-call A/Bs and at nsb/N >= 2 (results/h200/*-cute-v28). In throttled
# back-to-back rounds v23 was ahead in both dtypes (s10-call3). Until the eighth session: bf16 v22, fp8 v18;
# in the ninth: v23 in both.
DEFAULT_VARIANTS = {"bf16": "v23", "fp8": "v28"}
DEFAULT_CTAS_PER_SM = {"v2": 2, "v3": 1, "v4": 1, "v7": 1, "v9": 1, "v10": 1, "v15": 1, "v16": 1, "v17": 1, "v18": 1,
                       "v21": 1, "v22": 1, "v23": 1, "v24": 1, "v28": 1}


def attention_impl_name(variant: str) -> str:
    return "cute" if variant == "v2" else f"cute-{variant}"


def cute_config_for(workload, tile_q: int, ctas_per_sm: int | None = None, variant: str | None = None) -> CuteConfig:
    """The library configuration a workload needs (variant None: its dtype's default generation), or
    BackendUnavailable if the kernel has none."""
    s = workload.shape
    if workload.dtype not in DTYPES:
        raise BackendUnavailable(f"the CuTe attention stage supports {', '.join(DTYPES)}, not {workload.dtype}")
    if tile_q * s.group != 128 or s.head_dim != 128 or s.block != 128:
        raise BackendUnavailable(
            f"the CuTe attention stage is built for TILE_Q * G = 128, D = 128, block = 128 "
            f"(got TILE_Q {tile_q}, G {s.group}, D {s.head_dim}, block {s.block})")
    variant = variant or default_variant(workload.dtype)
    if variant in KNOCKOUT_VARIANTS + TRACE_VARIANTS:   # diagnostic scripts bind these; the harness cannot
        return CuteConfig(workload.dtype, tile_q, s.group, s.head_dim, s.block, 1, variant)
    if variant not in VARIANTS:
        raise BackendUnavailable(f"unknown CuTe kernel variant {variant!r} (have {', '.join(VARIANTS)})")
    if ctas_per_sm is None:
        ctas_per_sm = DEFAULT_CTAS_PER_SM[variant]
    allowed = VARIANT_CTAS[(variant, workload.dtype)]
    if not allowed:
        raise BackendUnavailable(f"the CuTe attention stage {variant} is not built for {workload.dtype}")
    if ctas_per_sm not in allowed:
        raise BackendUnavailable(f"the CuTe attention stage {variant} {workload.dtype} is built for {allowed} "
                                 f"CTAs per SM, not {ctas_per_sm}")
    return CuteConfig(workload.dtype, tile_q, s.group, s.head_dim, s.block, ctas_per_sm, variant)


def cute_kv_config(dtype: str, ctas_per_sm: int) -> KVOuterConfig:
    """kv-outer's configuration for a CuTe attention stage: the kernel is built for 8-token tiles and
    walks cta_range persistently, so the Triton stage's tuned tile, chunking and register cap do not
    apply; the scheduler's tile order (q_ranges, order_chunk) does."""
    return default_config(dtype).with_(ctas_per_sm=ctas_per_sm, tile_q=8, attn_chunk=0, attn_chunk_grid=0,
                                       attn_maxnreg=0)


class CuteAttentionStage:
    """Binds a loaded library to a plan's buffers; calling it launches one persistent grid on the
    current CUDA stream (CUDA-graph capturable: no host sync, no allocation)."""

    def __init__(self, workload, buffers: dict, config, variant: str | None = None):
        from .loader import resolve_library
        w = workload
        self.config = config
        self.cfg = cute_config_for(w, config.tile_q, config.ctas_per_sm, variant)
        self.library = resolve_library(self.cfg, w.device)
        # one-time setup before any capture: module load + the >48 KiB dynamic smem attribute (the
        # exported module sets it at load); a launch is then only cudaLaunchKernelEx on the given stream
        self.library.load_module()
        # fp8 wgmma wants K-major operands: V d-major ([pages, Hkv, D, block]), made once here.
        self.v = w.v_cache.transpose(-1, -2).contiguous() if w.dtype == "fp8" else w.v_cache
        if w.dtype == "fp8" and self.cfg.variant in FP8_V_KEY_PERMUTED:
            order = torch.tensor(fp8_v_key_order(), device=w.device)
            blk = self.v.shape[-1]
            self.v = self.v.view(*self.v.shape[:-1], blk // 16, 16)[..., order].reshape(self.v.shape).contiguous()
        b = buffers
        tensors = [w.q, w.k_cache, self.v, b["csr_query"], b["tile_key"], b["tile_edge"], b["tile_count"],
                   b["cta_range"], w.page_block, w.q_limit, b["o_part"], b["m_part"], b["l_part"]]
        widths = [w.shape.head_dim, w.shape.head_dim, self.v.shape[-1], 1, 1, 1, 1, 2, 1, 1,
                  w.shape.head_dim, 1, 1]
        for t in tensors:
            if not t.is_contiguous() or t.device != w.device:
                raise BackendUnavailable("the CuTe attention stage needs contiguous tensors on the workload's device")
        self.keep = tensors                                  # the pointers stay valid while the stage lives
        self.packed = self.library.pack([t.data_ptr() for t in tensors],
                                        [t.numel() // wd for t, wd in zip(tensors, widths)])
        self.hkv, self.num_pages = w.shape.hkv, w.num_pages
        self.scale = w.sm_scale * w.q_scale * w.k_scale
        self.out_scale = w.v_scale / 2.0 ** P_SHIFT[w.dtype]
        self.device = w.device

    def __call__(self) -> None:
        # the stream is read at every call: under torch.cuda.graph() it is the capturing side stream
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.library.launch(self.packed, self.hkv, self.num_pages, self.scale, self.out_scale, stream)


def diagnostic_stage(plan, workload, variant: str) -> CuteAttentionStage:
    """A diagnostic build's attention stage (manifest.diagnostic_base) on a plan of its base generation:
    the same buffers and configuration, so it can replace the plan's stage or run beside it. For
    benchmark scripts only; its outputs are not attention."""
    return CuteAttentionStage(workload, plan.buffers, plan.stages["attention"].config, variant)


def default_variant(dtype: str) -> str:
    return DEFAULT_VARIANTS.get(dtype, DEFAULT_VARIANTS["bf16"])


def _register_variant(variant: str) -> None:
    @register_attention_impl(attention_impl_name(variant))
    def cute_attention(workload, buffers: dict, config):
        return CuteAttentionStage(workload, buffers, config, variant)


for _variant in VARIANTS:
    _register_variant(_variant)


@register_attention_impl("cute-default")
def cute_default_attention(workload, buffers: dict, config):
    """The default generation of the workload's dtype (DEFAULT_VARIANTS)."""
    return CuteAttentionStage(workload, buffers, config, default_variant(workload.dtype))


# kv-outer-cute@...+ORDER: a scheduler tile order instead of key order (docs/perf-log.md, eighth session)
@register("kv-outer-cute")
class KVOuterCuteBackend(KVOuterBackend):
    name = "kv-outer-cute"
    description = "kv-outer with the attention stage as a CuTe DSL sm_90a kernel (prebuilt, loaded with ctypes)"
    dtypes = DTYPES

    def __init__(self, config=None, ctas_per_sm: int | None = None, variant: str | None = None,
                 order: str | None = None):
        """variant None: each dtype's default generation (DEFAULT_VARIANTS); order: the scheduler's tile
        order in config.tile_order's notation (None: key order)."""
        if variant is not None and variant not in VARIANTS:
            raise ValueError(f"unknown CuTe kernel variant {variant!r} (have {', '.join(VARIANTS)})")
        self._order_fields = tile_order(order) if order else {}
        super().__init__(attention_impl=attention_impl_name(variant) if variant else "cute-default", config=config)
        self.variant = variant
        self.order = order
        self._ctas_per_sm = ctas_per_sm

    @classmethod
    def from_option(cls, option: str) -> "KVOuterCuteBackend":
        """kv-outer-cute@GEN: the kernel generation GEN in every dtype it is built for; @GEN+ORDER (or
        @ORDER, each dtype's default generation) with the scheduler's tile order ORDER: phases, S:p
        (S query ranges dealt in phases), S:k (dealt in chunks of k tiles) or S."""
        variant, _, order = option.partition("+")
        if not order and variant not in VARIANTS and (variant == "phases" or variant[:1].isdigit()):
            variant, order = "", variant
        if variant and variant not in VARIANTS:
            raise ValueError(f"kv-outer-cute has no kernel generation {variant!r} (have {', '.join(VARIANTS)})")
        return cls(variant=variant or None, order=order or None)

    def variant_for(self, dtype: str) -> str:
        return self.variant or default_variant(dtype)

    def ctas_for(self, dtype: str) -> int:
        return DEFAULT_CTAS_PER_SM[self.variant_for(dtype)] if self._ctas_per_sm is None else self._ctas_per_sm

    def _plan(self, w):
        plan = super()._plan(w)
        plan.info["cute_variant"] = plan.stages["attention"].cfg.variant
        plan.info["quantization"] = "e4m3 Q/K/V/P on fp8 MMA" if w.dtype == "fp8" else f"none ({w.dtype} Q/K/V/P)"
        return plan

    def resolved_config(self, w):
        """kv-outer's configuration with the CuTe kernel's CTAs per SM (the persistent grid size) and its
        tile order: the one asked for, else (no config given) grouped_tile_order's for the workload."""
        cfg = self.config or cute_kv_config(w.dtype, self.ctas_for(w.dtype))
        if self._order_fields:
            cfg = cfg.with_(**self._order_fields)
        elif self.config is None:
            _, fanin = selected_pairs(w)
            cfg = cfg.with_(**grouped_tile_order(w.n_tokens, w.shape.group, w.shape.head_dim,
                                                 element_bytes(w.dtype), float(fanin.double().mean())))
        check_shape(w, cfg.tile_q, self.name)
        return cfg.with_(num_ctas=resolve_num_ctas(cfg, w.device))

    def unavailable_reason(self, dtype, device):
        if dtype not in self.dtypes:
            return f"{self.name} does not support dtype {dtype} (supports {', '.join(self.dtypes)})"
        if not VARIANT_CTAS[(self.variant_for(dtype), dtype)]:
            return f"{self.name}: kernel generation {self.variant_for(dtype)} is not built for {dtype}"
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            return f"{self.name} runs only on a CUDA GPU ({', '.join(SUPPORTED_ARCHS)})"
        arch = device_arch(device)
        if arch not in SUPPORTED_ARCHS:
            return f"{self.name} is built for {', '.join(SUPPORTED_ARCHS)}; this GPU is {arch}"
        reason = super().unavailable_reason(dtype, device)     # the shared Triton stages
        if reason:
            return reason
        from .build import dsl_unavailable_reason
        from .loader import build_dir
        cfg = CuteConfig(dtype, ctas_per_sm=self.ctas_for(dtype), variant=self.variant_for(dtype))
        _, why = find_library(cfg, build_dir(), arch)
        if why and dsl_unavailable_reason() is not None:
            return why
        return None
