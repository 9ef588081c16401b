"""Serving-step workloads: decode batches, mixed prefill + decode steps, and drifting selections.

Three generators share one layout rule and one selection rule.

Layout (causal; every request's query tokens are the last tokens of its context):
  decode  `requests` requests of `query_tokens` tokens each (1: plain decode, 2-4: speculative or
          multi-token decode); each request's context is drawn uniformly from [context_min, context]
          (seeded; context_min = context gives a fixed context).
  mixed   a chunked-prefill serving step: `chunks` prefill chunks of `tokens` tokens, each at the end
          of a `context`-token request, then `requests` decode requests as above, in one call.
  drift   one causal prefill chunk of `tokens` tokens at the end of a `context`-token request.

Selection: each query keeps its local block (its own position's block) last, after topk - 1
history blocks drawn from the complete blocks before its request's first query token (visible to
every query of the request). Token i's history is token i-1's with each of its topk - 1 blocks
replaced, independently with probability `drift`, by a block its predecessor did not hold (uniform
over those); without `drift` every token draws its history afresh. So two neighbours share
k - X of their k = topk - 1 history blocks, X ~ Binomial(k, p), and their Jaccard (local block
included) is about (1 - p) / (1 + p) for large k (`drift_expectations` gives the exact mean and
union_ratio this construction implies).
"""
from __future__ import annotations

import math
import random

import torch

from ..roofline.model import DECODE_TOKENS
from .selection import append_local, assemble, local_blocks, scattered_page_table
from .tiling import query_tiles
from .workload import AttnShape, Workload, WorkloadError

GENERATORS = ("decode", "mixed", "drift")
MAX_QUERY_TOKENS = DECODE_TOKENS     # tokens per decode request: plain, speculative or multi-token decode


def request_contexts(requests: int, context_min: int, context: int, seed: int) -> list[int]:
    """Each decode request's context, uniform in [context_min, context] (seeded, cheap: no tensors)."""
    if requests <= 0:
        return []
    if context_min == context:
        return [context] * requests
    gen = torch.Generator().manual_seed(seed + 2)
    return torch.randint(context_min, context + 1, (requests,), generator=gen).tolist()


def layout(generator: str, tokens: int | None, context: int, context_min: int | None, requests: int | None,
           query_tokens: int | None, chunks: int | None, seed: int) -> tuple[list[int], list[int]]:
    """(context per request, query tokens per request) of a serving workload; prefill chunks first."""
    cmin = context if context_min is None else context_min
    t = query_tokens or 1
    if generator == "drift":
        return [context], [tokens]
    decode = request_contexts(requests or 0, cmin, context, seed)
    if generator == "decode":
        return decode, [t] * len(decode)
    return [context] * chunks + decode, [tokens] * chunks + [t] * len(decode)


def _history_blocks(shape: AttnShape, kv: int, n: int) -> int:
    """Complete blocks before the first of the request's n query tokens: the history every one sees."""
    return (kv - n) // shape.block


