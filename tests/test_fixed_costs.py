"""Fixed costs: the calibration rule (Theil-Sen intercept), the profile's table, the model adding them, and
`auto` weighing every declared candidate with them (device profile patched)."""
import json
import math
import random
from dataclasses import replace

import pytest

from msa_bench.errors import UserError
from msa_bench.harness.measure.check import CPU_SHAPE  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)
from msa_bench.harness.calibration.fixed_costs import fit_series
from msa_bench.kernels import auto as auto_mod
from msa_bench.kernels import base
from msa_bench.kernels.auto import auto_line
from msa_bench.kernels.base import get_backend
from msa_bench.kernels.reference_backend import ReferenceBackend
from msa_bench.roofline import devices
from msa_bench.harness.calibration.ceilings import theil_sen
from msa_bench.roofline.devices import PRESETS, load_device, profile_from_dict
from msa_bench.roofline.model import ModelShape, fixed_cost, predict
from msa_bench.scenarios.coselection import coselected_workload
from msa_bench.scenarios.workload import AttnShape


# ---- the rule ------------------------------------------------------------------------------------

def test_theil_sen_finds_the_intercept_of_a_noisy_series_with_outliers():
    rng = random.Random(7)
    xs = [1e-6 * 1.5 ** k for k in range(14)]
    ys = [40e-6 + x / 0.7 + rng.gauss(0, 1e-6) for x in xs]
    ys[3] += 80e-6                  # a replay that met a clock drop
    ys[9] *= 3
    intercept, slope = theil_sen(xs, ys)
    assert intercept == pytest.approx(40e-6, rel=0.05)
    assert slope == pytest.approx(1 / 0.7, rel=0.05)
    # least squares is pulled far off by the same two points: the rule matters
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    ls = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert abs(my - ls * mx - 40e-6) > 0.1 * 40e-6


def test_theil_sen_refuses_a_series_without_two_roofline_times():
    with pytest.raises(UserError):
        theil_sen([1e-6], [2e-6])
    with pytest.raises(UserError):
        theil_sen([1e-6, 1e-6], [2e-6, 3e-6])


def test_the_module_fixed_cost_is_its_latency_point_time_shared_by_its_stages():
    rows = [(1e-6, {"module": 50e-6, "a": 20e-6, "b": 40e-6}, {"a": 3, "b": 1})]
    got = fit_series({("kv-outer", "fp8"): rows})
    assert set(got) == {"kv-outer/a/fp8", "kv-outer/b/fp8"}
    assert got["kv-outer/a/fp8"]["s"] + got["kv-outer/b/fp8"]["s"] == pytest.approx(50e-6)
    assert got["kv-outer/a/fp8"]["s"] == pytest.approx(50e-6 / 3)
    assert got["kv-outer/a/fp8"]["launches"] == 3 and got["kv-outer/a/fp8"]["latency_s"] == pytest.approx(20e-6)


def test_a_backend_with_items_takes_the_item_intercept_and_auto_is_skipped():
    """A packed module's latency-point time holds its one tile's walk: the fixed cost is the intercept of
    module time against item blocks; a stage the latency point did not run takes the next row's time."""
    latency = [(1e-6, {"module": 46e-6, "schedule": 10e-6, "attention": 30e-6}, {"attention": 1}, 16),
               (5e-6, {"module": 60e-6, "schedule": 10e-6, "attention": 30e-6, "combine": 20e-6}, {}, 16)]
    items = {"hybrid/bf16": {"s": 0.0, "block_s": 2e-6, "intercept_s": 14e-6}}
    got = fit_series({("hybrid", "bf16"): latency, ("auto", "bf16"): latency}, items)
    assert set(got) == {"hybrid/schedule/bf16", "hybrid/attention/bf16", "hybrid/combine/bf16"}
    assert sum(e["s"] for e in got.values()) == pytest.approx(14e-6)
    assert got["hybrid/combine/bf16"]["latency_s"] == pytest.approx(20e-6)


# ---- the profile and the model -------------------------------------------------------------------

FIXED = {"launch_s": 2e-6, "stages": {"kv-outer/index_map": {"s": 30e-6, "launches": 4},
                                      "kv-outer/combine/fp8": {"s": 1e-6, "launches": 2},
                                      "kv-outer/combine": {"s": 9e-6, "launches": 2}}}


def test_fixed_cost_takes_the_stage_cost_at_least_its_launches_and_the_dtype_entry_first():
    dev = replace(PRESETS["h200"], fixed_costs=FIXED)
    total, per = fixed_cost(dev, "kv-outer@v23", ("index_map", "schedule", "combine"), "fp8")
    assert per == {"index_map": 30e-6, "schedule": 0.0, "combine": 4e-6}     # combine: 2 launches x 2 us > 1 us
    assert total == pytest.approx(34e-6)
    assert fixed_cost(dev, "kv-outer", ("combine",), "bf16")[0] == pytest.approx(9e-6)
    assert fixed_cost(PRESETS["b200"], "kv-outer", ("index_map",))[0] == 0.0


