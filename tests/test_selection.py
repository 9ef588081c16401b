"""Selection generators: the contract (valid prefix, -1 padding, distinct ids, local block last, causal
bounds), achieved reuse, determinism; real-prefill case construction; the indexer's selection."""
import math
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from msa_bench.errors import UserError
from msa_bench.scenarios.indexer import indexer_workload
from msa_bench.scenarios.prefill_cases import (PrefillCase, benchmark_selection, get_case, load_cases,
                                             prefill_selection, prefill_workload, representative_cases)
from msa_bench.scenarios.selection import (check_selection, distinct_picks, synthetic_selection,
                                         synthetic_workload)
from msa_bench.scenarios.stats import selected_pairs, useful_flops, workload_stats
from msa_bench.scenarios.workload import AttnShape, WorkloadError


def assert_contract(sel: torch.Tensor, q_limit: torch.Tensor, block: int, causal: bool):
    """An independent, loop-free restatement of the contract (not via check_selection)."""
    hkv, n, topk = sel.shape
    valid = sel >= 0
    count = valid.sum(-1)
    ranks = torch.arange(topk)
    assert torch.equal(valid, ranks < count.unsqueeze(-1)), "valid entries must form a prefix"
    assert bool((sel[~valid] == -1).all()), "padding must be -1"
    for h in range(hkv):
        for q in range(n):
            ids = sel[h, q, :count[h, q]].tolist()
            assert len(set(ids)) == len(ids), "ids must be distinct per (head, query)"
            assert all(b * block <= int(q_limit[q]) for b in ids), "a block starts past the query's limit"
            if causal:
                assert ids and ids[-1] == int(q_limit[q]) // block, "local block must be last"
                assert all(b < ids[-1] for b in ids[:-1]), "history must precede the local block"


def distinct_pairs(sel: torch.Tensor) -> int:
    head = torch.arange(sel.shape[0]).view(-1, 1, 1).expand_as(sel)
    valid = sel >= 0
    return torch.unique(head[valid].long() * 10**7 + sel[valid].long()).numel()


