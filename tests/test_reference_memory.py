"""The float64 check's memory follows the rows it checks, not the cache: the oracle (scenarios/reference.py),
the sweep's compare_output and dense-masked's plan-time row check never upcast a whole K/V cache, and the
oracle's values are bitwise those of upcasting the whole cache first."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from msa_bench.harness.measure.check import compare_output, edge_case_workload, poison, sample_rows
from msa_bench.kernels.base import get_backend
from msa_bench.scenarios import reference
from msa_bench.scenarios.coselection import coselected_workload
from msa_bench.scenarios.indexer import indexer_workload
from msa_bench.scenarios.prefill_cases import PrefillCase, prefill_workload
from msa_bench.scenarios.reference import (CHUNK_BYTES, CHUNK_ROWS, chunk_rows, combine_partials,
                                           reference_attention, reference_partials, row_bytes)
from msa_bench.scenarios.selection import synthetic_workload
from msa_bench.scenarios.serving import serving_workload
from msa_bench.scenarios.workload import AttnShape

TINY = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)


class Float64Peak(TorchDispatchMode):
    """The largest float64 storage any op creates while active, in bytes."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.peak = max(self.peak, t.untyped_storage().nbytes())
        return out


def whole_cache_partials(w, rows=None, chunk=16, dtype=torch.float64):
    """The oracle as it was: the whole cache upcast first, then the same per-chunk gather."""
    s = w.shape
    rows = torch.arange(w.n_tokens) if rows is None else torch.as_tensor(rows).long()
    q, k, v = w.dequantized(dtype)
    pos = torch.arange(s.block)
    outs, ms, ls = [], [], []
    for start in range(0, len(rows), chunk):
        r = rows[start:start + chunk]
        pages = w.pages[:, r, :].permute(1, 0, 2).long()
        valid = pages >= 0
        pg = pages.clamp(min=0)
        heads = torch.arange(s.hkv).view(1, -1, 1).expand_as(pg)
        kb, vb = k[pg, heads], v[pg, heads]
        qg = q[r].view(len(r), s.hkv, s.group, s.head_dim)
        scores = torch.einsum("nhgd,nhktd->nhkgt", qg, kb) * w.sm_scale
        key_pos = w.page_block[pg].long().unsqueeze(-1) * s.block + pos
        visible = (key_pos <= w.q_limit[r].long().view(-1, 1, 1, 1)) & valid.unsqueeze(-1)
        scores = scores.masked_fill(~visible.unsqueeze(3), float("-inf"))
        m = scores.amax(dim=-1)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m_safe.unsqueeze(-1))
        ls.append(p.sum(-1))
        ms.append(m)
        outs.append(torch.einsum("nhkgt,nhktd->nhkgd", p, vb))
    return torch.cat(outs), torch.cat(ms), torch.cat(ls)


def small_workloads():
    s = TINY
    return {
        "synthetic": lambda: synthetic_workload(s, "bf16", 48, 1024, 0.5),
        "synthetic-causal-fp8": lambda: synthetic_workload(s, "fp8", 48, 1024, 0.5, causal=True),
        "co-selection": lambda: coselected_workload(s, "bf16", 48, 1024, 1.0, 0.5),
        "indexer": lambda: indexer_workload(s, "bf16", 48, 1024, True),
        "real-prefill": lambda: prefill_workload(PrefillCase("tiny", (5, 30), (70, 200)), s, "fp32"),
        "decode": lambda: serving_workload(s, "bf16", "decode", None, context=600, context_min=100, requests=5,
                                           query_tokens=2, drift=0.2),
        "decode-fp8": lambda: serving_workload(s, "fp8", "decode", None, context=400, requests=3),
        "mixed": lambda: serving_workload(s, "bf16", "mixed", tokens=40, context=500, context_min=90, requests=6,
                                          chunks=2, drift=0.1),
        "drift": lambda: serving_workload(s, "fp8", "drift", tokens=64, context=512, drift=0.1),
        "edge-cases": lambda: edge_case_workload(s, "fp16", [300, 150, 40], [20, 9, 3], False, hot=0.2, pad=0.3,
                                                 empty=2),
    }


