"""A small MSA-style model on random weights, hooked to the recorder: what the recorder's tests and the
shipped example trace (scripts/make-example-trace.py) capture. Its selections are no real model's.

Each layer has an indexer: per KV head an index query of each token and an index key of each token, the
keys mean-pooled over each block of `block` tokens. A query scores the complete blocks before its own,
keeps its top (topk - 1) and its own block last, -1 padding where fewer blocks exist (the causal MSA rule).
Between layers a random residual map moves the hidden states. The hidden states of a request are a
smooth random sequence (each token its predecessor's state, mostly), so that neighbouring tokens, as in
a language model, tend to select alike.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..roofline.shape import AttnShape
from ..scenarios.selection import append_local, local_blocks


def smooth_hidden(tokens: int, width: int, rho: float, gen: torch.Generator) -> torch.Tensor:
    """[tokens, width]: x_t = rho x_(t-1) + sqrt(1 - rho^2) noise, unit variance."""
    noise = torch.randn(tokens, width, generator=gen)
    out = torch.empty_like(noise)
    out[0] = noise[0]
    keep, fresh = rho, math.sqrt(1 - rho * rho)
    for t in range(1, tokens):
        out[t] = keep * out[t - 1] + fresh * noise[t]
    return out


class MSAIndexer(nn.Module):
    def __init__(self, shape: AttnShape, width: int, index_dim: int, gen: torch.Generator):
        super().__init__()
        self.shape, self.index_dim = shape, index_dim
        scale = 1 / math.sqrt(width)
        self.wq = nn.Parameter(torch.randn(width, shape.hkv * index_dim, generator=gen) * scale)
        self.wk = nn.Parameter(torch.randn(width, shape.hkv * index_dim, generator=gen) * scale)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Selection [Hkv, N, topk] int32 of the queries at `positions` of one request whose tokens so far
        are `hidden` [T, width]."""
        s, d = self.shape, self.index_dim
        own = local_blocks(positions, s.block)
        blocks = int(own.max())                       # complete blocks before the last query's own
        keys = (hidden[:blocks * s.block] @ self.wk).view(blocks, s.block, s.hkv, d).mean(1)     # [B, Hkv, d]
        probe = (hidden[positions.long()] @ self.wq).view(-1, s.hkv, d)                           # [N, Hkv, d]
        scores = torch.einsum("nhd,bhd->hnb", probe, keys)
        eligible = torch.arange(blocks).view(1, 1, -1) < own.view(1, -1, 1)
        width = min(s.topk - 1, blocks)
        top = scores.masked_fill(~eligible, float("-inf")).topk(width, dim=-1) if width else None
        if top is None:
            history, count = torch.zeros(s.hkv, len(positions), 0, dtype=torch.long), torch.zeros(len(positions))
        else:
            history, count = top.indices, torch.isfinite(top.values).sum(-1)
        return append_local(history, count, own, s.topk)


class TinyMSAModel(nn.Module):
    """`layers` indexers, a random residual map between them; forward() runs one engine step."""

    def __init__(self, shape: AttnShape, layers: int = 3, width: int = 128, index_dim: int = 32, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.shape = shape
        self.indexers = nn.ModuleList(MSAIndexer(shape, width, index_dim, gen) for _ in range(layers))
        self.mix = nn.ParameterList(nn.Parameter(torch.randn(width, width, generator=gen) / math.sqrt(width))
                                    for _ in range(layers))

    @torch.no_grad()
    def forward(self, hidden: list[torch.Tensor], positions: list[torch.Tensor], recorder=None) -> list[torch.Tensor]:
        """One step over requests: request r's tokens so far `hidden[r]` [T_r, width], its queries at
        `positions[r]`. Each layer's selection of all the step's queries goes to the recorder (the hook an
        engine places after its indexer's top-k); returns them."""
        out = []
        pos = torch.cat(positions)
        req = torch.cat([torch.full((len(p),), r, dtype=torch.int32) for r, p in enumerate(positions)])
        context = torch.tensor([int(p.max()) + 1 for p in positions], dtype=torch.int32)
        for layer, (indexer, mix) in enumerate(zip(self.indexers, self.mix)):
            sel = torch.cat([indexer(h, p) for h, p in zip(hidden, positions)], dim=1)
            if recorder is not None and recorder.wants(layer):
                recorder.record(layer, sel, pos, req, context)
            out.append(sel)
            hidden = [h + torch.tanh(h @ mix) for h in hidden]
        return out
