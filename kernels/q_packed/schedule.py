"""The q-packed schedule: token tiles (plan time) and their block unions and key limits (a GPU stage).

Token tiles, the query tiles of scenarios/tiling.py, depend only on q_request and q_limit, so plan()
cuts them on the host. The unions depend on the selection, so stage `schedule` builds them on the
device, inside the module's graph: one Triton program per (KV head, token tile) loads its P x topk
selected ids, ranks each distinct id among the tile's distinct ids (sort the (id, entry) pairs, open a
slot at the first entry of each id), and writes the union, its pages, and every token's key limit per
union slot. Fixed shapes, no host reads.

The union's order: first the blocks only the tile's first half of tokens selected, then those both
halves did, then those only the second half did, ascending within each. A CuTe consumer warpgroup holds
one half (4 tokens x 16 heads, one 64-row wgmma), so each half's blocks are one contiguous range of the
union, [0, lo_end) and [hi_start, count) (tile_split), and a warpgroup skips the rest without a branch
per block. A 12-token tile has three warpgroups (thirds of 4 tokens): a block's class is the (first,
last) third of the tokens that select it, in the order (0, 0) (0, 1) (0, 2) (1, 1) (1, 2) (2, 2), so the
thirds walk [0, e0), [s1, e1) and [s2, count) (tile_split, four a tile). The third third's range holds
the (1, 1) blocks, which its tokens did not select (their limits mask them): where tokens drift, a block
the middle tokens alone select is the rare one.
"""
from __future__ import annotations

import torch

from ...scenarios.tiling import query_tiles
from ..cute.manifest import WIDE_TOKENS
from .. import triton_common  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton is imported)
from ..triton_scans import scan_max, scan_min
from ..dispatch.triton_launch import launch
import triton
import triton.language as tl