def serving_problem(shape: AttnShape, generator: str, tokens: int | None, context: int, context_min: int | None,
                    requests: int | None, query_tokens: int | None, chunks: int | None,
                    drift: float | None) -> tuple[str, str] | None:
    """(axis, why) for a serving point that cannot be built as asked, else None. Cheap: no tensors."""
    k = shape.topk - 1
    if context <= 0:
        return "context", f"context must be positive, got {context}"
    if drift is not None and not (math.isfinite(drift) and 0.0 <= drift <= 1.0):
        return "drift", f"drift (probability a history block is replaced per token) must be in [0, 1], got {drift}"
    if generator == "drift" and drift is None:
        return "drift", "generator drift needs drift (the replacement probability p)"
    if generator in ("decode", "mixed"):
        if context_min is not None and not 0 < context_min <= context:
            return "context_min", f"context_min must be in [1, context {context}], got {context_min}"
        t = query_tokens or 1
        if not 1 <= t <= MAX_QUERY_TOKENS:
            return "query_tokens", f"query_tokens (per decode request) must be 1 to {MAX_QUERY_TOKENS}, got {t}"
        least = 0 if generator == "mixed" else 1
        if requests is None:
            return "requests", f"generator {generator} needs requests (its decode requests)"
        if requests < least:
            return "requests", f"requests (decode requests) must be at least {least}, got {requests}"
        if requests:
            cmin = context if context_min is None else context_min
            extra = 1 if drift else 0          # drift redraws outside the current k: one block more
            if _history_blocks(shape, cmin, t) < k + extra:
                need = (k + extra) * shape.block + t
                return "context_min", (f"a {cmin}-token decode context leaves {_history_blocks(shape, cmin, t)} "
                                       f"complete blocks before its {t} query tokens; top-{shape.topk} needs {k}"
                                       f"{' and drift one more' if drift else ''} (context_min >= {need})")
    if generator == "mixed" and (chunks is None or chunks < 1):
        return "chunks", f"chunks (prefill chunks in the step) must be at least 1, got {chunks}"
    if generator in ("mixed", "drift"):
        if tokens is None or tokens <= 0:
            return "tokens", f"tokens (prefill chunk) must be positive, got {tokens}"
        have = _history_blocks(shape, context, tokens) if context >= tokens else -1
        if have < k + (1 if drift else 0):
            return "context", (f"a {tokens}-token chunk at the end of a {context}-token context leaves {max(have, 0)} "
                               f"complete history blocks; top-{shape.topk} needs {k}{' and drift one more' if drift else ''}")
    return None


def _histories(rng: random.Random, hkv: int, n: int, k: int, available: int, drift: float | None) -> list:
    """[Hkv][n][k] history blocks of one request's n tokens (module docstring's rule)."""
    out = []
    for _ in range(hkv):
        cur = rng.sample(range(available), k)
        rows = [cur]
        for _ in range(1, n):
            if drift is None:
                cur = rng.sample(range(available), k)
            else:
                taken = set(cur)
                nxt = list(cur)
                for j in range(k):
                    # a context of few more blocks than k runs out of fresh ones: the block then stays
                    if rng.random() < drift and len(taken) < available:
                        b = rng.randrange(available)
                        while b in taken:
                            b = rng.randrange(available)
                        taken.add(b)
                        nxt[j] = b
                cur = nxt
            rows.append(cur)
        out.append(rows)
    return out


