"""The eager regime of the model: the host cost per stage launch and per-step planning that `calibrate`
measures (fixed_costs "host"), added by predict_module, and `auto@eager`'s pick following it."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from msa_bench.harness.measure.check import CPU_SHAPE  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)
from msa_bench.harness.calibration import fixed_costs
from msa_bench.harness.measure.timing import MODULE, PLAN_STEP, TimingConfig
from msa_bench.kernels import auto as auto_mod
from msa_bench.kernels.auto import auto_line
from msa_bench.kernels.base import get_backend
from msa_bench.harness.store.results import load_run
from msa_bench.roofline.devices import PRESETS, fixed_costs_problem, run_profile
from msa_bench.roofline.model import EAGER
from msa_bench.roofline.predict import predict_module, weigh_reason
from msa_bench.scenarios.coselection import coselected_workload
from msa_bench.scenarios.stats import ModelStats
from msa_bench.scenarios.workload import AttnShape

RESULTS_H100 = Path(__file__).resolve().parents[1] / "results" / "h100"

SMALL = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)
STAGES = {"launch_s": 1e-6}     # no stage measured: every candidate weighed, its launches priced


def workload(with_tensors=False):
    return coselected_workload(SMALL, "fp32", 64, 2048, 0.25, 1.0, group=8, seed=3, device="cpu",
                               with_tensors=with_tensors)


def profile(host=None):
    return replace(PRESETS["h200"], achieved={}, fixed_costs={**STAGES, **({"host": host} if host else {})})


def prediction(name, prof, regime="graph"):
    b, w = get_backend(name), workload()
    return predict_module(b.facts, ModelStats(w), b.model_record(w, prof), prof, w.dtype, regime=regime)


def test_eager_adds_planning_and_the_launches_up_to_the_work_then_the_longer_of_device_and_host():
    device = prediction("kv-outer", profile()).seconds
    launch, step = device / 10, device / 3
    host = {"kv-outer/bf16": {"s": launch, "step_s": step}}
    graph = prediction("kv-outer", profile(host))
    eager = prediction("kv-outer", profile(host), EAGER)
    stages = len(get_backend("kv-outer").stage_names)
    assert stages == 4 and graph.seconds == device
    # the device outlasts the host's remaining launches here: planning, then the launches of index_map,
    # schedule and attention (the stage that carries the work; no stage cost measured) before its work
    assert eager.seconds == pytest.approx(step + 3 * launch + device)
    assert eager.used["device_s"] == pytest.approx(device) and eager.used["host_launch_s"] == launch
    # a host slower than the device: the launches bind
    slow = {"kv-outer/bf16": {"s": graph.seconds, "step_s": 0.0}}
    assert prediction("kv-outer", profile(slow), EAGER).seconds == pytest.approx(graph.seconds * stages)
    assert prediction("kv-outer", profile(slow)).seconds == pytest.approx(graph.seconds)   # graph: unchanged


def test_host_costs_follow_the_host_probe():
    device = prediction("kv-outer", profile()).seconds
    launch, step = device / 10, device / 3
    b, w = get_backend("kv-outer"), workload()
    prof = profile({"kv-outer/bf16": {"s": launch, "step_s": step, "probe_s": 2e-6}})

    def eager(probe):
        return predict_module(b.facts, ModelStats(w), b.model_record(w, prof), prof, w.dtype, regime=EAGER,
                              host_probe_s=probe)
    same = eager(2e-6)
    assert same.seconds == pytest.approx(step + 3 * launch + device) and same.used["host_scale"] == 1
    # a host twice as slow as at calibration: every launch and the planning take twice as long
    twice = eager(4e-6)
    assert twice.seconds == pytest.approx(2 * step + 6 * launch + device) and twice.used["host_scale"] == 2
    assert twice.used["host_launch_s"] == pytest.approx(2 * launch)
    assert eager(None).seconds == same.seconds                    # the speed unknown: the costs as measured
    unprobed = profile({"kv-outer/bf16": {"s": launch, "step_s": step}})
    assert predict_module(b.facts, ModelStats(w), b.model_record(w, unprobed), unprobed, w.dtype, regime=EAGER,
                          host_probe_s=4e-6).seconds == pytest.approx(same.seconds)


def test_the_eager_wall_is_the_longest_chain_of_launches_then_device_time():
    from msa_bench.roofline.model import eager_wall, stage_device_s
    # stage i starts once its launch has returned and stage i - 1 has ended
    assert eager_wall([10.0, 10.0], [100.0, 5.0]) == pytest.approx(10 + 100 + 5)      # the device binds
    assert eager_wall([10.0, 10.0], [5.0, 100.0]) == pytest.approx(2 * 10 + 100)      # stage 2 waits on its launch
    assert eager_wall([10.0, 10.0], [1.0, 2.0]) == pytest.approx(2 * 10 + 2)          # the host binds, then the last
    assert eager_wall([0.0] * 3, [3.0, 4.0, 5.0]) == pytest.approx(12.0)              # no host: the device's sum
    assert eager_wall([30.0, 30.0, 30.0], [50.0, 1.0, 40.0]) == pytest.approx(max(30 + 91, 60 + 41, 90 + 40))
    assert eager_wall([40.0, 18.0], [6.0, 36.0]) == pytest.approx(40 + 18 + 36)       # each stage its own launch
    # the work goes to the attention stage, or the last where none is named; a module of no stage is one
    assert stage_device_s({"schedule": 1.0, "attention": 2.0, "combine": 3.0}, 10.0) == [1.0, 12.0, 3.0]
    assert stage_device_s({"gather": 1.0, "output": 2.0}, 10.0) == [1.0, 12.0]
    assert stage_device_s({}, 10.0) == [10.0]


def test_a_stage_measured_launch_cost_replaces_the_per_launch_one():
    from msa_bench.roofline.model import module_time, stage_launches
    host = {"q-packed/bf16": {"s": 10e-6, "step_s": 0.0, "stages": {"schedule": 40e-6}}}
    prof = profile(host)
    assert stage_launches(prof, "q-packed@p8", "bf16", ("schedule", "attention")) == [40e-6, 10e-6]
    assert stage_launches(prof, "kv-outer", "bf16", ("attention",)) == [0.0]           # none measured
    eager, parts = module_time(prof, "q-packed", "bf16", 30e-6, ("schedule", "attention"), regime=EAGER)
    assert eager == pytest.approx(40e-6 + 10e-6 + 30e-6) and parts["host_launch_s"] == 10e-6
    assert module_time(prof, "q-packed", "bf16", 30e-6, ("schedule", "attention"))[0] == pytest.approx(30e-6)


def test_the_host_fit_takes_each_stage_from_the_least_work_that_ran_it():
    H, S = fixed_costs.HOST_LAUNCH, fixed_costs.HOST_STAGES
    rows = [(2e-6, {MODULE: 90e-6, H: 30e-6, S: {"schedule": 50e-6, "attention": 20e-6}}, {}, 50),
            (1e-6, {MODULE: 40e-6, H: 18e-6, S: {"attention": 18e-6}}, {}, 16)]       # a one-token plan: no schedule
    fit = fixed_costs.fit_host({("q-packed", "bf16"): rows})
    assert fit == {"q-packed/bf16": {"s": 18e-6, "step_s": 0.0, "module_s": 40e-6,
                                     "stages": {"attention": 18e-6, "schedule": 50e-6}}}
    assert fixed_costs_problem({"host": fit}) is None
    assert "host must map" in fixed_costs_problem({"host": {"q-packed/bf16": {"s": 1e-6, "stages": {"a": 2.0}}}})


def test_eager_without_a_measured_host_cost_says_so_and_prices_it_at_zero(monkeypatch):
    prof = profile()
    assert prediction("kv-outer", prof, EAGER).seconds == pytest.approx(prediction("kv-outer", prof).seconds)
    monkeypatch.setattr(auto_mod, "device_profile", lambda device: prof)
    plan = get_backend("auto@eager").plan(workload(with_tensors=True))
    line = auto_line(plan.info)
    assert "regime eager" in line and "has no host cost per launch" in line and "at 0 s" in line
    assert "regime" not in auto_line(get_backend("auto").plan(workload(with_tensors=True)).info)


def test_a_candidate_without_a_host_cost_is_skipped_where_others_have_one():
    b, w = get_backend("msa-scatter"), workload()
    prof = profile({"kv-outer/bf16": {"s": 5e-6}})
    assert "no host cost for it in bf16" in weigh_reason(b.facts, ModelStats(w), prof, w.dtype, regime=EAGER)
    assert weigh_reason(b.facts, ModelStats(w), prof, w.dtype) is None


def test_host_costs_move_the_eager_pick(monkeypatch):
    w = workload(with_tensors=True)
    names = ("kv-outer", "msa-scatter", "q-packed", "hybrid")
    fast = {f"{n}/bf16": {"s": 0.0, "step_s": 0.0} for n in names}
    monkeypatch.setattr(auto_mod, "device_profile", lambda device: profile(fast))
    graph_pick = get_backend("auto").plan(w).info["auto"]["picked"]
    assert get_backend("auto@eager").plan(w).info["auto"]["picked"] == graph_pick
    slow = {**fast, f"{graph_pick}/bf16": {"s": 0.0, "step_s": 0.5}}     # its planning costs half a second a step
    monkeypatch.setattr(auto_mod, "device_profile", lambda device: profile(slow))
    eager = get_backend("auto@eager").plan(w).info["auto"]
    assert eager["picked"] != graph_pick and eager["regime"] == EAGER and eager["note"] is None
    assert 0 < eager["host_probe_s"] < 0.01         # the host's speed the pick was priced at
    assert get_backend("auto").plan(w).info["auto"]["picked"] == graph_pick       # graph ignores the host


def test_a_profile_refuses_a_bad_host_table():
    assert fixed_costs_problem({"host": {"kv-outer/bf16": {"s": 3e-6, "step_s": 0.0}}}) is None
    for bad in ({"kv-outer": {"s": 3e-6}}, {"kv-outer/bf16": {"s": -1.0}}, {"kv-outer/bf16": {"s": 1e-6, "step_s": 2.0}},
                {"kv-outer/bf16": {"step_s": 0.0}}, {"kv-outer/bf16": {"s": 1e-6, "probe_s": -1e-6}}, []):
        assert "host must map" in fixed_costs_problem({"host": bad})


def test_the_calibration_times_host_costs_eagerly_and_fits_them(monkeypatch):
    """The GPU procedure's eager series on the CPU (cpu-eager timer, Triton's interpreter)."""
    monkeypatch.setattr(auto_mod, "candidate_names", lambda: ["kv-outer"])
    series = fixed_costs.measure_series(PRESETS["h200"], ("fp32",), log=lambda *_: None, device="cpu",
                                        points=lambda dtype: fixed_costs.latency_points(dtype, SMALL),
                                        timing=replace(TimingConfig(cpu_reps=1, cpu_max_reps=1), timer=EAGER))
    (roof, medians, _, _), = series[("kv-outer", "fp32")]
    assert medians[fixed_costs.HOST_LAUNCH] > 0 and PLAN_STEP not in medians
    host = fixed_costs.fit_host(series)
    stages = medians[fixed_costs.HOST_STAGES]
    assert tuple(stages) == get_backend("kv-outer").stage_names and all(v > 0 for v in stages.values())
    assert 0 < medians[fixed_costs.HOST_PROBE] < 0.01           # the host's speed they were measured at
    assert host == {"kv-outer/fp32": {"s": medians[fixed_costs.HOST_LAUNCH], "step_s": 0.0,
                                      "module_s": medians[MODULE], "stages": stages,
                                      "probe_s": medians[fixed_costs.HOST_PROBE]}}
    # a series timed by the graph timer holds no host cost to fit
    graph = fixed_costs.measure_series(PRESETS["h200"], ("fp32",), log=lambda *_: None, device="cpu",
                                       points=lambda dtype: fixed_costs.latency_points(dtype, SMALL),
                                       timing=TimingConfig(cpu_reps=1, cpu_max_reps=1))
    assert fixed_costs.fit_host(graph) == {}


def test_merge_replaces_the_host_costs_it_measured_and_keeps_the_rest():
    old = {"launch_s": 1e-6, "stages": {"a/attention/bf16": {"s": 1e-6, "launches": 1},
                                        "b/attention/bf16": {"s": 1e-6, "launches": 1}},
           "host": {"a/bf16": {"s": 9e-6}, "b/bf16": {"s": 8e-6}}}
    fresh = {"launch_s": 2e-6, "launch_points": [], "stages": {"a/attention/bf16": {"s": 3e-6, "launches": 1}},
             "decode_achieved": {}, "items": {}, "host": {"a/bf16": {"s": 4e-6, "step_s": 0.0}},
             "date": "now", "seconds": 1.0, "method": "m"}
    out = fixed_costs.merge_fixed_costs(old, fresh, only=["a"])
    assert out["host"] == {"a/bf16": {"s": 4e-6, "step_s": 0.0}, "b/bf16": {"s": 8e-6}}


def test_the_report_predicts_an_eager_unit_in_the_eager_regime():
    from msa_bench.harness.report.tables import predicted_module_s
    from msa_bench.harness.running.runner import scalar_stats
    from msa_bench.scenarios.stats import workload_stats
    b, w = get_backend("kv-outer"), workload()
    prof = profile({"kv-outer/bf16": {"s": 1e-3, "step_s": 2e-3}})
    row = {**scalar_stats(workload_stats(w)), "backend": "kv-outer", "dtype": w.dtype,
           "plan_info": json.dumps({"model": b.model_record(w, prof)}),
           **{f"{s}.median_s": 1e-5 for s in b.stage_names}}
    graph = predicted_module_s({**row, "timer": "cuda-graph"}, prof)
    eager = predicted_module_s({**row, "timer": "cuda-eager"}, prof)
    assert graph == pytest.approx(prediction("kv-outer", prof).seconds)
    assert eager == pytest.approx(2e-3 + 1e-3 + max(graph, 3e-3))


def test_a_cpp_launch_path_has_its_own_host_cost_and_falls_back_to_nothing_else():
    from msa_bench.roofline.model import host_cost, host_measured
    prof = profile({"kv-outer-cute/bf16": {"s": 90e-6, "step_s": 0.0}, "kv-outer-cute@op/bf16": {"s": 5e-6}})
    assert host_cost(prof, "kv-outer-cute@op", "bf16") == (5e-6, 0.0)
    assert host_cost(prof, "kv-outer-cute@v23", "bf16") == (90e-6, 0.0)      # any other option is its base
    assert host_measured(prof, "kv-outer-cute@op", "bf16") and not host_measured(prof, "kv-outer-cute@v23", "bf16")
    assert host_cost(prof, "kv-outer-cute@v23+op", "bf16") == (5e-6, 0.0)    # its launch path's
    # another launch path, or @op where calibrate measured only BASE: no cost of another path stands in
    assert host_cost(prof, "kv-outer-cute@graph", "bf16") is None
    assert host_cost(prof, "kv-outer-cute@op", "fp8") is None
    assert host_cost(profile({"hybrid/bf16": {"s": 90e-6}}), "hybrid@op", "bf16") is None


def test_host_keys_follow_the_launch_word():
    from msa_bench.roofline.names import host_keys
    assert host_keys("q-packed-cute") == ["q-packed-cute"]
    assert host_keys("q-packed-cute@p12") == ["q-packed-cute@p12", "q-packed-cute"]
    assert host_keys("q-packed-cute@op+p12") == ["q-packed-cute@op+p12", "q-packed-cute@op"]
    assert host_keys("hybrid@fused-graph") == ["hybrid@fused-graph", "hybrid@graph"]
    assert host_keys("hybrid@graph") == ["hybrid@graph"]


def test_auto_eager_weighs_the_cpp_launch_path_only_where_calibrate_measured_it():
    w = workload()
    host = {f"{n}/bf16": {"s": 1e-6} for n in auto_mod.candidate_names()}        # the model prices fp32 as bf16
    measured = profile({**host, "kv-outer-cute@op/bf16": {"s": 4e-7}})
    cands, skipped = get_backend("auto@eager").candidates(w, measured, host_probe_s=None)
    weighed = set(cands) | set(skipped)
    assert "kv-outer-cute@op" in weighed and "q-packed-cute@op" not in weighed     # its host path unmeasured
    cands, skipped = get_backend("auto").candidates(w, measured)
    assert not any(n.endswith("@op") for n in set(cands) | set(skipped))         # graph replay: one launch path


def test_the_replayed_pick_weighs_what_auto_weighs_in_the_runs_regime():
    from msa_bench.harness.report import tables
    from msa_bench.kernels.auto import weighed_names
    measured = profile({"kv-outer-cute@op/bf16": {"s": 4e-7}})
    assert "kv-outer-cute@op" in weighed_names(measured, "bf16", "eager")
    assert "kv-outer-cute@op" not in weighed_names(measured, "fp8", "eager")          # measured for bf16 only
    assert not any(n.endswith("@op") for n in weighed_names(measured, "bf16", "graph"))
    # an eager run whose fastest unit is an @op one: the replay may pick it (it weighed only NAME before)
    run = load_run(RESULTS_H100 / "real-prefill-eager")
    prof = run_profile(run.meta).profile
    mp = tables.model_pick_table(run, prof)
    assert mp["fastest"].str.endswith("@op").any()
    assert mp["model pick"].str.endswith("@op").any() and (mp["pick/fastest"] >= 1.0).all()


def test_calibrate_measures_host_costs_of_both_launch_paths_and_merges_an_op_entry_alone():
    assert {"kv-outer-cute@op", "q-packed-cute@graph", "hybrid@op"} <= set(fixed_costs.host_names())
    assert fixed_costs.host_scope(["kv-outer-cute"]) == ["kv-outer-cute", "kv-outer-cute@op", "kv-outer-cute@graph"]
    assert fixed_costs.host_scope(None) is None
    old = {"launch_s": 1e-6, "stages": {"a/attention/bf16": {"s": 1e-6, "launches": 1}}, "host": {"a/bf16": {"s": 9e-6}}}
    fresh = {"launch_s": 2e-6, "launch_points": [], "stages": {"a/attention/bf16": {"s": 3e-6, "launches": 1}},
             "decode_achieved": {}, "items": {}, "date": "now", "seconds": 1.0, "method": "m",
             "host": {"a/bf16": {"s": 4e-6, "step_s": 0.0}, "a@op/bf16": {"s": 1e-6, "step_s": 0.0}}}
    out = fixed_costs.merge_fixed_costs(old, fresh, only=["a"])
    assert out["host"] == fresh["host"]              # the @op entry has no stages of its own and is kept


def test_an_eager_unit_whose_launch_path_has_no_host_cost_is_not_predicted():
    # the H100 profile measured kv-outer-cute@op's and q-packed-cute@op's host costs, not hybrid@op's: its
    # units were once predicted with the Python hybrid's launches (1.5x their measure)
    from msa_bench.harness.report import tables
    run = load_run(RESULTS_H100 / "real-prefill-eager")
    prof = run_profile(run.meta).profile
    fid = tables.fidelity_table(run, prof)
    assert "hybrid@op" not in set(fid["backend"])
    assert {"hybrid", "kv-outer-cute@op", "q-packed-cute@op"} <= set(fid["backend"])
    assert (fid["units"] == 16).all()
