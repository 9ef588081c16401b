"""Co-selected synthetic selections: groups of consecutive tokens share part of their top-k.

The synthetic generator's `share` axis. The request's tokens fall into groups of G consecutive tokens
(the first token starts the first group; the last group may be shorter). Per group and KV head, s of
the k freely drawn entries are shared: every token of the group selects them. Each token draws its
other k - s blocks on its own, distinct from the group's shared blocks and from every other token's
own draws. s = round(share x k), halves up, with k = topk, or topk - 1 in causal mode, where each
token keeps its local block as its own last entry (tokens of a group inside one block share it).

So a group of g tokens selects exactly m(g) = s + g (k - s) distinct pool blocks per KV head, and a
tile of P = G tokens is a group: union_ratio at P = G is, in closed form (`implied_union_ratio`),

    sum over groups of g x (m(g) + the group's distinct local blocks) / (N x topk)

(G at share 0, 1 at share 1 without local blocks). Reuse is held as the synthetic generator holds it:
each KV head has a pool of nsb / Hkv blocks (beyond the local ones), and the groups' m(g) blocks are
the rows of `distinct_picks` over it, which uses every pool block at least once. That needs
m(largest group) <= pool <= available blocks and pool <= sum of m(g) over the groups; outside that,
a one-line WorkloadError names the feasible reuse at this share and the feasible share at this reuse.
"""
from __future__ import annotations

import math

import torch

from .selection import (assemble, distinct_picks, local_blocks, request_limits, reuse_range,
                        scattered_page_table, split_pools, synthetic_geometry)
from .workload import AttnShape, Workload, WorkloadError

DEFAULT_GROUP = 8


def shared_count(share: float, k: int) -> int:
    """s = round(share x k), halves up (Python's round() sends 2.5 to 2)."""
    return int(math.floor(share * k + 0.5))


def group_sizes(tokens: int, group: int) -> list[int]:
    full, rest = divmod(tokens, group)
    return [group] * full + ([rest] if rest else [])


def _pool_bounds(tokens: int, group: int, s: int, k: int, available: int) -> tuple[int, int]:
    """Pool sizes per KV head the groups can fill: the largest group's m(g), and the blocks all groups
    together can cover (sum of m(g)), capped by the available blocks."""
    sizes = group_sizes(tokens, group)
    lo = s + max(sizes) * (k - s)
    return lo, min(available, len(sizes) * s + tokens * (k - s))


