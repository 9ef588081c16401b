"""Stage 1, index_map: selection pages -> per-(head, page) query lists (CSR), tile counts, combine index.

All torch ops on the workload's device with shapes fixed at construction: a stable sort of the edge
keys (so queries come out ascending within a key), a searchsorted for the CSR pointers and a scatter
for the combine index. Nothing is read back to the host, so the stage is CUDA-graph capturable.
"""
from __future__ import annotations

import torch


def edge_keys(pages: torch.Tensor, num_pages: int) -> torch.Tensor:
    """Key head * num_pages + page of every edge, flattened in (head, query, rank) order; padding
    ranks get the sentinel key Hkv * num_pages so they sort last."""
    hkv = pages.shape[0]
    heads = torch.arange(hkv, device=pages.device, dtype=torch.int32).view(-1, 1, 1) * num_pages
    sentinel = torch.full_like(pages, hkv * num_pages)
    return torch.where(pages >= 0, pages + heads, sentinel).view(-1)


class CSRBuilder:
    """The part both KV-stationary schedules share: sorted edges, CSR and tile pointers."""

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
        self.sorted_key = torch.empty(n_edges, dtype=torch.int32, device=dev)
        self.perm = torch.empty(n_edges, dtype=torch.int64, device=dev)
        self._key_ids = torch.arange(self.num_keys + 1, dtype=torch.int32, device=dev)

    @property
    def num_tiles_max(self) -> int:
        per_head = -(-self.n_tokens * self.topk // self.tile_q)
        return self.hkv * per_head + min(self.num_keys, self.pages.numel())

    def __call__(self) -> None:
        keys = edge_keys(self.pages, self.num_pages)
        torch.sort(keys, stable=True, out=(self.sorted_key, self.perm))
        torch.searchsorted(self.sorted_key, self._key_ids, out_int32=True, out=self.csr_ptr)
        self.csr_query.copy_(torch.div(self.perm, self.topk, rounding_mode="floor") % self.n_tokens)
        counts = self.csr_ptr[1:] - self.csr_ptr[:-1]
        tiles = torch.div(counts + (self.tile_q - 1), self.tile_q, rounding_mode="floor")
        self.tile_ptr[:1].zero_()
        torch.cumsum(tiles, 0, dtype=torch.int32, out=self.tile_ptr[1:])

    def edge_position(self):
        """For each sorted edge: (valid, clamped key, position of the edge within its key's list)."""
        key = self.sorted_key.long()
        valid = key < self.num_keys
        kc = key.clamp(max=self.num_keys - 1)
        j = torch.arange(key.numel(), device=key.device)
        return valid, kc, j - self.csr_ptr.long()[kc]


class IndexMap(CSRBuilder):
    """KV-outer index map: CSR + tile_ptr + combine_index [N, Hkv, topk] = tile * TILE_Q + slot (-1 pad)."""

    def __init__(self, pages: torch.Tensor, num_pages: int, tile_q: int):
        super().__init__(pages, num_pages, tile_q)
        self.combine_index = torch.empty(self.n_tokens, self.hkv, self.topk, dtype=torch.int32,
                                         device=pages.device)

    def __call__(self) -> None:
        super().__call__()
        valid, kc, pos = self.edge_position()
        tile = self.tile_ptr.long()[kc] + torch.div(pos, self.tile_q, rounding_mode="floor")
        where = torch.where(valid, tile * self.tile_q + pos % self.tile_q, torch.full_like(pos, -1))
        # edge e = (h * N + n) * topk + r lands at combine_index[n, h, r]
        e = self.perm
        r = e % self.topk
        n = torch.div(e, self.topk, rounding_mode="floor") % self.n_tokens
        h = torch.div(e, self.topk * self.n_tokens, rounding_mode="floor")
        dest = (n * self.hkv + h) * self.topk + r
        self.combine_index.view(-1).scatter_(0, dest, where.to(torch.int32))
