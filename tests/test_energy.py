"""roofline/energy.py's budget arithmetic, and on the GPU the board's power limit and energy counter
through NVML (harness/telemetry.py)."""
from __future__ import annotations

import time

import pytest

from msa_bench.roofline.energy import EnergyBudget, above_idle_j, cap_time_s

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


@pytest.mark.cuda
def test_power_limit_and_energy_counter_on_gpu():
    """On the GPU: the board's power limit and energy counter through NVML; the counter grows over work."""
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
    before, t0 = tel.energy_j(), time.perf_counter()
    while time.perf_counter() - t0 < 0.5:          # NVML updates the counter every few ms at most
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    assert tel.energy_j() > before
