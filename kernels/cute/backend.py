"""kv-outer-cute: the kv-outer stages (index_map, schedule, combine) with the CuTe DSL attention stage.

The attention stage reads the plan's buffers (kernels/kv_outer/__init__.py) and writes o_part, m_part,
l_part exactly as the Triton stage does, so the combine is shared. It needs a CUDA GPU of a built arch and
a prebuilt library (manifest.py, `msa-bench build-kernels`), or the DSL installed to compile on the spot.

Backend options (`kv-outer-cute@OPTION`, kernels/options.py): a kernel of manifest.KERNELS (`@v28`: that
kernel in every dtype), a scheduler tile order in config.tile_order's notation (`@2:p`, `@4:8`, `@phases`:
each dtype's default kernel with that order), or both (`@v23+2:p`). Without an order the backend picks
grouped_tile_order's for the workload.
"""
from __future__ import annotations

import torch

from ..base import BackendUnavailable, register
from ..dispatch import DISPATCH, GRAPH, checked
from ..options import Choice, Rest
from ..kv_outer.backend import KVOuterBackend, check_shape, register_attention_impl
from ...roofline.dtypes import DType
from ...scenarios.stats import selected_pairs
from ..kv_outer.config import KVOuterConfig, default_config, grouped_tile_order, resolve_num_ctas, tile_order
from .manifest import (DTYPES, KERNELS, P_SHIFT, SUPPORTED_ARCHS, CuteConfig, default_kernel, device_arch,
                       fp8_v_key_order)


def _tile_order_word(word: str) -> str:
    tile_order(word)                  # ValueError naming the notation
    return word


def cute_config_for(workload, tile_q: int, ctas_per_sm: int | None = None, kernel: str | None = None) -> CuteConfig:
    """The library configuration a workload needs (kernel None: its dtype's default), or BackendUnavailable
    if there is none."""
    s = workload.shape
    if workload.dtype not in DTYPES:
        raise BackendUnavailable(f"the CuTe attention stage supports {', '.join(DTYPES)}, not {workload.dtype}")
    if tile_q * s.group != 128 or s.head_dim != 128 or s.block != 128:
        raise BackendUnavailable(
            f"the CuTe attention stage is built for TILE_Q * G = 128, D = 128, block = 128 "
            f"(got TILE_Q {tile_q}, G {s.group}, D {s.head_dim}, block {s.block})")
    kernel = kernel or default_kernel(workload.dtype)
    if kernel not in KERNELS:
        raise BackendUnavailable(f"unknown CuTe kernel {kernel!r} (have {', '.join(KERNELS)})")
    k = KERNELS[kernel]
    if workload.dtype not in k.dtypes:
        raise BackendUnavailable(f"the CuTe kernel {kernel} is not built for {workload.dtype}")
    if ctas_per_sm not in (None, k.ctas_per_sm):
        raise BackendUnavailable(f"the CuTe kernel {kernel} runs {k.ctas_per_sm} CTAs per SM, not {ctas_per_sm}")
    return CuteConfig(kernel, workload.dtype, tile_q, s.group, s.head_dim, s.block, k.ctas_per_sm)


def cute_kv_config(dtype: str, ctas_per_sm: int) -> KVOuterConfig:
    """kv-outer's configuration for a CuTe attention stage: the kernel is built for 8-token tiles and
    walks cta_range persistently, so the Triton stage's tuned tile and chunking do not apply; the
    scheduler's tile order (q_ranges, order_chunk) does."""
    return default_config(dtype).with_(ctas_per_sm=ctas_per_sm, tile_q=8, attn_chunk=0)


