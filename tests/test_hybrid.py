"""hybrid: the split covers every selected (token, block) pair exactly once, the threshold comes from the
model, and the module output matches the float64 reference (CPU interpreter; bf16 on a GPU)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from msa_bench.harness.measure.check import edge_case_workload, tolerance  # sets TRITON_INTERPRET first
from msa_bench.kernels.base import BackendUnavailable, get_backend
from msa_bench.kernels.q_packed.schedule import NO_KEY, PackedSchedule
from msa_bench.roofline.devices import load_device
from msa_bench.roofline.hybrid import kv_outer_token_seconds, min_shared_tokens, packed_block_seconds
from msa_bench.roofline.model import ModelShape
from msa_bench.scenarios.reference import reference_attention, relative_error
from msa_bench.scenarios.workload import AttnShape

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = AttnShape(hq=8, hkv=2, head_dim=32, block=32 if DEVICE == "cuda" else 16, topk=4)


def split_pairs(w, sch):
    """(packed, residual) sets of (head, token, block) from the schedule's tile lists and residual pages."""
    s, P, U = w.shape, sch.P, sch.union_cap
    page_block = w.page_block.cpu()
    limit = sch.tile_limit.view(-1, U, P).cpu()
    packed = set()
    for tile in range(sch.num_tiles):
        head, tt = divmod(tile, sch.n_token_tiles)
        tok0 = int(sch.tile_tok0[tt])
        for j in range(int(sch.tile_count[tile])):
            block = int(page_block[int(sch.tile_page[tile, j])])
            packed |= {(head, tok0 + p, block) for p in range(P) if int(limit[tile, j, p]) != NO_KEY}
    res = sch.residual_pages.cpu()
    residual = {(h, q, int(page_block[int(res[h, q, k])])) for h, q, k in (res >= 0).nonzero().tolist()}
    return packed, residual


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), P=st.sampled_from([8, 12, 16]), share=st.integers(2, 16), causal=st.booleans(),
       hot=st.sampled_from([0.0, 0.5, 0.95]), pad=st.sampled_from([0.0, 0.4]),
       reqs=st.lists(st.tuples(st.integers(40, 160), st.integers(1, 30)), min_size=1, max_size=3))
def test_split_covers_every_pair_once(seed, P, share, causal, hot, pad, reqs):
    shape = AttnShape(hq=4, hkv=2, head_dim=16, block=16, topk=4)
    w = edge_case_workload(shape, "fp32", [max(kv, n) for kv, n in reqs], [n for _, n in reqs], causal, hot, pad,
                           seed=seed)
    sch = PackedSchedule(w, P, min_share=share, residual=True)
    sch()
    packed, residual = split_pairs(w, sch)
    sel = w.selection.cpu()
    selected = {(h, q, int(sel[h, q, k])) for h, q, k in (sel >= 0).nonzero().tolist()}
    assert not packed & residual
    assert packed | residual == selected
    # a packed block is one at least `share` of its tile's tokens select; a residual one fewer
    for tile in range(sch.num_tiles):
        lim = sch.tile_limit.view(-1, sch.union_cap, P)[tile, :int(sch.tile_count[tile])]
        assert ((lim != NO_KEY).sum(1) >= min(share, P)).all() or share > P


def test_one_token_tiles_leave_every_pair_to_the_residual_above_share_one():
    shape = AttnShape(hq=4, hkv=2, head_dim=16, block=16, topk=4)
    w = edge_case_workload(shape, "fp32", [90, 40, 130], [1, 1, 11], True, 0.0, 0.3, seed=5, device=DEVICE)
    sel = w.selection.cpu()
    selected = {(h, q, int(sel[h, q, k])) for h, q, k in (sel >= 0).nonzero().tolist()}
    for share in (1, 2):
        sch = PackedSchedule(w, 8, min_share=share, residual=True)
        sch.residual_pages.fill_(7)
        sch()
        packed, residual = split_pairs(w, sch)
        assert not packed & residual and packed | residual == selected
        decode = {pair for pair in selected if pair[1] < 2}          # tokens 0 and 1: one a request
        assert (decode <= packed) if share == 1 else (decode <= residual)


