"""msa-scatter: slot mapping, scatter epilogue and slot combine against the float64 reference
(CPU interpreter for fp32/fp16/fp8; bf16 and CUDA-graph replay on a GPU)."""
import pytest
import torch

from msa_bench.harness.measure.check import edge_case_workload, tolerance  # sets TRITON_INTERPRET first
from msa_bench.scenarios.reference import reference_attention, relative_error
from msa_bench.scenarios.workload import AttnShape
from msa_bench.kernels.base import get_backend
from msa_bench.kernels.kv_outer import stage_checks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp8 MMAs on the GPU reduce over >= 32 elements (check_shape): the same tests there take 32-token blocks
SHAPE = AttnShape(hq=8, hkv=2, head_dim=32, block=32 if DEVICE == "cuda" else 16, topk=4)
CASES = {
    "random-padded-2req": ([200, 120], [21, 16], False, 0.0, 0.4, 2),
    "causal-skewed": ([300], [29], True, 0.8, 0.2, 0),
}


def workload(case, dtype, shape=SHAPE):
    kv_lens, tokens, causal, hot, pad, empty = CASES[case]
    return edge_case_workload(shape, dtype, kv_lens, tokens, causal, hot, pad, empty, seed=3, device=DEVICE)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "fp8"])
@pytest.mark.parametrize("case", list(CASES))
def test_slots_and_output_match_reference(case, dtype, poisoned_run):
    w = workload(case, dtype)
    plan = get_backend("msa-scatter").plan(w)
    poisoned_run(plan)
    tol = tolerance(dtype)
    for stage, (ok, msg) in stage_checks.stage_checks(plan, w, torch.arange(w.n_tokens, device=w.device), tol).items():
        assert ok, f"{stage}: {msg}"
    ref_out, ref_lse = reference_attention(w)
    assert relative_error(plan.output, ref_out) <= tol
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(plan.lse), empty)
    assert relative_error(plan.lse[~empty], ref_lse[~empty]) <= tol


def test_slot_is_rank_among_valid_blocks():
    w = workload("random-padded-2req", "fp32")
    # a padding hole in the middle: the slot must still be the rank among valid blocks
    pages = w.pages.clone()
    a, b = w.page_table[int(w.q_request[0]), :2].tolist()
    pages[0, 0] = torch.tensor([a, -1, b, -1], dtype=torch.int32)
    w.pages = pages
    plan = get_backend("msa-scatter").plan(w)
    plan.stages["index_map"]()
    buf = plan.buffers
    slots = {}                                   # (head, query, page) -> slot written by the slot map
    for key in range(pages.shape[0] * w.num_pages):
        h, page = divmod(key, w.num_pages)
        for j in range(int(buf["csr_ptr"][key]), int(buf["csr_ptr"][key + 1])):
            slots[(h, int(buf["csr_query"][j]), page)] = int(buf["edge_slot"][j])
    assert slots[(0, 0, a)] == 0 and slots[(0, 0, b)] == 1          # the planted row, written out
    for h in range(pages.shape[0]):              # every other row: valid entries before it, counted
        for q in range(pages.shape[1]):
            row = pages[h, q].tolist()
            for r, page in enumerate(row):
                if page >= 0:
                    assert slots.pop((h, q, page)) == sum(1 for x in row[:r] if x >= 0)
    assert not slots                             # and no edge the selection does not hold


@pytest.mark.parametrize("topk", [3, 6, 16])
def test_slot_map_for_any_topk(topk):
    """The one-pass slot map (top-k rows padded to a power of two inside the kernel) against the
    direct construction: csr_query = the edge's token, edge_slot = valid ranks up to it, minus one."""
    from msa_bench.kernels.msa_scatter.index_map import SlotIndexMap
    gen = torch.Generator().manual_seed(topk)
    pages = torch.randint(-1, 9, (2, 37, topk), generator=gen).to(torch.int32).to(DEVICE)
    m = SlotIndexMap(pages, 9, 4)
    m()
    rank = torch.cumsum((pages >= 0).to(torch.int32), -1) - 1
    assert torch.equal(m.edge_slot.long(), rank.view(-1)[m.perm].long())
    assert torch.equal(m.csr_query.long(), torch.div(m.perm, topk, rounding_mode="floor") % 37)


def test_unwritten_slots_are_never_read(poisoned_run):
    w = workload("random-padded-2req", "fp16")
    plan = get_backend("msa-scatter").plan(w)
    poisoned_run(plan)
    assert torch.isnan(plan.buffers["o_slot"]).any()        # padding slots stay poisoned...
    assert torch.isfinite(plan.output).all()                  # ...and the combine never reads them


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cuda_bf16_fp8_and_graph_replay(dtype, graph_replay_equals_eager, poisoned_run):
    # block 32: fp8 MMAs on the GPU need a reduction of at least 32 (the P V dot reduces over the block)
    w = workload("causal-skewed", dtype, shape=AttnShape(hq=8, hkv=2, head_dim=32, block=32, topk=4))
    plan = get_backend("msa-scatter").plan(w)
    poisoned_run(plan)
    ref_out, _ = reference_attention(w)
    assert relative_error(plan.output, ref_out) <= tolerance(dtype)
    graph_replay_equals_eager(plan)


@pytest.mark.parametrize("dtype", ["fp32", "fp8"])
def test_chunked_grid_and_64_row_tiles(dtype, poisoned_run):
    """msa-scatter with the attention launch configurations of kv-outer (chunked grid, 64-row tiles)."""
    from msa_bench.kernels.kv_outer.config import KVOuterConfig
    w = workload("causal-skewed", dtype)
    plan = get_backend("msa-scatter").__class__(config=KVOuterConfig(tile_q=4, attn_chunk=3)).plan(w)
    assert plan.stages["attention"].chunk == 3
    poisoned_run(plan)
    ref_out, ref_lse = reference_attention(w)
    tol = tolerance(dtype)
    assert relative_error(plan.output, ref_out) <= tol
    empty = torch.isinf(ref_lse)
    assert relative_error(plan.lse[~empty], ref_lse[~empty]) <= tol
