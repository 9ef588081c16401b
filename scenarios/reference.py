"""Float64 oracle for top-k block-sparse attention, independent of any schedule.

It reads the selection directly: per query and KV head, gather the selected blocks, mask keys past
the query's limit, softmax, weighted sum. `reference_partials` gives the per-block split (raw
unnormalized O, row max m, row sum l, in natural-log units of the scaled score) and
`combine_partials` merges them by log-sum-exp, so a backend can be checked stage by stage.
"""
from __future__ import annotations

import torch

from .workload import Workload


def _rows(w: Workload, rows) -> torch.Tensor:
    if rows is None:
        return torch.arange(w.n_tokens, device=w.device)
    return torch.as_tensor(rows, device=w.device).long()


def reference_partials(w: Workload, rows=None, chunk: int = 16, dtype=torch.float64):
    """Per selected block partials for the given query rows.

    Returns o [n, Hkv, topk, G, D] (raw, unnormalized), m and l [n, Hkv, topk, G]; padded ranks
    and fully masked blocks have o = 0, l = 0, m = -inf.
    """
    s = w.shape
    rows = _rows(w, rows)
    q, k, v = w.dequantized(dtype)
    pos = torch.arange(s.block, device=w.device)
    outs, ms, ls = [], [], []
    for start in range(0, len(rows), chunk):
        r = rows[start:start + chunk]
        pages = w.pages[:, r, :].permute(1, 0, 2).long()                  # [n, Hkv, topk]
        valid = pages >= 0
        pg = pages.clamp(min=0)
        heads = torch.arange(s.hkv, device=w.device).view(1, -1, 1).expand_as(pg)
        kb = k[pg, heads]                                                  # [n, Hkv, topk, block, D]
        vb = v[pg, heads]
        qg = q[r].view(len(r), s.hkv, s.group, s.head_dim)                 # [n, Hkv, G, D]
        scores = torch.einsum("nhgd,nhktd->nhkgt", qg, kb) * w.sm_scale    # [n, Hkv, topk, G, block]
        key_pos = w.page_block[pg].long().unsqueeze(-1) * s.block + pos    # [n, Hkv, topk, block]
        visible = (key_pos <= w.q_limit[r].long().view(-1, 1, 1, 1)) & valid.unsqueeze(-1)
        scores = scores.masked_fill(~visible.unsqueeze(3), float("-inf"))
        m = scores.amax(dim=-1)                                            # [n, Hkv, topk, G]
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m_safe.unsqueeze(-1))
        ls.append(p.sum(-1))
        ms.append(m)
        outs.append(torch.einsum("nhkgt,nhktd->nhkgd", p, vb))
    return torch.cat(outs), torch.cat(ms), torch.cat(ls)


def combine_partials(o: torch.Tensor, m: torch.Tensor, l: torch.Tensor):
    """Merge per-block partials by log-sum-exp. Returns out [n, Hq, D] and lse [n, Hq] (natural log)."""
    n, hkv, _, g, d = o.shape
    big_m = m.amax(dim=2, keepdim=True)                                   # [n, Hkv, 1, G]
    big_m = torch.where(torch.isfinite(big_m), big_m, torch.zeros_like(big_m))
    wgt = torch.exp(m - big_m)                                             # exp(-inf) = 0 for padding
    big_l = (l * wgt).sum(dim=2)                                           # [n, Hkv, G]
    acc = (o * wgt.unsqueeze(-1)).sum(dim=2)                               # [n, Hkv, G, D]
    safe_l = torch.where(big_l > 0, big_l, torch.ones_like(big_l))
    out = torch.where(big_l.unsqueeze(-1) > 0, acc / safe_l.unsqueeze(-1), torch.zeros_like(acc))
    lse = torch.where(big_l > 0, big_m.squeeze(2) + torch.log(safe_l), torch.full_like(big_l, float("-inf")))
    return out.reshape(n, hkv * g, d), lse.reshape(n, hkv * g)


def reference_attention(w: Workload, rows=None, dtype=torch.float64):
    """Output [n, Hq, D] and LSE [n, Hq] for the given rows (all rows by default), in `dtype`."""
    return combine_partials(*reference_partials(w, rows, dtype=dtype))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or Inf anywhere counts as an infinite error."""
    out = out.to(torch.float64)
    ref = ref.to(out.device, torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)
