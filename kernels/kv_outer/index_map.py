"""Stage 1, index_map: selection pages -> per-(head, page) query lists (CSR), tile counts, combine index.

Device ops with shapes fixed at construction: one Triton pass writing every edge's key, a stable sort
of the keys (so queries come out ascending within a key), a searchsorted for the CSR pointers, a cumsum
of tile counts, then one Triton pass over the sorted edges that writes each edge's query (csr_query) and
its partial's row in the combine index. Nothing is read back to the host, so the stage is CUDA-graph
capturable.

The sort is most of the stage, and a radix sort's passes follow the key's width: keys are int16 where
every key and the padding sentinel fit (Hkv x pages < 32767: a request's pool of up to 8K blocks at
Hkv 4), else int32. On the H200, 1M edges: 55 us int16, 83 us int32 (docs/perf-log.md, 2026-12-04).
"""
from __future__ import annotations

import torch

from .. import triton_common  # noqa: F401  (before triton: the interpreter on a CPU)
from ..triton_scans import scan_max
import triton
import triton.language as tl

PLACE_BLOCK = 1024          # edges per program of place_sorted_kernel and place_edges_kernel
CHUNK_MIN, CHUNK_MAX = 1024, 4096     # edges per program of chunk_ranks_kernel (one in-register sort)


