"""Top-k selections: the contract rules, the scattered paged cache, and the synthetic generator.

Contract (see workload.py): selection [Hkv, N, topk] int32 of logical block ids of the query's
request, valid entries first, -1 padding after them, ids distinct per (head, query). Under
causality the query's own (local) block, q_limit // block, is the last valid entry and every other
entry is a block before it.

Synthetic generator, for a target reuse r = nsb / N (nsb = distinct selected (KV head, block) pairs):
each KV head draws a pool of blocks and every query picks distinct blocks from its head's pool. The
first `pool` picks of a head (in a random query order) walk a random permutation of the pool, so
every pool block is chosen at least once and nsb is exact (up to rounding r * N to an integer);
the remaining picks follow the popularity law (uniform, or Zipf with exponent `skew` over a random
ranking of the pool) without repeating a block within a query.

Causal mode is a chunked prefill: the N queries sit at positions context - N .. context - 1 after a
prefix of context - N tokens. Each query keeps its local block (last) plus topk - 1 history blocks
drawn from its head's pool, and the pool is taken from the prefix's complete blocks only, which
every query of the chunk can see. So nsb = Hkv x (local blocks of the chunk) + the pools, exactly,
and no pick is ever refused for visibility.
"""
from __future__ import annotations

import math

import torch

from .workload import AttnShape, Workload, WorkloadError, build_workload, torch_dtype

_REDRAW_ROUNDS = 4



# ---- contract rules ----------------------------------------------------------------------------

def local_blocks(q_limit: torch.Tensor, block: int) -> torch.Tensor:
    """The block holding each query's own position (causal)."""
    return torch.div(q_limit.long(), block, rounding_mode="floor")


def _at(bad: torch.Tensor) -> tuple[int, int, int]:
    """(head, token, slot) of the first True entry of a [Hkv, N, topk] mask."""
    h, n, r = (int(x) for x in bad.nonzero()[0].tolist())
    return h, n, r


def _where(h: int, n: int, r: int) -> str:
    return f"(head {h}, token {n}, slot {r})"


