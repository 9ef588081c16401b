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
from ..dispatch.triton_launch import launch
import triton
import triton.language as tl

PLACE_BLOCK = 1024          # sorted edges per program of place_edges_kernel


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
def edge_keys_kernel(pages_ptr, keys_ptr, n_edges, head_edges, num_pages, BLOCK: tl.constexpr):
    """Key head * num_pages + page of every edge e (pages flattened in (head, query, rank) order); padding
    ranks get the sentinel Hkv * num_pages, so they sort last."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = e < n_edges
    page = tl.load(pages_ptr + e, mask=live, other=-1)
    sentinel = (n_edges // head_edges) * num_pages
    key = tl.where(page >= 0, page + (e // head_edges) * num_pages, sentinel)
    tl.store(keys_ptr + e, key.to(keys_ptr.dtype.element_ty), mask=live)


def key_dtype(num_keys: int) -> torch.dtype:
    """The narrowest sort key holding every key and the sentinel num_keys."""
    return torch.int16 if num_keys < torch.iinfo(torch.int16).max else torch.int32


class CSRBuilder:
    """The part both KV-stationary schedules share: sorted edges, CSR and tile pointers. Subclasses
    call sort_and_count, then one pass of their own over the sorted edges fills csr_query."""

    def __init__(self, pages: torch.Tensor, num_pages: int, tile_q: int):
        self.pages = pages
        self.hkv, self.n_tokens, self.topk = pages.shape
        self.num_pages = num_pages
        self.num_keys = self.hkv * num_pages
        self.tile_q = tile_q
        dev = pages.device
        n_edges = pages.numel()
        self.csr_ptr = torch.empty(self.num_keys + 1, dtype=torch.int32, device=dev)
        self.csr_query = torch.empty(n_edges, dtype=torch.int32, device=dev)
        self.tile_ptr = torch.empty(self.num_keys + 1, dtype=torch.int32, device=dev)
        keys = key_dtype(self.num_keys)
        self.keys = torch.empty(n_edges, dtype=keys, device=dev)
        self.sorted_key = torch.empty(n_edges, dtype=keys, device=dev)
        self.perm = torch.empty(n_edges, dtype=torch.int64, device=dev)
        self.key_ids = torch.arange(self.num_keys + 1, dtype=keys, device=dev)     # searchsorted's targets

    @property
    def num_tiles_max(self) -> int:
        per_head = -(-self.n_tokens * self.topk // self.tile_q)
        return self.hkv * per_head + min(self.num_keys, self.pages.numel())

    def edge_keys(self) -> None:
        n_edges = self.keys.numel()
        if n_edges:
            launch(edge_keys_kernel, (triton.cdiv(n_edges, PLACE_BLOCK),), self.pages, self.keys, n_edges,
                   self.n_tokens * self.topk, self.num_pages, BLOCK=PLACE_BLOCK)

    def sort_and_count(self) -> None:
        """Sorted edge keys and their permutation, CSR pointers and tile pointers (kernels/kv_outer/op.py
        does the same from C)."""
        self.edge_keys()
        torch.sort(self.keys, stable=True, out=(self.sorted_key, self.perm))
        torch.searchsorted(self.sorted_key, self.key_ids, out_int32=True, out=self.csr_ptr)
        counts = self.csr_ptr[1:] - self.csr_ptr[:-1]
        tiles = torch.div(counts + (self.tile_q - 1), self.tile_q, rounding_mode="floor")
        self.tile_ptr[:1].zero_()
        torch.cumsum(tiles, 0, dtype=torch.int32, out=self.tile_ptr[1:])


class IndexMap(CSRBuilder):
    """KV-outer index map: CSR + tile_ptr + combine_index [N, Hkv, topk] = tile * TILE_Q + slot (-1 pad)."""

    def __init__(self, pages: torch.Tensor, num_pages: int, tile_q: int):
        super().__init__(pages, num_pages, tile_q)
        self.combine_index = torch.empty(self.n_tokens, self.hkv, self.topk, dtype=torch.int32,
                                         device=pages.device)

    def __call__(self) -> None:
        self.sort_and_count()
        self.place()

    def place(self) -> None:
        n_edges = self.perm.numel()
        launch(place_edges_kernel, (triton.cdiv(n_edges, PLACE_BLOCK),), self.sorted_key, self.perm, self.csr_ptr,
               self.tile_ptr, self.csr_query, self.combine_index, n_edges, self.num_keys, self.n_tokens,
               HKV=self.hkv, TOPK=self.topk, TILE_Q=self.tile_q, BLOCK=PLACE_BLOCK)