def _check_args(share: float, group: int) -> None:
    if not (isinstance(share, (int, float)) and math.isfinite(share) and 0.0 <= share <= 1.0):
        raise WorkloadError(f"share (fraction of the top-k a token group shares) must be between 0 and 1, "
                            f"got {share}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise WorkloadError(f"share_group (tokens per group) must be a positive integer, got {group}")


def plan_coselection(shape: AttnShape, tokens: int, context: int, reuse: float, share: float,
                     group: int = DEFAULT_GROUP, causal: bool = False) -> dict:
    """Pools and shared count for a (reuse, share) target; raises WorkloadError (one line) naming the
    feasible ranges when the combination cannot be met."""
    _check_args(share, group)
    geo = synthetic_geometry(shape, tokens, context, reuse, causal)
    k, available = geo["picks"], geo["available"]
    pools = split_pools(shape, tokens, reuse, geo)

    def fits(t: int) -> bool:
        lo, hi = _pool_bounds(tokens, group, t, k, available)
        return lo <= min(pools) and max(pools) <= hi

    if k == 0:
        raise WorkloadError(f"no reuse is feasible for tokens={tokens}, context={context}, topk={shape.topk}"
                            f"{', causal' if causal else ''}: {geo['what']} cannot fill top-{shape.topk}")
    s = shared_count(share, k)
    if fits(s):
        return {"nsb": round(reuse * tokens), "pools": pools, "available": available, "n_local": geo["n_local"],
                "picks": k, "shared": s, "group": group}
    where = (f"tokens={tokens}, context={context}, Hkv={shape.hkv}, top-{shape.topk}"
             f"{', causal' if causal else ''}, groups of {group} ({geo['what']})")
    ok = [t for t in range(k + 1) if fits(t)]
    at_reuse = (f"feasible share at reuse {reuse:g} is {ok[0] / k:.4g} to {ok[-1] / k:.4g}" if ok
                else f"no share is feasible at reuse {reuse:g}")
    lo, hi = _pool_bounds(tokens, group, s, k, available)
    if lo > hi:
        raise WorkloadError(f"share {share:g} is infeasible for {where}: no reuse fits; {at_reuse}")
    lo_r, hi_r = reuse_range(shape, tokens, geo, lo, hi)
    raise WorkloadError(f"reuse {reuse:g} with share {share:g} is infeasible for {where}; feasible reuse at "
                        f"share {share:g} is {lo_r:.4g} to {hi_r:.4g}; {at_reuse}")


def check_coselection(shape: AttnShape, tokens: int, context: int, reuse: float, share: float,
                      group: int = DEFAULT_GROUP, causal: bool = False) -> None:
    """Raise WorkloadError if the target cannot be generated (cheap: no sampling)."""
    plan_coselection(shape, tokens, context, reuse, share, group, causal)


def implied_union_ratio(shape: AttnShape, tokens: int, context: int, share: float, group: int = DEFAULT_GROUP,
                        causal: bool = False) -> float:
    """union_ratio at P = group that the construction gives exactly (see the module docstring)."""
    k = shape.topk - 1 if causal else shape.topk
    s = shared_count(share, k)
    local = local_blocks(torch.arange(context - tokens, context), shape.block) if causal else None
    total, start = 0, 0
    for g in group_sizes(tokens, group):
        n_local = int(local[start:start + g].unique().numel()) if causal else 0
        total += g * (s + g * (k - s) + n_local)
        start += g
    return total / (tokens * shape.topk)


def coselected_selection(shape: AttnShape, tokens: int, context: int, reuse: float, share: float,
                         group: int = DEFAULT_GROUP, skew: float = 0.0, causal: bool = False,
                         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(selection [Hkv, N, topk] int32, q_limit [N] int32) for one request of `context` tokens."""
    if skew < 0 or not math.isfinite(skew):
        raise WorkloadError(f"skew (Zipf exponent) must be >= 0, got {skew}")
    plan = plan_coselection(shape, tokens, context, reuse, share, group, causal)
    k, s = plan["picks"], plan["shared"]
    sizes = group_sizes(tokens, group)
    width = s + max(sizes) * (k - s)                                   # m of a full group
    # token t of group g takes its group row's shared entries and its own k - s entries after them
    gid = torch.arange(tokens) // group
    pos = torch.arange(tokens) % group
    own = s + pos.view(-1, 1) * (k - s) + torch.arange(k - s).view(1, -1)
    take = torch.cat([torch.arange(s).view(1, -1).expand(tokens, s), own], 1)
    gen = torch.Generator().manual_seed(seed)
    sel = torch.empty((shape.hkv, tokens, shape.topk), dtype=torch.int32)
    n_full = len(sizes) if sizes[-1] == group else len(sizes) - 1
    for h, pool in enumerate(plan["pools"]):
        blocks = torch.randperm(plan["available"], generator=gen)[:pool]   # the pool, in popularity order
        rows = distinct_picks(gen, len(sizes), width, pool, skew)
        # the coverage picks come first (row-major); a short last group keeps its row last, so its kept
        # prefix still holds them; the full groups are shuffled, and each row's roles are shuffled
        rows[:n_full] = rows[torch.randperm(n_full, generator=gen)]
        order = torch.rand(rows.shape, generator=gen, dtype=torch.float64)
        order[n_full:, s + sizes[-1] * (k - s):] = 2.0                 # a short group's dropped tail stays last
        rows = rows.gather(1, order.argsort(1))
        sel[h, :, :k] = blocks[rows[gid].gather(1, take)].to(torch.int32)
    return sel, request_limits(sel, shape, tokens, context, causal)


def coselected_workload(shape: AttnShape, dtype: str, tokens: int, context: int, reuse: float, share: float,
                        group: int = DEFAULT_GROUP, skew: float = 0.0, causal: bool = False, seed: int = 0,
                        device="cpu", with_tensors: bool = True) -> Workload:
    """A single-request workload that hits nsb/N = reuse and union_ratio at P = group as the share implies."""
    sel, q_limit = coselected_selection(shape, tokens, context, reuse, share, group, skew, causal, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    table, num_pages = scattered_page_table([context], shape.block, gen)
    meta = {"generator": "synthetic", "target_reuse": reuse, "skew": skew, "seed": seed, "kv_lens": [context],
            "share": share, "share_group": group,
            "target_union_ratio": implied_union_ratio(shape, tokens, context, share, group, causal)}
    return assemble(shape, dtype, sel, table, torch.zeros(tokens, dtype=torch.int32), q_limit, num_pages,
                    causal, seed, device, with_tensors, meta=meta)
