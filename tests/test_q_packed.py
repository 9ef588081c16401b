"""q-packed: the token tiles, the GPU-stage unions and limits against a plain oracle, and the module output
against the float64 reference (CPU interpreter for fp32/fp16/fp8; bf16 and graph replay on a GPU)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from msa_bench.harness.measure.check import edge_case_workload, tolerance  # sets TRITON_INTERPRET first
from msa_bench.kernels.base import get_backend
from msa_bench.kernels.q_packed.schedule import NO_KEY, PackedSchedule, token_tiles
from msa_bench.scenarios.workload import AttnShape

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = AttnShape(hq=8, hkv=2, head_dim=32, block=32 if DEVICE == "cuda" else 16, topk=4)
CASES = {   # name: (kv_lens, tokens per request, causal, hot, pad, empty)
    "random-padded-2req": ([200, 120], [21, 16], False, 0.0, 0.4, 2),
    "causal-3req-unaligned": ([300, 77, 150], [29, 11, 40], True, 0.0, 0.2, 0),
    "skewed-hot-block": ([256], [40], False, 0.9, 0.0, 0),
}


def workload(case: str, dtype: str, shape=SHAPE, seed=0):
    kv_lens, tokens, causal, hot, pad, empty = CASES[case]
    return edge_case_workload(shape, dtype, kv_lens, tokens, causal, hot, pad, empty, seed=seed, device=DEVICE)


def test_token_tiles_follow_positions_and_requests():
    # request 0: positions 5..20 (causal), request 1: positions 0..9
    q_request = torch.tensor([0] * 16 + [1] * 10)
    q_limit = torch.cat([torch.arange(5, 21), torch.arange(0, 10)])
    tok0, ntok = token_tiles(q_request, q_limit, 8, causal=True)
    assert tok0.tolist() == [0, 3, 11, 16, 24]           # windows [5,8) [8,16) [16,21) | [0,8) [8,10)
    assert ntok.tolist() == [3, 8, 5, 8, 2]
    tok0, ntok = token_tiles(q_request, q_limit, 8, causal=False)
    assert tok0.tolist() == [0, 8, 16, 24] and ntok.tolist() == [8, 8, 8, 2]


def oracle(w, P):
    """Per (head, tile): the union (blocks only the first P // 2 tokens select, then those both halves do,
    then the second half's own, each ascending; 12-token tiles by the (first, last) third of the tokens
    that select a block), its pages, each token's limit per union block, and the groups' ranges (lo_end,
    hi_start; thirds (e0, s1, e1, s2)), by Python loops."""
    tok0, ntok = token_tiles(w.q_request, w.q_limit, P, w.causal)
    sel, lim, table, req = w.selection.cpu(), w.q_limit.cpu(), w.page_table.cpu(), w.q_request.cpu()
    out = []
    for h in range(w.shape.hkv):
        for t0, n in zip(tok0.tolist(), ntok.tolist()):
            toks = range(t0, t0 + n)
            halves = {}
            for k, q in enumerate(toks):
                for b in sel[h, q].tolist():
                    if b >= 0:
                        halves.setdefault(b, set()).add(k >= P // 2)
            cls = {b: 1 if len(hs) == 2 else (2 if True in hs else 0) for b, hs in halves.items()}
            if P == 12:
                thirds = {}
                for k, q in enumerate(toks):
                    for b in sel[h, q].tolist():
                        if b >= 0:
                            thirds.setdefault(b, set()).add(k // 4)
                order = [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2)]
                cls = {b: order.index((min(g), max(g))) for b, g in thirds.items()}
            union = sorted(cls, key=lambda b: (cls[b], b))
            limits = [[(min(int(lim[q]) - b * w.shape.block, w.shape.block - 1) if b in sel[h, q].tolist()
                        else NO_KEY) for q in toks] + [NO_KEY] * (P - n) for b in union]
            per = [sum(c == k for c in cls.values()) for k in range(6)]
            split = ((per[0] + per[1], per[0]) if P != 12 else
                     (sum(per[:3]), per[0], sum(per[:5]), per[0] + per[1]))
            out.append((union, [int(table[int(req[t0]), b]) for b in union], limits, split))
    return out


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), P=st.sampled_from([1, 8, 12, 16]), causal=st.booleans(),
       pad=st.sampled_from([0.0, 0.5]), hot=st.sampled_from([0.0, 0.8]),
       reqs=st.lists(st.tuples(st.integers(20, 140), st.integers(1, 19)), min_size=1, max_size=3))
def test_schedule_matches_oracle(seed, P, causal, pad, hot, reqs):
    shape = AttnShape(hq=4, hkv=2, head_dim=16, block=16, topk=4)
    kv_lens = [max(kv, n) for kv, n in reqs]
    w = edge_case_workload(shape, "fp32", kv_lens, [n for _, n in reqs], causal, hot, pad, seed=seed)
    assert_schedule_matches_oracle(w, P)


@pytest.mark.parametrize("P", [1, 8, 12])
def test_one_token_tiles_match_oracle(P):
    # decode tokens (one a request, the schedule's one-token path) beside a causal chunk (the general one)
    shape = AttnShape(hq=4, hkv=2, head_dim=16, block=16, topk=4)
    w = edge_case_workload(shape, "fp32", [90, 40, 130, 64], [1, 1, 13, 1], True, 0.0, 0.4, seed=3)
    assert_schedule_matches_oracle(w, P)


def assert_schedule_matches_oracle(w, P):
    sch = PackedSchedule(w, P)
    sch.tile_page.fill_(123)
    sch.tile_count.fill_(77)
    sch.tile_split.fill_(55)
    sch.tile_limit.fill_(99)
    sch()
    U = sch.union_cap
    limit = sch.tile_limit.view(-1, U, P)
    for i, (union, pages, limits, split) in enumerate(oracle(w, P)):
        c = len(union)
        assert int(sch.tile_count[i]) == c and tuple(sch.tile_split.view(-1, len(split))[i].tolist()) == split
        assert sch.tile_page[i, :c].tolist() == pages and (sch.tile_page[i, c:] == -1).all()
        assert limit[i, :c].tolist() == limits
        assert (limit[i, c:] == NO_KEY).all()




@pytest.mark.parametrize("case, dtype", [     # each case and each dtype in the default run; every pair in the slow one
    pytest.param(c, d, id=f"{c}-{d}", marks=() if (i - j) % len(CASES) == 0 else pytest.mark.slow)
    for i, c in enumerate(CASES) for j, d in enumerate(["fp32", "fp16", "fp8"])])
def test_output_matches_reference(case, dtype, poisoned_run, matches_reference):
    w = workload(case, dtype)
    plan = get_backend("q-packed").plan(w)
    poisoned_run(plan)
    matches_reference(plan, w, tolerance(dtype))


@pytest.mark.slow
def test_sixteen_token_tiles_and_union_ratio(poisoned_run, matches_reference):
    w = workload("causal-3req-unaligned", "fp32")
    plan = get_backend("q-packed@p16").plan(w)
    poisoned_run(plan)
    matches_reference(plan, w, tolerance("fp32"))
    assert plan.info["tile_tokens"] == 16 and plan.info["executed_union_ratio"] >= 1.0


@pytest.mark.slow
def test_plan_twice_is_bitwise_equal():
    w = workload("random-padded-2req", "fp16")
    a, b = get_backend("q-packed").plan(w), get_backend("q-packed").plan(w)
    a.run()
    b.run()
    b.run()
    assert torch.equal(a.output, b.output) and torch.equal(a.lse, b.lse)


def test_bad_option_is_one_line():
    for bad in ("p5", "p8+x2", "w8", "p16+s3"):
        with pytest.raises(KeyError, match="p8|p16"):
            get_backend(f"q-packed@{bad}")
    assert get_backend("q-packed@p16").tokens_per_tile == 16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cuda_bf16_fp8_and_graph_replay(dtype, graph_replay_equals_eager, poisoned_run, matches_reference):
    w = workload("causal-3req-unaligned", dtype)
    plan = get_backend("q-packed").plan(w)
    poisoned_run(plan)
    matches_reference(plan, w, tolerance(dtype))
    graph_replay_equals_eager(plan)
    assert math.isfinite(plan.output.float().abs().sum().item())


def test_critical_walk_is_the_mean_walk_where_groups_walk_alike_and_more_where_they_drift():
    """cute_backend.critical_ratio: each tile at its longest group walk. Tokens that select the same blocks
    (one group of 8 sharing all) walk alike; drifting neighbours walk different blocks, so the longest walk
    is above the mean and below the union."""
    from msa_bench.kernels.q_packed.cute_backend import critical_ratio
    from msa_bench.scenarios.coselection import coselected_workload
    from msa_bench.scenarios.serving import serving_workload
    shape = AttnShape(hq=16, hkv=1, head_dim=32, block=16, topk=4)
    alike = coselected_workload(shape, "fp32", 64, 2048, 0.25, 1.0, 8, seed=1, device="cpu", with_tensors=False)
    drift = serving_workload(shape, "fp32", "drift", 96, 2048, drift=0.3, seed=2, device="cpu", with_tensors=False)
    for w, P in ((alike, 8), (drift, 8), (drift, 12)):
        sch = PackedSchedule(w, P)
        sch()
        selected = float((w.selection >= 0).sum())
        slots = torch.stack(sch.group_slots())
        mean = float(slots.sum()) * 4 / selected
        assert critical_ratio(sch, selected) == pytest.approx(float(slots.max(0).values.sum()) * P / selected)
        union = float(sch.tile_count.double().sum()) * P / selected
        if w is alike:
            assert critical_ratio(sch, selected) == pytest.approx(mean)
        else:
            assert mean < critical_ratio(sch, selected) <= union


def test_cute_backends_model_takes_its_plans_critical_walk():
    """q-packed-cute's layout (the plan's own schedule, its walk, its critical walk) is what its roofline
    prices: the MMAs at the critical walk, over the fraction of the kernel the plan runs. `@p8` keeps the
    8-token tiles, so the layout needs no GPU to count SMs (the schedule runs in the interpreter)."""
    from msa_bench.kernels.q_packed.cute_backend import critical_ratio
    from msa_bench.roofline.predict import predict_module
    from msa_bench.scenarios.stats import ModelStats
    from msa_bench.roofline.devices import achieved, load_device
    from msa_bench.scenarios.serving import serving_workload
    shape = AttnShape(hq=16, hkv=1, head_dim=32, block=16, topk=4)
    w = serving_workload(shape, "bf16", "drift", 96, 2048, drift=0.3, seed=2, device="cpu", with_tensors=False)
    backend, dev = get_backend("q-packed-cute@p8"), load_device("h200")
    schedule, walked, critical, _ = backend.layout(w)
    assert schedule.P == 8 and critical == critical_ratio(schedule, float((w.selection >= 0).sum())) > walked
    used = predict_module(backend.facts, ModelStats(w), backend.model_record(w, dev), dev, w.dtype).used
    assert used["executed_union_ratio"] == critical and used["achieved"] == achieved(dev, "q-packed-cute", "bf16")
