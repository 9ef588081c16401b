"""benchmarks/partial_precision.py: the emulated partial formats round as they claim, and a run at a
small shape writes its table (CPU only; the committed run is results/cpu/partial-precision)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from msa_bench.harness import check  # noqa: F401  (sets TRITON_INTERPRET first on a CPU)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import partial_precision as pp  # noqa: E402


def test_formats_round_as_their_element_types():
    gen = torch.Generator().manual_seed(0)
    o = torch.randn(64, 16, 128, generator=gen, dtype=torch.float64) * 40
    l = torch.rand(64, 16, generator=gen, dtype=torch.float64) * 100 + 1
    bf = pp.round_partials(o, l, "bf16")
    assert torch.equal(bf, o.to(torch.bfloat16).double()) and not torch.equal(bf, o)
    assert ((bf - o).abs() <= o.abs() * 2.0 ** -8).all()
    normal = (o / l.unsqueeze(-1)).abs() >= 2.0 ** -6           # e4m3's normal range: 3 mantissa bits
    for fmt in ("e4m3/l", "e4m3/l row-scaled"):
        r = pp.round_partials(o, l, fmt)
        rel = ((r - o).abs() / o.abs())[normal]
        assert rel.max() <= 2.0 ** -4 + 1e-12 and rel.mean() > 2.0 ** -8
    # a row scaled to e4m3's maximum keeps small values out of the subnormals
    tiny = torch.full((1, 1, 128), 1e-3, dtype=torch.float64)
    one = torch.ones(1, 1, dtype=torch.float64)
    assert (pp.round_partials(tiny, one, "e4m3/l row-scaled") - tiny).abs().max() < 1e-3 * 2.0 ** -4
    assert (pp.round_partials(tiny, one, "e4m3/l") - tiny).abs().max() > 1e-3 * 2.0 ** -4


def test_run_writes_errors_per_format(tmp_path, capsys):
    assert pp.main(["--out", str(tmp_path), "--dtypes", "fp8", "--tokens", "32", "--context", "8192",
                    "--reuse", "2"]) == 0
    data = json.loads((tmp_path / "partial_precision.json").read_text())
    (row,) = data["rows"]
    assert set(row["errors"]) == set(pp.FORMATS) and row["tolerance"] == 5e-2
    assert 0 < row["errors"]["bf16"] < row["errors"]["e4m3/l"] < 0.1


def test_bad_reuse_is_one_line_and_exit_2(tmp_path, capsys):
    assert pp.main(["--out", str(tmp_path), "--reuse", "lots"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --reuse")
    assert pp.main(["--out", str(tmp_path), "--dtypes", "fp8", "--tokens", "32", "--context", "8192",
                    "--reuse", "0.01"]) == 2
    assert "error: fp8 reuse 0.01" in capsys.readouterr().err