@st.composite
def synthetic_case(draw):
    hkv = draw(st.sampled_from([1, 2, 4]))
    shape = AttnShape(hq=hkv * draw(st.sampled_from([1, 2])), hkv=hkv, head_dim=8,
                      block=draw(st.sampled_from([4, 8, 16])), topk=draw(st.integers(2, 6)))
    causal = draw(st.booleans())
    tokens = draw(st.integers(1, 80))
    context = tokens + draw(st.integers(0, 600)) if causal else draw(st.integers(1, 700))
    b, k = shape.block, shape.topk
    if causal:
        n_local = (context - 1) // b - (context - tokens) // b + 1
        lo, hi = hkv * (n_local + k - 1), hkv * (n_local + min((context - tokens) // b, tokens * (k - 1)))
    else:
        lo, hi = hkv * k, hkv * min(math.ceil(context / b), tokens * k)
    nsb = draw(st.integers(lo, max(lo, hi)))
    return dict(shape=shape, tokens=tokens, context=context, reuse=nsb / tokens, feasible=lo <= hi,
                skew=draw(st.sampled_from([0.0, 0.5, 1.5])), causal=causal, seed=draw(st.integers(0, 2**31)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(synthetic_case())
def test_synthetic_contract_reuse_and_determinism(c):
    args = (c["shape"], c["tokens"], c["context"], c["reuse"], c["skew"], c["causal"], c["seed"])
    if not c["feasible"]:
        with pytest.raises(WorkloadError):
            synthetic_selection(*args)
        return
    sel, q_limit = synthetic_selection(*args)
    assert sel.dtype == torch.int32 and sel.shape == (c["shape"].hkv, c["tokens"], c["shape"].topk)
    assert_contract(sel, q_limit, c["shape"].block, c["causal"])
    check_selection(sel, q_limit, c["shape"].block, c["causal"])
    if c["causal"]:
        assert torch.equal(q_limit, torch.arange(c["context"] - c["tokens"], c["context"], dtype=torch.int32))
        assert bool((sel >= 0).all()), "causal synthetic queries keep a full top-k"
    else:
        assert bool((q_limit == c["context"] - 1).all())
    achieved = distinct_pairs(sel) / c["tokens"]
    assert abs(achieved - c["reuse"]) <= 0.05 * c["reuse"]
    again, _ = synthetic_selection(*args)
    assert torch.equal(sel, again)


def test_synthetic_seed_changes_selection():
    shape = AttnShape()
    a, _ = synthetic_selection(shape, 1024, 65536, 0.25, seed=1)
    b, _ = synthetic_selection(shape, 1024, 65536, 0.25, seed=2)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("tokens, context, reuse, causal, why", [
    (1024, 65536, 0.01, False, "feasible reuse"),      # pool smaller than top-k
    (1024, 65536, 3.0, False, "feasible reuse"),       # pool larger than the 512 context blocks
    (4096, 8192, 0.5, True, "feasible reuse"),         # history pool larger than the prefix
    (4096, 2048, 0.5, True, "must hold"),              # causal chunk longer than the context
    (1024, 65536, -1.0, False, "positive"),
])
def test_infeasible_targets_are_refused_in_one_line(tokens, context, reuse, causal, why):
    with pytest.raises(WorkloadError) as exc:
        synthetic_selection(AttnShape(), tokens, context, reuse, causal=causal)
    assert why in str(exc.value) and "\n" not in str(exc.value)
    assert isinstance(exc.value, UserError)


def test_skew_concentrates_fan_in_but_keeps_nsb():
    shape = AttnShape()
    flat = synthetic_workload(shape, "bf16", 2048, 65536, 0.5, skew=0.0, with_tensors=False)
    zipf = synthetic_workload(shape, "bf16", 2048, 65536, 0.5, skew=1.5, with_tensors=False)
    s0, s1 = workload_stats(flat), workload_stats(zipf)
    assert s0["nsb"] == s1["nsb"] == 1024
    assert s1["fanin_max"] > 4 * s0["fanin_max"]
    assert s1["fanin_p50"] < s0["fanin_p50"]


def test_distinct_picks_covers_pool_and_never_repeats():
    gen = torch.Generator().manual_seed(0)
    for rows, picks, pool, skew in [(50, 4, 4, 0.0), (50, 4, 200, 0.0), (300, 6, 20, 1.5), (10, 3, 30, 1.0)]:
        v = distinct_picks(gen, rows, picks, pool, skew)
        assert v.shape == (rows, picks)
        assert (v.sort(1).values[:, 1:] != v.sort(1).values[:, :-1]).all()
        assert torch.unique(v).numel() == pool


def test_distinct_picks_follow_popularity_without_replacement():
    # inclusion frequencies of the non-coverage rows match torch's own sampling without replacement
    gen = torch.Generator().manual_seed(1)
    rows, picks, pool = 60000, 3, 10
    ours = distinct_picks(gen, rows, picks, pool, skew=1.0)[pool:]
    weights = torch.arange(1, pool + 1, dtype=torch.float64).pow(-1.0)
    ref = torch.multinomial(weights.expand(rows, pool), picks, replacement=False, generator=gen)
    freq = lambda v: torch.bincount(v.flatten(), minlength=pool).double() / v.numel()
    assert torch.allclose(freq(ours), freq(ref), atol=0.006)
    assert freq(ours)[0] > 2 * freq(ours)[-1]


def test_large_synthetic_is_fast_and_exact():
    shape = AttnShape()
    start = time.perf_counter()
    w = synthetic_workload(shape, "bf16", 32768, 1048576, 0.25, skew=1.0, causal=True, with_tensors=False)
    elapsed = time.perf_counter() - start
    assert selected_pairs(w)[0].numel() == 8192
    assert elapsed < 30, f"generation took {elapsed:.1f} s"


def test_workload_pages_are_scattered_and_consistent():
    shape = AttnShape(hq=4, hkv=2, head_dim=8, block=8, topk=3)
    w = synthetic_workload(shape, "fp32", 40, 400, 0.5, seed=3)
    table = w.page_table[0]
    assert sorted(table.tolist()) == list(range(w.num_pages)), "every physical page holds one logical block"
    assert not torch.equal(table, torch.arange(w.num_pages, dtype=table.dtype)), "pages must be scattered"
    valid = w.selection >= 0
    assert torch.equal(w.pages[valid], table[w.selection[valid].long()])
    assert torch.equal(w.page_block[table.long()], torch.arange(w.num_pages, dtype=torch.int32))
    assert w.q.shape == (40, 4, 8) and w.q.dtype == torch.float32 and w.q.abs().sum() > 0


def test_contract_checker_rejects_each_violation():
    q_limit = torch.tensor([63, 63])
    good = torch.tensor([[[0, 5, 7, -1], [1, 2, 7, -1]]], dtype=torch.int32)
    check_selection(good, q_limit, 8, causal=True)
    bad = {
        "after -1 padding": [[[0, -1, 7, -1], [1, 2, 7, -1]]],
        "repeats": [[[5, 5, 7, -1], [1, 2, 7, -1]]],
        "starts after": [[[0, 5, 8, -1], [1, 2, 7, -1]]],
        "local block": [[[0, 7, 5, -1], [1, 2, 7, -1]]],
        "below -1": [[[0, 5, 7, -2], [1, 2, 7, -1]]],
    }
    for why, value in bad.items():
        with pytest.raises(WorkloadError, match=why):
            check_selection(torch.tensor(value, dtype=torch.int32), q_limit, 8, causal=True)


# ---- real prefill ------------------------------------------------------------------------------

def test_shipped_cases_match_the_benchmark_selection():
    cases = load_cases()
    entries = {e["case_id"]: e for e in benchmark_selection()}
    assert len(entries) == 128 and len(cases) == 55
    assert sum(e.get("representative_weight") or 0 for e in entries.values()) == 14805
    for c in cases.values():
        e = entries[c.case_id]
        assert c.batch_size == e["batch_size"] == 1
        assert (c.total_q, c.max_final_kv) == (e["total_q"], e["max_final_kv"])
        assert c.representative_weight == e.get("representative_weight")
        # the upstream useful-FLOPs convention: complete history pages before the local one
        pages = sum((p + i) // 128 for p, q in zip(c.prefix_lens, c.query_lens) for i in range(q))
        assert e["useful_flops"] == 2 * 128 * 128 * pages
    reps = representative_cases()
    assert len(reps) == 16 and sum(c.weight for c in reps) == 10434


def test_unshipped_and_unknown_cases_are_user_errors():
    with pytest.raises(UserError, match="not shipped"):
        get_case("prefill_632b631504ef33240a42")
    with pytest.raises(UserError, match="unknown prefill case"):
        get_case("prefill_000")


def _check_prefill(case: PrefillCase, shape: AttnShape):
    sel, q_request, q_limit = prefill_selection(case, shape)
    assert_contract(sel, q_limit, shape.block, causal=True)
    local = q_limit.long() // shape.block
    count = (sel >= 0).sum(-1)
    assert torch.equal(count, (local.clamp(max=shape.topk - 1) + 1).expand_as(count))
    starts = [0]
    for r, (p, q) in enumerate(zip(case.prefix_lens, case.query_lens)):
        rows = slice(starts[-1], starts[-1] + q)
        assert bool((q_request[rows] == r).all())
        assert torch.equal(q_limit[rows], torch.arange(p, p + q, dtype=torch.int32))
        starts.append(starts[-1] + q)
    # history spread over [0, local): sorted gaps of at least local // count - 1 blocks
    for h in range(shape.hkv):
        for n in range(0, case.total_q, max(1, case.total_q // 7)):
            hist = sorted(sel[h, n, :int(count[h, n]) - 1].tolist())
            if len(hist) >= 2:
                gaps = [b - a for a, b in zip(hist, hist[1:])]
                assert min(gaps) >= max(1, int(local[n]) // len(hist) - 1)
    again = prefill_selection(case, shape)
    assert all(torch.equal(a, b) for a, b in zip((sel, q_request, q_limit), again))
    return sel


@pytest.mark.parametrize("case_id", ["prefill_71ca49d3833621538e26", "prefill_3bae7083e0b65d7d2c2f",
                                     "prefill_41494d6ae94ebcee6d3c", "prefill_4469427d069d9467c4ec"])
def test_real_prefill_cases(case_id):
    case = get_case(case_id)
    sel = _check_prefill(case, AttnShape())
    w = prefill_workload(case, AttnShape(), "bf16", with_tensors=False)
    assert w.n_tokens == case.total_q and w.causal and w.meta["weight"] == case.weight
    assert workload_stats(w)["case_id"] == case_id
    assert torch.equal(w.selection, sel)


def test_multi_request_prefill_builds_disjoint_page_tables():
    shape = AttnShape(hq=4, hkv=2, head_dim=8, block=16, topk=5)
    case = PrefillCase("test_multi", query_lens=(20, 7, 33), prefix_lens=(0, 96, 160))
    sel = _check_prefill(case, shape)
    w = prefill_workload(case, shape, "fp32", with_tensors=False)
    table = w.page_table
    used = table[table >= 0]
    assert sorted(used.tolist()) == list(range(w.num_pages))
    assert [int((row >= 0).sum()) for row in table] == [2, 7, 13]
    valid = sel >= 0
    req = w.q_request.long().view(1, -1, 1).expand_as(sel)
    assert torch.equal(w.pages[valid], table[req[valid], sel[valid].long()])
    check_selection(w.selection, w.q_limit, shape.block, True, (table >= 0).sum(1), w.q_request)
    # a query at position p sees p + 1 - block * local tokens of its local block
    assert useful_flops(w) == 4 * shape.group * shape.head_dim * sum(
        min(shape.block, max(0, int(w.q_limit[n]) - b * shape.block + 1))
        for h in range(shape.hkv) for n in range(w.n_tokens) for b in w.selection[h, n].tolist() if b >= 0)


def test_large_real_prefill_case_is_vectorized():
    start = time.perf_counter()
    sel, _, _ = prefill_selection(get_case("prefill_26ab2fa007cb0d636c1c"), AttnShape())   # 16121 q x 337K kv
    assert sel.shape == (4, 16121, 16) and time.perf_counter() - start < 10


# ---- indexer -----------------------------------------------------------------------------------

def _scores(w, h, n):
    s = w.shape
    q, k, _ = w.dequantized(torch.float64)
    probe = q[n, h * s.group:(h + 1) * s.group].mean(0)
    kv_len = int(w.q_limit.max()) + 1 if not w.causal else int(w.q_limit.max()) + 1
    blocks = int((w.page_table[0] >= 0).sum())
    out = []
    for b in range(blocks):
        keys = k[w.page_table[0, b], h][: max(0, min(s.block, kv_len - b * s.block))]
        out.append(float(probe @ keys.mean(0)))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("causal", [False, True])
def test_indexer_selects_top_k_by_pooled_key_score(causal):
    shape = AttnShape(hq=4, hkv=2, head_dim=16, block=8, topk=4)
    w = indexer_workload(shape, "fp32", 24, 200, causal=causal, seed=5)
    assert_contract(w.selection, w.q_limit, shape.block, causal)
    for h in range(shape.hkv):
        for n in range(0, w.n_tokens, 5):
            sc = _scores(w, h, n)
            sel = [b for b in w.selection[h, n].tolist() if b >= 0]
            if causal:
                local = int(w.q_limit[n]) // shape.block
                assert sel[-1] == local
                sel, eligible = sel[:-1], list(range(local))
            else:
                eligible = list(range(len(sc)))
            assert len(sel) == min(len(eligible), shape.topk - causal)
            others = [b for b in eligible if b not in sel]
            if sel and others:
                assert min(sc[sel]) >= max(sc[others]) - 1e-4


def test_indexer_reuse_comes_from_the_data():
    shape = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)
    plain = indexer_workload(shape, "fp32", 256, 4096, seed=1, strength=0.0)
    topical = indexer_workload(shape, "fp32", 256, 4096, seed=1, strength=1.0)
    assert workload_stats(topical)["nsb"] < 0.6 * workload_stats(plain)["nsb"]
