"""Bitwise determinism (on the GPU where there is one, else the CPU): a plan run twice, a fresh plan of the same workload, and a separate
process give the same output and LSE, bit for bit (the schedules are atomic-free)."""
import subprocess
import sys

import pytest
import torch

from msa_bench.harness.measure.check import edge_case_workload  # sets TRITON_INTERPRET first
from msa_bench.kernels.base import get_backend
from msa_bench.scenarios.workload import AttnShape

SHAPE = dict(hq=8, hkv=2, head_dim=32, block=16, topk=4)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASE = dict(kv_lens=[200, 120], tokens=[21, 16], causal=False, hot=0.5, pad=0.3, empty=2, seed=5, device=DEVICE)

SCRIPT = """
import sys, torch
from msa_bench.harness.measure.check import edge_case_workload
from msa_bench.kernels.base import get_backend
from msa_bench.scenarios.workload import AttnShape
plan = get_backend(sys.argv[1]).plan(edge_case_workload(AttnShape(**{shape!r}), sys.argv[2], **{case!r}))
plan.run()
torch.save((plan.output, plan.lse), sys.argv[3])
"""


def run(backend: str, dtype: str):
    plan = get_backend(backend).plan(edge_case_workload(AttnShape(**SHAPE), dtype, **CASE))
    plan.run()
    return plan


def same(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))     # bitwise, NaN-safe


@pytest.mark.parametrize("backend, dtype", [("kv-outer", "fp16"), ("msa-scatter", "fp32")])
def test_output_and_lse_are_bitwise_reproducible(backend, dtype, tmp_path):
    plan = run(backend, dtype)
    out, lse = plan.output.clone(), plan.lse.clone()
    plan.output.fill_(float("nan"))
    plan.lse.fill_(float("nan"))
    plan.run()                                                              # the same plan again
    assert same(plan.output, out) and same(plan.lse, lse)
    fresh = run(backend, dtype)                                             # a fresh workload and plan
    assert same(fresh.output, out) and same(fresh.lse, lse)
    path = tmp_path / "out.pt"                                              # another process
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(shape=SHAPE, case=CASE), backend, dtype, str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    other_out, other_lse = torch.load(path)
    assert same(other_out, out) and same(other_lse, lse)
