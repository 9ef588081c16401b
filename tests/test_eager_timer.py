"""The eager timer (sweep --timer eager): its bookkeeping from recorded stamps, the timer on the CPU's
reference backend, the runs that carry it, compare refusing to mix timers, the report side by side, and
on a GPU the same against CUDA-graph replay."""
import json
import time

import pandas as pd
import pytest
import torch

from msa_bench.harness.measure.timing import (EAGER, MODULE, PER_STEP, PLAN, PLAN_STEP, TIMER_CPU_EAGER, TIMER_HOST,
                                              TimingConfig, eager_call, time_plan, timer_for, timer_mode)
from msa_bench.errors import UserError
from msa_bench.harness.store.results import load_run
from msa_bench.harness.store.seal import seal_unit
from msa_bench.kernels.base import get_backend
from msa_bench.scenarios.workload import AttnShape

GRID = ["--scenario", "smoke", "--backend", "reference", "--dtype", "fp32", "--reuse", "0.5", "--reps", "3"]


def test_eager_call_bookkeeping_from_stamps():
    # host: t0 10, stage calls (10.5, 12) and (13, 13.5), synchronize returns at 20
    # device: spans (0, 4) and (6, 7): the second stage waited 2 s for its launch
    call = eager_call(10.0, [(10.5, 12.0), (13.0, 13.5)], 20.0, [(0.0, 4.0), (6.0, 7.0)])
    assert call.wall_s == 10.0
    assert call.launch_s == (1.5, 0.5)
    assert call.device_s == (4.0, 1.0)
    assert call.gap_s == (0.0, 2.0)


@pytest.mark.parametrize("calls, done, spans", [
    ([(10.5, 12.0), (11.0, 13.5)], 20.0, [(0.0, 4.0), (6.0, 7.0)]),     # the second call began inside the first
    ([(10.5, 12.0), (13.0, 13.5)], 13.0, [(0.0, 4.0), (6.0, 7.0)]),     # done before the last call returned
    ([(10.5, 12.0), (13.0, 13.5)], 20.0, [(0.0, 4.0), (3.0, 7.0)]),     # the device ran two stages at once
    ([(10.5, 12.0)], 20.0, [(0.0, 4.0), (6.0, 7.0)]),                   # a span without its call
])
def test_eager_call_refuses_stamps_out_of_order(calls, done, spans):
    with pytest.raises(ValueError):
        eager_call(10.0, calls, done, spans)


def test_eager_call_of_a_module_called_once():
    # one call (10.5, 12.5) runs both stages; their own host times (0.75, 0.5) come from the stage pass
    call = eager_call(10.0, [(10.5, 12.5)], 20.0, [(0.0, 4.0), (6.0, 7.0)], [0.75, 0.5])
    assert call.launch_s == (0.75, 0.5) and call.module_launch_s == 2.0
    assert call.wall_s == 10.0 and call.gap_s == (0.0, 2.0)
    with pytest.raises(ValueError):             # a stage launch per span
        eager_call(10.0, [(10.5, 12.5)], 20.0, [(0.0, 4.0), (6.0, 7.0)], [0.75])


def test_eager_calls_a_plans_module_once_and_times_its_stages_alone(small_workload):
    plan = get_backend("reference").plan(small_workload())
    stages, log = dict(plan.stages), []

    def logged(name):
        def run():
            log.append(name)
            stages[name]()
        return run
    plan.stages = {name: logged(name) for name in stages}

    def module():                               # what a C++ program's one call is: every stage, and its cost
        log.append("module")
        for fn in stages.values():
            fn()
        time.sleep(0.003)
    plan.module = module
    out = time_plan(plan, TimingConfig(cpu_warmup=0, cpu_reps=3, cpu_max_reps=3, cv_target=10.0, timer=EAGER), "cpu")
    assert log.count("module") == 3             # once a sample (a CPU clock runs no warm call)
    assert log.count("attention") == log.count("combine") == 3    # each sample's stage pass
    for i in range(3):
        assert out[MODULE].launch_s[i] >= 0.003 and out[MODULE].seconds[i] >= 0.003
        assert out["attention"].launch_s[i] < 0.003 and out["combine"].launch_s[i] < 0.003


def test_timer_names_follow_device_and_mode():
    assert timer_for("cuda", EAGER) == "cuda-eager" and timer_for("cpu", EAGER) == TIMER_CPU_EAGER
    assert timer_mode("cuda-eager") == EAGER and timer_mode("cuda-graph") != EAGER and timer_mode("cpu") != EAGER


