"""`dense-floor`: every request's whole visible context and no selection: what the model costs without
sparse attention, the floor a sparse schedule is worth its kernel against.

FlashInfer reads the paged cache where it is: the head-major cache [num_pages, Hkv, block, D] is its HND
layout, so a request's pages are its page-table row (no fold, no copy) and the Hq / Hkv query heads of a
KV head share its loads in the kernel (GQA). Two paths, chosen by the workload:
  decode   (every request has one query token) BatchDecodeWithPagedKVCacheWrapper, one FlashInfer request
           per token: its request's pages up to its own block, that block's visible keys as the last
           page's length, on tensor cores (FA2). fp8: bf16 Q (q * q_scale, exact: a power-of-two scale),
           e4m3 K/V read as stored (k_scale in sm_scale, v_scale FlashInfer's out *= v_scale); FA2 converts
           them to bf16 for its MMAs. FlashInfer's CUDA-core decode and FA3's prefill kernels with one-token
           requests (e4m3 MMAs) lost by 3-13x and 10-16x on an H100 (docs/perf-log.md, 2026-12-07).
  prefill  (otherwise) BatchPrefillWithPagedKVCacheWrapper, one request per workload request, causal:
           its tokens are the last positions of its context in order, FlashInfer's bottom-right causal
           mask. FA3 on sm_90 (`@fa2` elsewhere or by choice); fp8 Q/K/V on FA3's fp8 MMAs with the
           scales in-kernel (FA2: bf16 Q, e4m3 K/V as in decode).
Its output is dense attention over every visible key, which only equals the sparse one where the
selection holds every visible block (sparsity ratio 1): the float64 check takes that context
(`full_context`), its FLOPs are the visible keys' (roofline Schedule.DENSE), and `auto` never weighs it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..roofline.schedules import Schedule
from ..scenarios.workload import Workload
from .base import Backend, BackendUnavailable, Plan, register
from .flashinfer_common import (FA3_MODULE_GLOB, FA3_SUFFIX, MIB, bf16_query, fa2_prefill_module, flashinfer_reason,
                                import_flashinfer, jit_module_built, workspace_sizes)
from .options import Choice

PREFILL_KERNELS = ("fa3", "fa2")


class LayoutError(ValueError):
    """The workload's tokens cannot be FlashInfer's requests (message is one line)."""


@dataclass
class DenseLayout:
    """FlashInfer's paged-KV arrays of the dense floor (int32, on the host)."""
    decode: bool                   # one query token per request: the decode wrapper, a request per token
    qo_indptr: torch.Tensor        # [R + 1] query tokens of each FlashInfer request
    kv_indptr: torch.Tensor        # [R + 1] its pages
    kv_indices: torch.Tensor       # [pages] physical pages, request order
    last_page_len: torch.Tensor    # [R] visible keys of its last page
    kv_lens: torch.Tensor          # [R] visible keys

    @property
    def num_requests(self) -> int:
        return self.last_page_len.numel()


def dense_layout(w: Workload) -> DenseLayout:
    """The FlashInfer requests of `w` (module docstring); LayoutError where its tokens are not in request
    order, are not the last positions of their context, or a visible block has no page."""
    b = w.shape.block
    req = w.q_request.long().cpu()
    lim = w.q_limit.long().cpu()
    counts = torch.bincount(req, minlength=w.page_table.shape[0])
    decode = bool((counts <= 1).all())
    if decode:
        owner, qo, kv = req, torch.ones_like(req), lim + 1
    else:
        if bool((req[1:] < req[:-1]).any()):
            raise LayoutError("its query tokens are not in request order (FlashInfer's requests are contiguous "
                              "ranges of Q)")
        owner = torch.nonzero(counts).view(-1)
        qo = counts[owner]
        kv = torch.full_like(counts, -1).scatter_reduce(0, req, lim, "amax")[owner] + 1
        first = torch.cumsum(qo, 0) - qo
        rank = torch.arange(req.numel()) - torch.repeat_interleave(first, qo)
        seen = torch.repeat_interleave(kv, qo)
        want = seen - torch.repeat_interleave(qo, qo) + rank if w.causal else seen - 1
        if not torch.equal(lim, want):
            raise LayoutError("a request's query tokens are not the last positions of its context in order "
                              "(FlashInfer's causal mask is bottom-right aligned)" if w.causal else
                              "a request's query tokens see different contexts (non-causal: one per request)")
    blocks = (kv - 1) // b + 1
    table = w.page_table.long().cpu()
    cols = torch.arange(int(blocks.max()))
    pages = table[owner][:, :cols.numel()]
    visible = cols.view(1, -1) < blocks.view(-1, 1)
    if bool((pages[visible] < 0).any()):
        raise LayoutError("a visible block of a request has no page (page_table -1)")
    zero = torch.zeros(1, dtype=torch.long)
    return DenseLayout(decode, torch.cat([zero, qo.cumsum(0)]).int(), torch.cat([zero, blocks.cumsum(0)]).int(),
                       pages[visible].int(), (kv - (blocks - 1) * b).int(), kv.int())