def serving_selection(shape: AttnShape, kv_lens: list[int], q_counts: list[int], drift: float | None,
                      seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(selection [Hkv, N, topk] int32, q_request [N] int32, q_limit [N] int32)."""
    rng = random.Random(seed)
    k = shape.topk - 1
    hist, req, lim = [], [], []
    for r, (kv, n) in enumerate(zip(kv_lens, q_counts)):
        hist.append(torch.tensor(_histories(rng, shape.hkv, n, k, _history_blocks(shape, kv, n), drift),
                                 dtype=torch.long).view(shape.hkv, n, k))
        req += [r] * n
        lim.append(torch.arange(kv - n, kv, dtype=torch.long))
    history = torch.cat(hist, 1)
    q_limit = torch.cat(lim)
    sel = append_local(history, torch.full((q_limit.numel(),), k), local_blocks(q_limit, shape.block), shape.topk)
    return sel, torch.tensor(req, dtype=torch.int32), q_limit.to(torch.int32)


def drift_expectations(shape: AttnShape, kv_lens: list[int], q_counts: list[int], drift: float,
                       tile: int = 8) -> dict:
    """The mean neighbour Jaccard and the union_ratio at P = tile (over the query tiles) this construction implies.

    Neighbours (consecutive tokens of one request) share k - X history blocks, X ~ Binomial(k, p),
    and their local block when it is the same one. A tile of g tokens holds U_g distinct history
    blocks per KV head: U_1 = k, and each next token adds its X replacements less those that return
    to a block the tile dropped earlier: U_{j+1} = U_j + k p (A - U_j) / (A - k), A the history
    blocks available; plus the tile's distinct local blocks."""
    k, p = shape.topk - 1, drift
    pmf = [math.comb(k, x) * p ** x * (1 - p) ** (k - x) for x in range(k + 1)]
    same = sum(w * (k + 1 - x) / (k + 1 + x) for x, w in enumerate(pmf))
    other = sum(w * (k - x) / (k + 2 + x) for x, w in enumerate(pmf))
    j_sum, pairs, u_sum, entries = 0.0, 0, 0.0, 0
    for kv, n in zip(kv_lens, q_counts):
        avail = _history_blocks(shape, kv, n)
        local = local_blocks(torch.arange(kv - n, kv), shape.block)
        moved = int((local[1:] != local[:-1]).sum())
        j_sum += same * (n - 1 - moved) + other * moved
        pairs += n - 1
        tile_id, _ = query_tiles(torch.zeros(n, dtype=torch.long), torch.arange(kv - n, kv), tile, causal=True)
        start = 0
        for g in torch.bincount(tile_id).tolist():
            u = float(k)
            for _ in range(g - 1):
                u += k * p * (avail - u) / max(avail - k, 1)
            u_sum += g * (u + int(local[start:start + g].unique().numel()))
            entries += g * shape.topk
            start += g
    return {"neighbour_jaccard": j_sum / pairs if pairs else None, "union_ratio": u_sum / entries}


def neighbour_jaccard(selection: torch.Tensor, q_request: torch.Tensor, chunk: int = 16384) -> float | None:
    """Mean Jaccard of the valid blocks of consecutive tokens of one request, over KV heads and pairs."""
    sel = selection.long().cpu()
    req = q_request.long().cpu()
    same = torch.nonzero(req[1:] == req[:-1]).view(-1)
    if same.numel() == 0:
        return None
    total = 0.0
    for i in range(0, same.numel(), chunk):
        idx = same[i:i + chunk]
        a, b = sel[:, idx], sel[:, idx + 1]
        inter = ((a.unsqueeze(-1) == b.unsqueeze(-2)) & (a >= 0).unsqueeze(-1)).sum((-1, -2))
        union = (a >= 0).sum(-1) + (b >= 0).sum(-1) - inter
        total += float((inter / union.clamp(min=1)).sum())
    return total / (same.numel() * sel.shape[0])


def serving_workload(shape: AttnShape, dtype: str, generator: str, tokens: int | None, context: int,
                     context_min: int | None = None, requests: int | None = None, query_tokens: int | None = None,
                     chunks: int | None = None, drift: float | None = None, seed: int = 0, device="cpu",
                     with_tensors: bool = True) -> Workload:
    """A decode, mixed or drift workload (module docstring); a point it cannot build is a WorkloadError."""
    problem = serving_problem(shape, generator, tokens, context, context_min, requests, query_tokens, chunks, drift)
    if problem:
        raise WorkloadError(f"{problem[0]}: {problem[1]}")
    kv_lens, q_counts = layout(generator, tokens, context, context_min, requests, query_tokens, chunks, seed)
    sel, q_request, q_limit = serving_selection(shape, kv_lens, q_counts, drift, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    table, num_pages = scattered_page_table(kv_lens, shape.block, gen)
    meta = {"generator": generator, "seed": seed, "kv_lens": kv_lens, "query_counts": q_counts, "drift": drift}
    if drift is not None:
        implied = drift_expectations(shape, kv_lens, q_counts, drift)
        meta.update(target_union_ratio=implied["union_ratio"], target_neighbour_jaccard=implied["neighbour_jaccard"])
    return assemble(shape, dtype, sel, table, q_request, q_limit, num_pages, True, seed, device, with_tensors,
                    meta=meta)

