"""kv-outer-cute, q-packed-cute and the hybrid dispatched from C++ (@op) against their Python dispatch, bitwise: output,
LSE and every intermediate buffer, on each workload family and tile order or tile size; in CUDA-graph
capture and under torch.compile through the torch op."""
from __future__ import annotations

import pytest
import torch

from msa_bench.harness.measure.check import edge_case_workload
from msa_bench.kernels.base import get_backend
from msa_bench.scenarios.prefill_cases import get_case, prefill_workload
from msa_bench.scenarios.selection import synthetic_workload
from msa_bench.scenarios.serving import serving_workload
from msa_bench.scenarios.workload import AttnShape

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = AttnShape(hq=64, hkv=4, head_dim=128, block=128, topk=16)
WORKLOADS = {
    "prefill-short": lambda d: prefill_workload(get_case("prefill_092e27340df8621a02f0"), SHAPE, d, seed=2,
                                                device="cuda"),
    "prefill-27k": lambda d: prefill_workload(get_case("prefill_34d5c963ddbc73bd8549"), SHAPE, d, seed=1,
                                              device="cuda"),
    "synthetic-causal": lambda d: synthetic_workload(SHAPE, d, 2048, 65536, 0.25, causal=True, seed=3,
                                                     device="cuda"),
    "drift-causal": lambda d: serving_workload(SHAPE, d, "drift", 1536, 40960, drift=0.07, seed=8, device="cuda"),
    "edge-noncausal": lambda d: edge_case_workload(SHAPE, d, [2600, 900], [29, 21], False, hot=0.3, pad=0.5,
                                                   empty=3, seed=6, device="cuda"),
    "no-keys": lambda d: edge_case_workload(SHAPE, d, [1000], [13], False, empty=13, seed=7, device="cuda"),
    "decode": lambda d: serving_workload(SHAPE, d, "decode", None, 32768, context_min=8192, requests=64, seed=9,
                                         device="cuda"),
}
# kv-outer-cute: the workload's own tile order (key order on these), phases over 2 ranges, chunks of 8;
# q-packed-cute: the rule's tiles, and 12-token tiles forced; the hybrid merging in its combine, and in the
# packed epilogue
VARIANTS = [("kv-outer-cute", ""), ("kv-outer-cute", "2:p"), ("kv-outer-cute", "4:8"),
            ("q-packed-cute", ""), ("q-packed-cute", "p12"), ("hybrid", ""), ("hybrid", "fused")]


_CACHE: dict = {}


def _plans(name: str, dtype: str, backend: str, option: str):
    python, op = backend + (f"@{option}" if option else ""), f"{backend}@op" + (f"+{option}" if option else "")
    for b in (python, op):
        reason = get_backend(b).unavailable_reason(dtype, "cuda")
        if reason:
            pytest.skip(reason)
    if (name, dtype) not in _CACHE:
        _CACHE[(name, dtype)] = WORKLOADS[name](dtype)
    w = _CACHE[(name, dtype)]
    return w, get_backend(python).plan(w), get_backend(op).plan(w)


def _same(a, b) -> None:
    """Bit for bit (NaN included)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _nan_run(plan) -> None:
    """Run `plan` into a NaN-filled output and LSE, and wait for it."""
    plan.output.fill_(float("nan"))
    plan.lse.fill_(float("nan"))
    plan.run()
    torch.cuda.synchronize()


@pytest.mark.parametrize("backend,option", VARIANTS)
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_op_computes_the_python_dispatch_bitwise(name, dtype, backend, option):
    _, python, op = _plans(name, dtype, backend, option)
    assert op.info["dispatch"].startswith("C++")
    for plan in (python, op):
        _nan_run(plan)
    _same(python.output, op.output)
    _same(python.lse, op.lse)
    for key, buf in python.buffers.items():
        if key.split(".")[-1] in ("o_part", "m_part", "l_part"):      # rows past the tiles are never written
            continue
        _same(buf, op.buffers[key])


def test_the_op_plan_replays_in_a_graph_as_it_runs(graph_replay_equals_eager):
    for backend in ("kv-outer-cute", "q-packed-cute"):
        _, _, op = _plans("prefill-short", "bf16", backend, "")
        graph_replay_equals_eager(op)


def test_graph_capture_and_torch_compile_run_the_same_bits():
    from msa_bench.kernels.dispatch.torch_op import register, unregister
    _, python, op = _plans("synthetic-causal", "bf16", "kv-outer-cute", "")
    python.run()
    program = op.stages["combine"].program
    handle = register(program)
    try:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            torch.ops.msa_bench.run_program(op.output, op.lse, handle)
        op.output.zero_()
        graph.replay()
        torch.cuda.synchronize()
        _same(python.output, op.output)

        @torch.compile(fullgraph=True)
        def forward(out, lse):
            torch.ops.msa_bench.run_program(out, lse, handle)
            return out.float().sum()

        op.output.zero_()
        total = forward(op.output, op.lse)
        torch.cuda.synchronize()
        _same(python.output, op.output)
        assert torch.isfinite(total)
    finally:
        unregister(handle)


@pytest.mark.parametrize("backend", ["kv-outer-cute", "q-packed-cute", "hybrid"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("name", ["prefill-short", "drift-causal", "decode"])
def test_the_module_as_one_graph_launch_computes_the_op_bitwise(name, dtype, backend, graph_replay_equals_eager):
    w, _, op = _plans(name, dtype, backend, "")
    graph = get_backend(f"{backend}@graph").plan(w)
    assert "CUDA graph" in graph.info["dispatch"]
    for plan in (op, graph, graph):                 # the graph launched twice: the second reads no first-run state
        _nan_run(plan)
        _same(op.output, plan.output)
        _same(op.lse, plan.lse)
    graph_replay_equals_eager(graph)                # under capture it adds its steps, not a graph launch