def test_threshold_from_the_roofline_by_hand():
    h200 = load_device("h200")
    s = ModelShape(dtype="bf16")
    packed = 4 * 8 * 16 * 128 * 128 / h200.peak_flops("bf16")        # MMA of 128 rows x one block
    assert packed_block_seconds(s, h200, 8) == pytest.approx(max(packed, 2 * 128 * 128 * 2 / h200.l2_bytes_per_s))
    one = (4 * 16 * 128 * 128 / h200.peak_flops("bf16") + 2 * 16 * (128 * 2 + 8) / h200.hbm_bytes_per_s
           + 16 * 128 * 2 / h200.l2_bytes_per_s)
    assert kv_outer_token_seconds(s, h200) == pytest.approx(one)
    assert min_shared_tokens(s, h200, 8) == math.ceil(packed_block_seconds(s, h200, 8) / one) == 3
    # warpgroups that walk only their own tokens' blocks: a block near the threshold costs two groups' rows
    assert min_shared_tokens(s, h200, 12, group_tokens=4) == min_shared_tokens(s, h200, 8) == 3
    assert min_shared_tokens(s, h200, 12) == math.ceil(packed_block_seconds(s, h200, 12) / one) == 5


@pytest.mark.slow
def test_default_layout_is_the_wide_fused_tile_in_fp8_where_selections_drift(monkeypatch):
    """fp8's default hybrid runs 12-token tiles with the epilogue merge where q-packed-cute runs the workload,
    no request holds one token, there are WIDE_MIN_TILES_PER_SM tiles an SM, the 12-token tiles load at most
    WIDE_MAX_LOADS times the 8-token tiles' union blocks and pack at least WIDE_MIN_PACKED of the entries:
    where tokens drift, not where groups of 8 share (a 12-token tile spans two groups) nor where nothing is
    shared. Elsewhere, and in bf16, 8 tokens and the combine. Named options keep what they name."""
    from msa_bench.kernels.q_packed import cute_backend
    from msa_bench.kernels.q_packed.cute_backend import QPackedCuteBackend
    from msa_bench.scenarios.serving import serving_workload
    monkeypatch.setattr(QPackedCuteBackend, "workload_unavailable_reason", lambda self, w: None)
    monkeypatch.setattr(cute_backend, "sm_count", lambda device: 2)
    layout = lambda name, w: get_backend(name).layout(w)      # noqa: E731

    def drift(dtype, tokens=240):
        return serving_workload(SHAPE, dtype, "drift", tokens=tokens, context=2048, context_min=None, requests=None,
                                chunks=None, drift=0.05, device="cpu", with_tensors=False)
    fp8 = drift("fp8")
    assert layout("hybrid", fp8) == (12, True) and get_backend("hybrid").stages_for(fp8) == ("schedule", "attention")
    assert layout("hybrid@p8", fp8) == (8, False) and layout("hybrid@combine", fp8) == (8, False)
    assert layout("hybrid@p12+combine", fp8) == (12, False) and layout("hybrid@p8+fused", fp8) == (8, True)
    bf16 = drift("bf16")
    assert layout("hybrid", bf16) == (8, False) and "combine" in get_backend("hybrid").stages_for(bf16)
    assert layout("hybrid@p12", bf16) == (12, False)
    for share in (1.0, 0.0):                     # two groups' blocks a 12-token tile; nothing to pack
        grouped = coselected_workload(SHAPE, "fp8", 240, 8192, 0.3, share, group=8, seed=3, with_tensors=False)
        assert layout("hybrid", grouped) == (8, False)
    one = edge_case_workload(SHAPE, "fp8", [400, 300], [200, 1], True, 0.6, 0.2, seed=1, device="cpu")
    assert layout("hybrid", one) == (8, False)                       # a decode token's request
    monkeypatch.setattr(cute_backend, "sm_count", lambda device: 1000)
    assert layout("hybrid", drift("fp8")) == (8, False)              # too few tiles an SM