def test_eager_on_cpu_times_launches_and_the_per_step_plan(small_workload):
    plan = get_backend("reference").plan(small_workload())
    calls = []

    def step():                 # per-step host work of a known length
        calls.append(1)
        time.sleep(0.002)
    plan.step = step
    cfg = TimingConfig(cpu_warmup=1, cpu_reps=4, cpu_max_reps=4, cv_target=10.0, timer=EAGER)
    out = time_plan(plan, cfg, "cpu")
    assert list(out) == [PLAN, PLAN_STEP, "attention", "combine", MODULE]
    assert len(calls) == 5                                  # warm-up and every sample call it once
    step_s = out[PLAN_STEP]
    assert step_s.timer == TIMER_HOST and step_s.per_step and min(step_s.seconds) >= 0.002
    for name in ("attention", "combine", MODULE):
        s = out[name]
        assert s.timer == TIMER_CPU_EAGER and len(s.seconds) == 4 and len(s.launch_s) == 4 and len(s.gap_s) == 4
        assert all(x > 0 for x in s.seconds) and all(g >= 0 for g in s.gap_s)
        # each call's host probe, the same on every stage of it, and a real launch time
        assert s.host_probe_s == out[MODULE].host_probe_s and all(0 < p < 0.01 for p in s.host_probe_s)
    for i in range(4):
        stages = out["attention"].launch_s[i] + out["combine"].launch_s[i]
        assert out[MODULE].launch_s[i] == pytest.approx(stages)
        # the wall-clock holds the launches, not the per-step plan that came before them
        assert stages <= out[MODULE].seconds[i] < stages + 0.002
        assert out["combine"].gap_s[i] == out[MODULE].gap_s[i]


def test_eager_remeasures_until_cv_or_bound(small_workload):
    plan = get_backend("reference").plan(small_workload())
    out = time_plan(plan, TimingConfig(cpu_warmup=0, cpu_reps=2, cpu_max_reps=5, cv_target=1e-12, timer=EAGER), "cpu")
    assert len(out[MODULE].seconds) == 5 and not out[MODULE].converged
    assert PLAN_STEP not in out                             # the reference plans nothing per step


def test_bad_timer_is_one_line(tmp_path, cli, one_error_line):
    code, _, err = cli("sweep", *GRID, "--timer", "lazy", "--out", tmp_path / "r")
    assert code == 2 and "--timer must be graph or eager" in one_error_line(err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cli):
    """A smoke sweep timed each way."""
    root = tmp_path_factory.mktemp("timers")
    for timer in ("graph", "eager"):
        code, _, err = cli("sweep", *GRID, "--timer", timer, "--out", root / timer)
        assert code == 0, err
    return root


def test_an_eager_run_carries_its_timer_and_rows(runs):
    run = load_run(runs / "eager")
    assert run.timer == TIMER_CPU_EAGER and run.meta["timing"]["timer"] == EAGER
    assert "--timer eager" in run.meta["resume_command"]
    assert set(run.status["timer"]) == {TIMER_CPU_EAGER}
    s = run.samples[run.samples["stage"] != PLAN]
    assert s["launch_s"].notna().all() and s["gap_s"].notna().all() and (s["host_probe_s"] > 0).all()
    module = run.value("launch_median_s")
    assert len(module) == len(run.status) and (module["value"] > 0).all()
    assert load_run(runs / "graph").timer == "cpu"


@pytest.mark.parametrize("statistic", ["launch_median_s", "host_probe_median_s"])
def test_an_edited_launch_median_is_damage(runs, tmp_path, statistic):
    import shutil
    copy = tmp_path / "eager"
    shutil.copytree(runs / "eager", copy)
    unit = sorted((copy / "units").iterdir())[0]
    stats = pd.read_parquet(unit / "stats.parquet")
    assert (stats["statistic"] == statistic).any()
    stats.loc[stats["statistic"] == statistic, "value"] *= 0.5
    stats.to_parquet(unit / "stats.parquet", index=False)
    seal_unit(unit)                     # sealed as written: only the content check can tell
    with pytest.raises(UserError, match=statistic):
        load_run(copy)


def test_resume_refuses_another_timer(runs, cli, one_error_line):
    code, _, err = cli("sweep", *GRID, "--out", runs / "eager", "--resume")
    assert code == 2 and "timed by 'cpu-eager'" in one_error_line(err)


def test_compare_refuses_runs_of_different_timers(runs, cli, one_error_line):
    for base, new in (("graph", "eager"), ("eager", "graph")):
        code, _, err = cli("compare", runs / base, runs / new)
        assert code == 2 and "compare runs of one timer" in one_error_line(err)
    code, out, _ = cli("compare", runs / "eager", runs / "eager")
    assert code == 0, out


