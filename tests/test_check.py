"""`msa-bench check` on the CPU shape: a real-prefill case, K requests of edge cases, the indexer, and the
options a workload does not use refused in one line, as `msa-bench workload` refuses them."""
import pytest
import torch

from msa_bench.harness.measure.check import (CPU_DEFAULTS, CPU_SHAPE, check_point, check_workload,  # sets TRITON_INTERPRET
                                     request_layout)
from msa_bench.scenarios.selection import synthetic_workload

CASE = "prefill_092e27340df8621a02f0"        # 182 query tokens after 17536 of context


def test_real_prefill_case_passes_with_the_reference(cli):
    code, out, _ = cli("check", "--backend", "reference", "--dtype", "fp32", "--generator", "real-prefill",
                       "--case", CASE)
    lines = out.splitlines()
    assert code == 0, out
    assert lines[0].startswith("reference fp32 on cpu: N=182 Hq=8 Hkv=2 D=32 block=16 topk=4 "
                               f"real-prefill {CASE} context=17718; compared 182 rows")
    assert lines[-1].endswith("(tol 1e-05): PASS")


def test_three_requests_pass_kv_outer_in_fp32_with_every_stage_checked(cli):
    code, out, _ = cli("check", "--backend", "kv-outer", "--dtype", "fp32", "--requests", "3", "--causal")
    lines = out.splitlines()
    assert code == 0, out
    assert lines[0].startswith("kv-outer fp32 on cpu: N=40 Hq=8 Hkv=2 D=32 block=16 topk=4 context=256 "
                               "3 requests (edge cases: padding, hot blocks) causal; compared 40 rows")
    stages = [ln.split()[0] for ln in lines if ln.startswith("  ") and " ok " in ln]
    assert stages == ["index_map", "schedule", "attention"]
    assert lines[-1].endswith("(tol 1e-05): PASS")


@pytest.mark.parametrize("causal", [False, True])
def test_requests_workload_holds_the_edge_cases(causal):
    point = check_point("synthetic", CPU_SHAPE, "fp32", 3, causal=causal, seed=4)
    w = check_workload(point, 3, "cpu")
    kv_lens, counts = request_layout(40, 256, 3)
    assert counts == [14, 13, 13] and kv_lens == [256, 213, 170]
    assert torch.equal(torch.bincount(w.q_request.long()), torch.tensor(counts))
    kept = (w.selection >= 0).sum(-1)                      # blocks each (KV head, token) keeps
    assert (kept < CPU_SHAPE.topk).any()                   # -1 padding
    assert bool((kept == 0).any()) == (not causal)         # a causal token keeps its own block
    assert w.meta["generator"] == "edge-cases" and w.meta["hot"] > 0


def test_synthetic_workload_is_the_one_check_always_built():
    point = check_point("synthetic", CPU_SHAPE, "fp16", causal=True, seed=3)
    w = check_workload(point, None, "cpu")
    old = synthetic_workload(CPU_SHAPE, "fp16", CPU_DEFAULTS["tokens"], CPU_DEFAULTS["context"], CPU_DEFAULTS["reuse"],
                             causal=True, seed=3, device="cpu")
    assert torch.equal(w.selection, old.selection) and torch.equal(w.q, old.q) and torch.equal(w.k_cache, old.k_cache)


def test_indexer_runs(cli):
    code, out, _ = cli("check", "--backend", "reference", "--dtype", "fp32", "--generator", "indexer", "--causal")
    assert code == 0 and "context=256 indexer causal; compared 40 rows" in out.splitlines()[0]


@pytest.mark.parametrize("args, needle", [
    (["--generator", "real-prefill"], "needs --case CASE_ID"),
    (["--generator", "real-prefill", "--case", CASE, "--tokens", "8"], "--tokens does not apply to --generator real-prefill"),
    (["--generator", "indexer", "--reuse", "0.5"], "--reuse does not apply to --generator indexer"),
    (["--case", CASE], "--case does not apply to --generator synthetic"),
    (["--generator", "spiky"], "--generator must be one of"),
    (["--requests", "3", "--reuse", "0.5"], "--reuse does not apply to --requests"),
    (["--requests", "3", "--generator", "indexer"], "--requests does not apply to --generator indexer"),
    (["--requests", "41"], "--requests must be between 1 and the 40 query tokens"),
    (["--reuse", "9"], "--reuse: reuse 9 is infeasible"),
])
def test_options_a_workload_does_not_use_are_one_line(cli, one_error_line, args, needle):
    code, _, err = cli("check", "--backend", "reference", "--dtype", "fp32", *args)
    assert code == 2 and needle in one_error_line(err)


def test_a_backend_declares_its_stage_checks_and_a_failing_one_fails_the_check(cli, monkeypatch):
    from msa_bench.kernels import base
    from msa_bench.kernels.reference_backend import ReferenceBackend

    class PlantedStageFault(ReferenceBackend):
        name = "planted-stage-fault"

        def stage_checks(self, plan, workload, rows, tol):
            return {"combine": (False, f"planted on {len(rows)} rows")}

    base.registered_names()
    monkeypatch.setitem(base._REGISTRY, PlantedStageFault.name, PlantedStageFault)
    code, out, _ = cli("check", "--backend", "reference", "--dtype", "fp32")
    assert code == 0 and not [ln for ln in out.splitlines() if " ok " in ln or "FAIL " in ln], out
    code, out, _ = cli("check", "--backend", "planted-stage-fault", "--dtype", "fp32")
    assert code == 1 and "  combine    FAIL planted on 40 rows" in out.splitlines(), out
