"""roofline/energy.py's budget arithmetic and benchmarks/energy_gpu.py without a GPU (stand-ins for
NVML and the launches; the GPU run is recorded in results/h200/bench)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from msa_bench.harness import check  # noqa: F401  (sets TRITON_INTERPRET first on a CPU)
from msa_bench.roofline.energy import EnergyBudget, above_idle_j, cap_time_s

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import energy_gpu  # noqa: E402

FLOPS = 2.0 ** 40          # the perf point's useful FLOPs = one 8192^3 matmul


def test_budget_of_a_target_at_the_power_limit():
    b = EnergyBudget(FLOPS, 600, power_limit_w=700.0, idle_w=100.0)
    assert b.target_s == pytest.approx(FLOPS / 600e12)
    assert b.joules_at_limit == pytest.approx(700.0 * FLOPS / 600e12)
    assert b.above_idle_j == pytest.approx(600.0 * FLOPS / 600e12)
    assert b.gflop_per_j == pytest.approx(600e12 / 700.0 / 1e9)
    # a launch that costs exactly the budget above idle runs at the target when the board is at its cap
    assert b.tflops_at_cap(b.above_idle_j) == pytest.approx(600.0)
    assert b.share(b.above_idle_j / 2) == pytest.approx(0.5)
    assert b.tflops_at_cap(2 * b.above_idle_j) == pytest.approx(300.0)


def test_above_idle_and_cap_time():
    assert above_idle_j(2.0, 0.003, 100.0) == pytest.approx(1.7)
    assert cap_time_s(1.2, 700.0, 100.0) == pytest.approx(0.002)
    with pytest.raises(ValueError, match="not above the idle draw"):
        cap_time_s(1.0, 90.0, 100.0)


class FakeTelemetry:
    available = True
    reason = ""

    def __init__(self, reads):
        self.reads = iter(reads)

    def energy_j(self):
        return next(self.reads)

    def sample(self):
        return {"sm_clock_mhz": 1700.0, "clock_event_reasons": 0x4, "power_w": 690.0}


def test_energy_of_counts_joules_and_time_per_launch(monkeypatch):
    """Three warm-up and three estimate launches, then enough launches for `seconds`, between two
    counter reads; J per launch = the difference over the launches."""
    calls = []
    clock = iter([0.0, 0.003, 10.0, 10.5])    # estimate start/end (1 ms per launch), then the measured run
    monkeypatch.setattr(energy_gpu.time, "perf_counter", lambda: next(clock))
    e = energy_gpu.energy_of(lambda: calls.append(1), FakeTelemetry([50.0, 400.0]), 0.5, sync=lambda: None)
    assert e["launches"] == 500 and len(calls) == 506
    assert e["joules_per_launch"] == pytest.approx(0.7) and e["s_per_launch"] == pytest.approx(0.001)
    assert e["mean_power_w"] == pytest.approx(700.0)
    assert e["slowdown_poll_share"] == 1.0 and e["sm_clock_mean_mhz"] == 1700.0


def test_summary_states_shares_of_the_budget():
    budget = EnergyBudget(FLOPS, 600, 700.0, 100.0)
    med = {"matmul": {"joules_per_launch": 1.0, "s_per_launch": 0.0015, "mean_power_w": 667.0},
           "write": {"joules_per_launch": 0.35, "s_per_launch": 0.0011, "mean_power_w": 318.0}}
    for m in med.values():
        m["above_idle_j"] = above_idle_j(m["joules_per_launch"], m["s_per_launch"], 100.0)
        m["budget_share"] = budget.share(m["above_idle_j"])
        m["tflops"] = FLOPS / m["s_per_launch"] / 1e12
        m["tflops_at_cap"] = budget.tflops_at_cap(m["above_idle_j"])
    rec = {"dtype": "bf16", "target_tflops": 600, "median": med,
           "budget": {"target_s": budget.target_s, "joules_at_limit": budget.joules_at_limit,
                      "above_idle_j": budget.above_idle_j, "gflop_per_j": budget.gflop_per_j,
                      "power_limit_w": 700.0, "idle_w": 100.0}}
    lines = []
    energy_gpu.summarize(rec, lines.append)
    assert lines[0].startswith("bf16: target 600 TFLOP/s = 1.833 ms") and "700 W limit" in lines[0]
    apart = (1.0 - 0.15) + (0.35 - 0.11)
    assert f"{apart:.3f} J above idle = {apart / budget.above_idle_j:.0%}" in lines[-1]


@pytest.mark.parametrize("argv,message", [(["--alias", "x"], "--alias wants integers"),
                                          (["--rounds", "0"], "--rounds and --reps >= 1"),
                                          (["--seconds", "0"], "--seconds and --idle-s > 0")])
def test_bad_arguments_exit_2_with_one_line(tmp_path, argv, message):
    assert energy_gpu.main(["--out", str(tmp_path)] + argv) == 2
    lines = (tmp_path / "energy_gpu.log").read_text().strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_no_gpu_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(energy_gpu.torch.cuda, "is_available", lambda: False)
    assert energy_gpu.main(["--out", str(tmp_path)]) == 2
    lines = (tmp_path / "energy_gpu.log").read_text().strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("error: no CUDA GPU visible")


@pytest.mark.cuda
def test_energy_of_a_real_launch_on_gpu():
    """On the GPU: the board's power limit and energy counter through NVML, and one item's joules."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from msa_bench.harness.telemetry import open_telemetry
    tel = open_telemetry("cuda")
    if not tel.available or tel.energy_j() is None:
        pytest.skip(f"NVML has no energy counter here ({tel.reason})")
    limit = tel.power_limit_w()
    assert limit is not None and 50 < limit < 3000
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    e = energy_gpu.energy_of(lambda: a @ a, tel, 0.3)
    assert e["launches"] >= 5 and e["s_per_launch"] > 0
    assert 0 < e["joules_per_launch"] and 10 < e["mean_power_w"] < 3000
    assert 0 < e["sm_clock_mean_mhz"] < 5000