def check_selection(selection: torch.Tensor, q_limit: torch.Tensor, block: int, causal: bool,
                    blocks_per_request: torch.Tensor | None = None, q_request: torch.Tensor | None = None,
                    page_table: torch.Tensor | None = None) -> None:
    """Raise WorkloadError naming the first contract violation and its (head, token, slot); return None if
    the selection is valid. With `page_table` (or `blocks_per_request`) and `q_request`, every id must
    name a block of its query's request. Causal: no block after the query's own, which comes last. Not
    causal: a block may lie wholly past the query's limit (fully masked: m = -inf, l = 0)."""
    if selection.dim() != 3:
        raise WorkloadError(f"selection must be [Hkv, N, topk], got shape {tuple(selection.shape)}")
    sel = selection.long().cpu()
    hkv, n, topk = sel.shape
    if tuple(q_limit.shape) != (n,):
        raise WorkloadError(f"q_limit has shape {tuple(q_limit.shape)}, expected ({n},)")
    limit = q_limit.long().cpu()
    valid = sel >= 0
    if (sel < -1).any():
        h, t, r = _at(sel < -1)
        raise WorkloadError(f"selection holds id {int(sel[h, t, r])} below -1 at {_where(h, t, r)}")
    # padding only after valid entries: once invalid, stays invalid along the rank axis
    hole = valid[..., 1:] & ~valid[..., :-1]
    if hole.any():
        h, t, r = _at(hole)
        raise WorkloadError(f"selection has a valid id after -1 padding at {_where(h, t, r + 1)}")
    keyed = torch.where(valid, sel, -2 - torch.arange(topk))          # padding: distinct, below every id
    srt, slot = keyed.sort(dim=-1, stable=True)
    dup = srt[..., 1:] == srt[..., :-1]
    if dup.any():
        h, t, r = _at(dup)
        raise WorkloadError(f"selection repeats block {int(srt[h, t, r])} within one (KV head, query) at "
                            f"{_where(h, t, int(slot[h, t, r + 1]))}")
    if page_table is not None and q_request is not None:
        table = page_table.long().cpu()
        req = q_request.long().cpu()
        if tuple(req.shape) != (n,) or (req < 0).any() or (req >= table.shape[0]).any():
            raise WorkloadError(f"q_request must hold {n} request indices in [0, {table.shape[0]})")
        width = table.shape[1]
        rows = req.view(1, n, 1).expand_as(sel)
        page = torch.where(valid & (sel < width), table[rows, sel.clamp(0, width - 1)], torch.zeros_like(sel))
        outside = valid & ((sel >= width) | (page < 0))
        if outside.any():
            h, t, r = _at(outside)
            raise WorkloadError(f"selection names block {int(sel[h, t, r])} at {_where(h, t, r)}, past the blocks "
                                f"of its request {int(req[t])} in the page table")
    elif blocks_per_request is not None and q_request is not None:
        blocks = blocks_per_request.long().cpu()[q_request.long().cpu()].view(1, n, 1)
        if (valid & (sel >= blocks)).any():
            h, t, r = _at(valid & (sel >= blocks))
            raise WorkloadError(f"selection names block {int(sel[h, t, r])} at {_where(h, t, r)}, outside its "
                                "request's page table")
    if causal:
        # no selected block may start past the query's limit: it would be a future block
        future = valid & (sel * block > limit.view(1, n, 1))
        if future.any():
            h, t, r = _at(future)
            raise WorkloadError(f"causal selection names block {int(sel[h, t, r])} at {_where(h, t, r)}, which "
                                f"starts after the query's last visible key {int(limit[t])}")
        count = valid.sum(-1)
        if (count == 0).any():
            h, t = (int(x) for x in (count == 0).nonzero()[0].tolist())
            raise WorkloadError(f"causal selection has no block at (head {h}, token {t}): a query keeps at least "
                                "its local block")
        last = sel.gather(-1, (count - 1).unsqueeze(-1)).squeeze(-1)
        own = local_blocks(limit, block).view(1, n).expand(hkv, n)
        wrong = last != own
        if wrong.any():
            h, t = (int(x) for x in wrong.nonzero()[0].tolist())
            raise WorkloadError(f"causal selection does not end with the query's local block {int(own[h, t])} "
                                f"at {_where(h, t, int(count[h, t]) - 1)} (it ends with {int(last[h, t])})")


def append_local(history: torch.Tensor, count: torch.Tensor, local: torch.Tensor, topk: int) -> torch.Tensor:
    """Causal selection [Hkv, N, topk] from history [Hkv, N, <= topk - 1] whose first `count` [N] (or
    [Hkv, N]) entries are valid: the local block goes right after them, -1 padding after that."""
    hkv, n, width = history.shape
    count = count.long().expand(hkv, n) if count.dim() == 1 else count.long()
    sel = torch.full((hkv, n, topk), -1, dtype=torch.long)
    slot = torch.arange(width).view(1, 1, -1)
    sel[..., :width] = torch.where(slot < count.unsqueeze(-1), history.long(), -1)
    sel.scatter_(2, count.unsqueeze(-1), local.long().view(1, n, 1).expand(hkv, n, 1))
    return sel.to(torch.int32)


# ---- paged cache -------------------------------------------------------------------------------