# each option and each dtype in the default run; every pair in the slow one
FAST_PAIRS = {("", "fp32"), ("@m1", "fp16"), ("@m3", "fp8"), ("@m16+p16", "fp32")}


@pytest.mark.parametrize("option, dtype", [
    pytest.param(o, d, id=f"{o}-{d}", marks=() if (o, d) in FAST_PAIRS else pytest.mark.slow)
    for o in ("", "@m1", "@m3", "@m16+p16") for d in ("fp32", "fp16", "fp8")])
def test_output_matches_reference(option, dtype, poisoned_run):
    w = edge_case_workload(SHAPE, dtype, [300, 140], [29, 40], True, 0.6, 0.2, seed=1, device=DEVICE)
    plan = get_backend(f"hybrid{option}").plan(w)
    poisoned_run(plan)
    ref_out, ref_lse = reference_attention(w)
    tol = tolerance(dtype)
    assert relative_error(plan.output, ref_out) <= tol
    assert relative_error(plan.lse, ref_lse) <= tol
    assert plan.info["min_share"] >= 1 and 0.0 <= plan.info["packed_entry_share"] <= 1.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cuda_bf16_fp8_and_graph_replay(dtype, graph_replay_equals_eager, poisoned_run):
    w = edge_case_workload(SHAPE, dtype, [300, 140], [29, 40], True, 0.6, 0.2, seed=1, device=DEVICE)
    plan = get_backend("hybrid@triton").plan(w)
    poisoned_run(plan)
    ref_out, _ = reference_attention(w)
    assert relative_error(plan.output, ref_out) <= tolerance(dtype)
    graph_replay_equals_eager(plan)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("option", ["", "@p12", "@fused", "@p12+fused"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cuda_study_shape_on_both_cute_stages(dtype, option, graph_replay_equals_eager):
    """At the study shape the split runs q-packed-cute and kv-outer-cute where both are built; the combine
    merges into the packed output in place, so a graph replay must still equal eager bitwise. `@p12`: the
    packed part on the wide tile, its warpgroups walking their thirds of what the threshold keeps; `@fused`:
    no combine stage, the packed epilogue merges the partials (a graph replay still reads them fresh)."""
    from msa_bench.harness.measure.check import check_backend, sample_rows
    w = coselected(0.5, tokens=512, context=65536, reuse=2.0, with_tensors=True, dtype=dtype)
    for name in ("q-packed-cute", "kv-outer-cute"):
        reason = get_backend(name).workload_unavailable_reason(w)
        if reason:
            pytest.skip(reason)
    name = f"hybrid{option}"
    err, tol, details = check_backend(name, w, rows=sample_rows(w.n_tokens))
    assert err <= tol
    info = details["info"]
    assert info["kv_outer"] == "kv-outer-cute" and info["attention"]["kernel"].startswith("qpk")
    assert info["attention"]["tile_tokens"] == (12 if "p12" in option else 8) == info["tile_tokens"]
    assert info["residual_merge"] == ("packed epilogue" if "fused" in option else "combine")
    assert ("_res" in info["attention"]["kernel"]) == ("fused" in option)
    assert 0.0 < info["packed_entry_share"] < 1.0
    graph_replay_equals_eager(get_backend(name).plan(w))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_epilogue_merge_reads_partials_past_2_31_elements():
    """With no co-selection at N 16384 nearly every entry is KV-outer's: its partials' rows x D pass 2^31
    elements, and the packed epilogue must address them with 64-bit offsets (32-bit ones read out of bounds)."""
    from msa_bench.harness.measure.check import check_backend, sample_rows
    w = coselected(0.0, tokens=16384, context=131072, reuse=0.25, with_tensors=True, dtype="fp8")
    for name in ("q-packed-cute", "kv-outer-cute"):
        reason = get_backend(name).workload_unavailable_reason(w)
        if reason:
            pytest.skip(reason)
    plan = get_backend("hybrid@p12+fused").plan(w)
    assert plan.buffers["kv.o_part"].numel() > 2 ** 31
    del plan
    err, tol, details = check_backend("hybrid@p12+fused", w, rows=sample_rows(w.n_tokens))
    assert err <= tol and details["info"]["residual_merge"] == "packed epilogue"


def test_wide_tiles_run_only_on_q_packed_cute():
    """`@p12` and `@fused` have no Triton packed kernel to fall back on: where q-packed-cute cannot take the
    workload the hybrid says so, and it refuses the dtypes the wide library is not built for; `@fused`
    has no combine stage."""
    wide = get_backend("hybrid@p12")
    assert wide.unavailable_reason("fp32", DEVICE) == "hybrid@p12 runs bf16, fp8 only"
    fused = get_backend("hybrid@fused")                  # its epilogue merge is q-packed-cute's too
    assert fused.unavailable_reason("fp32", DEVICE) == "hybrid@fused runs bf16, fp8 only"
    assert fused.stages_for(None) == ("schedule", "attention") and "combine" in get_backend("hybrid").stages_for(None)
    w = edge_case_workload(SHAPE, "fp8", [300], [29], True, 0.6, 0.2, seed=1, device=DEVICE)
    cute = get_backend("q-packed-cute").workload_unavailable_reason(w)
    if cute is None:
        pytest.skip("q-packed-cute runs this workload here")
    assert wide.workload_unavailable_reason(w) == f"hybrid@p12: its packed part runs on q-packed-cute: {cute}"
    with pytest.raises(BackendUnavailable):
        wide.plan(w)


def test_small_shapes_take_the_triton_parts_where_cute_is_built(monkeypatch):
    """A CuTe library is built for one shape: with the libraries present, a workload of another shape
    plans on the Triton kernels instead of failing in the CuTe stage."""
    from msa_bench.kernels.cute.backend import KVOuterCuteBackend
    from msa_bench.kernels.q_packed.cute_backend import QPackedCuteBackend
    from msa_bench.kernels.q_packed.hybrid import HybridBackend
    monkeypatch.setattr(QPackedCuteBackend, "unavailable_reason", lambda self, dtype, device: None)
    monkeypatch.setattr(KVOuterCuteBackend, "unavailable_reason", lambda self, dtype, device: None)
    w = edge_case_workload(SHAPE, "fp32", [300, 140], [29, 40], True, 0.6, 0.2, seed=1, device=DEVICE)
    hybrid = HybridBackend()
    assert hybrid.packed_backend(w) == "q-packed"
    assert hybrid.kv_backend(w.dtype, w.device, w).name == "kv-outer"
    assert "G 16, D 128, block 128" in get_backend("q-packed-cute").workload_unavailable_reason(w)
    w8 = edge_case_workload(SHAPE, "fp8", [300, 140], [29, 40], True, 0.6, 0.2, seed=1, device=DEVICE)
    assert "D = 128, block = 128" in get_backend("kv-outer-cute").workload_unavailable_reason(w8)


# ---- auto: the pick follows the model ---------------------------------------------------------------

from msa_bench.roofline.devices import PRESETS  # noqa: E402
from msa_bench.scenarios.coselection import coselected_workload  # noqa: E402

STUDY = AttnShape()                 # the study shape: the model's picks are about it


def coselected(share: float, shape=STUDY, tokens=256, context=65536, reuse=None, with_tensors=False, dtype="fp16"):
    reuse = reuse or (0.25 if share == 1.0 else 2.0)
    return coselected_workload(shape, dtype, tokens, context, reuse, share, group=8, seed=3, device=DEVICE,
                               with_tensors=with_tensors)


def picks(w) -> tuple[str, dict]:
    cands, _ = get_backend("auto").candidates(w)
    return min(cands, key=lambda k: cands[k][1]), {k: v[1] for k, v in cands.items()}


@pytest.mark.slow
def test_auto_packs_shared_selections_and_not_scattered_ones():
    pick, predicted = picks(coselected(1.0))
    assert pick == "q-packed"
    pick, predicted = picks(coselected(0.0))
    assert pick != "q-packed" and predicted[pick] < predicted["q-packed"]


@pytest.mark.slow
def test_auto_divides_by_the_measured_fraction(monkeypatch):
    from dataclasses import replace
    from msa_bench.kernels import auto
    h200 = load_device("h200")          # the preset with its committed calibration
    slow_packed = replace(h200, achieved={**h200.achieved, "q-packed/bf16": 0.01})
    monkeypatch.setattr(auto, "device_profile", lambda device: slow_packed)
    assert picks(coselected(1.0))[0] == "kv-outer"


@pytest.mark.slow
def test_auto_records_its_pick_and_matches_the_reference(poisoned_run):
    small = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)
    for share in (1.0, 0.0):
        w = coselected(share, small, 64, 2048, 0.25 if share == 1.0 else 2.0, with_tensors=True, dtype="fp32")
        plan = get_backend("auto").plan(w)
        auto = plan.info["auto"]
        assert auto["predicted_s"][auto["picked"]] == min(auto["predicted_s"].values())
        assert plan.info["schedule"] in ("q-packed", "kv-outer", "hybrid") and plan.backend == "auto"
        poisoned_run(plan)
        assert relative_error(plan.output, reference_attention(w)[0]) <= tolerance("fp32")


def test_a_plan_builds_its_packed_schedule_once_and_records_that_split(monkeypatch):
    """The packed schedule is built once per plan, the hybrid's own or auto's after weighing the hybrid's
    record, and the plan records the split the model predicts from."""
    from msa_bench.kernels import auto
    from msa_bench.kernels.q_packed import hybrid
    built = []

    class Counted(PackedSchedule):
        def __init__(self, w, tokens_per_tile, **kw):
            built.append(tokens_per_tile)
            super().__init__(w, tokens_per_tile, **kw)

    monkeypatch.setattr(hybrid, "PackedSchedule", Counted)
    monkeypatch.setattr(auto, "candidate_names", lambda: ["hybrid"])
    w = edge_case_workload(SHAPE, "fp32", [300, 140], [29, 40], True, 0.6, 0.2, seed=1, device=DEVICE)
    for name in ("hybrid", "auto"):
        built.clear()
        plan = get_backend(name).plan(w)
        assert built == [8], name
        assert plan.info["model"] == get_backend("hybrid").model_record(w), name
        assert plan.info["model"]["split"]["min_share"] == plan.info["min_share"], name


def test_each_part_blends_its_own_decode_share():
    """A decode token alone in its tile packs nothing: a chunked-prefill step's packed part is prefill work
    and its residual mostly decode, so each part's fraction blends by its own decode share, not the step's."""
    from msa_bench.roofline.predict import predict_module
    from msa_bench.scenarios.serving import serving_workload
    from msa_bench.scenarios.stats import ModelStats
    w = serving_workload(SHAPE, "bf16", "mixed", tokens=64, context=512, context_min=256, requests=16, chunks=1,
                         drift=0.05, device=DEVICE, with_tensors=False)
    stats, hybrid, dev = ModelStats(w), get_backend("hybrid@m2"), load_device("h200")
    used = predict_module(hybrid.facts, stats, hybrid.model_record(w, dev), dev, w.dtype).used
    assert used["packed_decode_share"] == 0.0 and stats["decode_share"] == pytest.approx(16 / 80)
    assert stats["decode_share"] < used["kv_outer_decode_share"] <= 1.0
    assert {used["packed_binding"], used["kv_outer_binding"]} <= {"hbm", "l2", "mma"}