@triton.jit
def place_edges_kernel(sorted_key_ptr, perm_ptr, csr_ptr, tile_ptr, csr_query_ptr, combine_index_ptr,
                       n_edges, num_keys, n_tokens, HKV: tl.constexpr, TOPK: tl.constexpr,
                       TILE_Q: tl.constexpr, BLOCK: tl.constexpr):
    """Sorted edge j = (key, original edge e = (h * N + n) * topk + r): csr_query[j] = n, and
    combine_index[n, h, r] = tile * TILE_Q + slot of its position in the key's list (-1 for padding)."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = j < n_edges
    key = tl.load(sorted_key_ptr + j, mask=live, other=0)
    e = tl.load(perm_ptr + j, mask=live, other=0)
    valid = key < num_keys
    kc = tl.minimum(key, num_keys - 1)
    pos = j - tl.load(csr_ptr + kc, mask=live, other=0)
    tile = tl.load(tile_ptr + kc, mask=live, other=0) + pos // TILE_Q
    where = tl.where(valid, tile * TILE_Q + pos % TILE_Q, -1)
    r = e % TOPK
    q = e // TOPK
    n = q % n_tokens
    h = q // n_tokens
    tl.store(csr_query_ptr + j, n.to(tl.int32), mask=live)
    tl.store(combine_index_ptr + (n * HKV + h) * TOPK + r, where.to(tl.int32), mask=live)


@triton.jit
def chunk_ranks_kernel(pages_ptr, rank_ptr, count_ptr, head_edges, num_pages, num_keys, chunks,
                       CHUNK: tl.constexpr):
    """Program (head h, chunk c) takes head h's edges [c * CHUNK, (c + 1) * CHUNK) (pages in (head, query,
    rank) order). Its key within the head is the page, num_pages for padding. One sort of (key, edge) pairs
    gives each edge its rank among the chunk's earlier edges of its key (rank_ptr) and each key's edges in
    the chunk, stored at count[row, c]: row h * num_pages + page, or num_keys + h for padding, so that
    padding follows every key as the sentinel does in a stable sort."""
    pid = tl.program_id(0)
    h = pid // chunks
    c = pid % chunks
    i = tl.arange(0, CHUNK)
    local = c * CHUNK + i
    live = local < head_edges
    e = h.to(tl.int64) * head_edges + local
    page = tl.load(pages_ptr + e, mask=live, other=-1)
    big = 2147483647
    v = tl.sort(tl.where(live, tl.where(page >= 0, page, num_pages) * CHUNK + i, big))
    ok = v != big
    key_s = v // CHUNK
    run_first = tl.associative_scan(
        tl.where(ok & ((i == 0) | (key_s != tl.gather(key_s, tl.maximum(i - 1, 0), 0))), i, 0), 0, scan_max)
    first_s = h.to(tl.int64) * head_edges + c * CHUNK
    tl.store(rank_ptr + first_s + v % CHUNK, (i - run_first).to(rank_ptr.dtype.element_ty), mask=ok)
    last = ok & ((i == CHUNK - 1) | (tl.gather(key_s, tl.minimum(i + 1, CHUNK - 1), 0) != key_s))
    row = tl.where(key_s < num_pages, h * num_pages + key_s, num_keys + h)
    tl.store(count_ptr + row.to(tl.int64) * chunks + c, i - run_first + 1, mask=last)


@triton.jit
def place_sorted_kernel(pages_ptr, rank_ptr, start_ptr, sorted_key_ptr, perm_ptr, n_edges, head_edges,
                        num_pages, num_keys, chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Edge e lands at start[row, its chunk] + its rank in the chunk: the exclusive prefix sum of the
    counts in (row, chunk) order is the position of a row's first edge of each chunk."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = e < n_edges
    page = tl.load(pages_ptr + e, mask=live, other=-1)
    h = e // head_edges
    c = (e - h * head_edges) // CHUNK
    key = h * num_pages + page
    row = tl.where(page >= 0, key, num_keys + h)
    dest = tl.load(start_ptr + row * chunks + c, mask=live, other=0) + tl.load(rank_ptr + e, mask=live, other=0)
    tl.store(sorted_key_ptr + dest, tl.where(page >= 0, key, num_keys).to(sorted_key_ptr.dtype.element_ty),
             mask=live)
    tl.store(perm_ptr + dest, e, mask=live)


def key_dtype(num_keys: int) -> torch.dtype:
    """The narrowest key holding every key and the sentinel num_keys."""
    return torch.int16 if num_keys < torch.iinfo(torch.int16).max else torch.int32


def chunk_size(head_edges: int, rows: int) -> int:
    """Edges per program of chunk_ranks_kernel: a power of two from CHUNK_MIN to CHUNK_MAX, the smallest
    whose count matrix (rows x chunks per head) is no larger than a head's edges (its memset and
    prefix sum then cost no more than a pass over the edges)."""
    chunk = CHUNK_MIN
    while chunk < CHUNK_MAX and rows * -(-head_edges // chunk) > head_edges:
        chunk *= 2
    return chunk


class CSRBuilder:
    """The part both KV-stationary schedules share: sorted edges, CSR and tile pointers. Subclasses
    call sort_and_count, then one pass of their own over the sorted edges fills csr_query."""

    def __init__(self, pages: torch.Tensor, num_pages: int, tile_q: int, chunk: int | None = None):
        self.pages = pages
        self.hkv, self.n_tokens, self.topk = pages.shape
        self.num_pages = num_pages
        self.num_keys = self.hkv * num_pages
        self.tile_q = tile_q
        dev = pages.device
        n_edges = pages.numel()
        self.head_edges = self.n_tokens * self.topk
        rows = self.num_keys + self.hkv
        self.chunk = chunk or chunk_size(self.head_edges, rows)
        if (num_pages + 1) * self.chunk >= 2 ** 31:
            raise ValueError(f"{num_pages} pages x {self.chunk}-edge chunks overflow the int32 sort pairs")
        self.chunks = max(1, -(-self.head_edges // self.chunk))
        self.csr_ptr = torch.empty(self.num_keys + 1, dtype=torch.int32, device=dev)
        self.csr_query = torch.empty(n_edges, dtype=torch.int32, device=dev)
        self.tile_ptr = torch.empty(self.num_keys + 1, dtype=torch.int32, device=dev)
        keys = key_dtype(self.num_keys)
        self.sorted_key = torch.empty(n_edges, dtype=keys, device=dev)
        self.perm = torch.empty(n_edges, dtype=torch.int64, device=dev)
        self.rank = torch.empty(n_edges, dtype=torch.int16, device=dev)
        self.counts = torch.empty(rows * self.chunks, dtype=torch.int32, device=dev)
        self.start = torch.zeros(rows * self.chunks + 1, dtype=torch.int32, device=dev)

    @property
    def num_tiles_max(self) -> int:
        per_head = -(-self.n_tokens * self.topk // self.tile_q)
        return self.hkv * per_head + min(self.num_keys, self.pages.numel())

    def sort_and_count(self) -> None:
        """Edges in stable (key, edge) order and their permutation, CSR pointers and tile pointers."""
        n_edges = self.perm.numel()
        self.counts.zero_()
        if n_edges:
            chunk_ranks_kernel[(self.hkv * self.chunks,)](
                self.pages, self.rank, self.counts, self.head_edges, self.num_pages, self.num_keys, self.chunks,
                CHUNK=self.chunk, num_warps=max(1, self.chunk // 256))
        torch.cumsum(self.counts, 0, dtype=torch.int32, out=self.start[1:])
        self.csr_ptr.copy_(self.start[:self.num_keys * self.chunks + 1:self.chunks])
        if n_edges:
            place_sorted_kernel[(triton.cdiv(n_edges, PLACE_BLOCK),)](
                self.pages, self.rank, self.start, self.sorted_key, self.perm, n_edges, self.head_edges,
                self.num_pages, self.num_keys, self.chunks, CHUNK=self.chunk, BLOCK=PLACE_BLOCK)
        counts = self.csr_ptr[1:] - self.csr_ptr[:-1]
        tiles = torch.div(counts + (self.tile_q - 1), self.tile_q, rounding_mode="floor")
        self.tile_ptr[:1].zero_()
        torch.cumsum(tiles, 0, dtype=torch.int32, out=self.tile_ptr[1:])


class IndexMap(CSRBuilder):
    """KV-outer index map: CSR + tile_ptr + combine_index [N, Hkv, topk] = tile * TILE_Q + slot (-1 pad)."""

    def __init__(self, pages: torch.Tensor, num_pages: int, tile_q: int, chunk: int | None = None):
        super().__init__(pages, num_pages, tile_q, chunk)
        self.combine_index = torch.empty(self.n_tokens, self.hkv, self.topk, dtype=torch.int32,
                                         device=pages.device)

    def __call__(self) -> None:
        self.sort_and_count()
        n_edges = self.perm.numel()
        place_edges_kernel[(triton.cdiv(n_edges, PLACE_BLOCK),)](
            self.sorted_key, self.perm, self.csr_ptr, self.tile_ptr, self.csr_query, self.combine_index,
            n_edges, self.num_keys, self.n_tokens, HKV=self.hkv, TOPK=self.topk, TILE_Q=self.tile_q,
            BLOCK=PLACE_BLOCK)