def test_predicted_time_is_the_largest_roofline_term_plus_the_fixed_costs():
    from msa_bench.roofline.model import module_time
    dev = replace(PRESETS["h200"], fixed_costs={"stages": {"kv-outer/index_map/bf16": {"s": 300e-6, "launches": 1}}})
    plain = predict("kv-outer", ModelShape(), 16, 16 * 64, dev)
    total, parts = module_time(dev, "kv-outer", "bf16", plain.time_s, ("index_map",))
    assert total == pytest.approx(max(plain.hbm_s, plain.l2_s, plain.mma_s) + 300e-6)
    assert total - parts["fixed_s"] == pytest.approx(plain.time_s) and parts["fixed_s"] == pytest.approx(300e-6)


def test_profile_json_round_trips_fixed_costs_and_refuses_bad_ones(tmp_path):
    data = {**json.loads(json.dumps(devices.asdict(PRESETS["h200"]))), "fixed_costs": FIXED}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert load_device(str(path)).fixed_costs == FIXED
    for bad in ({"launch_s": -1}, {"stages": {"nostage": {"s": 1e-6}}}, {"stages": {"a/b": {"s": "x"}}},
                {"stages": {"a/b": {"s": 1e-6, "launches": 1.5}}}):
        with pytest.raises(UserError, match="fixed_costs"):
            profile_from_dict({**data, "fixed_costs": bad}, "test")


def test_a_preset_takes_the_fixed_costs_of_its_committed_calibration(tmp_path, monkeypatch):
    calibrated = {**json.loads(json.dumps(devices.asdict(PRESETS["h200"]))), "fixed_costs": FIXED}
    folder = tmp_path / "results" / "h200" / "calibration"
    folder.mkdir(parents=True)
    (folder / "profile.json").write_text(json.dumps(calibrated))
    monkeypatch.chdir(tmp_path)                 # the working directory's results/<gpu>/calibration first
    got = load_device("h200")
    assert got.fixed_costs == FIXED and got.achieved == PRESETS["h200"].achieved
    assert devices.device_profile("cpu").fixed_costs == FIXED


# ---- auto's candidates ---------------------------------------------------------------------------

SMALL = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)


def workload(share=0.0, with_tensors=False):
    return coselected_workload(SMALL, "fp32", 64, 2048, 2.0 if share < 1 else 0.25, share, group=8, seed=3,
                               device="cpu", with_tensors=with_tensors)


class FakeQOuter(ReferenceBackend):
    """A backend that declares the Q-outer schedule and candidacy (runs the reference on the CPU)."""
    name = "fake-q-outer"
    schedule = "q-outer"
    candidate = True
    stage_names = ("attention", "combine")


class FakeDense(FakeQOuter):
    name = "fake-dense"
    schedule = "dense-not-modelled"


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setitem(base._REGISTRY, "fake-q-outer", FakeQOuter)
    monkeypatch.setitem(base._REGISTRY, "fake-dense", FakeDense)


def profile_with(monkeypatch, **changes):
    prof = replace(PRESETS["h200"], **{"achieved": devices.preset("h200").achieved, **changes})   # no fixed costs
    monkeypatch.setattr(auto_mod, "device_profile", lambda device: prof)
    return prof


def test_every_declared_candidate_is_weighed_and_the_rest_skipped_with_a_reason(fakes, monkeypatch):
    profile_with(monkeypatch, achieved={})               # nothing measured: every fraction is 1
    cands, skipped = get_backend("auto").candidates(workload())
    assert {"kv-outer", "msa-scatter", "q-packed", "hybrid", "fake-q-outer"} <= set(cands)
    assert "reference" not in cands and "reference" not in skipped and "dense-gather" not in cands
    assert "model has no schedule 'dense-not-modelled'" in skipped["fake-dense"]
    for name in ("flashinfer", "flashinfer-packed", "kv-outer-cute", "q-packed-cute"):     # no GPU here
        assert name in skipped and skipped[name]


def test_a_candidate_without_a_measured_fraction_is_skipped_where_others_have_one(fakes, monkeypatch):
    profile_with(monkeypatch)
    cands, skipped = get_backend("auto").candidates(workload())
    assert "fake-q-outer" not in cands and "no achieved fraction of fake-q-outer/bf16" in skipped["fake-q-outer"]
    assert "kv-outer" in cands


def test_fixed_costs_move_the_pick(fakes, monkeypatch):
    big = {"stages": {f"{b}/{s}": {"s": 0.5, "launches": 0} for b in ("kv-outer", "msa-scatter", "q-packed", "hybrid")
                      for s in ("index_map", "schedule", "attention", "combine")}}
    big["stages"]["fake-q-outer/attention"] = {"s": 0.0, "launches": 0}
    profile_with(monkeypatch, achieved={}, fixed_costs=big)
    w = workload(with_tensors=True)
    plan = get_backend("auto").plan(w)
    a = plan.info["auto"]
    assert a["picked"] == "fake-q-outer" and plan.info["schedule"] == "q-outer"
    assert a["used"]["kv-outer"]["fixed_s"] == pytest.approx(2.0)
    assert a["predicted_s"]["kv-outer"] == pytest.approx(a["used"]["kv-outer"]["roofline_s"] + 2.0)
    assert auto_line(plan.info).startswith("auto picked fake-q-outer (predicted us: fake-q-outer ")


def live(name, w, profile):
    """A backend's live prediction: its facts and the record it computes before planning."""
    from msa_bench.roofline.predict import predict_module
    from msa_bench.scenarios.stats import ModelStats
    b = get_backend(name)
    return predict_module(b.facts, ModelStats(w), b.model_record(w, profile), profile, w.dtype)


