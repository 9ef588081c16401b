"""The indexer generator: a selection computed from the workload's own Q and K, as the model does.

Scoring (the choice made here): for KV head h, a block's summary is the mean of its visible keys
(mean-pooled keys of head h), and a query's probe is the mean of its G query heads of that group;
score = probe . summary. Each query keeps its top-k blocks by score. Causal: only the complete
history blocks (before the query's local block) are eligible, top-(k-1) of them, and the local
block is forced last; a query with fewer eligible blocks gets fewer entries and -1 padding.

So that queries agree on blocks for a reason found in the data, Q and K are drawn structured: a
few latent "topic" directions per KV head, every key block carries one topic (drawn per block),
every run of `block` consecutive query tokens carries one topic, each plus unit Gaussian noise.
Queries of a topic then prefer that topic's blocks and mostly agree on which of them score
highest, so the reuse (nsb / N) comes out of the tensors; it is measured, not targeted.
"""
from __future__ import annotations

import torch

from ..roofline.dtypes import DType
from .selection import append_local, assemble, local_blocks, scattered_page_table
from .workload import AttnShape, Workload, WorkloadError, _quantize

_ROW_CHUNK = 4096
_BLOCK_CHUNK = 256


def draw_structured(shape: AttnShape, dtype: str, n_tokens: int, page_table: torch.Tensor,
                    num_pages: int, q_request: torch.Tensor, seed: int, topics: int = 8, strength: float = 0.5):
    """Seeded Q, K, V (quantized to `dtype`) with latent topics in Q and K; returns (q, k, v, scales)."""
    dtype = DType.parse(dtype, "dtype")
    if topics < 1:
        raise WorkloadError(f"topics must be >= 1, got {topics}")
    gen = torch.Generator().manual_seed(seed)
    s = shape
    dirs = torch.randn((s.hkv, topics, s.head_dim), generator=gen)
    # topic of each logical block, per request; a physical page inherits its block's topic
    block_topic = torch.randint(topics, page_table.shape, generator=gen)
    page_topic = torch.zeros(num_pages, dtype=torch.long)
    used = page_table >= 0
    page_topic[page_table[used].long()] = block_topic[used]
    k = torch.randn((num_pages, s.hkv, s.block, s.head_dim), generator=gen)
    k += strength * dirs[torch.arange(s.hkv).view(1, -1), page_topic.view(-1, 1)].unsqueeze(2)
    v = torch.randn((num_pages, s.hkv, s.block, s.head_dim), generator=gen)
    runs = (n_tokens + s.block - 1) // s.block
    q_topic = torch.randint(topics, (runs,), generator=gen).repeat_interleave(s.block)[:n_tokens]
    q = torch.randn((n_tokens, s.hkv, s.group, s.head_dim), generator=gen)
    q += strength * dirs[torch.arange(s.hkv).view(1, -1), q_topic.view(-1, 1)].unsqueeze(2)
    out, scales = [], []
    for x in (q.view(n_tokens, s.hq, s.head_dim), k, v):
        t, sc = _quantize(x, dtype)
        out.append(t)
        scales.append(sc)
    return out[0], out[1], out[2], tuple(scales)


def indexer_selection(shape: AttnShape, q: torch.Tensor, k: torch.Tensor, q_scale: float, k_scale: float,
                      page_table: torch.Tensor, q_request: torch.Tensor, q_limit: torch.Tensor,
                      causal: bool) -> torch.Tensor:
    """Top-k blocks per (KV head, query) by probe . mean-pooled keys; [Hkv, N, topk] int32."""
    s = shape
    n = q.shape[0]
    sel = torch.full((s.hkv, n, s.topk), -1, dtype=torch.int32)
    pos = torch.arange(s.block)
    for r in range(page_table.shape[0]):
        rows = (q_request == r).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        n_blocks = int((page_table[r] >= 0).sum())
        kv_len = int(q_limit[rows].max()) + 1
        summary = torch.empty((n_blocks, s.hkv, s.head_dim))                 # mean of each block's visible keys
        for b0 in range(0, n_blocks, _BLOCK_CHUNK):
            b = torch.arange(b0, min(b0 + _BLOCK_CHUNK, n_blocks))
            keys = k[page_table[r, b].long()].float() * k_scale                # [b, Hkv, block, D]
            visible = ((b.view(-1, 1) * s.block + pos) < kv_len).float()        # [b, block]
            summary[b] = torch.einsum("bhtd,bt->bhd", keys, visible) / visible.sum(1).clamp(min=1).view(-1, 1, 1)
        for start in range(0, rows.numel(), _ROW_CHUNK):
            rr = rows[start:start + _ROW_CHUNK]
            probe = (q[rr].float() * q_scale).view(len(rr), s.hkv, s.group, s.head_dim).mean(2)
            scores = torch.einsum("nhd,bhd->hnb", probe, summary)                # [Hkv, n, B]
            block_id = torch.arange(n_blocks).view(1, 1, -1)
            if causal:
                local = local_blocks(q_limit[rr], s.block)
                eligible = block_id < local.view(1, -1, 1)
                width = s.topk - 1
            else:
                eligible = block_id * s.block <= q_limit[rr].long().view(1, -1, 1)
                width = s.topk
            width = min(width, n_blocks)
            scores = scores.masked_fill(~eligible, float("-inf"))
            top = scores.topk(width, dim=-1)                                     # best first, -inf last
            count = torch.isfinite(top.values).sum(-1)                           # [Hkv, n]
            if causal:
                sel[:, rr] = append_local(top.indices, count, local, s.topk)
            else:
                if (count < s.topk).any():
                    raise WorkloadError(f"indexer: the context holds {n_blocks} blocks, fewer than top-{s.topk}")
                sel[:, rr] = top.indices.to(torch.int32)
    return sel


def indexer_workload(shape: AttnShape, dtype: str, tokens: int, context: int, causal: bool = False, seed: int = 0,
                     device="cpu", topics: int = 8, strength: float = 0.5) -> Workload:
    """One request of `context` tokens (causal: the N queries are its last N positions); tensors always drawn."""
    if tokens <= 0 or context <= 0:
        raise WorkloadError(f"tokens and context must be positive, got tokens={tokens}, context={context}")
    if causal and context < tokens:
        raise WorkloadError(f"causal: context ({context} tokens) must hold the {tokens} query tokens")
    if not causal and (context + shape.block - 1) // shape.block < shape.topk:
        raise WorkloadError(f"indexer: context {context} holds fewer than top-{shape.topk} blocks of {shape.block}")
    gen = torch.Generator().manual_seed(seed + 1)
    table, num_pages = scattered_page_table([context], shape.block, gen)
    q_request = torch.zeros(tokens, dtype=torch.int32)
    if causal:
        q_limit = torch.arange(context - tokens, context, dtype=torch.int32)
    else:
        q_limit = torch.full((tokens,), context - 1, dtype=torch.int32)
    q, k, v, scales = draw_structured(shape, dtype, tokens, table, num_pages, q_request, seed, topics, strength)
    sel = indexer_selection(shape, q, k, scales[0], scales[1], table, q_request, q_limit, causal)
    meta = {"generator": "indexer", "seed": seed, "topics": topics, "strength": strength, "kv_lens": [context]}
    return assemble(shape, dtype, sel, table, q_request, q_limit, num_pages, causal, seed, device,
                    tensors=(q, k, v, scales), meta=meta)
