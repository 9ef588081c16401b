"""The query tiles: the rule against a plain loop, and the three places that cut tiles (the q-packed
planner's GPU stage, the tile packing of FlashInfer's paged route and dense-gather, the union_ratio
statistics) held to the same tiles on random workloads."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from msa_bench.harness.measure.check import edge_case_workload  # sets TRITON_INTERPRET first
from msa_bench.kernels.packed_tiles import pack_tiles
from msa_bench.kernels.q_packed.schedule import PackedSchedule, token_tiles
from msa_bench.scenarios.stats import workload_union_ratio
from msa_bench.scenarios.tiling import query_tiles, tile_keys
from msa_bench.scenarios.workload import AttnShape


def loop_tiles(q_request: list[int], q_limit: list[int], tile: int, causal: bool) -> tuple[list[int], list[int]]:
    """(tile id, slot) of each token: a token joins the previous one's tile unless the request changes,
    (causal) the window of P positions changes, or that tile already holds P tokens."""
    ids, slots = [], []
    for i, (r, q) in enumerate(zip(q_request, q_limit)):
        joins = (i > 0 and r == q_request[i - 1] and slots[-1] + 1 < tile
                 and (not causal or q // tile == q_limit[i - 1] // tile))
        ids.append(ids[-1] + (not joins) if ids else 0)
        slots.append(slots[-1] + 1 if joins else 0)
    return ids, slots


@st.composite
def batches(draw):
    """Requests in runs (a request may come back later), positions rising from a random prefix, or
    repeating (several tokens at one position)."""
    runs = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(0, 70), st.booleans()),
                         min_size=1, max_size=5))
    q_request, q_limit = [], []
    for r, n, prefix, repeat in runs:
        q_request += [r] * n
        q_limit += [prefix + (t // 3 if repeat else t) for t in range(n)]
    return q_request, q_limit


@given(batches(), st.sampled_from([1, 3, 8, 16]), st.booleans())
def test_query_tiles_follow_the_rule(batch, tile, causal):
    q_request, q_limit = batch
    ids, slot = query_tiles(torch.tensor(q_request), torch.tensor(q_limit), tile, causal)
    assert (ids.tolist(), slot.tolist()) == loop_tiles(q_request, q_limit, tile, causal)


def test_causal_tiles_are_position_windows_and_plain_ones_count_from_the_first_token():
    q_request = torch.tensor([0] * 6 + [1] * 3)
    q_limit = torch.tensor([5, 6, 7, 8, 9, 10, 2, 3, 4])
    assert query_tiles(q_request, q_limit, 4, causal=True)[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3]
    assert query_tiles(q_request, q_limit, 4, causal=False)[0].tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="positive"):
        query_tiles(q_request, q_limit, 0, causal=True)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), P=st.sampled_from([4, 8]), causal=st.booleans(),
       reqs=st.lists(st.tuples(st.integers(20, 90), st.integers(1, 13)), min_size=1, max_size=3))
def test_the_planner_the_packing_and_the_statistics_cut_the_same_tiles(seed, P, causal, reqs):
    """The q-packed planner's GPU stage (Triton; the interpreter here) unions the blocks of each tile:
    what it executes, sum of union x tokens per tile, is union_ratio x the selected entries, and P x
    union per tile the padded union_ratio; the tile packing cuts the same tiles from the same keys."""
    shape = AttnShape(hq=4, hkv=2, head_dim=16, block=16, topk=4)
    w = edge_case_workload(shape, "fp32", [max(kv, n) for kv, n in reqs], [n for _, n in reqs], causal,
                           pad=0.3, seed=seed)
    sch = PackedSchedule(w, P)
    sch()
    selected = int((w.selection >= 0).sum())
    count = sch.tile_count.view(shape.hkv, -1).long()
    assert int((count * sch.tile_ntok.long()).sum()) == pytest.approx(workload_union_ratio(w, P) * selected)
    assert int(count.sum()) * P == pytest.approx(workload_union_ratio(w, P, padded=True) * selected)
    pack = pack_tiles(w.selection, tile_keys(w.q_request, w.q_limit, P, w.causal), P)
    tok0, ntok = token_tiles(w.q_request, w.q_limit, P, w.causal)
    assert pack.start.tolist() == tok0.tolist() and pack.length.tolist() == ntok.tolist()
    assert torch.equal(pack.count, count)