def test_flashinfer_packed_is_modelled_only_where_tiles_select_alike():
    from msa_bench.roofline.predict import unmodelled_reason
    from msa_bench.scenarios.stats import ModelStats
    fp = get_backend("flashinfer-packed")
    shared, scattered = workload(1.0), workload(0.0)
    assert unmodelled_reason(fp.facts, ModelStats(shared)) is None
    assert "union_ratio 1" in unmodelled_reason(fp.facts, ModelStats(scattered))


def test_check_prints_the_pick_and_every_prediction_on_one_line(cli):
    code, out, _ = cli("check", "--backend", "auto", "--dtype", "fp32")
    assert code == 0, out
    lines = [ln for ln in out.splitlines() if ln.startswith("auto picked ")]
    assert len(lines) == 1
    for name in ("kv-outer", "q-packed", "hybrid", "msa-scatter"):
        assert f" {name} " in lines[0]
    assert "skipped" in lines[0] and "flashinfer" in lines[0]


def test_a_result_row_stores_the_fixed_costs_of_the_stages_the_plan_ran():
    from msa_bench.harness.running import runner as sweep
    from msa_bench.scenarios.grid import make_workload, point_from_options
    from msa_bench.scenarios.stats import workload_stats
    runner = sweep.Runner.__new__(sweep.Runner)
    runner.profile, runner.timer = replace(PRESETS["h200"], fixed_costs=FIXED), "cuda-graph"
    point = point_from_options("synthetic", SMALL, "fp8", tokens=64, context=2048, reuse=2.0)
    wl = sweep.scalar_stats(workload_stats(make_workload(point, with_tensors=False)))
    stages = ["index_map", "schedule", "attention", "combine"]
    rows = {r["statistic"]: r["value"] for r in runner._model_rows(point, "kv-outer", wl, {}, stages)}
    assert rows["model_fixed_s"] == pytest.approx(34e-6) and rows["model_time_s"] > 0
    picked = {"schedule": "hybrid", "auto": {"backend": "kv-outer"}}
    rows = {r["statistic"]: r["value"] for r in runner._model_rows(point, "auto", wl, picked, stages)}
    assert rows == {"model_fixed_s": pytest.approx(34e-6)}      # hybrid: no one closed form, its fixed costs kept


def test_the_calibration_series_times_every_candidate_stage_and_fits_it(monkeypatch):
    """The GPU procedure's loop on the CPU (host timer, Triton's interpreter) over two candidates."""
    from msa_bench.harness.calibration import fixed_costs
    from msa_bench.harness.measure.timing import TimingConfig
    monkeypatch.setattr(auto_mod, "candidate_names", lambda: ["kv-outer", "flashinfer"])
    # the interpreter on a busy CPU can take a workload past a GPU step's limit (its own test below)
    monkeypatch.setattr(fixed_costs, "CANDIDATE_SECONDS", float("inf"))
    points = lambda dtype: fixed_costs.calibration_points(dtype, SMALL, (8, 32), (512, 1024))
    series = fixed_costs.measure_series(PRESETS["h200"], ("fp32",), log=lambda *_: None, device="cpu", points=points,
                                        timing=TimingConfig(cpu_reps=1, cpu_max_reps=1))
    assert set(series) == {("kv-outer", "fp32")}          # flashinfer: no GPU here
    rows = series[("kv-outer", "fp32")]
    assert len(rows) == 2 and len({r[0] for r in rows}) == 2
    assert set(rows[0][1]) == {"index_map", "schedule", "attention", "combine", "module"}
    stages = fit_series({k: v[:1] for k, v in series.items()})
    assert {k.split("/")[1] for k in stages if k.startswith("kv-outer/")} == {"index_map", "schedule", "attention",
                                                                             "combine"}
    assert all(e["s"] >= 0 for e in stages.values())


def test_a_packed_candidate_pays_full_tiles_on_decode():
    """One token per request: each tile holds one token, yet the packed kernel runs P x G rows per block."""
    from msa_bench.harness.measure.check import edge_case_workload
    from msa_bench.roofline.model import predict
    from msa_bench.scenarios.stats import ModelStats
    w = edge_case_workload(SMALL, "fp32", [256] * 16, [1] * 16, False, seed=2)
    stats = ModelStats(w)
    assert stats["union_ratio_p8"] == pytest.approx(1.0)
    assert stats["executed_union_ratio_p8"] == pytest.approx(8.0)
    bare = replace(PRESETS["h200"], achieved={}, fixed_costs={})
    got = live("q-packed", w, bare)
    full = predict("q-packed", ModelShape.of(w.shape, dtype=w.dtype), w.n_tokens, stats["nsb"], PRESETS["h200"],
                   stats["selected_blocks_per_query"], stats["useful_flops"], union_ratio=8.0)
    assert got.used["union_ratio"] == pytest.approx(8.0) and got.seconds == pytest.approx(full.time_s)


