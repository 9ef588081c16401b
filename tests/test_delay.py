"""The planted regression `NAME@delayP`: parsed in one place, on every backend, calibrated to P % of
the module."""
import json
import statistics

import pytest
import torch

from msa_bench.harness.measure.timing import MODULE, TimingConfig, time_plan
from msa_bench.kernels.base import get_backend
from msa_bench.kernels.delay import DELAY_STAGE, split_delay


def test_split_delay():
    assert split_delay("delay5") == (None, 5.0)
    assert split_delay("v28+delay10") == ("v28", 10.0)
    assert split_delay("v23+2:p") == ("v23+2:p", None)
    assert split_delay(None) == (None, None)
    with pytest.raises(ValueError):
        split_delay("delay0")


def test_delay_option_on_any_backend_keeps_the_inner_option():
    b = get_backend("kv-outer-cute@v28+delay5")
    assert b.name == "kv-outer-cute@v28+delay5" and b.percent == 5.0 and b.inner.name == "kv-outer-cute@v28"
    assert get_backend("reference@delay10").inner.name == "reference"
    with pytest.raises(KeyError):
        get_backend("reference@v28+delay5")      # the inner option is still checked
    with pytest.raises(KeyError):
        get_backend("reference@delay0")


def test_delay_costs_the_planted_share_of_the_module_on_cpu(small_workload):
    w = small_workload()
    plan = get_backend("reference@delay50").plan(w)
    assert list(plan.stages)[-1] == DELAY_STAGE
    assert plan.info["delay_percent"] == 50.0 and plan.info["delay_seconds"] > 0
    out = time_plan(plan, TimingConfig(cpu_reps=5, cpu_max_reps=5, cv_target=10.0), "cpu")
    delay = statistics.median(out[DELAY_STAGE].seconds)
    assert delay == pytest.approx(plan.info["delay_seconds"], rel=0.2, abs=2e-4)
    # the output is the inner backend's: the delay changes time only
    clean = get_backend("reference").plan(w)
    assert torch.equal(clean.run(), plan.run())


def test_delay_unit_in_a_sweep_records_the_planted_percent(tmp_path, cli):
    code, out, err = cli("sweep", "--scenario", "smoke", "--backend", "reference,reference@delay20",
                         "--reps", "2", "--out", tmp_path / "run")
    assert code == 0, out + err
    from msa_bench.harness.store.results import load_run
    run = load_run(tmp_path / "run")
    delayed = run.status[run.status["backend"] == "reference@delay20"]
    assert len(delayed) and all(json.loads(i)["delay_percent"] == 20.0 for i in delayed["plan_info"])
    assert (run.samples[run.samples["backend"] == "reference@delay20"]["stage"] == DELAY_STAGE).any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_delay_on_gpu_is_graph_timed_and_calibrated(small_workload):
    plan = get_backend("reference@delay10").plan(small_workload(n=256, blocks=32).to("cuda"))
    assert plan.info["delay_cycles"] > 0
    out = time_plan(plan, TimingConfig(), "cuda")
    delay = statistics.median(out[DELAY_STAGE].seconds)
    assert delay == pytest.approx(plan.info["delay_seconds"], rel=0.15)
    assert all(500 < c < 3000 for c in out[MODULE].sm_clock_mhz)
