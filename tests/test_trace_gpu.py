"""benchmarks/trace_gpu.py on the CPU: reading phase stamps out of m_part, the per-phase summary, the
timeline figure, and one-line argument errors. The trace build itself runs on the GPU (issue note)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trace_gpu  # noqa: E402

from msa_bench.kernels.cute import manifest as mf  # noqa: E402

SCRIPT = Path(trace_gpu.__file__)


def synthetic_m_part(cta_range, step=1000.0, lag=(0.0, 250.0)):
    """Stamps as a trace build writes them: iteration i of a CTA starts at i * step; warpgroup 1 runs
    `lag` cycles behind; phase k of an iteration at top + 100 k."""
    tiles = max(e for _, e in cta_range)
    m = torch.full((tiles * trace_gpu.ROWS,), -7.0)
    for begin, end in cta_range:
        for i in range(end - 1 - begin):
            for w in range(trace_gpu.WARPS):
                for k in range(len(trace_gpu.PHASES)):
                    m[(begin + i) * trace_gpu.ROWS + 16 * w + k] = i * step + lag[w // 4] + 100.0 * k
    return m


def test_trace_builds_are_diagnostic_configs():
    names = {c.variant + c.dtype for c in mf.knockout_configs()}
    assert {"v22trbf16", "v18trbf16", "v18trfp8"} <= names and "v22trfp8" not in names   # v22 is bf16 only
    assert mf.trace_base("v22tr") == "v22" and mf.trace_base("v18") is None and mf.trace_base("v99tr") is None
    assert len(trace_gpu.SPANS) == len(mf.TRACE_PHASES)


def test_stamps_and_summary():
    cta_range = [(0, 6), (6, 10), (10, 11)]
    per_cta = trace_gpu.stamps_of(synthetic_m_part(cta_range), torch.tensor(cta_range))
    assert [t.shape[0] for t in per_cta] == [5, 3, 0]          # a CTA's last tile is not traced
    rec = trace_gpu.summarize(per_cta)
    assert rec["iterations"] == 4 + 2
    assert rec["iteration_cycles"]["wg0"]["median"] == 1000.0
    for name, _, _ in trace_gpu.SPANS[:-1]:
        assert rec["phases"][name]["wg1"]["mean"] == 100.0
    assert rec["phases"]["loop tail"]["wg0"]["mean"] == 300.0
    assert abs(sum(p["wg0"]["share"] for p in rec["phases"].values()) - 1.0) < 1e-9
    assert rec["wg_issue_offset_share"]["median"] == 0.25


def test_timeline_figure(tmp_path):
    cta_range = [(0, 12)]
    (st,) = trace_gpu.stamps_of(synthetic_m_part(cta_range), torch.tensor(cta_range))
    png = tmp_path / "t.png"
    trace_gpu.plot_timeline(st, png, "synthetic", first=2, count=4)
    assert png.stat().st_size > 5000


@pytest.mark.parametrize("args, msg", [(["--dtypes", "fp16"], "--dtypes from"),
                                       (["--impls", "v18"], "--impls from"),
                                       (["--alias", "x"], "--alias wants integers")])
def test_bad_arguments_are_one_line(args, msg, tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    err = (proc.stdout + proc.stderr).strip().splitlines()
    assert any(msg in line for line in err) and "Traceback" not in proc.stderr