@pytest.mark.parametrize("name", list(small_workloads()))
def test_oracle_is_bitwise_the_whole_cache_oracle_on_every_generator(name):
    w = small_workloads()[name]()
    for rows in (None, torch.tensor([w.n_tokens - 1, 0, w.n_tokens // 2])):
        old = whole_cache_partials(w, rows)
        new = reference_partials(w, rows)
        assert all(torch.equal(a, b) for a, b in zip(old, new)), name
        old_out, old_lse = combine_partials(*old)
        out, lse = reference_attention(w, rows)
        assert torch.equal(out, old_out) and torch.equal(lse, old_lse), name


def test_float32_partials_are_those_of_the_whole_cache():
    w = serving_workload(TINY, "fp8", "mixed", tokens=24, context=300, requests=4, chunks=1)
    old = whole_cache_partials(w, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(old, reference_partials(w, dtype=torch.float32)))


def test_a_chunk_stays_under_its_budget_whatever_the_shape():
    full = AttnShape()
    assert chunk_rows(full) == CHUNK_ROWS                       # MiniMax-M3 rows: 16 per chunk, as before
    assert chunk_rows(full) * row_bytes(full) <= CHUNK_BYTES
    wide = AttnShape(hq=128, hkv=8, head_dim=256, block=256, topk=64)
    assert row_bytes(wide) > CHUNK_BYTES // CHUNK_ROWS          # so the budget, not the limit, sets the rows
    assert 1 <= chunk_rows(wide) < CHUNK_ROWS and chunk_rows(wide) * row_bytes(wide) <= CHUNK_BYTES


def test_fewer_rows_per_chunk_give_the_same_reference(monkeypatch):
    w = serving_workload(TINY, "bf16", "mixed", tokens=40, context=500, requests=6, chunks=2)
    want = reference_attention(w)
    monkeypatch.setattr(reference, "CHUNK_BYTES", 3 * row_bytes(TINY))
    assert chunk_rows(TINY) == 3
    with Float64Peak() as peak:
        got = reference_attention(w)
    assert peak.peak <= 3 * row_bytes(TINY)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-13) for a, b in zip(got, want))


# ---- a cache far bigger than what the checked rows touch --------------------------------------------

@pytest.fixture(scope="module")
def long_decode():
    """4 decode requests of 64K tokens, 2 rows each: under 1 MiB of K/V touched, 256 MiB of cache in float64."""
    return serving_workload(TINY, "bf16", "decode", None, context=65536, requests=4, query_tokens=2)


def _cache_float64_bytes(w) -> int:
    return w.k_cache.numel() * 8


def test_oracle_upcasts_only_the_blocks_its_rows_select(long_decode):
    w = long_decode
    with Float64Peak() as peak:
        out, _ = reference_attention(w)
    assert out.shape[0] == w.n_tokens
    assert peak.peak <= min(w.n_tokens, CHUNK_ROWS) * row_bytes(TINY)
    assert peak.peak * 100 < _cache_float64_bytes(w)


def test_compare_output_allocates_far_less_than_the_cache(long_decode):
    w = long_decode
    plan = get_backend("reference").plan(w)
    poison(plan)
    plan.run()
    with Float64Peak() as peak:
        err, tol, details = compare_output(plan, w, sample_rows(w.n_tokens, 5), "reference")
    assert err <= tol and details["rows"] == 5
    assert peak.peak * 100 < _cache_float64_bytes(w)


def test_dense_masked_plan_check_allocates_far_less_than_the_cache(long_decode):
    w = long_decode
    with Float64Peak() as peak:
        plan = get_backend("dense-masked").plan(w)
    assert any(t.endswith(" ms") for t in plan.info["tried"])       # its row check passed
    assert peak.peak * 100 < _cache_float64_bytes(w)