class CuteAttentionStage:
    """Binds a loaded library to a plan's buffers; calling it launches one persistent grid on the
    current CUDA stream (CUDA-graph capturable: no host sync, no allocation)."""

    def __init__(self, workload, buffers: dict, config, kernel: str | None = None):
        from .loader import resolve_library
        w = workload
        self.config = config
        self.cfg = cute_config_for(w, config.tile_q, config.ctas_per_sm, kernel)
        self.library = resolve_library(self.cfg, w.device)
        # one-time setup before any capture: module load + the >48 KiB dynamic smem attribute (the
        # exported module sets it at load); a launch is then only cudaLaunchKernelEx on the given stream
        self.library.load_module()
        # fp8 wgmma wants K-major operands: V d-major ([pages, Hkv, D, block]), made once here, its keys
        # permuted within every 16 as the kernel's P registers hold them (manifest.fp8_v_key_order).
        self.v = w.v_cache.transpose(-1, -2).contiguous() if w.dtype == "fp8" else w.v_cache
        if w.dtype == "fp8":
            order = torch.tensor(fp8_v_key_order(), device=w.device)
            blk = self.v.shape[-1]
            self.v = self.v.view(*self.v.shape[:-1], blk // 16, 16)[..., order].reshape(self.v.shape).contiguous()
        b = buffers
        tensors = [w.q, w.k_cache, self.v, b["csr_query"], b["tile_key"], b["tile_edge"], b["tile_count"],
                   b["cta_range"], w.page_block, w.q_limit, b["o_part"], b["m_part"], b["l_part"]]
        self.keep = tensors                                  # the pointers stay valid while the stage lives
        self.packed = self.library.pack(tensors, w.device)
        self.scalars = (w.shape.hkv, w.num_pages, w.sm_scale * w.q_scale * w.k_scale,
                        w.v_scale / 2.0 ** P_SHIFT[w.dtype])
        self.device = w.device

    def __call__(self) -> None:
        # the stream is read at every call: under torch.cuda.graph() it is the capturing side stream
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.library.launch(self.packed, self.scalars, stream)


@register_attention_impl("cute")
def cute_attention(workload, buffers: dict, config):
    """kv-outer's attention stage "cute": the default kernel of the workload's dtype."""
    return CuteAttentionStage(workload, buffers, config)


@register("kv-outer-cute")
class KVOuterCuteBackend(KVOuterBackend):
    name = "kv-outer-cute"
    description = "kv-outer with the attention stage as a CuTe DSL sm_90a kernel (prebuilt, loaded with ctypes)"
    dtypes = DTYPES
    options = {"kernel": Choice("kernel", tuple(KERNELS), refuses=r"v\d+"),
               "dispatch": DISPATCH,
               "order": Rest("tile order", _tile_order_word, "S:k|S:p|phases", ("phases", "2:p", "4:8", "1:0"))}

    def __init__(self, config=None, kernel: str | None = None, order: str | None = None, dispatch: str | None = None):
        """kernel None: each dtype's default (manifest.default_kernel); order: the scheduler's tile order
        in config.tile_order's notation (None: grouped_tile_order's for the workload, or config's);
        dispatch "op": the stages replayed from the C++ dispatch library (kernels/kv_outer/op.py), "graph":
        those stages captured at plan time as one CUDA graph the module launches, None: Python."""
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"kv-outer-cute has no kernel {kernel!r} (have {', '.join(KERNELS)})")
        self._order_fields = tile_order(order) if order else {}
        super().__init__(attention_impl="cute", config=config)
        self.kernel = kernel
        self.order = order
        self.dispatch = checked("kv-outer-cute", dispatch)

    def kernel_for(self, dtype: str) -> str:
        return self.kernel or default_kernel(dtype)

    def ctas_for(self, dtype: str) -> int:
        return KERNELS[self.kernel_for(dtype)].ctas_per_sm

    def workload_unavailable_reason(self, w) -> str | None:
        reason = self.unavailable_reason(w.dtype, w.device)
        if reason is None:
            tile_q = (self.config or cute_kv_config(w.dtype, self.ctas_for(w.dtype))).tile_q
            try:
                check_shape(w, tile_q, self.name)
                cute_config_for(w, tile_q, self.ctas_for(w.dtype), self.kernel_for(w.dtype))
            except BackendUnavailable as exc:
                reason = f"{self.name}: {exc}"
        return reason

    def attention_stage(self, w, buffers: dict, cfg: KVOuterConfig):
        return CuteAttentionStage(w, buffers, cfg, self.kernel_for(w.dtype))

    def _plan(self, w):
        plan = super()._plan(w)
        plan.info["cute_kernel"] = plan.stages["attention"].cfg.kernel
        if self.dispatch:
            from ..kv_outer.op import dispatch
            dispatch(plan, self.dispatch == GRAPH)
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
                                                 DType(w.dtype).bytes, float(fanin.double().mean())))
        check_shape(w, cfg.tile_q, self.name)
        return cfg.with_(num_ctas=resolve_num_ctas(cfg, w.device))

    def unavailable_reason(self, dtype, device):
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():      # the first thing to fix
            return f"{self.name} runs only on a CUDA GPU ({', '.join(SUPPORTED_ARCHS)})"
        if dtype not in self.dtypes:
            return f"{self.name} does not support dtype {dtype} (supports {', '.join(self.dtypes)})"
        if dtype not in KERNELS[self.kernel_for(dtype)].dtypes:
            return f"{self.name}: kernel {self.kernel_for(dtype)} is not built for {dtype}"
        arch = device_arch(device)
        if arch not in SUPPORTED_ARCHS:
            return f"{self.name} is built for {', '.join(SUPPORTED_ARCHS)}; this GPU is {arch}"
        reason = super().unavailable_reason(dtype, device)     # the shared Triton stages
        if reason:
            return reason
        if self.dispatch:
            from ..dispatch.build import unavailable_reason
            reason = unavailable_reason(self.name)
            if reason:
                return reason
        from .loader import library_unavailable_reason
        return library_unavailable_reason(CuteConfig(self.kernel_for(dtype), dtype, ctas_per_sm=self.ctas_for(dtype)),
                                          arch)
