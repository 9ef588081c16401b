"""Properties of the KV-outer index map, scheduler (every tile order) and combine index on random
selections: Hkv 1-4, N 1-40, top-k 1-6, 1-12 pages, 1-12 CTAs, 1-4 query ranges, 0-100% padding,
KV heads with no block at all.

The index map is held against a plain Python construction of the CSR; each closed-form schedule
against the sorted torch path (the scheduler's own oracle), buffer for buffer; and both against
properties no implementation shares: every tile placed once, the CTA ranges tiling the sequence, run
ends, and every combine-index entry pointing at the slot that holds its own (query, KV head, block).

Examples: the `ci` profile (default) draws 300, `slow` 2,000: HYPOTHESIS_PROFILE=slow python -m pytest
tests/test_kv_outer_properties.py, or pytest's --hypothesis-profile=slow.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import msa_bench.harness.measure.check  # noqa: F401  (sets TRITON_INTERPRET before triton is imported, on a CPU)
from msa_bench.kernels.kv_outer.index_map import IndexMap
from msa_bench.kernels.kv_outer.scheduler import Schedule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

BUFFERS = ("tile_key", "tile_edge", "tile_count", "tile_run_end", "cta_range", "combine_index")


@st.composite
def cases(draw):
    hkv, n, topk, num_pages = (draw(st.integers(lo, hi)) for lo, hi in ((1, 4), (1, 40), (1, 6), (1, 12)))
    pad = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]) | st.floats(0.0, 1.0))
    empty_heads = draw(st.sets(st.integers(0, hkv - 1), max_size=hkv))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    pages = torch.full((hkv, n, topk), -1, dtype=torch.int32)
    keep = (torch.rand(hkv, n, topk, generator=gen) >= pad).sum(-1).clamp(max=num_pages)   # valid entries
    for h in range(hkv):
        if h in empty_heads:
            continue
        for q in range(n):
            k = int(keep[h, q])
            pages[h, q, :k] = torch.randperm(num_pages, generator=gen)[:k].to(torch.int32)
    s = draw(st.integers(1, 4))
    deal = draw(st.sampled_from(["none", "chunks", "phases"]))
    order = (s, draw(st.integers(1, 5)) if deal == "chunks" else 0, deal == "phases")
    return dict(pages=pages, num_pages=num_pages, tile_q=draw(st.integers(1, 4)), num_ctas=draw(st.integers(1, 12)),
                order=order)


def csr_oracle(pages: torch.Tensor, num_pages: int, tile_q: int):
    """CSR pointers, per-key query lists, tile pointers and the combine index, built edge by edge."""
    hkv, n, topk = pages.shape
    lists = [[] for _ in range(hkv * num_pages)]
    for h in range(hkv):
        for q in range(n):
            for r in range(topk):
                page = int(pages[h, q, r])
                if page >= 0:
                    lists[h * num_pages + page].append((q, r))
    csr_ptr, tile_ptr, csr_query = [0], [0], []
    combine = torch.full((n, hkv, topk), -1, dtype=torch.int32)
    for key, edges in enumerate(lists):
        h = key // num_pages
        for pos, (q, r) in enumerate(edges):
            combine[q, h, r] = tile_ptr[-1] * tile_q + pos
            csr_query.append(q)
        csr_ptr.append(csr_ptr[-1] + len(edges))
        tile_ptr.append(tile_ptr[-1] + -(-len(edges) // tile_q))
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32)
    return as_tensor(csr_ptr), as_tensor(csr_query), as_tensor(tile_ptr), combine


def check_index_map(m: IndexMap, c: dict) -> None:
    csr_ptr, csr_query, tile_ptr, combine = csr_oracle(c["pages"], c["num_pages"], c["tile_q"])
    assert torch.equal(m.csr_ptr.cpu(), csr_ptr)
    assert torch.equal(m.csr_query[:csr_query.numel()].cpu(), csr_query)
    assert torch.equal(m.tile_ptr.cpu(), tile_ptr)
    assert torch.equal(m.combine_index.cpu(), combine)


def check_schedule(sched: Schedule, m: IndexMap, c: dict) -> None:
    """What any tile order must satisfy, whatever code laid it out."""
    pages, tile_q = c["pages"], c["tile_q"]
    key, edge, count = (getattr(sched, b).cpu().long() for b in ("tile_key", "tile_edge", "tile_count"))
    csr_ptr, csr_query = m.csr_ptr.cpu().long(), m.csr_query.cpu().long()
    total = int(m.tile_ptr[-1])
    # every index-map tile placed exactly once, padding after them
    placed = sorted(zip(key[:total].tolist(), edge[:total].tolist()))
    want = sorted((k, int(csr_ptr[k]) + i * tile_q) for k in range(csr_ptr.numel() - 1)
                  for i in range(int(m.tile_ptr[k + 1] - m.tile_ptr[k])))
    assert placed == want
    assert bool((key[total:] == -1).all())
    for p in range(total):
        k = int(key[p])
        assert int(count[p]) == min(tile_q, int(csr_ptr[k + 1]) - int(edge[p]))
    # the CTA ranges tile [0, total) in order
    rng = sched.cta_range.cpu().long()
    assert int(rng[0, 0]) == 0 and int(rng[-1, 1]) == total
    assert bool((rng[1:, 0] == rng[:-1, 1]).all()) and bool((rng[:, 1] >= rng[:, 0]).all())
    # run ends: the first later position holding another key
    ends = sched.tile_run_end.cpu().long().tolist()
    k = key.tolist()
    for p in range(len(k)):
        q = p + 1
        while q < len(k) and k[q] == k[p]:
            q += 1
        assert ends[p] == q
    # every combine-index entry points at the slot of its own (query, KV head, block)
    hkv, n, topk = pages.shape
    ci = sched.combine_index.cpu().long()
    for h in range(hkv):
        for q in range(n):
            for r in range(topk):
                page, at = int(pages[h, q, r]), int(ci[q, h, r])
                if page < 0:
                    assert at == -1
                    continue
                p, slot = divmod(at, tile_q)
                assert int(key[p]) == h * c["num_pages"] + page and slot < int(count[p])
                assert int(csr_query[int(edge[p]) + slot]) == q


@pytest.mark.slow
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_index_map_schedule_and_combine_index(c):
    pages = c["pages"].to(DEVICE)
    m = IndexMap(pages, c["num_pages"], c["tile_q"])
    m()
    check_index_map(m, c)
    fast, general = Schedule(m, c["num_ctas"], *c["order"]), Schedule(m, c["num_ctas"], *c["order"])
    general.closed_form = False
    fast()
    general()
    for name in BUFFERS:
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    check_schedule(fast, m, c)
