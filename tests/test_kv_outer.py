"""kv-outer: each stage's own output and the module output against the float64 reference.

Without a GPU the Triton kernels run in the CPU interpreter (harness.measure.check sets TRITON_INTERPRET=1
before triton is imported); bf16 is left to the CUDA tests because the interpreter's bf16 dot is wrong.
"""
import math

import pytest
import torch

from msa_bench.harness.measure.check import check_backend, edge_case_workload, tolerance  # sets TRITON_INTERPRET first
from msa_bench.scenarios.workload import AttnShape
from msa_bench.kernels.base import BackendUnavailable, get_backend
from msa_bench.kernels.kv_outer import stage_checks
from msa_bench.kernels.kv_outer.backend import ATTENTION_IMPLS, KVOuterBackend, register_attention_impl
from msa_bench.kernels.kv_outer.config import KVOuterConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp8 MMAs on the GPU reduce over >= 32 elements (check_shape): the same tests there take 32-token blocks
SHAPE = AttnShape(hq=8, hkv=2, head_dim=32, block=32 if DEVICE == "cuda" else 16, topk=4)
CPU_DTYPES = ["fp32", "fp16", "fp8"]

CASES = {   # name: (kv_lens, tokens per request, causal, hot, pad, empty)
    "random-padded-2req": ([200, 120], [21, 16], False, 0.0, 0.4, 2),
    "causal-local": ([300], [29], True, 0.0, 0.2, 0),
    "skewed-hot-block": ([256], [40], False, 0.9, 0.0, 0),
}


def workload(case: str, dtype: str, shape=SHAPE, seed=0):
    kv_lens, tokens, causal, hot, pad, empty = CASES[case]
    return edge_case_workload(shape, dtype, kv_lens, tokens, causal, hot, pad, empty, seed=seed, device=DEVICE)




@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_stages_and_output_match_reference(case, dtype, poisoned_run, matches_reference):
    w = workload(case, dtype)
    plan = get_backend("kv-outer").plan(w)
    poisoned_run(plan)
    tol = tolerance(dtype)
    checks = stage_checks.stage_checks(plan, w, torch.arange(w.n_tokens, device=w.device), tol)
    for stage, (ok, msg) in checks.items():
        assert ok, f"{stage}: {msg}"
    matches_reference(plan, w, tol)


@pytest.mark.parametrize("num_ctas", [1, 3, 200])
def test_schedule_covers_every_tile_once_for_any_grid(num_ctas, poisoned_run, matches_reference):
    w = workload("skewed-hot-block", "fp32")
    plan = KVOuterBackend(config=KVOuterConfig(num_ctas=num_ctas)).plan(w)
    poisoned_run(plan)
    ok, msg = stage_checks.check_schedule(plan, w)
    assert ok, msg
    rng = plan.buffers["cta_range"].long()
    covered = torch.cat([torch.arange(int(a), int(b)) for a, b in rng])
    assert torch.equal(covered, torch.arange(int(plan.buffers["tile_ptr"][-1])))
    matches_reference(plan, w, tolerance("fp32"))


def test_csr_is_a_stable_sort_and_tiles_split_hot_block(poisoned_run):
    w = workload("skewed-hot-block", "fp32")
    plan = KVOuterBackend(config=KVOuterConfig(num_ctas=16)).plan(w)
    poisoned_run(plan)
    b = plan.buffers
    counts = b["csr_ptr"].diff()
    hot = int(counts.argmax())
    assert int(counts[hot]) > 8 * 2        # the hot block holds several tiles, split over CTAs
    lo, hi = int(b["csr_ptr"][hot]), int(b["csr_ptr"][hot + 1])
    assert bool((b["csr_query"][lo:hi].diff() > 0).all())
    hot_tiles = (b["tile_key"] == hot).nonzero().flatten()
    owners = {c for c, (a, e) in enumerate(b["cta_range"].tolist()) for t in hot_tiles.tolist() if a <= t < e}
    assert len(owners) >= 2


def test_stage_checks_catch_corruption(poisoned_run):
    w = workload("random-padded-2req", "fp32")
    plan = get_backend("kv-outer").plan(w)
    poisoned_run(plan)
    b = plan.buffers
    lo = int(b["csr_ptr"][int(b["csr_ptr"].diff().argmax())])
    b["csr_query"][lo], b["csr_query"][lo + 1] = b["csr_query"][lo + 1].clone(), b["csr_query"][lo].clone()
    assert not stage_checks.check_csr(plan, w)[0]
    b["cta_range"][0, 1] += 1
    assert not stage_checks.check_schedule(plan, w)[0]
    some_partial = int(b["combine_index"][b["combine_index"] >= 0][0])
    b["m_part"][some_partial * SHAPE.group] += 1.0
    assert not stage_checks.check_partials(plan, w, torch.arange(w.n_tokens), 1e-5)[0]