def test_a_candidate_without_measured_fixed_costs_is_skipped_where_others_have_some(fakes, monkeypatch):
    profile_with(monkeypatch, achieved={}, fixed_costs={"stages": {"kv-outer/index_map/bf16": {"s": 1e-5},
                                                                   "q-packed/schedule": {"s": 1e-5}}})
    cands, skipped = get_backend("auto").candidates(workload())
    assert {"kv-outer", "q-packed"} <= set(cands)
    assert "no fixed costs" in skipped["msa-scatter"] and "no fixed costs" in skipped["hybrid"]
    profile_with(monkeypatch, achieved={}, fixed_costs={"stages": {"kv-outer/index_map/fp8": {"s": 1e-5},
                                                                   "q-packed/schedule": {"s": 1e-5}}})
    assert "kv-outer" in get_backend("auto").candidates(workload())[1]          # fp32 counts as bf16


def test_the_calibration_skips_a_candidate_whose_plan_would_build_a_kernel(monkeypatch):
    """A JIT build inside the step (FlashInfer FA3: minutes) is skipped, said, and never planned."""
    from msa_bench.harness.calibration import fixed_costs
    from msa_bench.harness.measure.timing import TimingConfig
    from msa_bench.kernels.q_packed.backend import QPackedBackend
    monkeypatch.setattr(auto_mod, "candidate_names", lambda: ["kv-outer", "q-packed"])
    monkeypatch.setattr(QPackedBackend, "build_pending_reason", lambda self, w: "q-packed: its kernel is not built")

    def never(self, w):
        raise AssertionError("planned a candidate that needs a build")
    monkeypatch.setattr(QPackedBackend, "_plan", never)
    lines, skipped = [], {}
    points = lambda dtype: fixed_costs.calibration_points(dtype, SMALL, (8, 32), (512, 1024))
    series = fixed_costs.measure_series(PRESETS["h200"], ("fp32",), log=lines.append, device="cpu", points=points,
                                        timing=TimingConfig(cpu_reps=1, cpu_max_reps=1), skipped=skipped)
    assert set(series) == {("kv-outer", "fp32")} and skipped == {"q-packed/fp32": "q-packed: its kernel is not built"}
    assert [ln for ln in lines if "q-packed" in ln] == ["  fixed costs: q-packed fp32 skipped: q-packed: its kernel "
                                                        "is not built"]


def test_the_fixed_costs_steps_measure_the_candidates_and_the_dense_baselines():
    from msa_bench.harness.calibration.fixed_costs import calibrated_names
    from msa_bench.kernels.auto import candidate_names
    names = calibrated_names()
    assert names[: len(candidate_names())] == candidate_names()
    assert "dense-floor" in names and "dense-masked" in names
    assert "auto" not in names and "dense-gather" not in names and "reference" not in names


def test_a_workload_the_model_does_not_predict_a_candidate_on_is_not_its_point(monkeypatch):
    """A per-token-mask tile is modelled only where its tokens select alike (flashinfer-packed): on an item
    point whose tokens select apart it is left out, and its other points stand (an H100 calibration lost
    flashinfer-packed's fixed costs to such a point)."""
    from msa_bench.harness.calibration import fixed_costs
    from msa_bench.harness.measure.timing import TimingConfig
    from msa_bench.roofline import predict as predict_mod
    monkeypatch.setattr(auto_mod, "candidate_names", lambda: ["kv-outer"])
    monkeypatch.setattr(fixed_costs, "CANDIDATE_SECONDS", float("inf"))
    unmodelled = predict_mod.unmodelled_reason
    monkeypatch.setattr(predict_mod, "unmodelled_reason",     # the model does not predict it on the 32-token point
                        lambda facts, stats: "not modelled here" if stats["n_tokens"] == 32 else unmodelled(facts, stats))
    lines, skipped = [], {}
    points = lambda dtype: fixed_costs.calibration_points(dtype, SMALL, (8, 32), (512, 1024))
    series = fixed_costs.measure_series(PRESETS["h200"], ("fp32",), log=lines.append, device="cpu", points=points,
                                        timing=TimingConfig(cpu_reps=1, cpu_max_reps=1), skipped=skipped)
    assert skipped == {} and not [ln for ln in lines if "skipped" in ln]
    assert len(series[("kv-outer", "fp32")]) == 1 and series[("kv-outer", "fp32")][0][0] > 0


def test_the_calibration_drops_a_candidate_that_runs_past_its_time(monkeypatch):
    from msa_bench.harness.calibration import fixed_costs
    from msa_bench.harness.measure.timing import TimingConfig
    monkeypatch.setattr(auto_mod, "candidate_names", lambda: ["kv-outer"])
    monkeypatch.setattr(fixed_costs, "CANDIDATE_SECONDS", 0.0)
    lines, skipped = [], {}
    points = lambda dtype: fixed_costs.calibration_points(dtype, SMALL, (8, 32), (512, 1024))
    series = fixed_costs.measure_series(PRESETS["h200"], ("fp32",), log=lines.append, device="cpu", points=points,
                                        timing=TimingConfig(cpu_reps=1, cpu_max_reps=1), skipped=skipped)
    assert series == {} and list(skipped) == ["kv-outer/fp32"] and "over 0 s" in skipped["kv-outer/fp32"]
    assert sum("kv-outer fp32 skipped after N 8" in ln and "over 0 s" in ln for ln in lines) == 1


