"""q-packed-cute on the GPU (sm_90a and a q-packed CuTe build, or the DSL to build one): the module against
the float64 reference on real prefill (a long and a short case), synthetic causal and non-causal
selections, multi-request edge cases and a request whose tokens select nothing, in bf16 and fp8 and in
every schedule option; CUDA-graph replay bitwise equal to eager."""
from __future__ import annotations

import math

import pytest
import torch

from msa_bench.harness.measure.check import check_backend, edge_case_workload, sample_rows
from msa_bench.kernels.base import get_backend
from msa_bench.kernels.cute.manifest import DEFAULT_OPTIONS, OPTION_FLAGS, SKIP_OPTIONS, SKIP_RATIO
from msa_bench.kernels.q_packed import cute_backend as cb
from msa_bench.scenarios.prefill_cases import get_case, prefill_workload
from msa_bench.scenarios.selection import synthetic_workload
from msa_bench.scenarios.serving import serving_workload
from msa_bench.scenarios.workload import AttnShape

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = AttnShape(hq=64, hkv=4, head_dim=128, block=128, topk=16)
OPTIONS = ["", "plain", "pp", "sa", "pp+sa", "p12"]
SAME_MMAS = OPTIONS[:-1]           # p12's tiles walk other unions in another order: not bitwise equal to these
DTYPES = ["bf16", "fp8"]
WORKLOADS = {
    # N 16384 after a 31360- and a 10752-token prefix (real prefill's heaviest-weighted case, the issue's
    # target, and its shortest-context N 16384 case), and 182 tokens after 17536
    "prefill-47k": lambda d: prefill_workload(get_case("prefill_c17ccf7fbbb5d1ee5648"), SHAPE, d, seed=1,
                                              device="cuda"),
    "prefill-27k": lambda d: prefill_workload(get_case("prefill_34d5c963ddbc73bd8549"), SHAPE, d, seed=1,
                                              device="cuda"),
    "prefill-short": lambda d: prefill_workload(get_case("prefill_092e27340df8621a02f0"), SHAPE, d, seed=2,
                                                device="cuda"),
    "synthetic-causal": lambda d: synthetic_workload(SHAPE, d, 2048, 65536, 0.25, causal=True, seed=3,
                                                     device="cuda"),
    # neighbours share about 87 % of their blocks: a tile's two warpgroups walk different blocks
    "drift-causal": lambda d: serving_workload(SHAPE, d, "drift", 1536, 40960, drift=0.07, seed=8, device="cuda"),
    "synthetic-noncausal": lambda d: synthetic_workload(SHAPE, d, 1024, 32768, 1.0, causal=False, seed=4,
                                                        device="cuda"),
    # three requests on a scattered page table, -1 padding, a hot block, tokens with no block at all,
    # tiles cut at unaligned positions
    "edge-causal": lambda d: edge_case_workload(SHAPE, d, [3000, 700, 1900], [37, 11, 64], True, hot=0.5,
                                                pad=0.3, seed=5, device="cuda"),
    "edge-noncausal": lambda d: edge_case_workload(SHAPE, d, [2600, 900], [29, 21], False, hot=0.3, pad=0.5,
                                                   empty=3, seed=6, device="cuda"),
    # every token selects nothing (not causal: a causal token keeps its local block): union count 0 in
    # every tile, O = 0 and LSE -inf everywhere
    "no-keys": lambda d: edge_case_workload(SHAPE, d, [1000], [13], False, empty=13, seed=7, device="cuda"),
    # one token a request: every tile one token, the kernel's direct path (no schedule stage); 256 one-token
    # tiles outnumber the SMs, so a default plan runs two tokens a tile (the pairs library)
    "decode": lambda d: serving_workload(SHAPE, d, "decode", None, 32768, context_min=8192, requests=64, seed=9,
                                         device="cuda"),
    "decode-edge": lambda d: edge_case_workload(SHAPE, d, [3000, 700, 1900, 2600, 900], [1] * 5, True, hot=0.5,
                                                pad=0.5, seed=10, device="cuda"),
    "decode-no-keys": lambda d: edge_case_workload(SHAPE, d, [1000, 600], [1, 1], False, empty=2, seed=11,
                                                   device="cuda"),
}
DIRECT = ("decode", "decode-edge", "decode-no-keys")
_CACHE: dict = {}


def workload(name: str, dtype: str):
    if (name, dtype) not in _CACHE:
        _CACHE[(name, dtype)] = WORKLOADS[name](dtype)
    return _CACHE[(name, dtype)]


def backend_name(option: str) -> str:
    return "q-packed-cute" + (f"@{option}" if option else "")