@register("dense-floor")
class DenseFloor(Backend):
    description = ("Dense floor: every request's whole visible context, no selection: FlashInfer's paged decode "
                   "(FA2 tensor cores) or causal FA3 prefill over the cache where it is")
    schedule = Schedule.DENSE
    dense = True
    full_context = True
    stage_names = ("attention",)
    options = {"kernel": Choice("prefill kernel", PREFILL_KERNELS)}

    def __init__(self, kernel: str | None = None, name: str = "dense-floor"):
        self.kernel, self.name = kernel, name
        self.dtypes = ("bf16", "fp8")

    def _uses_fa3(self, decode: bool, device) -> bool:
        return not decode and self._prefill_kernel(device) == "fa3"

    def _prefill_kernel(self, device) -> str:
        if self.kernel:
            return self.kernel
        cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
        return "fa3" if cuda and torch.cuda.get_device_capability(torch.device(device)) == (9, 0) else "fa2"

    def unavailable_reason(self, dtype: str, device) -> str | None:
        return flashinfer_reason(self, dtype, device, fa3=self.kernel == "fa3")

    def workload_unavailable_reason(self, w: Workload) -> str | None:
        reason = super().workload_unavailable_reason(w)
        if reason:
            return reason
        try:
            dense_layout(w)
        except LayoutError as exc:
            return f"{self.name}: {exc}"
        return None

    def build_pending_reason(self, w: Workload) -> str | None:
        # the tensor-core decode and prefill run FlashInfer's prefill modules, which a first plan may JIT-build
        # (FA3's are never prebuilt, FA2's of these dtypes not always: kernels/dense_masked.py)
        decode = bool((torch.bincount(w.q_request.long().cpu()) <= 1).all())
        if self._uses_fa3(decode, w.device):
            module, unless, what = FA3_MODULE_GLOB, None, "FA3"
        else:
            module, unless, what = fa2_prefill_module(w.dtype, w.shape.head_dim), FA3_SUFFIX, "FA2"
        if jit_module_built(module, unless):
            return None
        return (f"{self.name}: no built {what} prefill module ({module}) in FlashInfer's JIT cache; a first plan "
                f"JIT-builds it (minutes); build it ahead with `msa-bench check --backend {self.name} --dtype {w.dtype}"
                f"{' --generator decode --requests 16' if decode else ''}`")

    def _plan(self, w: Workload) -> Plan:
        fi = import_flashinfer()
        s, dev = w.shape, w.device
        try:
            lay = dense_layout(w)
        except LayoutError as exc:
            raise BackendUnavailable(f"{self.name}: {exc}") from None
        fp8 = w.dtype == "fp8"
        kernel = "fa3" if self._uses_fa3(lay.decode, dev) else "fa2"
        fp8_mma = fp8 and kernel == "fa3"
        R = lay.num_requests
        bufs = dict(kv_indptr=torch.empty(R + 1, dtype=torch.int32, device=dev),
                    kv_indices=torch.empty(max(lay.kv_indices.numel(), 1), dtype=torch.int32, device=dev),
                    last_page_len=torch.empty(R, dtype=torch.int32, device=dev))
        kv_indices = lay.kv_indices.to(dev)
        float_ws = torch.empty(16 * MIB, dtype=torch.uint8, device=dev)
        q, run_args, run_kwargs, buffers = w.q, (), {}, {}
        if fp8_mma:
            # FA3's fp8 path reads per-head scale tensors and applies them in-kernel
            for name, val, heads in (("scale_q", w.q_scale, s.hq), ("scale_k", w.k_scale, s.hkv),
                                     ("scale_v", w.v_scale, s.hkv)):
                buffers[name] = torch.full((heads,), float(val), dtype=torch.float32, device=dev)
            run_args = (buffers["scale_q"], buffers["scale_k"], buffers["scale_v"])
        elif fp8:
            q = buffers["q_bf16"] = bf16_query(w)
            run_kwargs = {"k_scale": float(w.k_scale), "v_scale": float(w.v_scale)}
        plan_kw = dict(q_data_type=q.dtype, kv_data_type=w.k_cache.dtype, o_data_type=torch.bfloat16,
                       sm_scale=w.sm_scale)
        if lay.decode:
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                float_ws, "HND", use_cuda_graph=True, use_tensor_cores=True, backend="fa2",
                paged_kv_indptr_buffer=bufs["kv_indptr"], paged_kv_indices_buffer=bufs["kv_indices"],
                paged_kv_last_page_len_buffer=bufs["last_page_len"])
            args = (lay.kv_indptr, kv_indices, lay.last_page_len, s.hq, s.hkv, s.head_dim, s.block)
        else:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                float_ws, "HND", use_cuda_graph=True, backend=kernel,
                qo_indptr_buf=torch.empty(R + 1, dtype=torch.int32, device=dev),
                paged_kv_indptr_buf=bufs["kv_indptr"], paged_kv_indices_buf=bufs["kv_indices"],
                paged_kv_last_page_len_buf=bufs["last_page_len"])
            args = (lay.qo_indptr, lay.kv_indptr, kv_indices, lay.last_page_len, s.hq, s.hkv, s.head_dim, s.block)
            plan_kw["causal"] = w.causal
        ws_float, ws_int, ws_source = workspace_sizes(wrapper, args, plan_kw, R)
        wrapper.reset_workspace_buffer(torch.empty(ws_float, dtype=torch.uint8, device=dev),
                                       torch.empty(ws_int, dtype=torch.uint8, device=dev))
        wrapper.plan(*args, **plan_kw)
        out = torch.empty(w.n_tokens, s.hq, s.head_dim, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(w.n_tokens, s.hq, dtype=torch.float32, device=dev)
        kv = (w.k_cache, w.v_cache)

        def attention():
            wrapper.run(q, kv, *run_args, out=out, lse=lse, return_lse=True, **run_kwargs)
            lse.mul_(math.log(2.0))           # FlashInfer's LSE is base 2

        attention()                    # loads the JIT module and caches FlashInfer's small buffers before capture
        torch.cuda.synchronize(dev)
        info = {"path": "decode" if lay.decode else "prefill", "wrapper": type(wrapper).__name__,
                "flashinfer_backend": kernel, "tensor_cores": True,
                "flashinfer_version": getattr(fi, "__version__", "unknown"), "causal": bool(w.causal),
                "requests": R, "pages": int(lay.kv_indices.numel()), "page_size": s.block, "kv_layout": "HND",
                "kv_tokens": int(lay.kv_lens.sum()), "num_qo_heads": s.hq, "num_kv_heads": s.hkv,
                "quantization": ("none (bf16 Q/K/V/P)" if not fp8 else "e4m3 Q/K/V/P on fp8 MMA, scales in-kernel"
                                 if fp8_mma else "bf16 Q (q_scale exact), e4m3 K/V; k_scale in sm_scale, "
                                 "out *= v_scale"),
                "float_workspace_bytes": ws_float, "int_workspace_bytes": ws_int, "workspace_source": ws_source,
                "cuda_graph_wrapper": True}
        plan = Plan(backend=self.name, stages={"attention": attention}, output=out, lse=lse, buffers=buffers,
                    info=info, step=lambda: wrapper.plan(*args, **plan_kw))
        plan._wrapper = wrapper         # keep FlashInfer's planned state alive with the plan
        return plan