def scattered_page_table(kv_lens: list[int], block: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Per-request page tables over one random permutation of the physical pages (like a serving cache).

    Returns page_table [R, max_blocks] int32 (-1 past a request's blocks) and the number of pages.
    """
    counts = [max(1, math.ceil(n / block)) for n in kv_lens]
    num_pages = sum(counts)
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.full((len(counts), max(counts)), -1, dtype=torch.int32)
    start = 0
    for r, c in enumerate(counts):
        table[r, :c] = perm[start:start + c]
        start += c
    return table, num_pages


def assemble(shape: AttnShape, dtype: str, selection: torch.Tensor, page_table: torch.Tensor,
             q_request: torch.Tensor, q_limit: torch.Tensor, num_pages: int, causal: bool, seed: int,
             device="cpu", with_tensors: bool = True, tensors=None, meta: dict | None = None) -> Workload:
    """A Workload from a selection and its page tables (validated by build_workload).

    with_tensors=True draws seeded random Q/K/V (scenarios.workload.build_workload); `tensors`
    = (q, k, v, (q_scale, k_scale, v_scale)) supplies them instead. with_tensors=False gives a
    selection-only workload for statistics: q/k/v are zero-stride placeholders of the right shape
    (no memory) and meta["with_tensors"] is False; `with_fresh_data` turns it into a full one.
    """
    meta = dict(meta or {})
    meta["with_tensors"] = with_tensors or tensors is not None
    if not meta["with_tensors"]:
        zero = torch.zeros((), dtype=torch_dtype(dtype), device=device)
        tensors = (zero.expand(selection.shape[1], shape.hq, shape.head_dim),
                   zero.expand(num_pages, shape.hkv, shape.block, shape.head_dim),
                   zero.expand(num_pages, shape.hkv, shape.block, shape.head_dim), (1.0, 1.0, 1.0))
    return build_workload(shape, dtype, selection, page_table, q_request, q_limit, num_pages, causal,
                          seed=seed, device=device, meta=meta, tensors=tensors)


# ---- synthetic generator -----------------------------------------------------------------------

def synthetic_geometry(shape: AttnShape, tokens: int, context: int, reuse: float, causal: bool) -> dict:
    """What a synthetic selection can draw from: `available` pool blocks per KV head, `n_local` local
    blocks, `picks` pool entries per query, `fixed` (KV head, local block) pairs; raises WorkloadError
    on a non-positive size or reuse."""
    if tokens <= 0 or context <= 0:
        raise WorkloadError(f"tokens and context must be positive, got tokens={tokens}, context={context}")
    if not (reuse > 0 and math.isfinite(reuse)):
        raise WorkloadError(f"reuse (nsb/N) must be a positive number, got {reuse}")
    b, hkv = shape.block, shape.hkv
    if causal:
        if context < tokens:
            raise WorkloadError(f"causal: context ({context} tokens) must hold the {tokens} query tokens")
        prefix = context - tokens
        available = prefix // b                                  # complete prefix blocks: visible to all
        n_local = (context - 1) // b - prefix // b + 1
        return {"available": available, "n_local": n_local, "picks": shape.topk - 1, "fixed": hkv * n_local,
                "what": f"{n_local} local blocks + a history pool per KV head from the {available} complete "
                        "prefix blocks"}
    available = math.ceil(context / b)
    return {"available": available, "n_local": 0, "picks": shape.topk, "fixed": 0,
            "what": f"a pool per KV head from the {available} context blocks"}


def reuse_range(shape: AttnShape, tokens: int, geo: dict, lo_pool: int, hi_pool: int) -> tuple[float, float]:
    """The nsb/N reached by pools of lo_pool and hi_pool blocks per KV head."""
    return ((geo["fixed"] + shape.hkv * lo_pool) / tokens, (geo["fixed"] + shape.hkv * hi_pool) / tokens)


def split_pools(shape: AttnShape, tokens: int, reuse: float, geo: dict) -> list[int]:
    """Pool size per KV head for nsb = round(reuse x N): the pairs beyond the local ones, split evenly."""
    # reuse x N past 2^62 (1e308 x N is inf) is no pool anyone can fill: too large, and infeasible like one
    pool_total = round(min(reuse * tokens, 2.0 ** 62)) - geo["fixed"]
    hkv = shape.hkv
    return [pool_total // hkv + (h < pool_total % hkv) for h in range(hkv)] if pool_total > 0 else [0] * hkv


def _plan_synthetic(shape: AttnShape, tokens: int, context: int, reuse: float, causal: bool) -> dict:
    """Pool sizes for a synthetic target; raises WorkloadError (one line) when it cannot be met."""
    geo = synthetic_geometry(shape, tokens, context, reuse, causal)
    picks, available = geo["picks"], geo["available"]
    lo_pool, hi_pool = picks, min(available, tokens * picks)
    lo_r, hi_r = reuse_range(shape, tokens, geo, lo_pool, hi_pool)
    if picks == 0 or hi_pool < lo_pool:
        raise WorkloadError(f"no reuse is feasible for tokens={tokens}, context={context}, topk={shape.topk}"
                            f"{', causal' if causal else ''}: {geo['what']} cannot fill top-{shape.topk}")
    pools = split_pools(shape, tokens, reuse, geo)
    if min(pools) < lo_pool or max(pools) > hi_pool:
        raise WorkloadError(f"reuse {reuse:g} is infeasible for tokens={tokens}, context={context}, "
                            f"Hkv={shape.hkv}, top-{shape.topk}{', causal' if causal else ''} ({geo['what']}); "
                            f"feasible reuse is {lo_r:.4g} to {hi_r:.4g}")
    return {"nsb": round(reuse * tokens), "pools": pools, "available": available, "n_local": geo["n_local"],
            "picks": picks}


def check_synthetic(shape: AttnShape, tokens: int, context: int, reuse: float, causal: bool = False) -> None:
    """Raise WorkloadError if the synthetic target cannot be generated (cheap: no sampling)."""
    _plan_synthetic(shape, tokens, context, reuse, causal)


def _zipf_weights(n: int, skew: float) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.float64).pow(-skew)


def _sample_excluding(gen: torch.Generator, weights: torch.Tensor, cum: torch.Tensor,
                      taken: torch.Tensor) -> torch.Tensor:
    """One item per row, drawn with probability proportional to `weights` among the items not in that
    row of `taken` [rows, j] (distinct items): inverse CDF with the taken items cut out.

    Draw u below the untaken mass, then step over the taken items at or below it. With the taken
    items sorted, u passes item i iff u >= start_i - (weight of taken items before i); those
    thresholds never decrease, so u passes a prefix of them and one comparison finds it."""
    rows, j = taken.shape
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    if j == 0:
        return torch.searchsorted(cum, u * cum[-1], right=True).clamp_(max=cum.numel() - 1)
    taken = taken.sort(dim=1).values
    w_cum = torch.take(weights, taken).cumsum(1)
    u = u * (cum[-1] - w_cum[:, -1])
    passed = (u.unsqueeze(1) >= torch.take(cum, taken) - w_cum).sum(1, keepdim=True)   # start_i - W_<i
    u = u + torch.where(passed > 0, w_cum.gather(1, (passed - 1).clamp(min=0)), 0.0).squeeze(1)
    return torch.searchsorted(cum, u, right=True).clamp_(max=cum.numel() - 1)


def _duplicates(vals: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """Entries repeating an earlier value of their row; among equal values fixed entries count first."""
    order = (vals * 2 + (~fixed).long()).argsort(dim=1)
    srt = vals.gather(1, order)
    dup_sorted = torch.zeros_like(fixed)
    dup_sorted[:, 1:] = srt[:, 1:] == srt[:, :-1]
    return torch.zeros_like(fixed).scatter(1, order, dup_sorted)


def distinct_picks(gen: torch.Generator, rows: int, picks: int, pool: int, skew: float = 0.0) -> torch.Tensor:
    """[rows, picks] indices into a pool of `pool` items, distinct per row, every item used at least once.

    Needs picks <= pool <= rows * picks. Item i has popularity (i + 1) ** -skew (0: uniform). The
    first `pool` picks (row-major) walk a random permutation (coverage); the others are drawn with
    replacement, repeats are redrawn a few rounds on the shrinking set of rows that have them, and
    rows still holding a repeat are redrawn exactly, pick by pick without replacement.
    """
    weights = _zipf_weights(pool, skew)
    cum = weights.cumsum(0)
    draw = lambda count: torch.searchsorted(cum, torch.rand(count, generator=gen, dtype=torch.float64) * cum[-1],
                                            right=True).clamp_(max=pool - 1)
    vals = draw(rows * picks)
    vals[:pool] = torch.randperm(pool, generator=gen)
    fixed = (torch.arange(rows * picks) < pool).view(rows, picks)       # a prefix of each row
    vals = vals.view(rows, picks)
    bad = torch.arange(rows)
    for _ in range(_REDRAW_ROUNDS):
        sub = vals[bad]
        dup = _duplicates(sub, fixed[bad])
        has = dup.any(1)
        bad, sub, dup = bad[has], sub[has], dup[has]
        if bad.numel() == 0:
            return vals
        sub[dup] = draw(int(dup.sum()))
        vals[bad] = sub
    bad = bad[_duplicates(vals[bad], fixed[bad]).any(1)]
    while bad.numel():                       # one pass, unless float rounding hit a taken item's edge
        sub, sub_fixed = vals[bad], fixed[bad]
        for j in range(picks):
            drawn = _sample_excluding(gen, weights, cum, sub[:, :j])
            sub[:, j] = torch.where(sub_fixed[:, j], sub[:, j], drawn)
        vals[bad] = sub
        bad = bad[_duplicates(sub, sub_fixed).any(1)]
    return vals


def request_limits(sel: torch.Tensor, shape: AttnShape, tokens: int, context: int, causal: bool) -> torch.Tensor:
    """q_limit [N] of one request whose N queries are the last of `context` tokens (causal: each sees up to
    its own position, and its own block becomes its selection's last entry, in place); not causal: all."""
    if not causal:
        return torch.full((tokens,), context - 1, dtype=torch.int32)
    q_limit = torch.arange(context - tokens, context, dtype=torch.int32)
    sel[:, :, -1] = local_blocks(q_limit, shape.block).to(torch.int32).view(1, -1)
    return q_limit


def synthetic_selection(shape: AttnShape, tokens: int, context: int, reuse: float, skew: float = 0.0,
                        causal: bool = False, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(selection [Hkv, N, topk] int32, q_limit [N] int32) for one request of `context` tokens."""
    if skew < 0 or not math.isfinite(skew):
        raise WorkloadError(f"skew (Zipf exponent) must be >= 0, got {skew}")
    plan = _plan_synthetic(shape, tokens, context, reuse, causal)
    gen = torch.Generator().manual_seed(seed)
    sel = torch.empty((shape.hkv, tokens, shape.topk), dtype=torch.int32)
    for h, pool in enumerate(plan["pools"]):
        blocks = torch.randperm(plan["available"], generator=gen)[:pool]   # the pool, in popularity order
        picks = distinct_picks(gen, tokens, plan["picks"], pool, skew)
        rows = torch.randperm(tokens, generator=gen)                        # scatter the coverage queries
        sel[h, :, :plan["picks"]] = blocks[picks[rows]].to(torch.int32)
    return sel, request_limits(sel, shape, tokens, context, causal)


def synthetic_workload(shape: AttnShape, dtype: str, tokens: int, context: int, reuse: float, skew: float = 0.0,
                       causal: bool = False, seed: int = 0, device="cpu", with_tensors: bool = True) -> Workload:
    """A single-request workload whose selection hits nsb/N = reuse (see the module docstring)."""
    sel, q_limit = synthetic_selection(shape, tokens, context, reuse, skew, causal, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    table, num_pages = scattered_page_table([context], shape.block, gen)
    meta = {"generator": "synthetic", "target_reuse": reuse, "skew": skew, "seed": seed, "kv_lens": [context]}
    return assemble(shape, dtype, sel, table, torch.zeros(tokens, dtype=torch.int32), q_limit, num_pages,
                    causal, seed, device, with_tensors, meta=meta)