NO_KEY = -1                      # a token's limit for a union block it did not select
_NO_KEY = tl.constexpr(NO_KEY)   # the same, where a Triton kernel reads it
# six classes' counts of union slots, each u_p2.bit_length() bits, share one int64: u_p2 at most 2^9
MAX_TILE_ENTRIES = 1 << (63 // 6 - 1)


def token_tiles(q_request: torch.Tensor, q_limit: torch.Tensor, tokens_per_tile: int,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_tok0 [Tt], tile_ntok [Tt]) int64 on the host: the first token and the token count of each
    query tile (scenarios/tiling.py)."""
    tile_id, slot = query_tiles(q_request.cpu(), q_limit.cpu(), tokens_per_tile, causal)
    tok0 = (slot == 0).nonzero().flatten()
    return tok0, torch.bincount(tile_id, minlength=tok0.numel())


@triton.jit
def pack_tile_kernel(sel_ptr, q_limit_ptr, q_request_ptr, page_table_ptr, tile_tok0_ptr, tile_ntok_ptr,
                     tile_count_ptr, tile_page_ptr, tile_limit_ptr, tile_split_ptr, residual_ptr, n_tokens,
                     n_token_tiles,
                     table_stride, P: tl.constexpr, TOPK: tl.constexpr, U: tl.constexpr, U_P2: tl.constexpr,
                     BLOCK: tl.constexpr, MIN_SHARE: tl.constexpr, RESIDUAL: tl.constexpr, FIELD: tl.constexpr,
                     K_P2: tl.constexpr, CELLS: tl.constexpr, THIRDS: tl.constexpr):
    tile = tl.program_id(0)                       # head * n_token_tiles + token tile
    head = tile // n_token_tiles
    tt = tile % n_token_tiles
    tok0 = tl.load(tile_tok0_ptr + tt)
    ntok = tl.load(tile_ntok_ptr + tt)
    if ntok == 1:
        _one_token_tile(sel_ptr, q_limit_ptr, q_request_ptr, page_table_ptr, tile_count_ptr, tile_page_ptr,
                        tile_limit_ptr, tile_split_ptr, residual_ptr, tile, head, tok0, n_tokens, table_stride,
                        P, TOPK, K_P2, U, U_P2, BLOCK, MIN_SHARE, RESIDUAL, CELLS, THIRDS)
    else:
        _many_token_tile(sel_ptr, q_limit_ptr, q_request_ptr, page_table_ptr, tile_count_ptr, tile_page_ptr,
                         tile_limit_ptr, tile_split_ptr, residual_ptr, tile, head, tok0, ntok, n_tokens,
                         table_stride, P, TOPK, U, U_P2, BLOCK, MIN_SHARE, RESIDUAL, FIELD, CELLS, THIRDS)


@triton.jit
def _id_runs(blk, i, N: tl.constexpr):
    """Sort the (block id, entry) pairs of entries i (padding, id -1, sorts last): per sorted position whether
    it holds an entry, its id (-1 for padding), its entry, and whether it opens its id's run (a union slot)."""
    big = 2147483647
    key = tl.sort(tl.where(blk >= 0, blk * N + i, big))
    valid = key != big
    blk_s = tl.where(valid, key // N, -1)
    prev = tl.gather(blk_s, tl.maximum(i - 1, 0), 0)
    return valid, blk_s, key % N, valid & ((i == 0) | (blk_s != prev))


@triton.jit
def _one_token_tile(sel_ptr, q_limit_ptr, q_request_ptr, page_table_ptr, tile_count_ptr, tile_page_ptr,
                    tile_limit_ptr, tile_split_ptr, residual_ptr, tile, head, tok0, n_tokens, table_stride,
                    P: tl.constexpr, TOPK: tl.constexpr, K_P2: tl.constexpr, U: tl.constexpr, U_P2: tl.constexpr,
                    BLOCK: tl.constexpr, MIN_SHARE: tl.constexpr, RESIDUAL: tl.constexpr, CELLS: tl.constexpr,
                    THIRDS: tl.constexpr):
    """A tile of one token (every decode token): its union is its own selection in ascending order, all of
    it the first half's, so the general path's sorts over P x topk entries reduce to one over topk."""
    j = tl.arange(0, K_P2)
    row0 = (head.to(tl.int64) * n_tokens + tok0) * TOPK
    blk = tl.load(sel_ptr + row0 + j, mask=j < TOPK, other=-1)
    valid, blk_s, entry, first = _id_runs(blk, j, K_P2)
    # an id's share is its entries, as in the general path (a repeated id counts twice)
    shared = tl.sum((blk_s[:, None] == blk_s[None, :]).to(tl.int32), 1)
    kept = valid & (shared >= MIN_SHARE)
    keep = first & kept
    rank = tl.cumsum(keep.to(tl.int32), 0) - 1
    count = tl.sum(keep.to(tl.int32), 0)
    tl.store(tile_count_ptr + tile, count)
    lo_end = count
    if P == 1:                  # a tile one token wide has no first half: the token is its second
        lo_end = count * 0
    if THIRDS:                  # all of it the first third's: (e0, s1, e1, s2) all count
        for k in tl.static_range(4):
            tl.store(tile_split_ptr + 4 * tile + k, count)
    else:
        tl.store(tile_split_ptr + 2 * tile, lo_end)
        tl.store(tile_split_ptr + 2 * tile + 1, lo_end)
    req = tl.load(q_request_ptr + tok0)
    page = tl.load(page_table_ptr + req.to(tl.int64) * table_stride + blk_s, mask=valid, other=-1)
    base = tile.to(tl.int64) * U
    i = tl.arange(0, U_P2)
    tl.store(tile_page_ptr + base + i, tl.full([U_P2], -1, tl.int32), mask=(i >= count) & (i < U))
    tl.store(tile_page_ptr + base + rank, page, mask=keep)
    # limits [U, P]: the token's own at (slot, 0), NO_KEY in every other cell (disjoint stores, no barrier)
    cell = tl.arange(0, CELLS)
    tl.store(tile_limit_ptr + base * P + cell, tl.full([CELLS], _NO_KEY, tl.int32),
             mask=(cell < U * P) & ((cell % P != 0) | (cell // P >= count)))
    limit = tl.minimum(tl.load(q_limit_ptr + tok0) - blk_s * BLOCK, BLOCK - 1)
    tl.store(tile_limit_ptr + (base + rank) * P, limit, mask=keep)
    if RESIDUAL:
        tl.store(residual_ptr + row0 + entry, tl.where(kept, -1, page), mask=valid)
        tl.store(residual_ptr + row0 + j, tl.full([K_P2], -1, tl.int32), mask=(j < TOPK) & (blk < 0))


@triton.jit
def _field(packed, c, FIELD: tl.constexpr):
    """Class c's count in a word of per-class counts FIELD bits each."""
    return ((packed >> (c * FIELD)) & ((1 << FIELD) - 1)).to(tl.int32)


@triton.jit
def _many_token_tile(sel_ptr, q_limit_ptr, q_request_ptr, page_table_ptr, tile_count_ptr, tile_page_ptr,
                     tile_limit_ptr, tile_split_ptr, residual_ptr, tile, head, tok0, ntok, n_tokens, table_stride,
                     P: tl.constexpr, TOPK: tl.constexpr, U: tl.constexpr, U_P2: tl.constexpr,
                     BLOCK: tl.constexpr, MIN_SHARE: tl.constexpr, RESIDUAL: tl.constexpr, FIELD: tl.constexpr,
                     CELLS: tl.constexpr, THIRDS: tl.constexpr):
    # One sort; everything after it is scans and gathers (a bitonic sort of U_P2 costs log^2 steps, a
    # scan log: the stage ran four sorts before 2026-12-04, docs/perf-log.md)
    i = tl.arange(0, U_P2)                        # entry i: token i // TOPK, rank i % TOPK
    ok = (i < U) & (i // TOPK < ntok)
    row0 = (head.to(tl.int64) * n_tokens + tok0) * TOPK      # the tile's first entry in [Hkv, N, topk]
    blk = tl.load(sel_ptr + row0 + i, mask=ok, other=-1)
    valid, blk_s, entry, first = _id_runs(blk, i, U_P2)
    n_valid = tl.sum(valid.to(tl.int32), 0)
    # each sorted position's run (one id's entries): [run_first, run_end); its length is the tokens that
    # select the id
    run_first = tl.associative_scan(tl.where(first, i, 0), 0, scan_max)
    opens_next = (tl.gather(first.to(tl.int32), tl.minimum(i + 1, U_P2 - 1), 0) != 0) & (i + 1 < U_P2)
    run_end = tl.minimum(tl.associative_scan(tl.where(opens_next, i + 1, U_P2), 0, scan_min, reverse=True), n_valid)
    keep = valid & (run_end - run_first >= MIN_SHARE)  # ids fewer tokens select go to the KV-outer residual
    kept_first = first & keep
    count = tl.sum(kept_first.to(tl.int32), 0)
    tl.store(tile_count_ptr + tile, count)
    # a run's entries are in token order, so its first and last entry hold its least and greatest token;
    # halves: 0 first half only, 1 both, 2 second half only
    tok_lo = tl.gather(entry, run_first, 0) // TOPK
    tok_hi = tl.gather(entry, tl.maximum(run_end - 1, 0), 0) // TOPK
    if THIRDS:      # (first, last) third: (0, 0) (0, 1) (0, 2) (1, 1) (1, 2) (2, 2) -> 0 .. 5
        g_lo = tok_lo // (P // 3)
        g_hi = tok_hi // (P // 3)
        cls = tl.where(g_lo == 0, g_hi, tl.where(g_hi == 1, 3, tl.where(g_lo == 1, 4, 5)))
    else:
        cls = tl.where(tok_hi < P // 2, 0, tl.where(tok_lo >= P // 2, 2, 1))
    # union slot in (class, id) order: the kept ids of lower classes, then those of its class at earlier
    # sorted positions (ids ascend there); per-class counts travel as FIELD-bit fields of one int64 scan
    one_hot = tl.where(kept_first, tl.full([U_P2], 1, tl.int64) << (cls.to(tl.int64) * FIELD), 0)
    total = tl.sum(one_hot, 0)
    slot = _field(tl.cumsum(one_hot, 0) - one_hot, cls.to(tl.int64), FIELD)
    for c in tl.static_range(6):
        slot += tl.where(cls > c, _field(total, c, FIELD), 0)
    rank = tl.gather(slot, run_first, 0)
    n_lo = _field(total, 0, FIELD)
    n_both = _field(total, 1, FIELD)
    if THIRDS:
        n_02 = _field(total, 2, FIELD)
        n_11 = _field(total, 3, FIELD)
        n_12 = _field(total, 4, FIELD)
        tl.store(tile_split_ptr + 4 * tile, n_lo + n_both + n_02)
        tl.store(tile_split_ptr + 4 * tile + 1, n_lo)
        tl.store(tile_split_ptr + 4 * tile + 2, n_lo + n_both + n_02 + n_11 + n_12)
        tl.store(tile_split_ptr + 4 * tile + 3, n_lo + n_both)
    else:
        tl.store(tile_split_ptr + 2 * tile, n_lo + n_both)
        tl.store(tile_split_ptr + 2 * tile + 1, n_lo)
    req = tl.load(q_request_ptr + tok0)
    page = tl.load(page_table_ptr + req.to(tl.int64) * table_stride + blk_s, mask=valid, other=-1)
    base = tile.to(tl.int64) * U
    tl.store(tile_page_ptr + base + rank, page, mask=kept_first)
    tl.store(tile_page_ptr + base + i, tl.full([U_P2], -1, tl.int32), mask=(i >= count) & (i < U))
    # limits [U, P]: NO_KEY everywhere, then each kept entry's limit at (its slot, its token)
    cell = tl.arange(0, CELLS)
    tl.store(tile_limit_ptr + base * P + cell, tl.full([CELLS], _NO_KEY, tl.int32), mask=cell < U * P)
    tl.debug_barrier()
    token = entry // TOPK
    limit = tl.minimum(tl.load(q_limit_ptr + tok0 + token, mask=valid, other=0) - blk_s * BLOCK, BLOCK - 1)
    tl.store(tile_limit_ptr + (base + rank) * P + token, limit, mask=keep)
    if RESIDUAL:      # pages [Hkv, N, topk] of the entries left to KV-outer, -1 elsewhere
        tl.store(residual_ptr + row0 + entry, tl.where(keep, -1, page), mask=valid)
        tl.store(residual_ptr + row0 + i, tl.full([U_P2], -1, tl.int32), mask=ok & (blk < 0))


class PackedSchedule:
    """Stage `schedule`: per (KV head, token tile) the union of selected blocks (module docstring: its
    order and tile_split), its pages and the per-token key limits, written into buffers allocated here.
    Only blocks that at least min_share of the tile's tokens select are packed; with `residual`, the other
    entries' pages go to residual_pages [Hkv, N, topk] (-1 elsewhere), the selection a KV-outer stack
    runs."""

    def __init__(self, workload, tokens_per_tile: int, min_share: int = 1, residual: bool = False):
        w, s = workload, workload.shape
        self.min_share = min_share
        self.w, self.P = w, tokens_per_tile
        tok0, ntok = token_tiles(w.q_request, w.q_limit, tokens_per_tile, w.causal)
        dev = w.device
        self.n_token_tiles = tok0.numel()
        self.union_cap = u = tokens_per_tile * s.topk
        self.tile_tok0 = tok0.to(torch.int32).to(dev)
        self.tile_ntok = ntok.to(torch.int32).to(dev)
        tiles = s.hkv * self.n_token_tiles
        self.tile_count = torch.zeros(tiles, dtype=torch.int32, device=dev)
        self.tile_page = torch.full((tiles, u), -1, dtype=torch.int32, device=dev)
        self.tile_limit = torch.full((tiles * u * tokens_per_tile,), NO_KEY, dtype=torch.int32, device=dev)
        self.thirds = tokens_per_tile == WIDE_TOKENS            # the CuTe wide tile's three warpgroups
        # (lo_end, hi_start); thirds (e0, s1, e1, s2)
        self.tile_split = torch.zeros(tiles * (4 if self.thirds else 2), dtype=torch.int32, device=dev)
        self.buffers = dict(tile_tok0=self.tile_tok0, tile_ntok=self.tile_ntok, tile_count=self.tile_count,
                            tile_page=self.tile_page, tile_limit=self.tile_limit, tile_split=self.tile_split)
        # with a share threshold, the pages of the entries it leaves out: a KV-outer stack takes them
        self.residual_pages = torch.full_like(w.pages, -1) if residual else None
        if self.residual_pages is not None:
            self.buffers["residual_pages"] = self.residual_pages
        u_p2 = triton.next_power_of_2(u)
        field = u_p2.bit_length()        # a class's count of union slots (at most u_p2); six in one int64
        if w.page_table.shape[-1] * u_p2 >= (1 << 31) - 1 or u_p2 > MAX_TILE_ENTRIES:
            raise ValueError(f"the q-packed schedule sorts a tile's entries by (block id, entry) in 31 bits and "
                             f"counts its six classes in 63: at most {((1 << 31) - 2) // u_p2} blocks a request "
                             f"and {MAX_TILE_ENTRIES} entries a tile, got {w.page_table.shape[-1]} and {u_p2}")
        self.consts = dict(P=tokens_per_tile, TOPK=s.topk, K_P2=triton.next_power_of_2(s.topk), U=u, U_P2=u_p2,
                           BLOCK=s.block, MIN_SHARE=min_share,
                           RESIDUAL=self.residual_pages is not None, FIELD=field, THIRDS=self.thirds,
                           CELLS=triton.next_power_of_2(u * tokens_per_tile))      # the [U, P] limits, P 12 too
        # four entries a thread: of 1, 2, 4 and 8 warps the fastest at 128 entries (1) and 256 (2) on the
        # H200 (docs/perf-log.md, 2026-12-04)
        self.num_warps = max(1, u_p2 // 128)

    @property
    def num_tiles(self) -> int:
        return self.w.shape.hkv * self.n_token_tiles

    def group_slots(self) -> tuple[torch.Tensor, ...]:
        """Per tile (float64), the union slots each group of tokens walks after the stage ran (a CuTe
        consumer warpgroup per group): the halves' [0, lo_end) and [hi_start, count), or the thirds'
        [0, e0), [s1, e1) and [s2, count)."""
        count = self.tile_count.double()
        if self.thirds:
            split = self.tile_split.view(-1, 4).double()
            return split[:, 0], split[:, 2] - split[:, 1], count - split[:, 3]
        split = self.tile_split.view(-1, 2).double()
        return split[:, 0], count - split[:, 1]

    def critical_slots(self) -> torch.Tensor:
        """Per tile (float64), the most union slots any of its groups walks after the stage ran: where the
        groups walk different blocks, the tile lasts as long as its longest walk (docs/perf-log.md,
        2026-12-04)."""
        return torch.stack(self.group_slots()).max(0).values

    def __call__(self) -> None:
        if self.num_tiles == 0:
            return
        w = self.w
        launch(pack_tile_kernel, (self.num_tiles,),
               w.selection, w.q_limit, w.q_request, w.page_table, self.tile_tok0, self.tile_ntok, self.tile_count,
               self.tile_page, self.tile_limit, self.tile_split,
               self.tile_count if self.residual_pages is None else self.residual_pages,
               w.n_tokens, self.n_token_tiles, w.page_table.stride(0),
               num_warps=self.num_warps, **self.consts)