def test_flashinfer_fa3_needs_a_build_until_its_module_is_in_the_jit_cache(tmp_path, monkeypatch):
    from msa_bench.kernels import flashinfer_common
    monkeypatch.setattr(flashinfer_common, "jit_dirs", lambda: [tmp_path])
    w = workload()
    fa3, fa2 = get_backend("flashinfer-fa3"), get_backend("flashinfer")
    assert "JIT-builds" in fa3.build_pending_reason(w) and fa2.build_pending_reason(w) is None
    built = tmp_path / "0.7.2" / "90a" / "cached_ops" / "batch_prefill_with_kv_cache_dtype_q_bf16_sm90"
    built.mkdir(parents=True)
    (built / "batch_prefill_with_kv_cache_dtype_q_bf16_sm90.so").write_bytes(b"")
    assert fa3.build_pending_reason(w) is None


def test_dense_masked_needs_a_build_until_its_fa2_module_is_in_the_jit_cache(tmp_path, monkeypatch):
    """The paged path's FA2 module (K/V in the data's dtype), not FA3's of the same prefix, counts as built."""
    from msa_bench.kernels import flashinfer_common
    from msa_bench.kernels.dense_masked import PAGED, DenseMasked
    monkeypatch.setattr(flashinfer_common, "jit_dirs", lambda: [tmp_path])
    dense = get_backend("dense-masked")
    w = workload()
    assert dense.build_pending_reason(w) is None                   # on the CPU: no paged path, nothing to build
    monkeypatch.setattr(DenseMasked, "candidates", lambda self, device: [PAGED])
    bf16, fp8 = replace(w, dtype="bf16"), replace(w, dtype="fp8")
    assert "JIT-builds" in dense.build_pending_reason(bf16)
    stem = "batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_{}_dtype_o_bf16_dtype_idx_i32_head_dim_qk_{}_" \
           "head_dim_vo_{}_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False{}"
    d = w.shape.head_dim

    def build(name):
        (tmp_path / "cached_ops" / name).mkdir(parents=True)
        (tmp_path / "cached_ops" / name / f"{name}.so").write_bytes(b"")
    build(stem.format("bf16", d, d, "_sm90"))
    assert "JIT-builds" in dense.build_pending_reason(bf16)       # FA3's module is another kernel
    build(stem.format("bf16", d, d, "_kv_stride_equal"))
    assert dense.build_pending_reason(bf16) is None and "JIT-builds" in dense.build_pending_reason(fp8)
    build(stem.format("e4m3", d, d, ""))
    assert dense.build_pending_reason(fp8) is None


# ---- HBM fractions and item floors ---------------------------------------------------------------

def _row(roof, module, blocks=None):
    return (roof, {"module": module, "attention": module}, {"attention": 1}, blocks)


def test_the_decode_fraction_is_the_median_roofline_over_the_time_less_the_fixed_cost():
    from msa_bench.harness.calibration.fixed_costs import fit_decode_achieved
    rng = random.Random(3)
    rows = [_row(r, 20e-6 + r / 0.8 * (1 + rng.uniform(-0.01, 0.01))) for r in (1e-4, 2e-4, 3e-4, 4e-4, 5e-4)]
    rows[2] = _row(3e-4, 3e-3)               # a replay that met a clock drop: the median ignores it
    stages = {"q-packed/attention/bf16": {"s": 20e-6}, "q-packed/attention/fp8": {"s": 99e-6}}
    got = fit_decode_achieved({("q-packed", "bf16"): rows, ("auto", "bf16"): rows}, stages)
    assert got == {"q-packed/bf16": pytest.approx(0.8, rel=0.02)}      # auto: its pick's


def test_a_backend_whose_fraction_leaves_its_hbm_term_out_gets_no_decode_fraction():
    """FlashInfer's FA2 fraction scales its L2 and MMA terms only (Backend.fraction_terms): its prefill
    fraction prices its decode work, so a calibration writes it no decode fraction."""
    from msa_bench.harness.calibration.fixed_costs import fit_decode_achieved, scales_hbm
    rows = [_row(r, r / 0.6) for r in (1e-4, 2e-4, 3e-4)]
    assert not scales_hbm("flashinfer") and scales_hbm("flashinfer-fa3") and scales_hbm("kv-outer-cute")
    got = fit_decode_achieved({("flashinfer", "fp8"): rows, ("kv-outer-cute", "fp8"): rows}, {})
    assert got == {"kv-outer-cute/fp8": pytest.approx(0.6)}


def test_an_item_is_the_slope_of_module_time_against_its_blocks_and_the_intercept_its_fixed_cost():
    from msa_bench.harness.calibration.fixed_costs import fit_items
    rows = [_row(1e-6, 35e-6 + b * 1e-6, blocks=b) for b in (16, 50, 115)]
    got = fit_items({("q-packed", "bf16"): rows, ("kv-outer", "bf16"): [_row(1e-6, 1e-4)] * 3})
    assert set(got) == {"q-packed/bf16"}                               # kv-outer declares no items
    assert got["q-packed/bf16"]["intercept_s"] == pytest.approx(35e-6)
    assert got["q-packed/bf16"]["block_s"] == pytest.approx(1e-6) and got["q-packed/bf16"]["s"] == 0.0


