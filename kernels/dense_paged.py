"""Dense masked attention that reads the paged cache where it is: FlashInfer's FA2 paged prefill with a
custom mask, one FlashInfer request per (request, KV head).

Request (r, h) holds request r's query tokens with the G = Hq / Hkv heads of KV head h in FA2's rows,
and its whole dense context, blocks 0 .. P_r - 1 (P_r: the block of its last query's limit, plus one),
as pages page * Hkv + h of the head-major cache viewed [num_pages * Hkv, 1, block, D] (no copy), every
page whole. The custom mask (bit k of a row: key k is selected and visible to that query) hides the
unselected blocks, the keys past each query's limit and the tail of the last page; the tail's keys
are still read, so plan() checks that they are finite (a masked key's probability is 0, and 0 x NaN is
NaN). A row holds P_r x 128 keys, a multiple of 64: the packed mask is two int64 words per (row,
page) (narrower words where a block is no multiple of 64 keys), written in place of the wrapper's
packed buffer by a few torch ops (no host sync: the stage can be captured).

Stages: gather (Q into FlashInfer's request order; fp8 Q dequantized to bf16, exact with a power-of-
two scale), mask (the packed mask from the selection and q_limit), attention (FA2; fp8 K/V
dequantized in the kernel, k_scale and v_scale as FlashInfer applies them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scenarios.workload import Workload
from .base import BackendUnavailable
from .flashinfer_common import MIB, import_flashinfer, workspace_sizes

WORD_TYPES = {64: torch.int64, 32: torch.int32, 16: torch.int16, 8: torch.int8}     # keys per mask word


# FlashInfer counts the bits of the mask it packs in int32 (segment_packbits' indptr): a larger mask overflows
# them (an illegal address in the 2 x 2K-chunk + 256 decode step at 128K, 2**31 bits)
MAX_MASK_BITS = 2**31 - 1


def word_bits(block: int) -> int | None:
    """Keys per mask word: the widest word a block's keys fill whole; None if a block is no whole byte."""
    return next((bits for bits in WORD_TYPES if block % bits == 0), None)


@dataclass
class Contexts:
    """The requests that have query tokens, in order, read once from the workload (on the host)."""
    requests: torch.Tensor         # [R'] request ids
    limits: torch.Tensor           # [R'] its last query's limit (the last key any of its queries sees)
    blocks: torch.Tensor           # [R'] its dense context blocks, P: the limit's block, plus one
    tokens: list[torch.Tensor]     # its token ids, in order


