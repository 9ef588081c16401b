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
                                          (["--rounds", "0"], "must be >= 0, --rounds and --reps >= 1"),
                                          (["--energy-launches", "-1"], "--energy-launches >= 0")])
def test_bad_arguments_exit_2_with_one_line(tmp_path, argv, message):
    assert bounds_gpu.main(["--out", str(tmp_path)] + argv) == 2
    lines = (tmp_path / "bounds_gpu.log").read_text().strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_energy_is_reported_unavailable_without_a_counter():
    """Where NVML has no energy counter (here: no GPU), the record says so instead of a number."""
    from msa_bench.harness.telemetry import Telemetry
    rec, lines = {"dtype": "bf16"}, []
    bounds_gpu.measure_energy(rec, {"v22": None}, {}, Telemetry(False, "no GPU"), 10, 1e12, lines.append)
    assert rec["energy"].startswith("unavailable") and len(lines) == 1 and "no energy counter" in lines[0]


def test_energy_per_launch_from_the_counter(monkeypatch):
    """J per launch = counter difference over the launches; power = that over the wall time."""
    from msa_bench.harness.telemetry import Telemetry

    class FakeTelemetry(Telemetry):
        def __init__(self):
            super().__init__(True)
            self.reads = iter([100.0, 100.0, 107.0])       # the availability probe, then before and after
        def energy_j(self):
            return next(self.reads)
        def sample(self):          # a real NVML sample's keys
            return {"sm_clock_mhz": 1800.0, "clock_event_reasons": 0x4, "power_w": 690.0}

    class FakeTimer:
        calls = 0
        def _call(self):
            FakeTimer.calls += 1

    clock = iter([10.0, 10.5])
    monkeypatch.setattr(bounds_gpu.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(bounds_gpu.torch.cuda, "synchronize", lambda: None)
    rec, lines = {"dtype": "fp8"}, []
    bounds_gpu.measure_energy(rec, {"v18": None}, {"v18": FakeTimer()}, FakeTelemetry(), 100, 2e12, lines.append)
    e = rec["energy"]["v18"]
    assert FakeTimer.calls == 103 and abs(e["joules_per_launch"] - 0.07) < 1e-12
    assert abs(e["mean_power_w"] - 14.0) < 1e-9 and abs(e["s_per_launch"] - 0.005) < 1e-12
    assert abs(e["gflop_per_joule"] - 2e12 / 0.07 / 1e9) < 1e-6 and len(lines) == 1


def test_gpu_environment_without_a_gpu_is_one_logged_line(monkeypatch):
    """The setup the benchmark scripts share: no CUDA GPU is one error line and None."""
    import cute_gpu
    monkeypatch.setattr(cute_gpu.torch.cuda, "is_available", lambda: False)
    lines = []
    assert cute_gpu.gpu_environment("build/cute", lines.append) is None
    assert lines == ["error: no CUDA GPU visible"]


def test_gpu_environment_exports_the_build_dir(monkeypatch, tmp_path):
    import cute_gpu
    monkeypatch.setattr(cute_gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cute_gpu, "environment", lambda build: {"gpu": "H200", "sms": 132, "torch": "t", "cuda": "13.0",
                                                                "build_dir": str(build)})
    monkeypatch.delenv("MSA_BENCH_CUTE_DIR", raising=False)
    lines = []
    env = cute_gpu.gpu_environment(str(tmp_path), lines.append)
    assert env["build_dir"] == str(tmp_path.resolve()) and cute_gpu.os.environ["MSA_BENCH_CUTE_DIR"] == str(tmp_path.resolve())
    assert len(lines) == 1 and lines[0].startswith("H200 (132 SMs)") and "source hash" in lines[0]


def test_repeater_runs_once_then_on_every_call(monkeypatch):
    """The launcher bounds_gpu and energy_gpu share: one run at construction (before any capture), then
    one per call; eager here (graph capture needs the GPU, which the GPU runs exercise)."""
    monkeypatch.setattr(bounds_gpu.torch.cuda, "synchronize", lambda: None)
    calls = []
    r = bounds_gpu.Repeater(lambda: calls.append(1), graph=False)
    assert len(calls) == 1 and r.graph is None
    r()
    r()
    assert len(calls) == 3


def test_backend_for_takes_a_generation_or_knock_out_with_a_tile_order():
    """GEN[+ORDER]: the knock-out's base generation and the order in config.tile_order's notation;
    without an order the backend picks one per workload; a bad order is one clear error."""
    b = bounds_gpu.backend_for("v23ko-bare+4:p")
    assert b.variant == "v23" and b.order == "4:p"
    b = bounds_gpu.backend_for("v28")
    assert b.variant == "v28" and b.order is None
    with pytest.raises(ValueError):
        bounds_gpu.backend_for("v23+4:x")