def test_a_module_is_floored_by_its_item_alone_and_decode_work_takes_the_decode_fraction():
    from msa_bench.roofline.devices import achieved
    from msa_bench.roofline.model import decode_share, is_decode, module_time
    fc = {"stages": {"q-packed/attention/bf16": {"s": 5e-6, "launches": 1}},
          "decode_achieved": {"q-packed/bf16": 0.9}, "items": {"q-packed/bf16": {"s": 20e-6, "block_s": 1e-6}}}
    dev = replace(PRESETS["h200"], achieved={"q-packed/bf16": 0.5}, fixed_costs=fc)
    assert achieved(dev, "q-packed", "bf16", decode=True) == 0.9 and achieved(dev, "q-packed", "bf16") == 0.5
    assert achieved(dev, "kv-outer", "bf16", decode=True) == 1.0
    # a chunked-prefill step: each share at its own rate, 0.5 / 0.9 + 0.5 / 0.5 seconds per roofline second
    assert achieved(dev, "q-packed", "bf16", decode=0.5) == pytest.approx(1 / (0.5 / 0.9 + 0.5 / 0.5))
    assert is_decode(256, 256) and is_decode(256, 64) and not is_decode(8192, 1) and not is_decode(10, 0)
    assert decode_share([1] * 1024 + [1024]) == 0.5 and decode_share([4] * 8) == 1.0 and decode_share([8192]) == 0.0
    small, parts = module_time(dev, "q-packed", "bf16", 1e-6, ("attention",), item_blocks=16)
    assert small == pytest.approx(36e-6 + 5e-6) and parts["item_floor_s"] == pytest.approx(36e-6)
    assert module_time(dev, "q-packed", "bf16", 1e-3, ("attention",), item_blocks=16)[0] == pytest.approx(1e-3 + 5e-6)
    assert module_time(dev, "q-packed", "bf16", 1e-6, ("attention",))[0] == pytest.approx(6e-6)    # no items


def test_a_decode_workload_is_predicted_with_the_decode_fraction():
    from msa_bench.harness.measure.check import edge_case_workload
    from msa_bench.scenarios.stats import ModelStats
    w = edge_case_workload(SMALL, "fp32", [256] * 16, [1] * 16, False, seed=2)
    dev = replace(PRESETS["h200"], achieved={"q-packed/bf16": 0.5},
                  fixed_costs={"decode_achieved": {"q-packed/bf16": 0.25}})
    assert ModelStats(w)["decode_share"] == 1.0
    used = live("q-packed", w, dev).used
    assert used["achieved"] == 0.25
    # a step of 16 decode tokens and a 64-token chunk: a fifth of its tokens are decode work
    step = edge_case_workload(SMALL, "fp32", [256] * 16 + [512], [1] * 16 + [64], False, seed=2)
    assert ModelStats(step)["decode_share"] == pytest.approx(0.2)
    used = live("q-packed", step, dev).used
    assert used["achieved"] == pytest.approx(1 / (0.2 / 0.25 + 0.8 / 0.5))


@pytest.mark.parametrize("bad", [{"decode_achieved": {"q-packed/bf16": 0}}, {"decode_achieved": {"q-packed": 0.5}},
                                 {"items": {"q-packed/bf16": {"s": 1e-5}}}, {"items": {"q-packed/bf16": 3}}])
def test_a_profile_refuses_bad_decode_fractions_and_items(bad):
    data = {**json.loads(json.dumps(PRESETS["h200"].__dict__)), "fixed_costs": bad}
    with pytest.raises(UserError, match="fixed_costs"):
        profile_from_dict(data, "test")


def test_the_replay_floors_a_packed_unit_by_its_item_and_uses_the_decode_fraction():
    """The replay predicts from the row's workload statistics with today's model, never the run's stored time."""
    from msa_bench.harness.report.tables import predicted_module_s
    fc = {"decode_achieved": {"q-packed/bf16": 0.5}, "items": {"q-packed/bf16": {"s": 20e-6, "block_s": 1e-6}}}
    dev = replace(PRESETS["h200"], achieved={}, fixed_costs=fc)
    row = {"backend": "q-packed", "dtype": "bf16", "module.model_time_s": 1.0, "wl_topk": 16,
           "wl_n_tokens": 8, "wl_requests": 8, "wl_nsb": 8 * 4 * 16, "wl_union_ratio_p8": 2.0,
           "wl_decode_share": 1.0}
    roof = predict("q-packed", ModelShape(), 8, 8 * 4 * 16, dev, union_ratio=2.0).time_s
    assert roof / 0.5 < 52e-6 and predicted_module_s(row, dev) == pytest.approx(20e-6 + 32e-6)
    prefill = {**row, "wl_n_tokens": 65536, "wl_requests": 1, "wl_nsb": 65536, "wl_decode_share": 0.0}
    roof = predict("q-packed", ModelShape(), 65536, 65536, dev, union_ratio=2.0).time_s
    assert roof > 52e-6 and predicted_module_s(prefill, dev) == pytest.approx(roof)       # prefill: fraction 1
    assert math.isnan(predicted_module_s({**row, "backend": "dense-gather"}, dev))       # a probe: not modelled

