"""benchmarks/bounds_gpu.py without a GPU: its write-floor kernel (Triton interpreter) and its
argument errors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from msa_bench.harness import check  # noqa: F401  (sets TRITON_INTERPRET first on a CPU)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bounds_gpu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype,n,block", [(torch.bfloat16, 3000, 1024), (torch.float32, 77, 64)])
def test_store_zeros_writes_every_word(dtype, n, block):
    base = torch.full((n + 64,), 3.0, dtype=dtype, device=DEVICE)
    t = base[:n]
    bounds_gpu.store_zeros(t, block=block)
    assert not t.any()
    assert (base[n:] == 3.0).all()          # the masked tail of the last block is not written


@pytest.mark.parametrize("argv,message", [(["--alias", "0,x"], "--alias wants integers"),
                                          (["--alias", "-4"], "must be >= 0"),
                                          (["--rounds", "0"], "must be >= 0, --rounds and --reps >= 1")])
def test_bad_arguments_exit_2_with_one_line(tmp_path, argv, message):
    assert bounds_gpu.main(["--out", str(tmp_path)] + argv) == 2
    lines = (tmp_path / "bounds_gpu.log").read_text().strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
