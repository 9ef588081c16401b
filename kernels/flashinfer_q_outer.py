"""Q-outer baseline: FlashInfer's paged attention kernels with one request per (query token, KV head).

The fold (pure torch, runs on CPU, see `fold_requests`):
  request r = q * Hkv + h holds the G = Hq / Hkv query heads of token q that share KV head h;
  its page list is the selected blocks workload.pages[h, q, :] (padding and fully masked blocks
  dropped), each page index written as page * Hkv + h so that the head-major cache
  [num_pages, Hkv, block, D] viewed as [num_pages * Hkv, 1, block, D] (a view, no copy) is a
  one-head paged cache with page size = block. The one block a query sees only in part (its
  local block under causality, or the request's final partial block) goes last and its visible
  length becomes last_page_len; every other page is full.

Two ways to put the G heads into FlashInfer's rows (both pure views of Q [N, Hq, D] and of the
output): "heads" = qo_len 1, num_qo_heads G, num_kv_heads 1 (FA2 packs GQA heads into its rows);
"rows" = qo_len G, num_qo_heads 1 (FA3 tiles query rows only, so the heads go there).

Variants: prefill-fa2 (BatchPrefillWithPagedKVCacheWrapper, backend fa2, "heads"), decode-tc
(BatchDecodeWithPagedKVCacheWrapper, use_tensor_cores, backend fa2: the same FA2 kernel reached
through the decode API, "heads"), prefill-fa3 (BatchPrefillWithPagedKVCacheWrapper, backend fa3,
"rows"; fp8 Q/K/V there run on FA3's fp8 tensor-core path with the scales applied in-kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..roofline.schedules import Schedule
from ..scenarios.workload import Workload
from .base import Backend, BackendUnavailable, Plan, register
from .flashinfer_common import (FA3_MODULE_GLOB, MIB, import_flashinfer, jit_module_built,  # noqa: F401  (import_flashinfer: re-exported)
                                flashinfer_reason, workspace_sizes)

VARIANTS = ("prefill-fa2", "decode-tc", "prefill-fa3")
FOLD_OF_VARIANT = {"prefill-fa2": "heads", "decode-tc": "heads", "prefill-fa3": "rows"}

# The registered "flashinfer" default: the faster of prefill-fa2 and decode-tc on the H200
# (shared/measured/h200.json, bf16, random top-16: prefill-fa2 112 TFLOP/s vs decode-tc 93 at
# N 2048 / 256 blocks per head; equal at N 16384 / 1024 blocks; measured 2026-11-29 by the FlashInfer
# benchmark script removed after commit 9821365).
DEFAULT_VARIANT = "prefill-fa2"



class FoldError(ValueError):
    """The selection cannot be expressed as FlashInfer page lists (message is one line)."""


@dataclass
class QOuterFold:
    """FlashInfer's paged-KV arrays for the folded requests (int32, on the pages' device)."""
    qo_indptr: torch.Tensor        # [R + 1]   query rows of each request (step 1 or G)
    kv_indptr: torch.Tensor        # [R + 1]   pages of each request
    kv_indices: torch.Tensor       # [nnz]     page * Hkv + head, request order, partial page last
    last_page_len: torch.Tensor    # [R]       visible keys of the last page (0 for an empty request)
    rows_per_request: int          # 1 ("heads") or G ("rows")
    qo_heads: int                  # G ("heads") or 1 ("rows")
    dropped_blocks: int            # selected blocks with no visible key (left out)

    @property
    def num_requests(self) -> int:
        return self.last_page_len.numel()

    def kv_lens(self, block: int) -> torch.Tensor:
        count = (self.kv_indptr[1:] - self.kv_indptr[:-1]).long()
        return torch.where(count > 0, (count - 1) * block + self.last_page_len.long(), torch.zeros_like(count))


def fold_requests(pages: torch.Tensor, q_limit: torch.Tensor, page_block: torch.Tensor, block: int,
                  group: int, fold: str = "heads") -> QOuterFold:
    """Build the fold's index arrays from a workload's pages [Hkv, N, topk], q_limit [N], page_block."""
    if fold not in ("heads", "rows"):
        raise FoldError(f"unknown fold {fold!r}; use 'heads' or 'rows'")
    hkv, n, topk = pages.shape
    dev = pages.device
    p = pages.long().permute(1, 0, 2).reshape(n * hkv, topk)               # request r = q * Hkv + h
    head = torch.arange(hkv, device=dev).repeat(n)                          # [R]
    limit = q_limit.long().to(dev).repeat_interleave(hkv)                   # [R]
    valid = p >= 0
    start = page_block.long().to(dev)[p.clamp(min=0)] * block               # first key position of each page
    vis = (limit.unsqueeze(1) - start + 1).clamp(0, block)
    vis = torch.where(valid, vis, torch.zeros_like(vis))
    keep = vis > 0
    partial = keep & (vis < block)
    n_partial = partial.sum(1)
    if bool((n_partial > 1).any()):
        bad = int((n_partial > 1).sum())
        raise FoldError(f"{bad} (token, KV head) requests see more than one partially visible block; "
                        "FlashInfer's page lists allow only the last page to be partial")
    # full pages first (selection order kept), the partial page last, dropped entries after
    rank = torch.arange(topk, device=dev).expand_as(p)
    key = torch.where(keep, partial.long(), torch.full_like(rank, 2)) * topk + rank
    order = key.argsort(dim=1)
    p_s, keep_s, vis_s = p.gather(1, order), keep.gather(1, order), vis.gather(1, order)
    count = keep_s.sum(1)
    kv_indptr = torch.zeros(n * hkv + 1, dtype=torch.long, device=dev)
    kv_indptr[1:] = count.cumsum(0)
    kv_indices = (p_s * hkv + head.unsqueeze(1))[keep_s]                   # row-major: request order
    last = vis_s.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    last = torch.where(count > 0, last, torch.zeros_like(last))
    rows = 1 if fold == "heads" else group
    qo_indptr = torch.arange(n * hkv + 1, dtype=torch.long, device=dev) * rows
    return QOuterFold(qo_indptr=qo_indptr.to(torch.int32), kv_indptr=kv_indptr.to(torch.int32),
                      kv_indices=kv_indices.to(torch.int32), last_page_len=last.to(torch.int32),
                      rows_per_request=rows, qo_heads=group if fold == "heads" else 1,
                      dropped_blocks=int((valid & ~keep).sum()))


def folded_views(w: Workload, fold: str):
    """(q, k, v) as FlashInfer sees them: q [R * rows, heads, D]; k, v [num_pages * Hkv, 1, block, D] (HND)."""
    s = w.shape
    n = w.n_tokens
    if fold == "heads":
        q = w.q.view(n * s.hkv, s.group, s.head_dim)
    else:
        q = w.q.view(n * s.hq, 1, s.head_dim)
    k = w.k_cache.view(w.num_pages * s.hkv, 1, s.block, s.head_dim)
    v = w.v_cache.view(w.num_pages * s.hkv, 1, s.block, s.head_dim)
    return q, k, v


@register("flashinfer")
class FlashInferQOuter(Backend):
    description = "Q-outer: FlashInfer paged attention, one request per (query token, KV head)"
    schedule = Schedule.Q_OUTER
    candidate = True
    stage_names = ("attention",)

    def __init__(self, variant: str = DEFAULT_VARIANT, name: str = "flashinfer", fold: str | None = None):
        if variant not in VARIANTS:
            raise BackendUnavailable(f"unknown flashinfer variant {variant!r}; choose one of {', '.join(VARIANTS)}")
        self.variant = variant
        self.name = name
        self.fold = fold or FOLD_OF_VARIANT[variant]
        self.dtypes = ("bf16", "fp8")
        if variant == "prefill-fa2":
            # FA2 runs bf16 MMAs (fp8 K/V widened in the kernel) at one rate per re-read, decode or prefill,
            # while its unique K/V stream keeps the HBM's rate: its fp8 time stayed flat as its HBM term
            # grew past the L2 term (the reuse sweep; docs/perf-log.md, 2026-12-04)
            self.fraction_terms = ("l2", "mma")

    def unavailable_reason(self, dtype: str, device) -> str | None:
        return flashinfer_reason(self, dtype, device, fa3=self.variant == "prefill-fa3")

    def build_pending_reason(self, w: Workload) -> str | None:
        # FA3 (sm_90) prefill modules are not in FlashInfer's prebuilt set: a first plan JIT-builds one
        # (about 165 s on the H200, 2026-12-01); FA2 and decode load prebuilt ones
        if self.variant != "prefill-fa3" or jit_module_built(FA3_MODULE_GLOB):
            return None
        return (f"{self.name}: no built FA3 prefill module ({FA3_MODULE_GLOB}) in FlashInfer's JIT cache; a first "
                f"plan JIT-builds it (minutes); build it ahead with `msa-bench check --backend {self.name}`")

    # ---- plan ---------------------------------------------------------------------------------
    def _plan(self, w: Workload) -> Plan:
        fi = import_flashinfer()
        s = w.shape
        dev = w.device
        fold = fold_requests(w.pages, w.q_limit, w.page_block, s.block, s.group, self.fold)
        empty = int((fold.kv_indptr[1:] == fold.kv_indptr[:-1]).sum())
        if empty:
            raise BackendUnavailable(f"{self.name}: {empty} (token, KV head) requests see no key; "
                                     "FlashInfer's paged kernels need at least one visible key per request")
        fp8 = w.dtype == "fp8"
        q, k, v = folded_views(w, self.fold)
        buffers = {}
        run_kwargs, run_args = {}, ()
        if self.variant == "prefill-fa3" and fp8:
            q_dtype = kv_dtype = torch.float8_e4m3fn
            # FA3's fp8 path reads per-head scale tensors (one head here) and applies them in-kernel
            for name, val in (("scale_q", w.q_scale), ("scale_k", w.k_scale), ("scale_v", w.v_scale)):
                buffers[name] = torch.full((1,), float(val), dtype=torch.float32, device=dev)
            run_args = (buffers["scale_q"], buffers["scale_k"], buffers["scale_v"])
            scale_path = "fp8 Q/K/V, scales in-kernel (FA3 fp8 tensor cores)"
        elif fp8:
            # FA2 has no fp8 tensor-core path: bf16 Q (q * q_scale is exact: power-of-two scale),
            # fp8 K/V dequantized in the kernel; k_scale folds into sm_scale, v_scale is FlashInfer's
            # post-kernel `out *= v_scale` inside run() (captured with it).
            q = (q.to(torch.float32) * w.q_scale).to(torch.bfloat16)
            buffers["q_bf16"] = q
            q_dtype, kv_dtype = torch.bfloat16, torch.float8_e4m3fn
            run_kwargs = {"k_scale": float(w.k_scale), "v_scale": float(w.v_scale)}
            scale_path = "bf16 Q (dequantized in plan), fp8 K/V; k_scale in sm_scale, v_scale out *= v_scale"
        else:
            q_dtype = kv_dtype = torch.bfloat16
            scale_path = "bf16"
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=dev)
        R = fold.num_requests
        nnz = max(int(fold.kv_indices.numel()), 1)
        bufs = dict(qo_indptr=torch.empty(R + 1, dtype=torch.int32, device=dev),
                    kv_indptr=torch.empty(R + 1, dtype=torch.int32, device=dev),
                    kv_indices=torch.empty(nnz, dtype=torch.int32, device=dev),
                    last_page_len=torch.empty(R, dtype=torch.int32, device=dev))
        host = dict(qo_indptr=fold.qo_indptr.cpu(), kv_indptr=fold.kv_indptr.cpu(),
                    last_page_len=fold.last_page_len.cpu())
        kv_indices = fold.kv_indices.to(dev)
        float_ws = torch.empty(16 * MIB, dtype=torch.uint8, device=dev)
        plan_kw = dict(q_data_type=q_dtype, kv_data_type=kv_dtype, o_data_type=torch.bfloat16,
                       sm_scale=w.sm_scale)
        if self.variant == "decode-tc":
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                float_ws, "HND", use_cuda_graph=True, use_tensor_cores=True, backend="fa2",
                paged_kv_indptr_buffer=bufs["kv_indptr"], paged_kv_indices_buffer=bufs["kv_indices"],
                paged_kv_last_page_len_buffer=bufs["last_page_len"])
            args = (host["kv_indptr"], kv_indices, host["last_page_len"], fold.qo_heads, 1, s.head_dim, s.block)
        else:
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                float_ws, "HND", use_cuda_graph=True, backend="fa2" if self.variant == "prefill-fa2" else "fa3",
                qo_indptr_buf=bufs["qo_indptr"], paged_kv_indptr_buf=bufs["kv_indptr"],
                paged_kv_indices_buf=bufs["kv_indices"], paged_kv_last_page_len_buf=bufs["last_page_len"])
            args = (host["qo_indptr"], host["kv_indptr"], kv_indices, host["last_page_len"],
                    fold.qo_heads, 1, s.head_dim, s.block)
            plan_kw["causal"] = False      # one token per request: masking is all in last_page_len
        ws_float, ws_int, ws_source = workspace_sizes(wrapper, args, plan_kw, R)
        wrapper.reset_workspace_buffer(torch.empty(ws_float, dtype=torch.uint8, device=dev),
                                       torch.empty(ws_int, dtype=torch.uint8, device=dev))
        wrapper.plan(*args, **plan_kw)

        def attention():
            wrapper.run(q, (k, v), *run_args, out=out, **run_kwargs)

        attention()                    # loads the JIT module and caches FlashInfer's small buffers before capture
        torch.cuda.synchronize(dev)
        buffers.update(out_folded=out, kv_indices=bufs["kv_indices"], kv_indptr=bufs["kv_indptr"],
                       last_page_len=bufs["last_page_len"], qo_indptr=bufs["qo_indptr"])
        info = {"variant": self.variant, "wrapper": type(wrapper).__name__,
                "flashinfer_backend": getattr(wrapper, "_backend", None),
                "flashinfer_version": getattr(fi, "__version__", "unknown"), "fold": self.fold,
                "num_qo_heads": fold.qo_heads, "num_kv_heads": 1, "rows_per_request": fold.rows_per_request,
                "requests": R, "pages": int(fold.kv_indices.numel()), "page_size": s.block,
                "kv_layout": "HND", "dropped_blocks": fold.dropped_blocks, "dtype_path": scale_path,
                "quantization": ("none (bf16 Q/K/V/P)" if not fp8 else "e4m3 Q/K/V/P on fp8 MMA"
                                 if self.variant == "prefill-fa3" else "fp8 K/V, bf16 Q and compute"),
                "float_workspace_bytes": ws_float, "int_workspace_bytes": ws_int, "workspace_source": ws_source,
                "kv_tokens": int(fold.kv_lens(s.block).sum()), "cuda_graph_wrapper": True}
        plan = Plan(backend=self.name, stages={"attention": attention}, output=out.view(w.n_tokens, s.hq, s.head_dim),
                    buffers=buffers, info=info, step=lambda: wrapper.plan(*args, **plan_kw))
        plan._wrapper = wrapper         # keep FlashInfer's planned state alive with the plan
        return plan


@register("flashinfer-fa3")
class FlashInferFA3(FlashInferQOuter):
    def __init__(self):
        super().__init__("prefill-fa3", name="flashinfer-fa3")