def test_merge_keeps_the_backends_not_remeasured():
    from msa_bench.harness.calibration.fixed_costs import merge_fixed_costs
    old = {"launch_s": 1e-6, "launch_points": [[1, 2e-5]], "method": "stages: ...",
           "stages": {"a/attention/bf16": {"s": 1.0}, "b/attention/bf16": {"s": 2.0}, "b/combine/bf16": {"s": 3.0}},
           "decode_achieved": {"a/bf16": 0.5, "b/bf16": 0.6}, "items": {"a/bf16": {"block_s": 1.0}}}
    fresh = {"launch_s": 2e-6, "launch_points": [[1, 3e-5]], "date": "2026-12-02 06:00:00", "seconds": 30.0,
             "stages": {"b/attention/bf16": {"s": 5.0}}, "decode_achieved": {"b/bf16": 0.9}, "items": {}}
    out = merge_fixed_costs(old, fresh, ["b"])
    assert out["stages"] == {"a/attention/bf16": {"s": 1.0}, "b/attention/bf16": {"s": 5.0}}   # b's combine dropped
    assert out["decode_achieved"] == {"a/bf16": 0.5, "b/bf16": 0.9} and out["items"] == {"a/bf16": {"block_s": 1.0}}
    assert out["launch_s"] == 2e-6 and out["method"].endswith("b re-measured 2026-12-02 06:00:00 (30 s)")
    assert "unmeasured" not in out and old["stages"]["b/attention/bf16"] == {"s": 2.0}        # not mutated
    with pytest.raises(UserError, match="fixed costs of a were not measured"):
        merge_fixed_costs(old, fresh, ["a"])


OLD_FC = {"launch_s": 1e-6, "launch_points": [[1, 2e-5]], "method": "stages: ...", "date": "2026-12-02 05:00:00",
          "stages": {"a/attention/bf16": {"s": 1.0}, "a/attention/fp8": {"s": 1.5}, "b/attention/bf16": {"s": 2.0},
                     "gone/attention/bf16": {"s": 9.0}},
          "decode_achieved": {"a/bf16": 0.5, "a/fp8": 0.4, "b/bf16": 0.6}, "items": {"a/bf16": {"block_s": 1.0}}}


def _fresh(stages, decode):
    return {"launch_s": 2e-6, "launch_points": [[1, 3e-5]], "date": "2026-12-03 06:00:00", "seconds": 30.0,
            "method": "stages: fresh", "stages": stages, "decode_achieved": decode, "items": {}}


def test_a_full_calibration_keeps_and_names_a_candidate_it_skipped():
    """A candidate skipped on one dtype keeps that dtype's entries, every table, named with their date and why;
    its other dtype and the other candidates are replaced whole; a backend no longer a candidate goes."""
    from msa_bench.harness.calibration.fixed_costs import merge_fixed_costs
    fresh = _fresh({"a/attention/fp8": {"s": 7.0}, "b/attention/bf16": {"s": 8.0}}, {"a/fp8": 0.7, "b/bf16": 0.8})
    out = merge_fixed_costs(OLD_FC, fresh, None, {"a/bf16": "after N 1: planning and timing took 41 s"},
                            candidates=["a", "b"])
    assert out["stages"] == {"a/attention/bf16": {"s": 1.0}, "a/attention/fp8": {"s": 7.0},
                             "b/attention/bf16": {"s": 8.0}}
    assert out["decode_achieved"] == {"a/bf16": 0.5, "a/fp8": 0.7, "b/bf16": 0.8}
    assert out["items"] == {"a/bf16": {"block_s": 1.0}}
    assert out["unmeasured"] == {"a/bf16": {"kept_from": "2026-12-02 05:00:00",
                                            "why": "after N 1: planning and timing took 41 s"}}
    assert out["method"] == ("stages: fresh; a/bf16 kept from 2026-12-02 05:00:00 (after N 1: planning and timing "
                             "took 41 s)")
    # re-kept later: the entries keep the date they were measured on; measured again: no longer named
    again = merge_fixed_costs(out, _fresh({"a/attention/fp8": {"s": 7.0}, "b/attention/bf16": {"s": 8.0}}, {}),
                              None, {"a/bf16": "failed"}, candidates=["a", "b"])
    assert again["unmeasured"]["a/bf16"] == {"kept_from": "2026-12-02 05:00:00", "why": "failed"}
    assert "unmeasured" not in merge_fixed_costs(out, _fresh({"a/attention/bf16": {"s": 3.0},
                                                              "a/attention/fp8": {"s": 3.0}}, {}),
                                                 None, {}, candidates=["a"])


def test_a_candidate_skipped_on_the_decode_batches_is_not_half_replaced():
    """Stages measured at the latency point but the batches skipped: the unit keeps all its old entries."""
    from msa_bench.harness.calibration.fixed_costs import merge_fixed_costs
    fresh = _fresh({"a/attention/bf16": {"s": 3.0}, "b/attention/bf16": {"s": 8.0}}, {"a/bf16": 0.9})
    out = merge_fixed_costs(OLD_FC, fresh, ["a", "b"], {"b/bf16": "at N 264: out of memory"})
    assert out["stages"]["b/attention/bf16"] == {"s": 2.0} and out["decode_achieved"]["b/bf16"] == 0.6
    assert out["stages"]["a/attention/bf16"] == {"s": 3.0} and out["decode_achieved"]["a/bf16"] == 0.9
    assert out["unmeasured"] == {"a/fp8": {"kept_from": "2026-12-02 05:00:00", "why": "not measured here"},
                                 "b/bf16": {"kept_from": "2026-12-02 05:00:00", "why": "at N 264: out of memory"}}
    assert out["method"].endswith("a, b re-measured 2026-12-03 06:00:00 (30 s); a/fp8 kept from 2026-12-02 "
                                  "05:00:00 (not measured here); b/bf16 kept from 2026-12-02 05:00:00 (at N 264: "
                                  "out of memory)")
    with pytest.raises(UserError, match="fixed costs of b were not measured"):
        merge_fixed_costs(OLD_FC, fresh, ["b"], {"b/bf16": "at N 264: out of memory"})



