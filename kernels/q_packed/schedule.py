"""The q-packed schedule: token tiles (plan time) and their block unions and key limits (a GPU stage).

Token tiles depend only on q_request and q_limit, so plan() cuts them on the host. The unions depend
on the selection, so they are built on the device by `PackedSchedule()`, inside the module's graph:
sort each tile's P x topk selected ids, keep the first of each run, and scatter every selected entry's
key limit to its union slot. Fixed shapes, no host reads.
"""
from __future__ import annotations

import torch

NO_KEY = -1                      # a token's limit for a union block it did not select


def token_tiles(q_request: torch.Tensor, q_limit: torch.Tensor, tokens_per_tile: int,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_tok0 [Tt], tile_ntok [Tt]) int64 on the host: runs of consecutive tokens of one request whose
    window (causal: position // P; otherwise the index within the request // P) is the same."""
    req = q_request.long().cpu()
    n = req.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    idx = torch.arange(n)
    new_req = torch.ones(n, dtype=torch.bool)
    new_req[1:] = req[1:] != req[:-1]
    if causal:
        window = q_limit.long().cpu() // tokens_per_tile
    else:
        run_start = torch.where(new_req, idx, torch.zeros_like(idx)).cummax(0).values
        window = (idx - run_start) // tokens_per_tile
    start = new_req.clone()
    start[1:] |= window[1:] != window[:-1]
    tok0 = idx[start]
    ntok = torch.diff(torch.cat([tok0, torch.tensor([n])]))
    return tok0, ntok


class PackedSchedule:
    """Stage `schedule`: per (KV head, token tile) the sorted union of selected blocks, its pages and the
    per-token key limits, written into buffers allocated here."""

    def __init__(self, workload, tokens_per_tile: int):
        w, s = workload, workload.shape
        self.w, self.P = w, tokens_per_tile
        tok0, ntok = token_tiles(w.q_request, w.q_limit, tokens_per_tile, w.causal)
        dev = w.device
        self.n_token_tiles = tt = tok0.numel()
        self.union_cap = u = tokens_per_tile * s.topk
        slot = torch.arange(tokens_per_tile)
        tok = tok0.view(-1, 1) + slot.view(1, -1)
        self.tok_valid = (slot.view(1, -1) < ntok.view(-1, 1)).to(dev)                   # [Tt, P]
        self.tok_index = torch.where(self.tok_valid.cpu(), tok, torch.zeros_like(tok)).to(dev)
        self.tile_request = w.q_request.long()[tok0.to(dev)] if tt else torch.zeros(0, dtype=torch.long, device=dev)
        self.tile_tok0 = tok0.to(torch.int32).to(dev)
        self.tile_ntok = ntok.to(torch.int32).to(dev)
        tiles = s.hkv * tt
        self.tile_count = torch.zeros(tiles, dtype=torch.int32, device=dev)
        self.tile_page = torch.full((tiles, u), -1, dtype=torch.int32, device=dev)
        self.tile_limit = torch.full((tiles * u * tokens_per_tile + 1,), NO_KEY, dtype=torch.int32, device=dev)
        self.buffers = dict(tile_tok0=self.tile_tok0, tile_ntok=self.tile_ntok, tile_count=self.tile_count,
                            tile_page=self.tile_page, tile_limit=self.tile_limit)

    @property
    def num_tiles(self) -> int:
        return self.w.shape.hkv * self.n_token_tiles

    def __call__(self) -> None:
        w, s, P, U, tt = self.w, self.w.shape, self.P, self.union_cap, self.n_token_tiles
        if tt == 0:
            return
        sel = w.selection.long()[:, self.tok_index]                                      # [Hkv, Tt, P, topk]
        sel = torch.where(self.tok_valid.view(1, tt, P, 1), sel, torch.full_like(sel, -1))
        flat = sel.view(s.hkv, tt, U)
        srt = flat.sort(dim=-1).values
        first = srt >= 0
        first[..., 1:] &= srt[..., 1:] != srt[..., :-1]
        pos = first.cumsum(-1) - 1
        big = torch.iinfo(torch.int64).max
        union = torch.full((s.hkv, tt, U + 1), big, dtype=torch.long, device=srt.device)
        union.scatter_(-1, torch.where(first, pos, torch.full_like(pos, U)), srt)
        union = union[..., :U].contiguous()
        self.tile_count.copy_(first.sum(-1).view(-1))
        have = union != big
        table = w.page_table.long()
        page = table[self.tile_request.view(1, tt, 1), torch.where(have, union, torch.zeros_like(union))]
        self.tile_page.copy_(torch.where(have, page, torch.full_like(page, -1)).view(-1, U))
        # every selected entry's limit, scattered to (tile, union slot, token); padding to the spare last slot
        slot = torch.searchsorted(union, flat)                                           # [Hkv, Tt, U]
        limit = (w.q_limit.long()[self.tok_index].view(1, tt, P, 1) - sel * s.block).clamp(max=s.block - 1)
        tile = torch.arange(s.hkv * tt, device=srt.device).view(s.hkv, tt, 1, 1)
        token = torch.arange(P, device=srt.device).view(1, 1, P, 1)
        dest = (tile * U + slot.view(s.hkv, tt, P, -1)) * P + token
        dest = torch.where(sel >= 0, dest, torch.full_like(dest, self.tile_limit.numel() - 1))
        self.tile_limit.fill_(NO_KEY)
        self.tile_limit.scatter_(0, dest.view(-1), limit.view(-1).to(torch.int32))
        self.tile_limit[-1:].fill_(NO_KEY)
