"""Token-packed Q-outer baseline: FlashInfer FA2 with one request per (KV head, tile of P tokens).

A tile (kernels/packed_tiles.py) is P consecutive query tokens; its request walks the union of the
blocks its tokens selected, with the KV head's G = Hq / Hkv query heads packed into the rows
(num_qo_heads G, num_kv_heads 1: P = 8 fills FA2's 128-row query tile at G 16). Each token must
see exactly its own blocks up to its own q_limit, so every request carries a per-token mask unless
none is needed. One FlashInfer wrapper per KV head (the selection differs per head); Q is read
through a strided per-head view, the paged cache through the [num_pages * Hkv, 1, block, D] view
(page index page * Hkv + head), so nothing is copied before the kernel.

Two routes, options of one class:
  paged  BatchPrefillWithPagedKVCacheWrapper: the query tiles (scenarios/tiling.py), inside one
         request and, causal, one window of P positions, so a tile has one local block; its union is
         sorted by logical block (the local block last) and its last page may be partial (last_page_len).
  bsr    BlockSparseAttentionWrapper: the block-sparse matrix's rows are the batch's tokens cut into
         tiles of R = P rows (a tile may span two requests), its columns the head-major cache viewed
         as [num_pages * Hkv * block, 1, D] NHD (column block page * Hkv + head); every block is full,
         so partial visibility always needs the mask.
The mask of a KV head is the cheapest exact one for all its tiles: "none" (every tile token selected
every union block and sees all its keys, bar a last page every token sees to the same length),
"causal" (the same, but the last page is the tile's own block and FlashInfer's bottom-right causal
rule gives each token its exact limit), else "custom": a bit per (token, key) of the request, packed
little-endian, all ones on the blocks a token selected and sees whole. FlashInfer applies a custom
mask to every request of the wrapper, so one tile that needs it makes the head pay for it.

FlashInfer 0.7.2.post1 takes a pre-packed mask (packed_custom_mask / packed_mask) but then leaves
mask_indptr in bits while the kernel reads byte offsets (flashinfer PR #2201); every request's mask
here is a whole number of bytes (block % 8 == 0), and the byte offsets are written after plan().

The output stage copies the per-head outputs [Hkv, N, G, D] into [N, Hq, D] (FA2 writes O rows
contiguous in its own head count), applying v_scale for fp8. fp8: FA2 has no fp8 MMA here; it reads
e4m3 K/V and computes in bf16 from bf16 Q (q * q_scale, in plan), k_scale folded into sm_scale.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..roofline.schedules import Schedule
from ..scenarios.tiling import tile_keys
from ..scenarios.workload import Workload
from .base import Backend, BackendUnavailable, Plan, register
from .flashinfer_common import MIB, bf16_query, gpu_reason, import_flashinfer, workspace_sizes
from .options import Choice, Number
from .packed_tiles import TilePack, pack_tiles, visible_selection

ROUTES = ("paged", "bsr")
TILE_SIZES = (8, 16)
DEFAULT_ROUTE = "paged"          # reads the cache as it is and keeps the causal fast path; the lead may switch
FA2_CTA_ROWS = 128               # FA2's query tile for more than 64 packed rows (FA2DetermineCtaTileQ)
MASK_NONE, MASK_CAUSAL, MASK_CUSTOM = "none", "causal", "custom"
BSR_INT_WORKSPACE = 64 * MIB
BSR_FLOAT_WORKSPACE = 512 * MIB


# ---- planning (pure torch: runs on the CPU for tests) -----------------------------------------------

def tile_ids(w: Workload, route: str) -> torch.Tensor:
    """The ids the route packs: logical blocks for paged; unique across requests (request x blocks +
    block) for bsr, whose tiles are rows of one block-sparse matrix over the whole batch."""
    sel = visible_selection(w)
    if route == "paged":
        return sel
    width = w.page_table.shape[1]
    return torch.where(sel >= 0, w.q_request.long().view(1, -1, 1) * width + sel, sel)


def tile_key(w: Workload, route: str, tile: int) -> torch.Tensor:
    """The runs the route cuts into tiles of P = tile: the query tiles for paged; the whole batch as one
    run for bsr (its block-sparse rows cut every P)."""
    if route == "paged":
        return tile_keys(w.q_request, w.q_limit, tile, w.causal)
    return torch.zeros(w.n_tokens, dtype=torch.long, device=w.q_request.device)


def executed_rows_work(pack: TilePack, group: int) -> int:
    """Query rows x union blocks FA2 computes: each request's G x length rows round up to 128-row tiles."""
    rows = torch.div(pack.length * group + FA2_CTA_ROWS - 1, FA2_CTA_ROWS, rounding_mode="floor") * FA2_CTA_ROWS
    return int((rows.view(1, -1) * pack.count.clamp(min=1)).sum())