def test_check_backend_reports_error_and_sampled_rows():
    w = workload("causal-local", "fp16")
    err, tol, details = check_backend("kv-outer", w, rows=[0, 5, 28], stages=True)
    assert err <= tol == tolerance("fp16")
    assert details["rows"] == 3 and all(ok for ok, _ in details["stage_checks"].values())


def test_pluggable_attention_impl(poisoned_run, matches_reference):
    calls = []

    @register_attention_impl("test-wrapped-triton")
    def wrapped(workload, buffers, config):
        stage = ATTENTION_IMPLS["triton"](workload, buffers, config)
        return lambda: (calls.append(1), stage())

    try:
        w = workload("causal-local", "fp32")
        plan = KVOuterBackend(attention_impl="test-wrapped-triton").plan(w)
        poisoned_run(plan)
        assert calls == [1] and plan.info["attention_impl"] == "test-wrapped-triton"
        matches_reference(plan, w, tolerance("fp32"))
    finally:
        ATTENTION_IMPLS.pop("test-wrapped-triton")
    reason = KVOuterBackend(attention_impl="nope").unavailable_reason("fp32", DEVICE)
    assert reason and "nope" in reason


def test_unavailable_reasons(monkeypatch):
    backend = get_backend("kv-outer")
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert "TRITON_INTERPRET=1" in backend.unavailable_reason("fp32", "cpu")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert "bf16" in backend.unavailable_reason("bf16", "cpu")
    with pytest.raises(BackendUnavailable):
        backend.plan(edge_case_workload(AttnShape(hq=6, hkv=2, head_dim=32, block=16, topk=4), "fp32",
                                        [64], [4], False, device=DEVICE))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cuda_bf16_fp8_and_graph_replay(dtype, graph_replay_equals_eager, poisoned_run, matches_reference):
    # block 32: fp8 MMAs on the GPU need a reduction of at least 32 (the P V dot reduces over the block)
    w = workload("causal-local", dtype, shape=AttnShape(hq=8, hkv=2, head_dim=32, block=32, topk=4))
    plan = get_backend("kv-outer").plan(w)
    poisoned_run(plan)
    matches_reference(plan, w, tolerance(dtype))
    graph_replay_equals_eager(plan)
    assert math.isfinite(plan.output.float().abs().sum().item())


ATTENTION_VARIANTS = {   # name: (tile_q, Attention keyword arguments)
    "chunk2-per-program": (8, dict(chunk=2)),
    "tile64-chunk4": (4, dict(chunk=4)),
    "tile64-persistent": (4, dict(chunk=0)),
}


@pytest.mark.parametrize("variant, dtype", [     # each variant and dtype in the default run; every pair in the slow one
    pytest.param(v, d, id=f"{v}-{d}", marks=() if (i - j) % len(CPU_DTYPES) == 0 else pytest.mark.slow)
    for i, v in enumerate(ATTENTION_VARIANTS) for j, d in enumerate(CPU_DTYPES)])
def test_attention_variants_match_reference(variant, dtype, poisoned_run, matches_reference):
    """Every launch variant of the Triton attention stage (chunked grids, 64-row tiles) writes the same
    partials as the reference, checked stage by stage and end to end."""
    from msa_bench.kernels.kv_outer.attention import STORE_TILES, Attention
    tile_q, kw = ATTENTION_VARIANTS[variant]
    w = workload("skewed-hot-block", dtype)
    cfg = KVOuterConfig(tile_q=tile_q, num_ctas=3)
    plan = KVOuterBackend(config=cfg).plan(w)
    plan.stages["attention"] = Attention(w, plan.buffers, tile_q, 3, 4, 2, STORE_TILES, **kw)
    poisoned_run(plan)
    tol = tolerance(dtype)
    for stage, (ok, msg) in stage_checks.stage_checks(plan, w, torch.arange(w.n_tokens, device=w.device),
                                                     tol).items():
        assert ok, f"{stage}: {msg}"
    matches_reference(plan, w, tol)


ORDERS = [(3, 0, 0, False), (1, 2, 0, False), (2, 5, 0, False), (4, 3, 2, False), (1, 0, 0, True), (3, 0, 0, True),
          (2, 0, 2, True)]


@pytest.mark.parametrize("backend,q_ranges,order_chunk,attn_chunk,phases", [   # msa-scatter: two orders by default
    pytest.param(b, *o, id="-".join(map(str, (b, *o))),
                 marks=pytest.mark.slow if b == "msa-scatter" and o not in (ORDERS[0], ORDERS[-1]) else ())
    for b in ("kv-outer", "msa-scatter") for o in ORDERS])