def _skip_unavailable(name: str, dtype: str) -> None:
    reason = get_backend(name).unavailable_reason(dtype, "cuda")
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("case", list(WORKLOADS))
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_float64_reference(dtype, option, case):
    name = backend_name(option)
    _skip_unavailable(name, dtype)
    w = workload(case, dtype)
    err, tol, details = check_backend(name, w, rows=sample_rows(w.n_tokens))
    assert err <= tol, (case, details["out_rel_err"], details.get("lse_rel_err"))
    attention = details["info"]["attention"]
    # 12-token tiles: named, or a default fp8 plan of many tiles whose warpgroups skip nothing (real prefill's N 16384)
    wide = case not in DIRECT and (option == "p12" or (option == "" and case in ("prefill-47k", "prefill-27k")))
    assert (attention["tile_tokens"] == 12) == wide, details["info"]
    if option == "p12" and not wide:      # decode keeps its own tiles and the default flags
        flags = DEFAULT_OPTIONS[dtype]
    elif option or wide:
        flags = tuple(tag in option.split("+") for tag in OPTION_FLAGS)
    else:       # the default's flags, or where the warpgroups skip blocks (drift) the dtype's for skipping
        skips = details["info"]["executed_union_ratio"] > SKIP_RATIO and dtype in SKIP_OPTIONS
        flags = SKIP_OPTIONS[dtype] if skips else DEFAULT_OPTIONS[dtype]
        if case.startswith("prefill") or case == "drift-causal":     # real prefill's halves select alike
            assert skips == (case == "drift-causal" and dtype in SKIP_OPTIONS), details["info"]
    assert attention["direct"] == (case in DIRECT)
    assert attention["pairs"] == (option == "" and cb.pairs_path(w))
    assert attention["kernel"] == (cb.wide_config(dtype).name if wide else attention["kernel"])
    if not attention["pairs"]:
        assert tuple(attention[flag] for flag in OPTION_FLAGS.values()) == flags


@pytest.mark.parametrize("case", DIRECT)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pairs_match_the_reference_and_one_token_tiles_bitwise(dtype, case, monkeypatch):
    """Every decode case in pairs (one SM, so the one-token tiles outnumber it): odd token counts, padded
    selections and tokens with different counts. A pair's tokens take the one-token tile's MMAs and softmax
    steps in the same order (the options only reorder them), so its output equals one token a tile's
    bitwise."""
    _skip_unavailable("q-packed-cute", dtype)
    w = workload(case, dtype)
    monkeypatch.setattr(cb, "sm_count", lambda device: 1)
    err, tol, details = check_backend("q-packed-cute", w, rows=sample_rows(w.n_tokens))
    assert err <= tol and details["info"]["attention"]["pairs"], (case, details["out_rel_err"])
    outs = []
    for sms in (1, 10 ** 6):
        monkeypatch.setattr(cb, "sm_count", lambda device, n=sms: n)
        plan = get_backend("q-packed-cute").plan(w)
        plan.run()
        torch.cuda.synchronize()
        outs.append((plan.output.clone(), plan.lse.clone(), plan.info["attention"]["pairs"]))
    assert [o[2] for o in outs] == [True, False]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("case", ["no-keys", "decode-no-keys"])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_no_keys_gives_zero_output_and_minus_infinity(dtype, option, case):
    name = backend_name(option)
    _skip_unavailable(name, dtype)
    plan = get_backend(name).plan(workload(case, dtype))
    plan.output.fill_(float("nan"))
    plan.lse.fill_(float("nan"))
    plan.run()
    torch.cuda.synchronize()
    assert ("schedule" in plan.stages) == (case not in DIRECT)
    if "schedule" in plan.stages:
        assert int(plan.buffers["tile_count"].max()) == 0
    assert bool((plan.output == 0).all()) and bool(torch.isneginf(plan.lse).all())


@pytest.mark.parametrize("case", ["edge-causal", "decode-edge", "decode"])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_replay_equals_eager(dtype, option, case, graph_replay_equals_eager, poisoned_run):
    name = backend_name(option)
    _skip_unavailable(name, dtype)
    plan = get_backend(name).plan(workload(case, dtype))
    poisoned_run(plan)
    graph_replay_equals_eager(plan)
    assert math.isfinite(plan.output.float().abs().sum().item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_options_agree_with_each_other(dtype):
    """The schedule options only reorder when the same MMAs and softmax steps are issued (each block's O is
    rescaled by its alpha before its P V in every option): the outputs are bitwise equal. A difference
    means a race or a misordered rescale, not rounding."""
    for case in ("synthetic-causal", "drift-causal", "decode-edge"):
        outs = []
        for option in SAME_MMAS:
            name = backend_name(option)
            _skip_unavailable(name, dtype)
            plan = get_backend(name).plan(workload(case, dtype))
            plan.run()
            torch.cuda.synchronize()
            outs.append((plan.output.float().clone(), plan.lse.clone()))
        for option, (out, lse) in zip(SAME_MMAS[1:], outs[1:]):
            assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1]), (case, option)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_model_predicts_the_tiles_the_plan_runs(dtype):
    """`auto`'s prediction of a default plan: the MMAs of its tiles' critical walk (as the plan records it),
    over the fraction of the kernel it runs (the 12-token tiles' own)."""
    from msa_bench.roofline.devices import achieved, device_profile
    from msa_bench.roofline.predict import predict_module
    from msa_bench.scenarios.stats import ModelStats
    _skip_unavailable("q-packed-cute", dtype)
    backend, profile = get_backend("q-packed-cute"), device_profile("cuda")
    for case, tokens in (("prefill-47k", 12), ("drift-causal", 8)):
        w = workload(case, dtype)
        plan = backend.plan(w)
        used = predict_module(backend.facts, ModelStats(w), backend.model_record(w, profile), profile, dtype).used
        assert plan.info["tile_tokens"] == tokens, case
        name = "q-packed-cute@p12" if tokens == 12 else "q-packed-cute"
        assert used["achieved"] == achieved(profile, name, dtype), case
        assert used["executed_union_ratio"] == pytest.approx(plan.info["critical_union_ratio"]), case