def contexts(w: Workload) -> Contexts:
    req = w.q_request.long().cpu()
    lim = w.q_limit.long().cpu()
    reqs, limits, toks = [], [], []
    for r in range(w.page_table.shape[0]):
        tok = torch.nonzero(req == r).view(-1)
        if tok.numel():
            reqs.append(r)
            limits.append(int(lim[tok].max()))
            toks.append(tok)
    limits = torch.tensor(limits, dtype=torch.long)
    return Contexts(torch.tensor(reqs, dtype=torch.long), limits, limits // w.shape.block + 1, toks)


def paged_sizes(w: Workload) -> dict:
    """Bytes the paged plan allocates: the packed mask, its words before compaction, the bool mask
    FlashInfer's plan packs once, folded Q and O; the keys and FLOPs it executes."""
    s = w.shape
    ctx = contexts(w)
    blocks = ctx.blocks
    rows = torch.tensor([t.numel() for t in ctx.tokens], dtype=torch.long)
    keys = int((rows * blocks).sum()) * s.block
    bits = keys * s.hkv
    words = int(rows.sum()) * s.hkv * int(blocks.max() if blocks.numel() else 0) * 2 * 8
    qo = 3 * w.n_tokens * s.hq * s.head_dim * 2
    return {"kv_bytes": 0, "mask_bytes": bits // 8 + words + bits, "total_bytes": bits // 8 + words + bits + qo,
            "dense_keys": keys, "executed_flops": 4.0 * s.hq * s.head_dim * keys}


def _tail_reason(w: Workload, ctx: Contexts) -> str | None:
    """One line if a request's dense context has a block with no page, or its last page holds keys past
    its context that are not finite (the kernel reads them, masked)."""
    s = w.shape
    table = w.page_table.long().cpu()
    reqs, blocks = ctx.requests, ctx.blocks
    cols = torch.arange(int(blocks.max()))
    missing = (table[reqs][:, :cols.numel()] < 0) & (cols.view(1, -1) < blocks.view(-1, 1))
    if bool(missing.any()):
        r = int(reqs[missing.any(1)][0])
        return f"dense-masked@flashinfer: request {r} has context blocks with no page (page_table -1)"
    first = ctx.limits % s.block + 1                                                   # keys seen in the last page
    pages = table[reqs, blocks - 1].to(w.k_cache.device)
    past = (torch.arange(s.block).view(1, -1) >= first.view(-1, 1)).to(w.k_cache.device)
    for cache in (w.k_cache, w.v_cache):
        bad = ~torch.isfinite(cache[pages].float()).all(-1).all(1) & past              # [R', block]
        if bool(bad.any()):
            r = int(reqs[bad.any(1).cpu()][0])
            return (f"dense-masked@flashinfer reads whole pages and request {r}'s last page holds keys past "
                    "its context that are not finite")
    return None


@dataclass
class PagedLayout:
    """FlashInfer's arrays for the (request, KV head) requests and the rows of the mask (host, int)."""
    qo_indptr: torch.Tensor        # [R + 1] int32
    kv_indptr: torch.Tensor        # [R + 1] int32: pages of each request
    kv_indices: torch.Tensor       # [pages] int32: page * Hkv + head
    row_tok: torch.Tensor          # [M] token of each mask row, in FlashInfer's order
    row_head: torch.Tensor         # [M] its KV head
    row_blocks: torch.Tensor       # [M] its request's context blocks
    pmax: int                      # the longest context, in blocks

    @property
    def num_requests(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def mask_bits(self) -> int:
        return int(self.row_blocks.sum())

    def compact_index(self) -> torch.Tensor | None:
        """Positions of the (row, page) pairs in a [M, pmax] grid, row-major; None where every row has pmax."""
        if bool((self.row_blocks == self.pmax).all()):
            return None
        grid = torch.arange(self.pmax).view(1, -1) < self.row_blocks.view(-1, 1)
        return torch.nonzero(grid.view(-1)).view(-1)


def paged_layout(w: Workload, ctx: Contexts | None = None) -> PagedLayout:
    """Request (r, h): r's tokens in order, pages table[r, :P_r] * Hkv + h (module docstring)."""
    hkv = w.shape.hkv
    ctx = ctx or contexts(w)
    table = w.page_table.long().cpu()
    qo, kv, indices, row_tok, row_head, row_blocks = [0], [0], [], [], [], []
    for r, tok, p in zip(ctx.requests.tolist(), ctx.tokens, ctx.blocks.tolist()):
        for h in range(hkv):
            qo.append(qo[-1] + tok.numel())
            kv.append(kv[-1] + p)
            indices.append(table[r, :p] * hkv + h)
            row_tok.append(tok)
            row_head.append(torch.full_like(tok, h))
            row_blocks.append(torch.full_like(tok, p))
    return PagedLayout(torch.tensor(qo, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32),
                       torch.cat(indices).to(torch.int32), torch.cat(row_tok), torch.cat(row_head),
                       torch.cat(row_blocks), int(ctx.blocks.max()))


def mask_builder(w: Workload, lay: PagedLayout, words: torch.Tensor, empty: torch.Tensor):
    """A function that writes the packed mask into `words` (WORD_TYPES[word_bits(block)], block / bits per
    (row, page), FlashInfer's row order, compacted) and, per row, whether it sees no key into `empty`:
    torch ops only, no host sync."""
    s = w.shape
    dev = words.device
    pmax = lay.pmax
    row_index = (lay.row_head * w.n_tokens + lay.row_tok).to(dev)        # into [Hkv * N] selection rows
    blocks_rows = lay.row_blocks.to(dev).view(-1, 1)
    limit_rows = w.q_limit.long().to(dev)[lay.row_tok.to(dev)].view(-1, 1, 1)
    bits = word_bits(s.block)
    per_page = s.block // bits
    key0 = torch.arange(pmax, device=dev).view(-1, 1) * s.block + torch.arange(0, s.block, bits, device=dev)
    compact = lay.compact_index()
    compact = None if compact is None else compact.to(dev)
    one = torch.ones((), dtype=words.dtype, device=dev)

    def build():
        sel = w.selection.long().view(s.hkv * w.n_tokens, s.topk)[row_index]          # [M, topk]
        sel = torch.where((sel >= 0) & (sel < blocks_rows), sel, pmax)
        chosen = torch.zeros(sel.shape[0], pmax + 1, dtype=torch.bool, device=dev).scatter_(1, sel, True)
        count = (limit_rows - key0.unsqueeze(0) + 1).clamp_(0, bits).to(words.dtype)   # visible keys per word
        full = torch.where(count >= bits, -one, (one << count.clamp(max=bits - 1)) - one)
        word = torch.where(chosen[:, :pmax].unsqueeze(-1), full, 0)                     # [M, pmax, per_page]
        torch.all(word.view(word.shape[0], -1) == 0, dim=1, out=empty)
        flat = word.view(-1, per_page)
        words.view(-1, per_page).copy_(flat if compact is None else flat.index_select(0, compact))

    return build


def build_paged_stages(w: Workload):
    """(stages, output, info, (wrapper, step)) of the paged dense path (module docstring); step: its plan() as
    a serving engine repeats it every step."""
    fi = import_flashinfer()
    s = w.shape
    dev, b, g, hkv, d = w.device, s.block, s.group, s.hkv, s.head_dim
    if word_bits(b) is None:
        raise BackendUnavailable(f"dense-masked@flashinfer packs the mask in whole bytes per block; block {b} is not")
    ctx = contexts(w)
    lay = paged_layout(w, ctx)
    reason = _tail_reason(w, ctx)
    if reason:
        raise BackendUnavailable(reason)
    n_req, bits = lay.num_requests, lay.mask_bits * b
    if bits >= MAX_MASK_BITS:
        raise BackendUnavailable(f"dense-masked@flashinfer: its mask holds {bits:,} bits, past FlashInfer's int32 "
                                 f"bit offsets ({MAX_MASK_BITS:,})")
    kv_indices = lay.kv_indices.to(dev)
    last = torch.full((n_req,), b, dtype=torch.int32)
    mask_buf = torch.empty(bits // 8, dtype=torch.uint8, device=dev)
    bufs = dict(qo_indptr_buf=torch.empty(n_req + 1, dtype=torch.int32, device=dev),
                paged_kv_indptr_buf=torch.empty(n_req + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buf=torch.empty(max(kv_indices.numel(), 1), dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buf=torch.empty(n_req, dtype=torch.int32, device=dev),
                custom_mask_buf=mask_buf, mask_indptr_buf=torch.empty(n_req + 1, dtype=torch.int32, device=dev))
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16 * MIB, dtype=torch.uint8, device=dev), "HND",
                                                     use_cuda_graph=True, backend="fa2", **bufs)
    fp8 = w.dtype == "fp8"
    plan_kw = dict(q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                   o_data_type=torch.bfloat16, sm_scale=w.sm_scale, causal=False)
    args = (lay.qo_indptr, lay.kv_indptr, kv_indices, last, g, 1, d, b)
    ws_float, ws_int, ws_source = workspace_sizes(wrapper, args, plan_kw, n_req)
    wrapper.reset_workspace_buffer(torch.empty(ws_float, dtype=torch.uint8, device=dev),
                                   torch.empty(ws_int, dtype=torch.uint8, device=dev))
    # the documented path: a bool mask FlashInfer packs (and whose byte offsets it writes); the mask stage
    # overwrites the packed bits in place, same layout (every row a whole number of words)
    zeros = torch.zeros(bits, dtype=torch.bool, device=dev)

    def step():
        wrapper.plan(*args, custom_mask=zeros, **plan_kw)
    step()
    if wrapper._custom_mask_buf.data_ptr() != mask_buf.data_ptr():
        raise BackendUnavailable("dense-masked@flashinfer: FlashInfer did not keep the given mask buffer")
    rows = lay.row_tok.numel()
    empty = torch.empty(rows, dtype=torch.bool, device=dev)
    mask = mask_builder(w, lay, mask_buf.view(WORD_TYPES[word_bits(b)]), empty)

    q_index = (lay.row_tok * hkv + lay.row_head).to(dev)                 # into Q viewed [N * Hkv, G, D]
    q_bf16 = torch.empty(w.n_tokens * hkv, g, d, dtype=torch.bfloat16, device=dev) if fp8 else None
    q_src = q_bf16 if fp8 else w.q.view(w.n_tokens * hkv, g, d)
    q_fold = torch.empty(rows, g, d, dtype=torch.bfloat16, device=dev)
    out_fold = torch.empty_like(q_fold)
    out = torch.zeros(w.n_tokens, s.hq, d, dtype=torch.bfloat16, device=dev)
    out_rows = out.view(w.n_tokens * hkv, g, d)

    def gather():
        if fp8:                          # q * q_scale in bf16: exact, the scale is a power of two
            q_bf16.copy_(w.q.view(q_bf16.shape)).mul_(float(w.q_scale))
        torch.index_select(q_src, 0, q_index, out=q_fold)

    run_kwargs = {"k_scale": float(w.k_scale), "v_scale": float(w.v_scale)} if fp8 else {}
    k = w.k_cache.view(w.num_pages * hkv, 1, b, d)
    v = w.v_cache.view(w.num_pages * hkv, 1, b, d)

    def attention():
        wrapper.run(q_fold, (k, v), out=out_fold, **run_kwargs)
        out_fold.masked_fill_(empty.view(-1, 1, 1), 0.0)
        out_rows.index_copy_(0, q_index, out_fold)

    info = {"flashinfer_backend": "fa2", "flashinfer_version": getattr(fi, "__version__", "unknown"),
            "flashinfer_requests": n_req, "pages": int(kv_indices.numel()), "mask_bytes_packed": bits // 8,
            "workspace_source": ws_source}
    return {"gather": gather, "mask": mask, "attention": attention}, out, info, (wrapper, step)