def test_grouped_tile_order_matches_reference(backend, q_ranges, order_chunk, attn_chunk, phases, poisoned_run, matches_reference):
    """Any tile order the scheduler lays out keeps the stage checks and the output exact; a grouped
    order puts tiles in (KV head, query range) groups, dealt to persistent CTAs chunk by chunk, or in
    phases (part c of every group to CTA c)."""
    w = workload("random-padded-2req", "fp32")
    cfg = KVOuterConfig(num_ctas=3, q_ranges=q_ranges, order_chunk=order_chunk, attn_chunk=attn_chunk,
                        order_phases=phases)
    plan = get_backend(backend).__class__(config=cfg).plan(w)
    poisoned_run(plan)
    checks = stage_checks.stage_checks(plan, w, torch.arange(w.n_tokens, device=w.device), tolerance("fp32"))
    for stage, (ok, msg) in checks.items():
        assert ok, f"{stage}: {msg}"
    matches_reference(plan, w, tolerance("fp32"))
    b = plan.buffers
    total = int(b["tile_ptr"][-1])
    key = b["tile_key"][:total].long()
    first_query = b["csr_query"][b["tile_edge"][:total].long()].long()
    group = torch.div(key, w.num_pages, rounding_mode="floor") * q_ranges + first_query * q_ranges // w.n_tokens
    rng = b["cta_range"].long().tolist()
    dealt = order_chunk if attn_chunk == 0 else 0
    if phases and attn_chunk == 0:
        # each CTA's range runs through the groups in order; CTA c's part of group g is the c-th of
        # C near-equal contiguous cuts of g's tiles (key order inside a group is kept)
        groups = w.shape.hkv * q_ranges
        per_cta = [torch.bincount(group[a:e], minlength=groups) for a, e in rng]
        for (a, e), counts in zip(rng, per_cta):
            assert bool((group[a:e].diff() >= 0).all())
        counts = torch.stack(per_cta)                                    # [C, groups]
        assert int((counts.max(0).values - counts.min(0).values).max()) <= 1
        by_group = torch.cat([key[a:e][group[a:e] == g] for g in range(groups) for a, e in rng])
        want = torch.cat([key[group == g] for g in range(groups)])
        assert torch.equal(torch.sort(want).values, torch.sort(by_group).values)
        heads = torch.div(by_group, w.num_pages, rounding_mode="floor")
        assert bool((heads.diff() >= 0).all())                           # parts in group order, heads ascending
    elif dealt == 0:
        assert bool((group.diff() >= 0).all())
    else:   # CTA c holds chunks c, c + C, ... of the grouped sequence, in that order
        dealt_back = torch.cat([group[a:e].view(-1) for a, e in rng])
        chunks = [group[a:e].split(dealt) for a, e in rng]
        rounds = max(len(c) for c in chunks)
        merged = torch.cat([c[r] for r in range(rounds) for c in chunks if r < len(c)])
        assert dealt_back.numel() == total and bool((merged.diff() >= 0).all())


def test_phases_keep_key_runs_whole():
    """A phased order loads each key's K/V at most once per part it is cut into: at q_ranges 1 the runs
    of equal keys inside the CTAs' ranges exceed the keys by less than the number of parts."""
    w = workload("random-padded-2req", "fp32")
    plan = KVOuterBackend(config=KVOuterConfig(num_ctas=3, order_phases=True)).plan(w)
    plan.run()
    b = plan.buffers
    total = int(b["tile_ptr"][-1])
    key = b["tile_key"][:total].long()
    runs = sum(int((key[a:e].diff() != 0).sum()) + (e > a) for a, e in b["cta_range"].long().tolist())
    keys = int(torch.unique(key).numel())
    assert keys <= runs < keys + 3 * w.shape.hkv


def test_phases_and_chunks_are_exclusive():
    with pytest.raises(ValueError, match="pick one"):
        KVOuterBackend(config=KVOuterConfig(num_ctas=2, order_chunk=4, order_phases=True)).plan(
            workload("causal-local", "fp32"))


def test_schedule_rejects_bad_order():
    with pytest.raises(ValueError, match="q_ranges"):
        KVOuterBackend(config=KVOuterConfig(num_ctas=2, q_ranges=0)).plan(workload("causal-local", "fp32"))


def test_chunk_size_shrinks_to_fill_the_gpu_on_short_prefills():
    from msa_bench.kernels.kv_outer.attention import MIN_CHUNK, fill_chunk
    assert fill_chunk(64, 200_000, 132) == 64               # N 8192: 3125 chunks, the tuned size
    assert fill_chunk(64, 3584, 132) == 8                   # N ~171: 56 chunks of 64 -> 448 of 8
    assert fill_chunk(64, 9000, 132) == 32                  # 141 chunks of 64 -> 282 of 32
    assert fill_chunk(64, 10, 132) == MIN_CHUNK             # never below the floor
    assert fill_chunk(0, 10, 132) == 0                      # persistent mode untouched


