"""Stage 2, schedule: flatten every (head, block, query tile) into one tile sequence and give each
persistent CTA a contiguous slice of nearly equal work.

Deterministic and atomic-free: tile t belongs to the key whose tile range holds it (a searchsorted
over tile_ptr), and CTA c gets tiles [c * T // C, (c + 1) * T // C) where T is the real tile count,
read on the device. A heavy block's tiles simply fall into several CTAs' slices. Every tile costs
one full TILE_Q x G MMA pair whatever its query count, so equal tile counts are equal work up to the
K/V block load at each key change inside a slice.
"""
from __future__ import annotations

import torch


class Schedule:
    def __init__(self, csr_ptr: torch.Tensor, tile_ptr: torch.Tensor, num_tiles_max: int, tile_q: int,
                 num_ctas: int):
        dev = csr_ptr.device
        self.csr_ptr, self.tile_ptr = csr_ptr, tile_ptr
        self.num_keys = tile_ptr.numel() - 1
        self.tile_q, self.num_ctas = tile_q, num_ctas
        self.tile_key = torch.empty(num_tiles_max, dtype=torch.int32, device=dev)
        self.tile_edge = torch.empty(num_tiles_max, dtype=torch.int32, device=dev)
        self.tile_count = torch.empty(num_tiles_max, dtype=torch.int32, device=dev)
        self.cta_range = torch.empty(num_ctas, 2, dtype=torch.int32, device=dev)
        self._tiles = torch.arange(num_tiles_max, dtype=torch.int32, device=dev)
        self._ctas = torch.arange(num_ctas + 1, dtype=torch.int64, device=dev)

    def __call__(self) -> None:
        t = self._tiles
        total = self.tile_ptr[-1:]
        key = torch.searchsorted(self.tile_ptr, t, right=True, out_int32=True) - 1
        real = t < total
        kc = key.clamp(max=self.num_keys - 1).long()
        first = self.csr_ptr[kc] + (t - self.tile_ptr[kc]) * self.tile_q
        count = (self.csr_ptr[kc + 1] - first).clamp(max=self.tile_q)
        zero = torch.zeros_like(t)
        torch.where(real, key, zero - 1, out=self.tile_key)
        torch.where(real, first, zero, out=self.tile_edge)
        torch.where(real, count, zero, out=self.tile_count)
        bounds = torch.div(self._ctas * total.long(), self.num_ctas, rounding_mode="floor").to(torch.int32)
        self.cta_range[:, 0].copy_(bounds[:-1])
        self.cta_range[:, 1].copy_(bounds[1:])
