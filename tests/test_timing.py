"""The timing protocol on the real reference backend: CPU path here, CUDA graphs on a GPU."""
import pytest
import torch

from msa_bench.harness.measure.timing import MODULE, PLAN, TIMER_CPU, TimingConfig, summarize, time_plan
from msa_bench.scenarios.workload import AttnShape, build_workload
from msa_bench.kernels.base import get_backend


def small_workload(n=12, blocks=4, seed=0):
    shape = AttnShape(hq=8, hkv=2, head_dim=16, block=8, topk=2)
    sel = torch.stack([torch.stack([torch.tensor([(i + h) % blocks, (i + h + 1) % blocks]) for i in range(n)])
                       for h in range(shape.hkv)]).int()
    return build_workload(shape, "bf16", sel, torch.arange(blocks).view(1, -1).int(), torch.zeros(n).int(),
                          torch.full((n,), blocks * shape.block - 1).int(), blocks, causal=False, seed=seed)


def test_time_plan_cpu_stages_module_and_plan():
    plan = get_backend("reference").plan(small_workload())
    cfg = TimingConfig(cpu_warmup=1, cpu_reps=3, cpu_max_reps=6, cv_target=10.0)
    out = time_plan(plan, cfg, "cpu")
    assert list(out) == [PLAN, "attention", "combine", MODULE]
    assert out[PLAN].seconds == [plan.plan_seconds]
    assert all(s.sm_clock_mhz is None and s.clock_event_reasons is None for s in out.values())   # GPU only
    for name in ("attention", "combine", MODULE):
        assert out[name].timer == TIMER_CPU and len(out[name].seconds) == 3
        assert all(s > 0 for s in out[name].seconds)


def test_remeasure_until_cv_or_bound():
    plan = get_backend("reference").plan(small_workload())
    # an impossible CV target forces re-measurement up to the bound
    out = time_plan(plan, TimingConfig(cpu_warmup=0, cpu_reps=2, cpu_max_reps=5, cv_target=1e-12), "cpu")
    assert len(out[MODULE].seconds) == 5 and not out[MODULE].converged


def test_summarize_order_statistics():
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median_s"] == 3.0 and s["p25_s"] == 2.0 and s["p75_s"] == 4.0 and s["iqr_s"] == 2.0
    assert s["n_reps"] == 5 and s["cv"] > 1


def test_timing_config_from_scenario_and_reps():
    cfg = TimingConfig.from_dict({"reps": 30, "warmup": 2, "cold_l2": False}, reps=None)
    assert (cfg.reps, cfg.cpu_reps, cfg.warmup, cfg.cpu_warmup, cfg.cold_l2) == (30, 30, 2, 2, False)
    assert cfg.max_reps >= 30
    cfg = TimingConfig.from_dict({"reps": 30}, reps=7)     # the CLI wins over the scenario
    assert cfg.reps == 7 and cfg.cpu_reps == 7 and cfg.cpu_max_reps == 7
    assert TimingConfig.from_dict(None) == TimingConfig()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_time_plan_gpu_graph_replays():
    from msa_bench.scenarios.reference import reference_attention, relative_error
    from msa_bench.harness.measure.timing import TIMER_GPU
    w = small_workload(n=64, blocks=8).to("cuda")
    plan = get_backend("reference").plan(w)
    out = time_plan(plan, TimingConfig(warmup=2, reps=20, max_reps=40), "cuda")
    for name in ("attention", "combine", MODULE):
        assert out[name].timer == TIMER_GPU and 20 <= len(out[name].seconds) <= 40
        assert all(0 < s < 1 for s in out[name].seconds)
        # the spin-probed SM clock of every sample, and the NVML reason mask (none read here: 0)
        assert len(out[name].sm_clock_mhz) == len(out[name].seconds)
        assert all(200 < c < 3500 for c in out[name].sm_clock_mhz)
        assert out[name].clock_event_reasons == [0] * len(out[name].seconds)
    torch.cuda.synchronize()
    ref, _ = reference_attention(w)          # the last module-graph replay left a correct output
    assert relative_error(plan.output, ref) < 1e-2
