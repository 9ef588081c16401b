"""Calibration's pure parts: plateau detection, profile assembly/JSON round trip, the plot; the CLI on CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from msa_bench.errors import UserError
from msa_bench.harness.calibration.ceilings import (MIB, build_profile, find_plateaus, l2_and_hbm_plateaus, l2_window,
                                          plot_sweep, write_profile)
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


def h200_first_run_curve():
    """Synthetic unit-test input for the plateau picker (not a measurement): the shape of the first H200 run's
    sweep (plain loads, L1 not bypassed), MiB -> TB/s. 1-4 MiB are L1 hits, 15-30 MiB is L2, >= 120 MiB HBM."""
    points = {1: 16.9, 2: 12.6, 4: 12.8, 8: 9.7, 15: 7.45, 16: 7.5, 24: 7.55, 32: 7.5, 45: 7.7, 48: 7.9,
              60: 5.6, 64: 5.2, 90: 4.3, 120: 4.18, 128: 4.18, 256: 4.17, 512: 4.18, 1024: 4.19, 2048: 4.18}
    return [int(k * MIB) for k in points], [v * 1e12 for v in points.values()]


def test_l2_plateau_is_taken_from_the_l2_window_not_the_l1_hits():
    sizes, bw = h200_first_run_curve()
    l2, hbm = l2_and_hbm_plateaus(sizes, bw, L2)
    # the L1-served 2-4 MiB run (12.7 TB/s) is the highest plateau overall but lies below L2/8 = 7.5 MiB
    assert any(p.level > 12e12 for p in find_plateaus(bw))
    assert l2_window(L2) == (L2 // 8, L2 // 2)
    assert l2.level / 1e12 == pytest.approx(7.5, abs=0.01)
    assert (sizes[l2.first], sizes[l2.last]) == (15 * MIB, 24 * MIB)    # 8 MiB (9.7) is alone, not a run
    assert all(L2 // 8 <= sizes[k] <= L2 // 2 for k in range(l2.first, l2.last + 1))
    assert hbm.level / 1e12 == pytest.approx(4.18, abs=0.01)
    assert sizes[hbm.first] == 120 * MIB and sizes[hbm.last] == 2048 * MIB       # from 2x the L2
    # only one point in the window: refused with the window named
    keep = [k for k in range(len(sizes)) if not (15 * MIB <= sizes[k] <= 24 * MIB)]
    with pytest.raises(UserError, match="L2/8 .. L2/2"):
        l2_and_hbm_plateaus([sizes[k] for k in keep], [bw[k] for k in keep], L2)


def test_hbm_plateau_survives_a_noisy_last_point():
    """Synthetic input: the tail's last point 15% low. The plateau before it stands; the partly resident
    60-90 MiB points do not join it."""
    sizes, bw = h200_first_run_curve()
    bw = bw[:-1] + [3.5e12]
    l2, hbm = l2_and_hbm_plateaus(sizes, bw, L2)
    assert (sizes[hbm.first], sizes[hbm.last]) == (120 * MIB, 1024 * MIB)
    assert hbm.level / 1e12 == pytest.approx(4.18, abs=0.01)


def test_sweep_without_hbm_plateau_is_refused():
    sizes, bw = h200_like_curve()
    with pytest.raises(UserError, match="HBM plateau"):
        l2_and_hbm_plateaus(sizes[:7], bw[:7], L2)                   # stops at 64 MiB
    with pytest.raises(UserError, match="no plateau below half the L2"):
        l2_and_hbm_plateaus(sizes[6:], bw[6:], L2)


def test_profile_json_round_trips_through_devices_loader(tmp_path):
    m = measurements()
    prof = build_profile("h200-calibrated", m)
    # the ceiling is the read stream the kernels run, never the copy_ (read + write) measured beside it
    assert prof.hbm_bytes_per_s == 3.7e12
    hbm = prof.measured["hbm"]
    assert (hbm["read_bytes_per_s"], hbm["copy_bytes_per_s"], hbm["chosen"]) == (3.7e12, 4.19e12, "read")
    assert hbm["sweep_plateau_bytes_per_s"] == pytest.approx(m["hbm_plateau"]["bytes_per_s"])
    assert "hbm" not in m                                              # the caller's dict is not modified
    assert prof.l2_bytes_per_s == pytest.approx(m["l2_plateau"]["bytes_per_s"])
    loaded = write_profile(prof, tmp_path / "cal" / "profile.json")
    assert loaded == load_device(str(tmp_path / "cal" / "profile.json"))
    assert loaded.mma_flops == {"bf16": 7.88e14, "fp8": 1.435e15}
    data = json.loads((tmp_path / "cal" / "profile.json").read_text())
    for key in ("name", "hbm_bytes_per_s", "l2_bytes_per_s", "mma_flops", "l2_bytes", "sms", "measured"):
        assert key in data
    assert data["measured"]["gpu"] == "NVIDIA H200" and data["measured"]["date"]
    assert data["measured"]["hbm"]["rule"].startswith("hbm_bytes_per_s = the highest read stream")


def test_l2_ceiling_is_the_highest_rate_measured():
    m = measurements()
    plateau = m["l2_plateau"]["bytes_per_s"]
    m["l2_best"] = {"kernel": "read", "bytes_per_s": plateau * 1.1}
    prof = build_profile("h200-calibrated", m)
    assert prof.l2_bytes_per_s == pytest.approx(plateau * 1.1)
    m["l2_best"]["bytes_per_s"] = plateau * 0.9                         # the plateau is higher: it stands
    assert build_profile("x", m).l2_bytes_per_s == pytest.approx(plateau)


def test_build_profile_rejects_bad_measurements():
    m = measurements()
    m["matmul"]["bf16_flops"] = 0.0
    with pytest.raises(UserError):
        build_profile("x", m)


def test_plot_is_written(tmp_path):
    png = tmp_path / "bw.png"
    plot_sweep(measurements(), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = measurements()
    m["l2_plateau"]["window_bytes"] = list(l2_window(L2))             # as run_calibration records it
    plot_sweep(m, tmp_path / "bw2.png")
    assert (tmp_path / "bw2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


INTERPRET_SCRIPT = """
import torch, triton.language
import msa_bench.harness.calibration.ceilings as cal
cal.tl = triton.language        # the interpreter patches the triton.language it finds in the kernel's globals
kernel = cal._read_kernel()
x = torch.arange(8 * 64, dtype=torch.float32)
for bypass in (False, True):
    out = torch.zeros(4, dtype=torch.float32)
    kernel[(4,)](x, out, 8, 8 * 3, BLOCK=64, BYPASS_L1=bypass)     # 8 chunks read 3 times by 4 programs
    assert float(out.sum()) == 3 * float(x.sum()), (bypass, float(out.sum()))
gather = cal._gather_kernel()
idx = torch.tensor([3, 0, 7, 3, 3, 5], dtype=torch.int32)
out = torch.zeros(4, dtype=torch.float32)
gather[(4,)](x, idx, out, 6, BLOCK=64)                              # 6 whole blocks by 4 programs
assert float(out.sum()) == float(x.view(8, 64)[idx.long()].sum()), float(out.sum())
print("ok")
"""


def test_read_kernel_bypass_l1_sums_every_element_in_the_interpreter():
    """The Triton read kernel, plain and .cg loads, and the block gather, in Triton's CPU interpreter (TRITON_INTERPRET must be set
    before triton is imported, hence a subprocess): both flavours sum every element. Bandwidth needs a GPU."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", INTERPRET_SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"


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
    from msa_bench.harness.calibration.ceilings import calibrate
    result = calibrate(tmp_path, quick=True, log=lambda *_: None)
    assert result["profile"].l2_bytes_per_s > result["profile"].measured["hbm_plateau"]["bytes_per_s"]