@dataclass
class HeadRequests:
    """FlashInfer's arrays for one KV head's requests (one per tile), int32 on the workload's device."""
    head: int
    qo_indptr: torch.Tensor       # [R + 1] tile token ranges (rows of the per-head Q view)
    kv_indptr: torch.Tensor       # [R + 1] pages per request
    kv_indices: torch.Tensor      # [nnz] page * Hkv + head, union order (local block last for paged)
    last_page_len: torch.Tensor   # [R] keys of the last page (block unless mask "none"/"causal" trims it)
    mask_mode: str                # none | causal | custom
    packed_mask: torch.Tensor | None   # [bytes] uint8, request-major, row-major [qo_len, kv_len] bits, little
    mask_indptr: torch.Tensor | None   # [R + 1] byte offsets of each request's mask
    pairs: int                    # (tile, union block) pairs computed
    partial_pairs: int            # of those, pairs some tile token may not see whole (they need the mask)
    empty_tiles: int              # tiles whose tokens see no block here (one fully masked page each)

    @property
    def num_requests(self) -> int:
        return self.last_page_len.numel()


def head_requests(w: Workload, pack: TilePack, head: int, route: str) -> HeadRequests:
    """One KV head's requests from the tile pack: pages, lengths and the cheapest exact mask."""
    s = w.shape
    b = s.block
    dev = pack.union.device
    union, count = pack.union[head].long(), pack.count[head]
    bits = pack.bits[head].long()
    t, cap = union.shape
    lane = torch.arange(pack.tile, device=dev)
    tok_ok = lane.view(1, -1) < pack.length.view(-1, 1)                        # [T, P]
    tok = (pack.start.view(-1, 1) + lane).clamp(max=w.n_tokens - 1)
    empty = count == 0
    n_entries = count.clamp(min=1)                                              # an empty tile keeps one masked page
    entry_ok = torch.arange(cap, device=dev).view(1, -1) < n_entries.view(-1, 1)   # [T, C]
    real = union >= 0
    if route == "paged":
        blk = union.clamp(min=0)
        req = w.q_request.long()[tok[:, 0]].view(-1, 1).expand_as(blk)
    else:
        width = w.page_table.shape[1]
        blk, req = union.clamp(min=0) % width, torch.div(union.clamp(min=0), width, rounding_mode="floor")
    page = torch.where(real, w.page_table.long()[req, blk], torch.zeros_like(blk))
    chose = ((bits.unsqueeze(1) >> lane.view(1, -1, 1)) & 1).bool() & real.unsqueeze(1)      # [T, P, C]
    lim = w.q_limit.long()[tok]
    vis = (lim.unsqueeze(-1) - blk.unsqueeze(1) * b + 1).clamp(0, b)
    vis = torch.where(chose & tok_ok.unsqueeze(-1), vis, torch.zeros_like(vis))

    # the cheapest exact mask: every token chose every block, all but the last page whole to all
    live = tok_ok.unsqueeze(-1) & entry_ok.unsqueeze(1)                          # [T, P, C]
    last = (n_entries - 1).view(-1, 1)
    body = live & (torch.arange(cap, device=dev).view(1, 1, -1) < last.unsqueeze(1))
    uniform = ~empty & ~(live & ~chose).flatten(1).any(1) & ~(body & (vis < b)).flatten(1).any(1)
    v_last = vis.gather(2, last.unsqueeze(1).expand(-1, pack.tile, 1)).squeeze(2)              # [T, P]
    final = (pack.length - 1).clamp(min=0).view(-1, 1)
    v_end = v_last.gather(1, final)                                                             # [T, 1]
    same = ((v_last == v_last[:, :1]) | ~tok_ok).all(1)
    stair = ((v_last == v_end - (final - lane.view(1, -1))) | ~tok_ok).all(1)
    if route == "bsr":                                  # no last_page_len: the last page must be whole too
        same &= v_last[:, 0] == b
        stair &= v_end.squeeze(1) == b
    if bool((uniform & same).all()):
        mode, last_len = MASK_NONE, v_last[:, 0]
    elif bool((uniform & stair).all()):
        mode, last_len = MASK_CAUSAL, v_end.squeeze(1)
    else:
        mode, last_len = MASK_CUSTOM, torch.full_like(count, b)

    kv_indptr = torch.zeros(t + 1, dtype=torch.long, device=dev)
    kv_indptr[1:] = n_entries.cumsum(0)
    kv_indices = (page * s.hkv + head)[entry_ok]
    qo_indptr = torch.cat([pack.start, pack.start.new_full((1,), w.n_tokens)]) if t else pack.start.new_zeros(1)
    packed = mask_indptr = None
    if mode == MASK_CUSTOM:
        if b % 8:
            raise BackendUnavailable(f"flashinfer-packed: a custom mask needs block % 8 == 0 (block {b})")
        # byte j of a (token, block) row holds keys 8j .. 8j+7: its low min(max(vis - 8j, 0), 8) bits set
        ones = (vis.to(torch.int32).unsqueeze(-1) - 8 * torch.arange(b // 8, device=dev, dtype=torch.int32)).clamp(0, 8)
        byte = ((1 << ones) - 1).to(torch.uint8)                                   # [T, P, C, b / 8]
        packed = byte[live].reshape(-1)
        mask_indptr = torch.zeros(t + 1, dtype=torch.long, device=dev)
        mask_indptr[1:] = (pack.length * n_entries * (b // 8)).cumsum(0)
        mask_indptr = mask_indptr.to(torch.int32)
    partial = (live & (vis < b)).any(1) & entry_ok
    i32 = torch.int32
    return HeadRequests(head=head, qo_indptr=qo_indptr.to(i32), kv_indptr=kv_indptr.to(i32),
                        kv_indices=kv_indices.to(i32), last_page_len=last_len.to(i32), mask_mode=mode,
                        packed_mask=packed, mask_indptr=mask_indptr, pairs=int(n_entries.sum()),
                        partial_pairs=int(partial.sum()), empty_tiles=int(empty.sum()))


@dataclass
class PackedPlan:
    route: str
    tile: int
    pack: TilePack
    heads: list[HeadRequests]
    tile_work: dict = field(default_factory=dict)     # P -> FA2 rows x union blocks (the tile choice)
    executed_entries: int = 0                          # (token, union block) pairs computed
    selected_entries: int = 0                          # (token, block) pairs selected with a visible key

    @property
    def union_ratio(self) -> float:
        return self.executed_entries / max(self.selected_entries, 1)

    def mask_summary(self) -> str:
        modes = [h.mask_mode for h in self.heads]
        pairs = sum(h.pairs for h in self.heads)
        partial = sum(h.partial_pairs for h in self.heads)
        kinds = ", ".join(f"{m} x{modes.count(m)}" for m in (MASK_NONE, MASK_CAUSAL, MASK_CUSTOM) if m in modes)
        return (f"per KV head: {kinds}; {partial} of {pairs} (tile, block) pairs ({100 * partial / max(pairs, 1):.1f}%)"
                f" need a per-token mask, the rest are all ones")


def packed_plan(w: Workload, route: str = DEFAULT_ROUTE, tile: int | None = None) -> PackedPlan:
    """Tiles, per-head requests and masks for the route; `tile` None picks 8 or 16 by FA2's work."""
    if route not in ROUTES:
        raise BackendUnavailable(f"flashinfer-packed: unknown route {route!r} (choose {', '.join(ROUTES)})")
    ids = tile_ids(w, route)
    packs = {p: pack_tiles(ids, tile_key(w, route, p), p) for p in ((tile,) if tile else TILE_SIZES)}
    work = {p: executed_rows_work(pk, w.shape.group) for p, pk in packs.items()}
    chosen = min(work, key=lambda p: (work[p], p))
    pack = packs[chosen]
    heads = [head_requests(w, pack, h, route) for h in range(w.shape.hkv)]
    return PackedPlan(route=route, tile=chosen, pack=pack, heads=heads, tile_work=work,
                      executed_entries=int(pack.executed_entries()), selected_entries=int(pack.selected_entries()))


# ---- the backend ------------------------------------------------------------------------------------

@register("flashinfer-packed")
class FlashInferPacked(Backend):
    description = ("Token-packed Q-outer: FlashInfer FA2, one request per (KV head, tile of P tokens) over the "
                   "tile's union of blocks, per-token masks")

    def __init__(self, route: str = DEFAULT_ROUTE, tile: int | None = None, name: str = "flashinfer-packed"):
        if route not in ROUTES:
            raise ValueError(f"flashinfer-packed has no route {route!r} (choose {', '.join(ROUTES)})")
        if tile is not None and tile not in TILE_SIZES:
            raise ValueError(f"flashinfer-packed tile size must be one of {TILE_SIZES}, got {tile}")
        self.route, self.tile, self.name = route, tile, name
        self.dtypes = ("bf16", "fp8")
        self.tile_tokens = tile or TILE_SIZES[0]

    schedule = Schedule.Q_PACKED
    candidate = True
    stage_names = ("attention", "output")
    options = {"route": Choice("route", ROUTES), "tile": Number("tile size", "p", TILE_SIZES)}

    # the packed model counts a tile's masked rows as MMA work; FlashInfer's per-token masks cost more than
    # that (its achieved fraction falls 2.3x from union_ratio 1 to 1.9, and 2-5x on the drift, mixed and
    # multi-token decode runs), so the model is exact only where every tile's tokens select alike
    union_one_only = True

    def unavailable_reason(self, dtype: str, device) -> str | None:
        reason = gpu_reason(self.name, device) or super().unavailable_reason(dtype, device)
        if reason:
            return reason
        try:
            import_flashinfer()
        except BackendUnavailable as exc:
            return str(exc)
        return None

    def _plan(self, w: Workload) -> Plan:
        fi = import_flashinfer()
        s = w.shape
        dev = w.device
        pp = packed_plan(w, self.route, self.tile)
        fp8 = w.dtype == "fp8"
        q = bf16_query(w)
        kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        sm_scale = w.sm_scale * (w.k_scale if fp8 else 1.0)
        v_scale = float(w.v_scale) if fp8 else 1.0
        n = w.n_tokens
        o_heads = torch.empty(s.hkv, n, s.group, s.head_dim, dtype=torch.bfloat16, device=dev)
        output = torch.empty(n, s.hq, s.head_dim, dtype=torch.bfloat16, device=dev)
        q_heads = [q[:, h * s.group:(h + 1) * s.group] for h in range(s.hkv)]    # strided views, no copy
        build = self._paged_wrappers if self.route == "paged" else self._bsr_wrappers
        runs, ws_info, replans = build(fi, w, pp, kv_dtype, sm_scale)

        def attention():
            for h, run in enumerate(runs):
                run(q_heads[h], o_heads[h])

        out4 = output.view(n, s.hkv, s.group, s.head_dim)
        heads_first = o_heads.permute(1, 0, 2, 3)

        def output_stage():
            if v_scale == 1.0:
                out4.copy_(heads_first)
            else:
                torch.mul(heads_first, v_scale, out=out4)

        attention()                    # loads the JIT modules and FlashInfer's small buffers before capture
        output_stage()
        torch.cuda.synchronize(dev)
        quant = ("fp8 K/V read by FA2, bf16 Q (q * q_scale, in plan) and bf16 compute; k_scale in sm_scale, "
                 "v_scale in the output stage") if fp8 else "bf16 Q/K/V, bf16 compute"
        info = {"route": self.route, "tile_size": pp.tile, "tile_choice": {f"p{p}": v for p, v in pp.tile_work.items()},
                "tile_choice_rule": f"least FA2 work: query rows rounded to {FA2_CTA_ROWS} x union blocks",
                "tiles": pp.pack.num_tiles, "union_ratio": round(pp.union_ratio, 4),
                "executed_entries": pp.executed_entries, "selected_entries": pp.selected_entries,
                "tile_segments": "query tiles (scenarios/tiling.py)" if self.route == "paged" else "batch rows (BSR)",
                "mask": pp.mask_summary(), "mask_modes": [h.mask_mode for h in pp.heads],
                "mask_bytes": sum(0 if h.packed_mask is None else h.packed_mask.numel() for h in pp.heads),
                "empty_tiles": sum(h.empty_tiles for h in pp.heads), "quantization": quant,
                "flashinfer_backend": "fa2", "flashinfer_version": getattr(fi, "__version__", "unknown"),
                "num_qo_heads": s.group, "num_kv_heads": 1, "requests_per_head": pp.heads[0].num_requests,
                "pages": sum(h.kv_indices.numel() for h in pp.heads), "page_size": s.block,
                "q_layout": "strided per-head view of Q", "output_stage": "[Hkv, N, G, D] -> [N, Hq, D] copy",
                **ws_info}
        def step():
            for replan in replans:
                replan()

        plan = Plan(backend=self.name, stages={"attention": attention, "output": output_stage}, output=output,
                    buffers={"out_heads": o_heads}, info=info, step=step)
        plan._keep = (runs, pp)       # the wrappers (bound in runs) keep their buffers and plans alive
        return plan

    def _paged_wrappers(self, fi, w: Workload, pp: PackedPlan, kv_dtype, sm_scale):
        s = w.shape
        dev = w.device
        k = w.k_cache.view(w.num_pages * s.hkv, 1, s.block, s.head_dim)
        v = w.v_cache.view(w.num_pages * s.hkv, 1, s.block, s.head_dim)
        uniform = bool((pp.pack.length == pp.tile).all())
        staged = []
        for hr in pp.heads:
            r = hr.num_requests
            custom = hr.mask_mode == MASK_CUSTOM
            bufs = dict(qo_indptr_buf=torch.empty(r + 1, dtype=torch.int32, device=dev),
                        paged_kv_indptr_buf=torch.empty(r + 1, dtype=torch.int32, device=dev),
                        paged_kv_indices_buf=torch.empty(max(hr.kv_indices.numel(), 1), dtype=torch.int32, device=dev),
                        paged_kv_last_page_len_buf=torch.empty(r, dtype=torch.int32, device=dev))
            if custom:
                bufs["custom_mask_buf"] = torch.empty(max(hr.packed_mask.numel(), 1), dtype=torch.uint8, device=dev)
                bufs["mask_indptr_buf"] = torch.empty(r + 1, dtype=torch.int32, device=dev)
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                torch.empty(16 * MIB, dtype=torch.uint8, device=dev), "HND", use_cuda_graph=True, backend="fa2", **bufs)
            args = (hr.qo_indptr.cpu(), hr.kv_indptr.cpu(), hr.kv_indices.to(dev), hr.last_page_len.cpu(),
                    s.group, 1, s.head_dim, s.block)
            kw = dict(packed_custom_mask=hr.packed_mask.to(dev) if custom else None,
                      causal=hr.mask_mode == MASK_CAUSAL, sm_scale=sm_scale, q_data_type=torch.bfloat16,
                      kv_data_type=kv_dtype, o_data_type=torch.bfloat16, uniform_q_len=pp.tile if uniform else None)
            staged.append((hr, wrapper, bufs, args, kw, workspace_sizes(wrapper, args, kw, r)))
        float_ws = torch.empty(max(f for *_, (f, _, _) in staged), dtype=torch.uint8, device=dev)   # shared: runs are serial
        runs, replans = [], []
        for hr, wrapper, bufs, args, kw, (_, i_bytes, _) in staged:
            wrapper.reset_workspace_buffer(float_ws, torch.empty(i_bytes, dtype=torch.uint8, device=dev))

            def replan(wr=wrapper, args=args, kw=kw, bufs=bufs, offsets=hr.mask_indptr.to(dev)
                       if hr.mask_mode == MASK_CUSTOM else None):
                wr.plan(*args, **kw)
                if offsets is not None:           # byte offsets (flashinfer PR #2201: plan leaves bits)
                    bufs["mask_indptr_buf"].copy_(offsets)
            replan()
            replans.append(replan)
            runs.append(lambda qh, oh, wr=wrapper: wr.run(qh, (k, v), out=oh))
        info = {"wrapper": "BatchPrefillWithPagedKVCacheWrapper", "kv_layout": "HND", "cuda_graph_wrapper": True,
                "uniform_q_len": pp.tile if uniform else None, "float_workspace_bytes": float_ws.numel(),
                "int_workspace_bytes": [st[5][1] for st in staged], "workspace_source": staged[0][5][2]}
        return runs, info, replans

    def _bsr_wrappers(self, fi, w: Workload, pp: PackedPlan, kv_dtype, sm_scale):
        s = w.shape
        dev = w.device
        cols = w.num_pages * s.hkv * s.block
        k = w.k_cache.view(cols, 1, s.head_dim)          # NHD, column block c = page * Hkv + head
        v = w.v_cache.view(cols, 1, s.head_dim)
        float_ws = torch.empty(BSR_FLOAT_WORKSPACE, dtype=torch.uint8, device=dev)
        runs, replans = [], []
        for hr in pp.heads:
            wrapper = fi.BlockSparseAttentionWrapper(float_ws, backend="fa2")
            wrapper.reset_workspace_buffer(float_ws, torch.empty(BSR_INT_WORKSPACE, dtype=torch.uint8, device=dev))
            custom = hr.mask_mode == MASK_CUSTOM
            args = (hr.kv_indptr.to(dev), hr.kv_indices.to(dev), w.n_tokens, cols, pp.tile, s.block, s.group, 1,
                    s.head_dim)
            kw = dict(packed_mask=hr.packed_mask.to(dev) if custom else None, causal=hr.mask_mode == MASK_CAUSAL,
                      sm_scale=sm_scale, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
                      o_data_type=torch.bfloat16)

            def replan(wr=wrapper, args=args, kw=kw, offsets=hr.mask_indptr.to(dev) if custom else None):
                wr.plan(*args, **kw)
                if offsets is not None:           # byte offsets (flashinfer PR #2201: plan leaves bits)
                    if not hasattr(wr, "_mask_indptr_buf"):
                        raise BackendUnavailable("flashinfer-packed@bsr: this FlashInfer's "
                                                 "BlockSparseAttentionWrapper keeps no _mask_indptr_buf to correct "
                                                 "(written for 0.7.2.post1)")
                    wr._mask_indptr_buf = offsets
            replan()
            replans.append(replan)
            runs.append(lambda qh, oh, wr=wrapper: wr.run(qh, k, v, out=oh))
        info = {"wrapper": "BlockSparseAttentionWrapper", "kv_layout": "NHD (head-major cache as columns)",
                "cuda_graph_wrapper": False, "float_workspace_bytes": BSR_FLOAT_WORKSPACE,
                "int_workspace_bytes": BSR_INT_WORKSPACE, "bsr_columns": cols}
        return runs, info, replans

