"""Calibration's pure parts: plateau detection, profile assembly/JSON round trip, the plot; the CLI on CPU."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from msa_bench.harness.errors import UserError
from msa_bench.roofline.calibrate import (MIB, build_profile, find_plateaus, l2_and_hbm_plateaus, plot_sweep,
                                          write_profile)
from msa_bench.roofline.devices import load_device

L2 = 60 * MIB
SIZES = [1 << k for k in range(20, 32)]                    # 1 MiB .. 2 GiB


def h200_like_curve():
    """L2 ~8 TB/s up to 16 MiB, a transition, HBM ~3.6 TB/s from 256 MiB (TB/s -> bytes/s)."""
    tb = [7.6, 7.95, 8.1, 8.0, 8.05, 6.1, 4.6, 3.9, 3.62, 3.6, 3.63, 3.61]
    return SIZES, [t * 1e12 for t in tb]


def measurements():
    sizes, bw = h200_like_curve()
    l2, hbm = l2_and_hbm_plateaus(sizes, bw, L2)
    return {"gpu": "NVIDIA H200", "date": "2026-11-29 12:00:00", "sms": 132, "l2_bytes": L2,
            "hbm_read_bytes_per_s": 3.7e12, "hbm_copy_bytes_per_s": 4.19e12,
            "l2_sweep": [{"bytes": s, "repeats": 1, "bytes_per_s": b} for s, b in zip(sizes, bw)],
            "l2_plateau": {"bytes_per_s": l2.level, "from_bytes": sizes[l2.first], "to_bytes": sizes[l2.last]},
            "hbm_plateau": {"bytes_per_s": hbm.level, "from_bytes": sizes[hbm.first], "to_bytes": sizes[hbm.last]},
            "matmul": {"n": 8192, "bf16_flops": 7.88e14, "fp8_flops": 1.435e15},
            "versions": {"torch": "2.11"}, "driver": "580"}


def test_find_plateaus_splits_a_step_curve():
    runs = find_plateaus([8.0, 8.1, 7.9, 5.0, 3.6, 3.62, 3.61])
    assert [(p.first, p.last) for p in runs] == [(0, 2), (4, 6)]
    assert runs[0].level == pytest.approx(8.0) and runs[1].level == pytest.approx(3.61)


def test_find_plateaus_flat_and_noisy():
    assert [(p.first, p.last) for p in find_plateaus([5.0] * 6)] == [(0, 5)]
    assert find_plateaus([1.0, 2.0, 4.0, 8.0]) == []                  # no two neighbours within 10%


def test_l2_and_hbm_plateaus_on_an_h200_like_sweep():
    sizes, bw = h200_like_curve()
    l2, hbm = l2_and_hbm_plateaus(sizes, bw, L2)
    assert l2.level / 1e12 == pytest.approx(8.0, abs=0.06)
    assert sizes[l2.last] <= L2 // 2
    assert hbm.level / 1e12 == pytest.approx(3.615, abs=0.02)
    assert sizes[hbm.last] == 2 << 30
    # order of points does not matter
    l2r, hbmr = l2_and_hbm_plateaus(sizes[::-1], bw[::-1], L2)
    assert (l2r.level, hbmr.level) == (l2.level, hbm.level)


def test_sweep_without_hbm_plateau_is_refused():
    sizes, bw = h200_like_curve()
    with pytest.raises(UserError, match="HBM plateau"):
        l2_and_hbm_plateaus(sizes[:7], bw[:7], L2)                   # stops at 64 MiB
    with pytest.raises(UserError, match="no plateau below half the L2"):
        l2_and_hbm_plateaus(sizes[6:], bw[6:], L2)


def test_profile_json_round_trips_through_devices_loader(tmp_path):
    m = measurements()
    prof = build_profile("h200-calibrated", m)
    assert prof.hbm_bytes_per_s == 4.19e12                             # max(read, copy)
    assert prof.l2_bytes_per_s == pytest.approx(m["l2_plateau"]["bytes_per_s"])
    loaded = write_profile(prof, tmp_path / "cal" / "profile.json")
    assert loaded == load_device(str(tmp_path / "cal" / "profile.json"))
    assert loaded.mma_flops == {"bf16": 7.88e14, "fp8": 1.435e15}
    data = json.loads((tmp_path / "cal" / "profile.json").read_text())
    for key in ("name", "hbm_bytes_per_s", "l2_bytes_per_s", "mma_flops", "l2_bytes", "sms", "measured"):
        assert key in data
    assert data["measured"]["gpu"] == "NVIDIA H200" and data["measured"]["date"]


def test_build_profile_rejects_bad_measurements():
    m = measurements()
    m["matmul"]["bf16_flops"] = 0.0
    with pytest.raises(UserError):
        build_profile("x", m)


def test_plot_is_written(tmp_path):
    png = tmp_path / "bw.png"
    plot_sweep(measurements(), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_calibrate_cli_without_gpu_is_one_line_and_nonzero(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "msa_bench.cli", "calibrate", "--out", str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "GPU" in lines[0]
    assert not (tmp_path / "c").exists()


@pytest.mark.cuda
def test_calibrate_quick_on_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from msa_bench.roofline.calibrate import calibrate
    result = calibrate(tmp_path, quick=True, log=lambda *_: None)
    assert result["profile"].l2_bytes_per_s > result["profile"].measured["hbm_plateau"]["bytes_per_s"]