def test_report_sets_graph_and_eager_side_by_side(runs, tmp_path, cli):
    code, _, err = cli("report", runs / "graph", "--beside", runs / "eager", "--out", tmp_path / "rep")
    assert code == 0, err
    text = (tmp_path / "rep" / "summary.md").read_text()
    section = text.split("## Eager against graph")[1].split("\n## ")[0]
    header = next(ln for ln in section.splitlines() if ln.startswith("| backend"))
    assert "| module_us graph | module_us eager | eager/graph |" in header
    rows = [ln for ln in section.splitlines() if ln.startswith("| reference")]
    graph, eager = load_run(runs / "graph"), load_run(runs / "eager")
    assert len(rows) == len(eager.status)
    from msa_bench.harness.report.timers import eager_table
    table = eager_table(eager, graph)
    g = graph.value("median_s").set_index("point_key")["value"] * 1e6
    e = eager.value("median_s").set_index("point_key")["value"] * 1e6
    ratio = (e / g).sort_values().to_numpy()
    assert sorted(table["eager/graph"]) == pytest.approx(ratio)
    # either order names the same pair
    code, _, err = cli("report", runs / "eager", "--beside", runs / "graph", "--out", tmp_path / "rep2")
    assert code == 0, err
    assert "| module_us graph | module_us eager | eager/graph |" in (tmp_path / "rep2" / "summary.md").read_text()


def test_report_beside_a_run_of_the_same_timer_is_one_line(runs, tmp_path, cli, one_error_line):
    code, _, err = cli("report", runs / "eager", "--beside", runs / "eager", "--out", tmp_path / "rep")
    assert code == 2 and "pairs a graph-timed and an eager-timed run" in one_error_line(err)


# ---- on a GPU -----------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_eager_output_equals_graph_replay_and_times_add_up(small_workload):
    from msa_bench.harness.measure.timing import TIMER_GPU_EAGER
    w = small_workload(n=64, blocks=8).to("cuda")
    graph_plan = get_backend("reference").plan(w)
    time_plan(graph_plan, TimingConfig(warmup=1, reps=20, max_reps=20), "cuda")
    eager_plan = get_backend("reference").plan(w)
    out = time_plan(eager_plan, TimingConfig(warmup=1, reps=20, max_reps=40, timer=EAGER), "cuda")
    torch.cuda.synchronize()
    assert torch.equal(graph_plan.output, eager_plan.output)
    m = out[MODULE]
    assert m.timer == TIMER_GPU_EAGER and len(m.seconds) >= 20 and m.clock_event_reasons is not None
    for i in range(len(m.seconds)):
        assert m.seconds[i] >= m.launch_s[i] > 0
        assert out["attention"].seconds[i] > 0 and out["combine"].gap_s[i] >= 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["flashinfer", "flashinfer-packed"])
def test_gpu_flashinfer_plan_is_timed_per_step(name):
    from msa_bench.harness.measure.check import compare_output
    from msa_bench.scenarios.coselection import coselected_workload
    backend = get_backend(name)
    # the study's shape (FlashInfer's head dim and page size), tokens of a tile selecting alike
    w = coselected_workload(AttnShape(), "bf16", 64, 8192, 1.0, 1.0, group=8, seed=0, device="cuda")
    if backend.workload_unavailable_reason(w):
        pytest.skip(backend.workload_unavailable_reason(w))
    plan = backend.plan(w)
    assert plan.step is not None
    out = time_plan(plan, TimingConfig(warmup=1, reps=20, max_reps=20, timer=EAGER), "cuda")
    assert out[PLAN_STEP].per_step and out[PLAN_STEP].timer == TIMER_HOST and min(out[PLAN_STEP].seconds) > 0
    err, tol, _ = compare_output(plan, w, None, name)        # replanned every step, still right
    assert err <= tol


def test_per_step_is_a_statistic_of_the_stage_row(small_workload):
    from msa_bench.harness.running.runner import Runner
    from msa_bench.scenarios.grid import point_from_options
    plan = get_backend("reference").plan(small_workload())
    plan.step = lambda: None
    samples = time_plan(plan, TimingConfig(cpu_reps=2, cpu_max_reps=2, timer=EAGER), "cpu")
    point = point_from_options("synthetic", small_workload().shape, "fp32", tokens=12, context=32, reuse=0.5)
    runner = Runner.__new__(Runner)
    runner.timer = TIMER_CPU_EAGER
    stats, raw = runner._timing_rows(point, "reference", samples, {})
    per_step = {r["stage"] for r in stats if r["statistic"] == PER_STEP}
    assert per_step == {PLAN_STEP} and all(r["value"] == 1.0 for r in stats if r["statistic"] == PER_STEP)
    assert {r["stage"] for r in raw if "launch_s" in r} == {"attention", "combine", MODULE}
    assert json.dumps(stats)                                # plain values, as a unit's file holds them


def test_the_report_says_how_fast_the_host_was():
    from msa_bench.harness.report.timers import host_state_line
    table = pd.DataFrame({"backend": ["a", "b", "b"], "probe_us": [8.0, 8.2, 12.0]})
    (line, _) = host_state_line(table)
    assert "median 8.20 us a launch, 8.00-12.00" in line and "1 unit(s) ran while the host was over 1.2x" in line
    assert "(b)" in line
    assert "No unit ran" in host_state_line(table.iloc[:2])[0]
    assert host_state_line(pd.DataFrame({"backend": ["a"], "probe_us": [float("nan")]})) == []
