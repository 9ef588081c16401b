"""Tile packing: the plan every token-packed Q-outer schedule starts from.

A tile is up to P consecutive query tokens that share a key (scenarios/tiling.py): the query tiles,
keyed by tile_keys (a request and, causal, a window of P positions), or any other key a caller packs
by (the whole batch as one run for FlashInfer's block-sparse rows). A run of equal keys is cut into
tiles of P from its first token, so its last tile may be shorter. Per (KV head, tile) the plan gives

  union  [Hkv, T, C]   the distinct block ids its tokens selected, ascending, -1 after them (C = P x topk)
  count  [Hkv, T]      how many entries of `union` are valid
  hits   [Hkv, T, C]   how many tile tokens selected each union entry (0 on padding)
  bits   [Hkv, T, C]   P-bit mask of the tile tokens (bit i = token start + i) that selected the entry
                       (int32 for P <= 31, int64 for P <= 62; None for larger P)

and per tile `start` [T] (first token) and `length` [T] (tokens; 0 for a padding tile). Ids are
whatever the caller packs: logical block ids for tiles inside one request, or ids made unique across
requests (request x blocks + block) when a tile may span requests. Negative ids are padding.

plan_tiles() makes no device-to-host synchronisation: every output's size follows from the input
shapes and `max_tiles`, tiles past the real ones have length 0 and an empty union, and the real tile
count is a device scalar (`tile_count`; a count above max_tiles means tiles were cut off). It is
written for a CUDA graph. pack_tiles() is the host-side convenience that bounds max_tiles exactly and
trims the padding (it synchronises).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..scenarios.tiling import cut_runs
from ..scenarios.workload import Workload


@dataclass
class TilePack:
    tile: int                  # P
    start: torch.Tensor        # [T] int64 first token of each tile (N for padding tiles)
    length: torch.Tensor       # [T] int64 tokens in each tile (0 for padding tiles)
    union: torch.Tensor        # [Hkv, T, C] ids, ascending, -1 padded
    count: torch.Tensor        # [Hkv, T] int64
    hits: torch.Tensor         # [Hkv, T, C] int64
    bits: torch.Tensor | None  # [Hkv, T, C] int32/int64 token masks (None when P > 62)
    tile_count: torch.Tensor   # 0-dim int64 on the device: tiles the runs really need
    token_tile: torch.Tensor   # [N] int64 tile of each token
    token_slot: torch.Tensor   # [N] int64 its index inside the tile

    @property
    def num_tiles(self) -> int:
        """Tiles held (real and padding): a shape, no synchronisation."""
        return self.start.numel()

    def compact(self) -> "TilePack":
        """Drop padding tiles and trim the union capacity to the largest union (synchronises)."""
        t = int(self.tile_count)
        if t > self.num_tiles:
            raise ValueError(f"max_tiles {self.num_tiles} is below the {t} tiles the runs need")
        cap = max(int(self.count[:, :t].max()) if t and self.count.numel() else 0, 1)
        cut = (slice(None), slice(0, t), slice(0, cap))
        return replace(self, start=self.start[:t], length=self.length[:t], union=self.union[cut],
                       count=self.count[:, :t], hits=self.hits[cut],
                       bits=None if self.bits is None else self.bits[cut])

    def executed_entries(self) -> torch.Tensor:
        """(token, union block) pairs a packed kernel computes: sum over tiles of length x count (device scalar)."""
        return (self.length.view(1, -1) * self.count).sum()

    def selected_entries(self) -> torch.Tensor:
        """(token, block) pairs the tokens selected: sum of hits (device scalar)."""
        return self.hits.sum()


def visible_selection(w: Workload) -> torch.Tensor:
    """selection [Hkv, N, topk] (int64) with -1 for blocks that hold no key the token may see."""
    sel = w.selection.long()
    start = sel * w.shape.block
    seen = (sel >= 0) & (start <= w.q_limit.long().view(1, -1, 1))
    return torch.where(seen, sel, torch.full_like(sel, -1))


def max_tiles_bound(n_tokens: int, tile: int, runs: int) -> int:
    """Upper bound on the tiles `runs` runs of n_tokens tokens need: ceil(N / P) + runs - 1."""
    return max(-(-n_tokens // tile) + max(runs, 1) - 1, 0)


def _dedupe_rows(ids: torch.Tensor) -> torch.Tensor:
    """Each (head, token) row with negative ids and repeats set to -1 (order kept)."""
    ids = ids.long()
    srt, order = torch.where(ids >= 0, ids, torch.full_like(ids, -1)).sort(dim=-1)
    dup = torch.zeros_like(srt, dtype=torch.bool)
    dup[..., 1:] = srt[..., 1:] == srt[..., :-1]
    keep = torch.empty_like(dup).scatter_(-1, order, ~dup)
    return torch.where(keep & (ids >= 0), ids, torch.full_like(ids, -1))


def plan_tiles(ids: torch.Tensor, key: torch.Tensor, tile: int, max_tiles: int) -> TilePack:
    """Pack ids [Hkv, N, K] (negative = padding) into tiles of `tile` tokens: runs of equal `key` [N], each
    cut every `tile` tokens (scenarios/tiling.py: cut_runs).

    Fixed-size outputs ([Hkv, max_tiles, tile * K]) and no device-to-host synchronisation."""
    if tile < 1:
        raise ValueError(f"tile size must be positive, got {tile}")
    hkv, n, k = ids.shape
    if key.shape != (n,):
        raise ValueError(f"key has shape {tuple(key.shape)}, expected ({n},)")
    dev = ids.device
    t_max = int(max_tiles)
    cap = tile * k
    tile_id, slot = cut_runs(key.to(dev), tile)
    idx = torch.arange(n, device=dev)
    first = slot == 0
    dump = torch.full_like(tile_id, t_max)
    in_range = tile_id < t_max
    start = torch.full((t_max + 1,), n, dtype=torch.long, device=dev)
    start.scatter_(0, torch.where(first & in_range, tile_id, dump), idx)
    length = torch.zeros(t_max + 1, dtype=torch.long, device=dev)
    length.index_add_(0, torch.where(in_range, tile_id, dump), torch.ones_like(idx))
    start, length = start[:t_max], length[:t_max]
    tile_count = tile_id[-1] + 1 if n else torch.zeros((), dtype=torch.long, device=dev)

    # every tile's tokens' ids side by side: [Hkv, T, P, K]
    lane = torch.arange(tile, device=dev)
    tok = start.view(-1, 1) + lane
    tok_ok = lane.view(1, -1) < length.view(-1, 1)
    rows = _dedupe_rows(ids)[:, tok.clamp(max=max(n - 1, 0))]
    big = torch.iinfo(torch.long).max
    rows = torch.where(tok_ok.view(1, t_max, tile, 1) & (rows >= 0), rows, torch.full_like(rows, big))
    flat = rows.reshape(hkv, t_max, cap)
    srt, order = flat.sort(dim=-1)
    valid = srt != big
    new = valid.clone()
    new[..., 1:] &= srt[..., 1:] != srt[..., :-1]
    rank = new.long().cumsum(-1) - 1
    count = new.sum(-1)
    dest = torch.where(valid, rank, torch.full_like(rank, cap))            # padding goes to a dump column
    union = torch.full((hkv, t_max, cap + 1), -1, dtype=torch.long, device=dev)
    union.scatter_(-1, torch.where(new, rank, torch.full_like(rank, cap)), srt)
    hits = torch.zeros((hkv, t_max, cap + 1), dtype=torch.long, device=dev)
    hits.scatter_add_(-1, dest, valid.long())
    bits = None
    if tile <= 62:
        lane_of = torch.div(order, k, rounding_mode="floor")                # tile token of each sorted entry
        word = torch.where(valid, torch.ones_like(lane_of) << lane_of, torch.zeros_like(lane_of))
        bits = torch.zeros((hkv, t_max, cap + 1), dtype=torch.long, device=dev)
        bits.scatter_add_(-1, dest, word)                                   # rows are deduped: add == or
        bits = bits[..., :cap]
        if tile <= 31:
            bits = bits.to(torch.int32)
    return TilePack(tile=tile, start=start, length=length, union=union[..., :cap].to(ids.dtype), count=count,
                    hits=hits[..., :cap], bits=bits, tile_count=tile_count, token_tile=tile_id, token_slot=slot)


def pack_tiles(ids: torch.Tensor, key: torch.Tensor, tile: int) -> TilePack:
    """plan_tiles with max_tiles bounded from the runs of `key`, padding trimmed (synchronises)."""
    n = key.numel()
    runs = int((key[1:] != key[:-1]).sum()) + 1 if n else 0
    return plan_tiles(ids, key, tile, max_tiles_bound(n, tile, runs)).compact()
