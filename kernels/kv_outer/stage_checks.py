"""Checks of each KV-stationary stage's own output, independent of the stage code.

Each check reads the plan's buffers after a run and returns (ok, one-line message). Used by the
tests and by `msa-bench check`. Partials are compared with scenarios.reference.reference_partials on
the given query rows.
"""
from __future__ import annotations

import math

import torch

from ...scenarios.reference import reference_partials, relative_error


def _edges(w):
    """Valid edges as (head, query, rank, key) long tensors, in (head, query, rank) order."""
    hkv, n, topk = w.pages.shape
    h, q, r = torch.meshgrid(torch.arange(hkv, device=w.device), torch.arange(n, device=w.device),
                             torch.arange(topk, device=w.device), indexing="ij")
    pages = w.pages.long()
    valid = pages >= 0
    return h[valid], q[valid], r[valid], (h * w.num_pages + pages)[valid]


def check_csr(plan, w) -> tuple[bool, str]:
    b, tile_q = plan.buffers, plan.info["config"]["tile_q"]
    num_keys = w.shape.hkv * w.num_pages
    _, q, _, key = _edges(w)
    order = torch.argsort(key * w.n_tokens + q)                  # (key, query) ascending, unique
    counts = torch.bincount(key, minlength=num_keys)
    ptr = torch.zeros(num_keys + 1, dtype=torch.long, device=w.device)
    ptr[1:] = counts.cumsum(0)
    tiles = torch.zeros_like(ptr)
    tiles[1:] = ((counts + tile_q - 1) // tile_q).cumsum(0)
    e = key.numel()
    if not torch.equal(b["csr_ptr"].long(), ptr):
        return False, "csr_ptr differs from a torch bincount/cumsum"
    if not torch.equal(b["csr_query"][:e].long(), q[order]):
        return False, "csr_query differs from a torch sort by (key, query)"
    if not torch.equal(b["tile_ptr"].long(), tiles):
        return False, "tile_ptr differs from cumsum(ceil(count / tile_q))"
    return True, f"{e} edges over {int((counts > 0).sum())} keys, {int(tiles[-1])} tiles"


def check_schedule(plan, w) -> tuple[bool, str]:
    """The positions hold every index-map tile exactly once (any order), runs end where keys change,
    and the CTA ranges cover the sequence contiguously, balanced to one tile (key order) or to one
    dealing chunk (grouped order)."""
    b, cfg = plan.buffers, plan.info["config"]
    tile_q = cfg["tile_q"]
    tile_ptr, csr_ptr = b["tile_ptr"].long(), b["csr_ptr"].long()
    total = int(tile_ptr[-1])
    key, edge, count = b["tile_key"].long(), b["tile_edge"].long(), b["tile_count"].long()
    if total > key.numel():
        return False, f"{total} tiles exceed the {key.numel()} tile slots"
    if (key[total:] != -1).any() or (count[total:] != 0).any():
        return False, "tiles past the end are not marked empty"
    num_keys = tile_ptr.numel() - 1
    want_key = torch.repeat_interleave(torch.arange(num_keys, device=key.device), tile_ptr.diff())
    nth = torch.arange(total, device=key.device) - tile_ptr[want_key]
    want_edge = csr_ptr[want_key] + nth * tile_q              # ascending: a tile is named by its first edge
    want_count = (csr_ptr[want_key + 1] - want_edge).clamp(max=tile_q)
    if not torch.equal(torch.sort(edge[:total]).values, want_edge):
        return False, "the positions do not hold each tile (cut of a key's edges into tile_q runs) once"
    tile = torch.searchsorted(want_edge, edge[:total])
    if not torch.equal(key[:total], want_key[tile]) or not torch.equal(count[:total], want_count[tile]):
        return False, "tile_key / tile_count do not match the tile whose first edge sits there"
    pos = torch.arange(key.numel(), device=key.device)
    last = torch.ones_like(key, dtype=torch.bool)
    last[:-1] = key[1:] != key[:-1]
    ends = pos[last] + 1
    want_end = ends[torch.searchsorted(ends, pos, right=True)]
    if not torch.equal(b["tile_run_end"].long(), want_end):
        return False, "tile_run_end does not end each run of equal keys"
    rng = b["cta_range"].long()
    sizes = rng[:, 1] - rng[:, 0]
    covered = (int(rng[0, 0]) == 0 and int(rng[-1, 1]) == total and torch.equal(rng[1:, 0], rng[:-1, 1])
               and bool((sizes >= 0).all()))
    if not covered:
        return False, "cta_range does not cover [0, tiles) with contiguous slices"
    slack = max(1, int(cfg.get("order_chunk") or 0))          # the plan's config, resolved
    if cfg.get("order_phases"):                                  # one tile of rounding per group part
        slack = max(slack, w.shape.hkv * int(cfg.get("q_ranges") or 1))
    if total and int(sizes.max() - sizes.min()) > slack:
        return False, f"cta slices unbalanced: {int(sizes.min())}..{int(sizes.max())} tiles"
    return True, f"{total} tiles over {rng.shape[0]} CTAs, {int(sizes.min())}..{int(sizes.max())} per CTA"


def check_combine_index(plan, w) -> tuple[bool, str]:
    b, tile_q = plan.buffers, plan.info["config"]["tile_q"]
    ci = b["combine_index"].long()                               # [N, Hkv, topk]
    pad = w.pages.permute(1, 0, 2) < 0
    if not torch.equal(ci < 0, pad) or (ci[pad] != -1).any():
        return False, "combine_index padding does not match the selection's -1 entries"
    h, q, r, key = _edges(w)
    idx = ci[q, h, r]
    tile, slot = idx // tile_q, idx % tile_q
    if (b["tile_key"].long()[tile] != key).any():
        return False, "combine_index points into a tile of another key"
    if (slot >= b["tile_count"].long()[tile]).any():
        return False, "combine_index points past its tile's query count"
    if (b["csr_query"].long()[b["tile_edge"].long()[tile] + slot] != q).any():
        return False, "combine_index points at another query's row"
    return True, f"{idx.numel()} partials addressed"


def _compare_finite(got: torch.Tensor, ref: torch.Tensor, what: str) -> tuple[float, str | None]:
    """Relative error over finite reference entries; -inf entries must match exactly."""
    inf = torch.isinf(ref)
    if not torch.equal(torch.isinf(got) & (got < 0), inf):
        return math.inf, f"{what}: -inf entries differ from the reference"
    return relative_error(got[~inf], ref[~inf]), None


def check_partials(plan, w, rows, tol: float) -> tuple[bool, str]:
    """kv-outer partials (o_part, m_part, l_part) read back through combine_index vs the reference."""
    b, g = plan.buffers, w.shape.group
    rows = torch.as_tensor(rows, device=w.device).long()
    o_ref, m_ref, l_ref = reference_partials(w, rows)              # [n, Hkv, topk, G(, D)]
    ci = b["combine_index"][rows].long()                          # [n, Hkv, topk]
    valid = ci >= 0
    prow = (ci[valid].unsqueeze(-1) * g + torch.arange(g, device=w.device))   # [edges, G]
    errs = []
    for got, ref, what in ((b["o_part"][prow], o_ref[valid], "o_part"), (b["m_part"][prow], m_ref[valid], "m_part"),
                           (b["l_part"][prow], l_ref[valid], "l_part")):
        err, bad = _compare_finite(got.double(), ref, what)
        if bad:
            return False, bad
        errs.append(err)
    err = max(errs)
    return err <= tol, f"rel err o {errs[0]:.2e}, m {errs[1]:.2e}, l {errs[2]:.2e} on {int(valid.sum())} partials (tol {tol:g})"


def check_slots(plan, w, rows, tol: float) -> tuple[bool, str]:
    """msa-scatter slot partials (o_slot = O / l, lse_slot = m + log l) vs the reference."""
    b = plan.buffers
    s = w.shape
    rows = torch.as_tensor(rows, device=w.device).long()
    o_ref, m_ref, l_ref = reference_partials(w, rows)
    pages = w.pages[:, rows].permute(1, 0, 2)                     # [n, Hkv, topk]
    valid = pages >= 0
    slot = (valid.long().cumsum(-1) - 1)
    n_idx, h_idx, r_idx = valid.nonzero(as_tuple=True)
    sl = slot[n_idx, h_idx, r_idx]
    qi = rows[n_idx]
    heads = h_idx.unsqueeze(-1) * s.group + torch.arange(s.group, device=w.device)  # [edges, G]
    got_o = b["o_slot"][sl.unsqueeze(-1), qi.unsqueeze(-1), heads].double()
    got_lse = b["lse_slot"][sl.unsqueeze(-1), qi.unsqueeze(-1), heads].double()
    l = l_ref[n_idx, h_idx, r_idx]
    seen = l > 0
    ref_o = torch.where(seen.unsqueeze(-1), o_ref[n_idx, h_idx, r_idx] / torch.where(seen, l, 1).unsqueeze(-1), 0)
    ref_lse = torch.where(seen, m_ref[n_idx, h_idx, r_idx] + torch.log(torch.where(seen, l, 1)), -math.inf)
    err_o, bad = _compare_finite(got_o, ref_o, "o_slot")
    if bad:
        return False, bad
    err_l, bad = _compare_finite(got_lse, ref_lse, "lse_slot")
    if bad:
        return False, bad
    err = max(err_o, err_l)
    return err <= tol, f"rel err o_slot {err_o:.2e}, lse_slot {err_l:.2e} on {int(valid.sum())} partials (tol {tol:g})"


def stage_checks(plan, w, rows, tol: float) -> dict[str, tuple[bool, str]]:
    """All stage checks that apply to this plan, by stage name."""
    out = {"index_map": check_csr(plan, w), "schedule": check_schedule(plan, w)}
    if "combine_index" in plan.buffers:
        ok, msg = check_combine_index(plan, w)
        out["index_map"] = (out["index_map"][0] and ok, out["index_map"][1] + "; " + msg)
        out["attention"] = check_partials(plan, w, rows, tol)
    else:
        out["attention"] = check_slots(plan, w, rows, tol)
    return out
