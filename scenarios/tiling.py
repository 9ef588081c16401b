"""Query tiles: how a token-packed schedule, and every statistic that models one, cuts the batch's query
tokens into tiles of up to P tokens.

A tile holds consecutive tokens of one request. Causal, it is a window of P positions (position // P,
a causal token's position being its q_limit): the tiles the q-packed kernels run, aligned to positions
so that a tile never straddles a query block whose size P divides. Not causal, q_limit is the same for
every token of a request and says nothing of order, so tiles count P tokens from the request's first.
A run of tokens that shares a key (request, and window when causal) is cut again every P tokens, so
no tile holds more than P even where positions repeat; a request whose tokens are not contiguous in
the batch starts a new run wherever it resumes.

Pure torch with no device-to-host synchronisation: the same code cuts tiles on the host and inside a
CUDA graph.
"""
from __future__ import annotations

import torch

REQUEST_STRIDE = 1 << 31     # tile key of a causal token: request * stride + position // P


def tile_keys(q_request: torch.Tensor, q_limit: torch.Tensor | None, tile: int, causal: bool) -> torch.Tensor:
    """[N] int64: tokens whose tiles may join share a key (the request, and causal its window q_limit // P)."""
    key = q_request.long() * REQUEST_STRIDE
    if causal:
        key = key + torch.div(q_limit.long(), tile, rounding_mode="floor")
    return key


def cut_runs(key: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile id [N], slot [N]): runs of consecutive equal keys, each cut into tiles of `tile` tokens from its
    first; tile ids count from 0 in token order, a token's slot is its index within its tile."""
    n = key.numel()
    idx = torch.arange(n, device=key.device)
    boundary = torch.ones(n, dtype=torch.bool, device=key.device)
    if n > 1:
        boundary[1:] = key[1:] != key[:-1]
    run_start = torch.where(boundary, idx, torch.zeros_like(idx)).cummax(0).values
    slot = (idx - run_start) % tile
    return (slot == 0).long().cumsum(0) - 1, slot


def query_tiles(q_request: torch.Tensor, q_limit: torch.Tensor | None, tile: int,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile id [N], slot [N]) of every query token: the rule in the module docstring."""
    if tile < 1:
        raise ValueError(f"tile size must be positive, got {tile}")
    return cut_runs(tile_keys(q_request, q_limit, tile, causal), tile)
