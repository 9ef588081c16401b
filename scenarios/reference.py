"""Float64 oracle for top-k block-sparse attention, independent of any schedule.

It reads the selection directly: per query and KV head, gather the selected blocks, mask keys past
the query's limit, softmax, weighted sum. `reference_partials` gives the per-block split (raw
unnormalized O, row max m, row sum l, in natural-log units of the scaled score) and
`combine_partials` merges them by log-sum-exp, so a backend can be checked stage by stage.

Memory follows the rows checked, never the cache: rows go in chunks, and a chunk upcasts only the
K/V blocks its rows select (gathered in the data dtype first), so a chunk's working set stays under
CHUNK_BYTES whatever the context. Dequantizing after the gather is elementwise, so the values are
those of upcasting the whole cache.
"""
from __future__ import annotations

import torch

from .workload import AttnShape, Workload

CHUNK_ROWS = 16                 # rows per chunk at most
CHUNK_BYTES = 1 << 30           # a chunk's working set in the compute dtype at most (fewer rows when needed)


def _rows(w: Workload, rows) -> torch.Tensor:
    if rows is None:
        return torch.arange(w.n_tokens, device=w.device)
    return torch.as_tensor(rows, device=w.device).long()


def row_bytes(shape: AttnShape, itemsize: int = 8) -> int:
    """Working set of one row: its gathered K and V, scores (with their masked and exp copies),
    partial O and Q, in a dtype of `itemsize` bytes."""
    s = shape
    elems = (2 * s.hkv * s.topk * s.block * s.head_dim + 3 * s.hq * s.topk * s.block
             + s.hq * s.topk * s.head_dim + s.hq * s.head_dim)
    return itemsize * elems


def chunk_rows(shape: AttnShape, limit: int = CHUNK_ROWS, itemsize: int = 8) -> int:
    """Rows per chunk: `limit`, fewer when that many rows would exceed CHUNK_BYTES (at least one)."""
    return max(1, min(limit, CHUNK_BYTES // row_bytes(shape, itemsize)))


def _gather(cache: torch.Tensor, pages: torch.Tensor, heads: torch.Tensor, scale: float, dtype) -> torch.Tensor:
    """cache[pages, heads] as `dtype` times `scale`; one-byte (fp8) caches are indexed as bytes."""
    if cache.element_size() == 1 and cache.dtype != torch.uint8:
        picked = cache.view(torch.uint8)[pages, heads].view(cache.dtype)
    else:
        picked = cache[pages, heads]
    return picked.to(dtype) * scale


def _partial_chunks(w: Workload, rows, chunk: int, dtype):
    """(o, m, l) of reference_partials, one chunk of rows at a time."""
    s = w.shape
    rows = _rows(w, rows)
    chunk = chunk_rows(s, chunk, torch.empty((), dtype=dtype).element_size())
    pos = torch.arange(s.block, device=w.device)
    for start in range(0, len(rows), chunk):
        r = rows[start:start + chunk]
        pages = w.pages[:, r, :].permute(1, 0, 2).long()                  # [n, Hkv, topk]
        valid = pages >= 0
        pg = pages.clamp(min=0)
        heads = torch.arange(s.hkv, device=w.device).view(1, -1, 1).expand_as(pg)
        kb = _gather(w.k_cache, pg, heads, w.k_scale, dtype)               # [n, Hkv, topk, block, D]
        vb = _gather(w.v_cache, pg, heads, w.v_scale, dtype)
        qg = (w.q[r].to(dtype) * w.q_scale).view(len(r), s.hkv, s.group, s.head_dim)  # [n, Hkv, G, D]
        scores = torch.einsum("nhgd,nhktd->nhkgt", qg, kb) * w.sm_scale    # [n, Hkv, topk, G, block]
        key_pos = w.page_block[pg].long().unsqueeze(-1) * s.block + pos    # [n, Hkv, topk, block]
        visible = (key_pos <= w.q_limit[r].long().view(-1, 1, 1, 1)) & valid.unsqueeze(-1)
        scores = scores.masked_fill(~visible.unsqueeze(3), float("-inf"))
        m = scores.amax(dim=-1)                                            # [n, Hkv, topk, G]
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m_safe.unsqueeze(-1))
        yield torch.einsum("nhkgt,nhktd->nhkgd", p, vb), m, p.sum(-1)


def reference_partials(w: Workload, rows=None, chunk: int = CHUNK_ROWS, dtype=torch.float64):
    """Per selected block partials for the given query rows, `chunk` rows at a time at most.

    Returns o [n, Hkv, topk, G, D] (raw, unnormalized), m and l [n, Hkv, topk, G]; padded ranks
    and fully masked blocks have o = 0, l = 0, m = -inf.
    """
    outs, ms, ls = [], [], []
    for o, m, l in _partial_chunks(w, rows, chunk, dtype):
        outs.append(o)
        ms.append(m)
        ls.append(l)
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
    """Output [n, Hq, D] and LSE [n, Hq] for the given rows (all rows by default), in `dtype`; each
    chunk's partials are combined as they come, so only [n, Hq, D] outlives a chunk."""
    outs, lses = [], []
    for part in _partial_chunks(w, rows, CHUNK_ROWS, dtype):
        out, lse = combine_partials(*part)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or Inf anywhere counts as an infinite error."""
    out = out.to(torch.float64)
    ref = ref.to(out.device, torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)