def test_a_stage_only_longer_tiles_run_adds_its_own_time_and_one_token_batches_do_not_pay_it():
    """q-packed-cute's one-token plans (the latency point, decode batches) run no schedule stage; its item
    workloads (8-token tiles) do. The schedule then costs its own time on the least work that ran it, on top
    of the shared module cost, and the decode fraction subtracts only the stages each batch ran."""
    from msa_bench.harness.calibration.fixed_costs import fit_decode_achieved
    latency = {("q-packed-cute", "bf16"): [(1e-6, {"module": 30e-6, "attention": 30e-6}, {"attention": 1}, 16)]}
    items = {"q-packed-cute/bf16": {"s": 0.0, "block_s": 1.5e-6, "intercept_s": 5e-6}}
    beyond = {("q-packed-cute", "bf16"): [(9e-6, {"module": 130e-6, "schedule": 12e-6, "attention": 118e-6}, {"schedule": 1}, 115),
                                          (4e-6, {"module": 85e-6, "schedule": 9e-6, "attention": 76e-6}, {"schedule": 1}, 50)],
              ("auto", "bf16"): [(4e-6, {"module": 85e-6, "schedule": 9e-6}, {}, 50)]}
    got = fit_series(latency, items, beyond)
    assert set(got) == {"q-packed-cute/attention/bf16", "q-packed-cute/schedule/bf16"}
    assert got["q-packed-cute/attention/bf16"]["s"] == pytest.approx(5e-6)         # the shared cost, unchanged
    assert got["q-packed-cute/schedule/bf16"]["s"] == pytest.approx(9e-6)          # the least work's own time
    assert got["q-packed-cute/schedule/bf16"]["launches"] == 1
    assert fit_series(latency, items) == {"q-packed-cute/attention/bf16": got["q-packed-cute/attention/bf16"]}
    batches = [_row(r, 5e-6 + r / 0.9) for r in (1e-4, 2e-4, 3e-4)]                # attention alone
    assert fit_decode_achieved({("q-packed-cute", "bf16"): batches}, got) == {"q-packed-cute/bf16": pytest.approx(0.9)}


def test_the_first_candidate_on_each_calibration_workload_times_a_dropped_plan_first(monkeypatch):
    """As a sweep's first unit does (timing.warm_plan): on each workload one plan of the first candidate is
    timed with the fewest samples and dropped, then every candidate is timed with the calibration's own."""
    from msa_bench.harness.calibration import fixed_costs
    from msa_bench.harness.measure import timing
    from msa_bench.harness.measure.timing import TimingConfig
    monkeypatch.setattr(auto_mod, "candidate_names", lambda: ["flashinfer", "kv-outer", "msa-scatter"])
    real, calls = timing.time_plan, []

    def record(plan, config, device, *rest):
        calls.append((plan.backend, config.cpu_reps))
        return real(plan, config, device, *rest)
    monkeypatch.setattr(timing, "time_plan", record)
    monkeypatch.setattr(fixed_costs, "time_plan", record)
    points = lambda dtype: fixed_costs.calibration_points(dtype, SMALL, (8, 32), (512, 1024))
    series = fixed_costs.measure_series(PRESETS["h200"], ("fp32",), log=lambda *_: None, device="cpu", points=points,
                                        timing=TimingConfig(cpu_reps=2, cpu_max_reps=2))
    assert set(series) == {("kv-outer", "fp32"), ("msa-scatter", "fp32")}      # flashinfer: no GPU here
    per_workload = [("kv-outer", 1), ("kv-outer", 2), ("msa-scatter", 2)]
    assert calls == per_workload * 2


def test_host_medians_share_a_one_call_module_among_its_stages():
    from types import SimpleNamespace as NS
    from msa_bench.harness.calibration.fixed_costs import HOST_LAUNCH, HOST_PROBE, HOST_STAGES, host_medians
    from msa_bench.harness.measure.timing import MODULE
    samples = {MODULE: NS(launch_s=[12e-6, 12e-6, 30e-6], host_probe_s=[8e-6] * 3),
               "schedule": NS(launch_s=[8e-6] * 3), "attention": NS(launch_s=[7e-6, 8e-6, 9e-6])}
    apart = host_medians(samples, ("schedule", "attention"), one_call=False)
    assert apart[HOST_LAUNCH] == pytest.approx(6e-6) and apart[HOST_PROBE] == 8e-6
    assert apart[HOST_STAGES] == {"schedule": 8e-6, "attention": 8e-6}            # each in its own call
    once = host_medians(samples, ("schedule", "attention"), one_call=True)
    assert once[HOST_STAGES] == pytest.approx({"schedule": 6e-6, "attention": 6e-6})  # the one call, shared
    assert sum(once[HOST_STAGES].values()) == pytest.approx(2 * once[HOST_LAUNCH])
