"""dense-gather on CPU: the availability rule, the query blocks and runs it plans, and its gather and
SDPA calls executed with torch's math kernel in float64 against the reference (both masking styles:
keys cut + bottom-right causal as for FlashAttention, whole blocks + additive bias as for cuDNN)."""
import pytest
import torch

from msa_bench.harness.measure.check import edge_case_workload
from msa_bench.kernels.base import BackendUnavailable, get_backend
from msa_bench.kernels.dense_gather import CAUSAL, FULL, DenseGather, build_stages, dense_plan
from msa_bench.scenarios.prefill_cases import PrefillCase, prefill_workload
from msa_bench.scenarios.reference import reference_attention, relative_error
from msa_bench.scenarios.selection import synthetic_workload
from msa_bench.scenarios.workload import AttnShape, build_workload

SMALL = AttnShape(hq=8, hkv=2, head_dim=16, block=16, topk=4)


def run_dense(w, kernel):
    dp = dense_plan(w)
    gather, attention, out, _, _ = build_stages(w, dp, kernel, torch.float64)
    out.fill_(float("nan"))
    gather()
    attention()
    return out


@pytest.mark.parametrize("kernel", ["math", "math-bias"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("case", [((64,), (48,)), ((40, 23, 16), (37, 0, 64)), ((5,), (3,))])
def test_real_prefill_matches_the_reference(kernel, dtype, case):
    """Batch 1 and several requests, prefixes aligned or not, early blocks with fewer history blocks."""
    w = prefill_workload(PrefillCase("t", *case), SMALL, dtype)
    assert relative_error(run_dense(w, kernel), reference_attention(w)[0]) < 1e-12


def test_query_blocks_and_runs():
    """Request 0: prefix 37 (block 2 at offset 5) + 40 tokens -> query blocks of 11, 16, 13 tokens seeing 3, 4, 4
    blocks (topk 4: 2 history + local at block 2, then 3 + local); request 1 from position 0: 16 + 7 tokens
    seeing 1 and 2 blocks. Consecutive blocks of one shape share a run (one SDPA call)."""
    w = prefill_workload(PrefillCase("t", (40, 23), (37, 0)), SMALL, "bf16", with_tensors=False)
    dp = dense_plan(w)
    assert dp.groups == 5
    shapes = [(r.start, r.groups, r.rows, r.heads[0].blocks, r.heads[0].kind, r.heads[0].keys) for r in dp.runs]
    assert shapes == [(0, 1, 11, 3, CAUSAL, 2 * 16 + 16), (11, 1, 16, 4, CAUSAL, 3 * 16 + 16),
                      (27, 1, 13, 4, CAUSAL, 3 * 16 + 13), (40, 1, 16, 1, CAUSAL, 16), (56, 1, 7, 2, CAUSAL, 16 + 7)]
    assert all(r.uniform for r in dp.runs)
    assert dp.full_groups == 1
    assert dp.slots.numel() == sum(r.groups * SMALL.hkv * r.width for r in dp.runs)
    # slots are page * Hkv + head of the blocks each (query block, head) selected, local block last
    r = dp.runs[1]
    for h in range(SMALL.hkv):
        got = dp.slots[r.slot + h * r.width: r.slot + (h + 1) * r.width].tolist()
        sel = sorted(x for x in w.selection[h, r.start].tolist() if x >= 0)
        assert got == [int(w.page_table[0, b]) * SMALL.hkv + h for b in sel]


def test_long_prefill_is_one_run_of_full_query_blocks():
    w = prefill_workload(PrefillCase("t", (160,), (64,)), SMALL, "bf16", with_tensors=False)
    dp = dense_plan(w)
    assert [(r.groups, r.rows, r.heads[0].blocks) for r in dp.runs] == [(10, 16, 4)]
    assert dp.full_groups == 10


def test_noncausal_shared_pool_is_full_attention():
    n = 20
    sel = torch.tensor([0, 2, -1, -1], dtype=torch.int32).view(1, 1, 4).expand(SMALL.hkv, n, 4).contiguous()
    w = build_workload(SMALL, "fp8", sel, torch.tensor([[1, 0, 2]], dtype=torch.int32), torch.zeros(n, dtype=torch.int32),
                       torch.full((n,), 39, dtype=torch.int32), 3, False)
    dp = dense_plan(w)
    assert [(r.groups, r.rows, r.heads[0].kind, r.heads[0].keys) for r in dp.runs] == [(1, 16, FULL, 16 + 8),
                                                                                       (1, 4, FULL, 16 + 8)]
    for kernel in ("math", "math-bias"):
        assert relative_error(run_dense(w, kernel), reference_attention(w)[0]) < 1e-12


def test_unavailable_where_query_blocks_do_not_share():
    w = synthetic_workload(SMALL, "bf16", 64, 512, 0.5, causal=True, seed=3, with_tensors=False)
    with pytest.raises(BackendUnavailable) as exc:
        dense_plan(w)
    msg = str(exc.value)
    assert "\n" not in msg and "select the same blocks" in msg
    assert "4 of 4 query blocks (100.0%) do not" in msg
    w = edge_case_workload(SMALL, "bf16", [256], [32], True, seed=1)
    with pytest.raises(BackendUnavailable, match=r"of \d+ query blocks"):
        dense_plan(w)


def test_tokens_with_no_block_get_zeros():
    n = 8
    sel = torch.full((SMALL.hkv, n, 4), -1, dtype=torch.int32)
    sel[0, :, 0] = 0                                   # head 1 selects nothing
    w = build_workload(SMALL, "bf16", sel, torch.tensor([[0]], dtype=torch.int32), torch.zeros(n, dtype=torch.int32),
                       torch.full((n,), 15, dtype=torch.int32), 1, False)
    out = run_dense(w, "math")
    assert bool((out[:, SMALL.group:] == 0).all())
    assert relative_error(out, reference_attention(w)[0]) < 1e-12


def test_options_and_cpu_reason():
    assert get_backend("dense-gather").kernel == "auto"
    assert get_backend("dense-gather@flash").kernel == "flash"
    with pytest.raises(KeyError, match="no kernel"):
        get_backend("dense-gather@fa3")
    reasons = {get_backend("dense-gather").unavailable_reason(dt, "cpu") for dt in ("bf16", "fp8", "fp16")}
    assert reasons == {"dense-gather needs a CUDA GPU (torch SDPA's CUDA kernels); the workload is on cpu"}
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        DenseGather().plan(prefill_workload(PrefillCase("t", (5,), (3,)), SMALL, "bf16"))


def test_the_reason_check_and_the_plan_pack_once(monkeypatch):
    from msa_bench.kernels import dense_gather
    calls = []
    real = dense_gather.dense_plan
    monkeypatch.setattr(dense_gather, "dense_plan", lambda w: calls.append(w) or real(w))
    w = prefill_workload(PrefillCase("tiny", (5, 30), (70, 200)), SMALL, "bf16")
    other = prefill_workload(PrefillCase("tiny", (5, 30), (70, 200)), SMALL, "bf16")
    b = DenseGather()
    first = b._dense_plan(w)
    assert b._dense_plan(w) is first and len(calls) == 1           # the plan reuses the check's packing
    assert b._dense_plan(other) is not first and len(calls) == 2     # another workload packs its own