ORDERS = [(1, 0, False), (1, 0, True), (2, 0, False), (2, 0, True), (3, 2, False), (1, 3, False)]   # (S, k, phases)


@pytest.mark.parametrize("case", ["random-padded-2req", "causal-local"])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("num_ctas", [3, 7])
def test_closed_form_schedule_equals_the_sorted_one(case, order, num_ctas):
    """Every order comes from the Triton passes (positions in closed form); the general torch path
    (sort, deal) lays out the same order, buffer for buffer."""
    from msa_bench.kernels.kv_outer.index_map import IndexMap
    from msa_bench.kernels.kv_outer.scheduler import Schedule
    w = workload(case, "fp32")
    m = IndexMap(w.pages, w.num_pages, 2)
    m()
    fast, general = Schedule(m, num_ctas, *order), Schedule(m, num_ctas, *order)
    general.closed_form = False
    assert fast.closed_form
    fast()
    general()
    for name in ("tile_key", "tile_edge", "tile_count", "tile_run_end", "cta_range", "combine_index"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name


@pytest.mark.parametrize("case", ["random-padded-2req", "causal-local"])
def test_index_map_keys_narrow_where_they_fit(case, monkeypatch):
    """int16 sort keys (every key and the sentinel fit) give the index map int32 keys give, buffer for
    buffer; the width follows the key count."""
    from msa_bench.kernels.kv_outer import index_map
    assert index_map.key_dtype(32766) == torch.int16 and index_map.key_dtype(32767) == torch.int32
    w = workload(case, "fp32")
    narrow = index_map.IndexMap(w.pages, w.num_pages, 2)
    monkeypatch.setattr(index_map, "key_dtype", lambda num_keys: torch.int32)
    wide = index_map.IndexMap(w.pages, w.num_pages, 2)
    assert narrow.sorted_key.dtype == torch.int16 and wide.sorted_key.dtype == torch.int32
    narrow()
    wide()
    for name in ("csr_ptr", "csr_query", "tile_ptr", "combine_index", "perm"):
        assert torch.equal(getattr(narrow, name), getattr(wide, name)), name
    assert torch.equal(narrow.sorted_key.int(), wide.sorted_key)


@pytest.mark.slow
def test_closed_form_schedules_fuzzed_against_the_sorted_path():
    """Random small selections (1-3 KV heads, padding, every third with a KV head that has no tiles,
    tile_q 1-3, 1-9 CTAs), every order against the sorted path, buffer for buffer. The empty head is
    the case a masked check on the H200 caught: a key cut between two CTAs' parts then lies at adjacent
    positions, and its run continues across the CTA boundary. With query ranges a key's tiles fall in
    several groups, and runs can also join across groups."""
    from msa_bench.kernels.kv_outer.index_map import IndexMap
    from msa_bench.kernels.kv_outer.scheduler import Schedule
    g = torch.Generator().manual_seed(2)
    for trial in range(12):
        hkv, n, num_pages = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 4), (2, 14), (2, 8)))
        pages = torch.randint(0, num_pages, (hkv, n, 3), generator=g).int()
        pages[torch.rand(hkv, n, 3, generator=g) < 0.3] = -1
        if trial % 3 == 0:
            pages[int(torch.randint(0, hkv, (1,), generator=g))] = -1
        m = IndexMap(pages.to(DEVICE), num_pages, int(torch.randint(1, 4, (1,), generator=g)))
        m()
        for num_ctas in (1, 3, 5, 9):
            for order in ORDERS:
                fast, general = Schedule(m, num_ctas, *order), Schedule(m, num_ctas, *order)
                general.closed_form = False
                fast()
                general()
                for name in ("tile_key", "tile_edge", "tile_count", "tile_run_end", "cta_range", "combine_index"):
                    assert torch.equal(getattr(fast, name), getattr(general, name)), (trial, num_ctas, order, name)


def test_run_ends_follow_runs_across_blocks():
    """run_ends_kernel with 16-position blocks over runs of 1-60 equal keys (padding -1 at the end): the
    same ends as the sorted path's searchsorted, also for runs that cross one or several blocks."""
    from msa_bench.kernels.kv_outer.scheduler import run_ends_kernel
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 60, (12,), generator=g).tolist() + [17]
    key = torch.cat([torch.full((n,), i if i < 12 else -1, dtype=torch.int32) for i, n in enumerate(lengths)])
    key[lengths[0]:lengths[0] + lengths[1]] = 0                  # runs 0 and 1 share a key: one run
    key = key.to(DEVICE)
    out = torch.full_like(key, -7)
    run_ends_kernel[(-(-key.numel() // 16),)](key, out, key.numel(), BLOCK=16)
    start = torch.ones_like(key)
    start[1:] = key[1:] != key[:-1]
    run = torch.cumsum(start, 0)
    assert torch.equal(out.long(), torch.searchsorted(run, run, right=True))
