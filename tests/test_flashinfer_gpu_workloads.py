"""benchmarks/flashinfer_gpu.py's workload builders on the CPU (no GPU, no FlashInfer): the padded causal
selection that crashed the first H200 run, and the script's --dry-run over its check and timing shapes."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "flashinfer_gpu.py"


@pytest.fixture(scope="module")
def fg():
    spec = importlib.util.spec_from_file_location("flashinfer_gpu_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_causal_workload_pads_short_histories_to_topk(fg):
    # 8 blocks of context, queries 300..999: fewer than topk - 1 earlier blocks exist (was shape (4, 700, 9))
    w = fg.causal_workload(700, 1000, "bf16", 4, "cpu")
    assert tuple(w.selection.shape) == (fg.SHAPE.hkv, 700, fg.SHAPE.topk)
    sel = w.selection.long()
    count = (sel >= 0).sum(-1)
    local = (w.q_limit.long() // fg.SHAPE.block).view(1, -1)
    assert torch.equal(count, local.expand_as(count) + 1)            # every earlier block, then the local one
    assert torch.equal(sel.gather(-1, (count - 1).unsqueeze(-1)).squeeze(-1), local.expand_as(count))
    assert bool((sel[..., -1] == -1).all())                          # padding after, never before
    info = fg.validate_workload(w)
    assert info["padded_rows"] == fg.SHAPE.hkv * 700 and info["valid_per_row_max"] == 8


def test_causal_selection_with_a_long_history_is_full(fg):
    w = fg.causal_workload(64, 3000, "bf16", 2, "cpu")
    assert bool((w.selection >= 0).all())
    fg.validate_workload(w)


def test_validate_workload_rejects_a_broken_selection(fg):
    w = fg.causal_workload(64, 3000, "bf16", 2, "cpu")
    w.selection[0, 0, :2] = w.selection[0, 0, 1]                   # a block twice
    with pytest.raises(ValueError, match="twice"):
        fg.validate_workload(w)


def test_dry_run_builds_every_check_shape_and_the_quick_timing_shape(fg, tmp_path):
    assert fg.main(["--dry-run", "--quick", "--dtypes", "bf16", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "flashinfer_gpu_dry_run.json").read_text())["workloads"]
    labels = [r["shape"] for r in records]
    assert labels == [label for label, _ in fg.check_shapes("cpu")] + ["timed N2048 pool256"]
    assert all(r["ok"] and r["reference_finite"] for r in records)
