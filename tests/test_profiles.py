"""Which profile a command uses (discovery and precedence), what a run records of it, the prefill fit's rule,
and the report's flag on units measured above their roofline."""
import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from msa_bench.errors import UserError
from msa_bench.roofline import devices
from msa_bench.roofline.devices import PRESETS, PROFILE_ENV, resolve_profile, run_profile

ROOT = Path(__file__).resolve().parents[1]


def calibrated(tmp_path, slug, **changes):
    data = {**json.loads(json.dumps(asdict(PRESETS.get(slug, PRESETS["h100"])))), "name": f"{slug}-calibrated",
            "hbm_bytes_per_s": 3.0e12, **changes}
    folder = tmp_path / "results" / slug / "calibration"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "profile.json").write_text(json.dumps(data))
    return folder / "profile.json"


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A working directory with no calibration, and no checkout's either."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(devices, "PACKAGE_ROOT", tmp_path / "no-checkout")
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.delenv("MSA_BENCH_PROFILE_SAID", raising=False)
    return tmp_path


def test_the_flag_comes_before_the_calibration_and_the_preset(here):
    calibrated(here, "h100")
    own = here / "mine.json"
    PRESETS["b200"].to_json(own)
    choice = resolve_profile(str(own), "NVIDIA H100 80GB HBM3")
    assert choice.origin == "flag" and choice.profile == PRESETS["b200"] and choice.sha256 and choice.note is None
    assert choice.path == "mine.json"                    # relative to the working directory, as a run records it


def test_a_calibrated_file_comes_before_the_preset_and_a_preset_name_reads_it(here):
    path = calibrated(here, "h100")
    choice = resolve_profile(None, "NVIDIA H100 80GB HBM3")
    assert choice.origin == "calibration" and choice.profile.hbm_bytes_per_s == 3.0e12 and choice.note is None
    assert choice.path == "results/h100/calibration/profile.json"
    assert choice.sha256 == __import__("hashlib").sha256(path.read_bytes()).hexdigest()
    assert devices.load_device("h100").hbm_bytes_per_s == 3.0e12 == resolve_profile("h100", None).profile.hbm_bytes_per_s


def test_without_a_calibration_the_gpu_gets_its_preset_and_one_line_saying_how_to_make_one(here, capsys):
    choice = resolve_profile(None, "NVIDIA H100 80GB HBM3")
    assert choice.origin == "preset" and choice.profile == PRESETS["h100"]
    assert not choice.profile.achieved and not choice.profile.fixed_costs          # unit fractions, no fixed costs
    assert "no calibration of NVIDIA H100" in choice.note and "msa-bench calibrate" in choice.note
    choice.say()
    choice.say()                                                                  # said once
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("note: no calibration")


def test_an_unknown_gpu_is_never_modelled_as_another(here):
    choice = resolve_profile(None, "NVIDIA A100-SXM4-80GB")
    assert choice.profile is None and choice.origin == "none"
    assert "matches no preset" in choice.note and "results/a100-sxm4-80gb/calibration" in choice.note
    with pytest.raises(UserError, match="needs the roofline's ceilings"):
        choice.required("msa-bench roofline")
    calibrated(here, "a100-sxm4-80gb")                # its own calibration: then it is modelled
    assert resolve_profile(None, "NVIDIA A100-SXM4-80GB").profile.name == "a100-sxm4-80gb-calibrated"


def test_sweep_device_reaches_auto_through_the_environment(here, monkeypatch):
    own = here / "mine.json"
    PRESETS["b200"].to_json(own)
    monkeypatch.setenv(PROFILE_ENV, str(own))
    assert devices.device_profile("cpu") == PRESETS["b200"]
    monkeypatch.delenv(PROFILE_ENV)
    assert devices.device_profile("cpu") == PRESETS["h200"]        # no GPU: the study's GPU, h200


def test_the_h200_preset_agrees_with_its_calibration():
    cal = json.loads((ROOT / "results" / "h200" / "calibration" / "profile.json").read_text())
    p = PRESETS["h200"]
    assert p.hbm_bytes_per_s == pytest.approx(cal["measured"]["hbm"]["read_bytes_per_s"], rel=1e-3)
    assert p.hbm_bytes_per_s == pytest.approx(cal["hbm_bytes_per_s"], rel=1e-3)      # the read, not the copy
    assert p.l2_bytes_per_s == pytest.approx(cal["l2_bytes_per_s"], rel=1e-3)
    assert p.mma_flops == pytest.approx(cal["mma_flops"], rel=1e-3)
    assert p.vendor["hbm_bytes_per_s"] == 4.8e12 and cal["vendor"]["hbm_bytes_per_s"] == 4.8e12


# ---- provenance ---------------------------------------------------------------------------------

def test_a_run_records_its_profile_and_the_report_repredicts_with_it(here, fake_run):
    from msa_bench.harness.store import results
    path = calibrated(here, "h100")
    run = here / "run"
    fake_run(run, {"kv-outer": [1e-3] * 5})
    meta = results.read_meta(run)
    meta["provenance"] = {"device_name": "NVIDIA H100", "gpu_name": "NVIDIA H100",
                          "profile": resolve_profile(None, "NVIDIA H100").provenance()}
    assert meta["provenance"]["profile"]["path"] == "results/h100/calibration/profile.json"
    assert meta["provenance"]["profile"]["origin"] == "calibration"
    choice = run_profile(meta)
    assert choice.origin == "recorded" and choice.profile.hbm_bytes_per_s == 3.0e12
    path.write_text(path.read_text().replace("3000000000000.0", "3100000000000.0"))     # changed since
    changed = run_profile(meta)
    assert changed.profile.hbm_bytes_per_s == 3.1e12 and "not here as it was" in changed.note
    assert run_profile({"provenance": {"gpu_name": None}}).profile is None             # a CPU run: no model


def test_the_sweep_records_the_profile_in_run_json(here):
    """A CPU sweep (smoke) with --device names the profile file and its hash in provenance."""
    from msa_bench.harness.store import results
    from msa_bench.harness.running.sweep import SweepRequest, run_sweep
    own = here / "mine.json"
    PRESETS["h100"].to_json(own)
    req = SweepRequest(scenario="smoke", backends=["kv-outer"], dtypes=["fp32"], tokens=[16], reuse=[0.5],
                       out=str(here / "run"), device=str(own), reps=1)
    run_sweep(req)
    prof = results.read_meta(here / "run")["provenance"]["profile"]
    assert prof["path"] == "mine.json" and prof["sha256"] and prof["origin"] == "flag" and prof["name"] == "h100"


# ---- the prefill fit ----------------------------------------------------------------------------

def _scaled(run, backend, factor, noise=0.0, seed=0):
    """The run with `backend`'s measured module medians times `factor` (and multiplicative noise)."""
    st = run.stats.copy()
    rows = (st["backend"] == backend) & (st["stage"] == "module") & (st["statistic"] == "median_s")
    rng = np.random.default_rng(seed)
    st.loc[rows, "value"] = st.loc[rows, "value"] * factor * (1 + noise * rng.standard_normal(rows.sum()))
    return replace(run, stats=st)


@pytest.fixture(scope="module")
def cosel():
    from msa_bench.harness.store.results import load_run
    return load_run(ROOT / "results" / "h200" / "co-selection")


def test_the_fit_is_the_median_fraction_and_follows_the_measured_time(cosel):
    from msa_bench.harness.calibration.calibrate import fit_prefill
    dev = devices.load_device("h200")
    base = fit_prefill(cosel, dev)["achieved"]
    slower = fit_prefill(_scaled(cosel, "kv-outer", 2.0), dev, dev.achieved, only=["kv-outer"])
    # twice the time less the same fixed cost: the fraction falls to about half, nothing else moves
    assert slower["achieved"]["kv-outer/bf16"] == pytest.approx(base["kv-outer/bf16"] / 2, rel=0.05)
    assert {k: v for k, v in slower["achieved"].items() if not k.startswith("kv-outer/")} == \
        {k: v for k, v in dev.achieved.items() if not k.startswith("kv-outer/")}
    # noise of 5 % on every unit: the median moves by less than that
    noisy = fit_prefill(_scaled(cosel, "kv-outer", 1.0, noise=0.05, seed=3), dev, only=["kv-outer"])["achieved"]
    assert noisy["kv-outer/fp8"] == pytest.approx(base["kv-outer/fp8"], rel=0.05)
    fit = fit_prefill(cosel, dev)["fractions"]["kv-outer/bf16"]
    assert fit["units"] == 7 and fit["run"].endswith("co-selection") and fit["commit"] and fit["date"]


def test_a_backend_missing_from_the_fit_keeps_its_fraction_or_has_none(cosel):
    from msa_bench.harness.calibration.calibrate import fit_prefill
    dev = devices.load_device("h200")
    without = replace(cosel, status=cosel.status[cosel.status["backend"] != "msa-scatter"],
                      stats=cosel.stats[cosel.stats["backend"] != "msa-scatter"])
    kept = fit_prefill(without, dev, dev.achieved)
    assert kept["achieved"]["msa-scatter/bf16"] == dev.achieved["msa-scatter/bf16"]
    assert kept["kept"]["msa-scatter/bf16"]["value"] == dev.achieved["msa-scatter/bf16"]
    fresh = fit_prefill(without, dev, {})                      # a first calibration: none, and why
    assert "msa-scatter/bf16" not in fresh["achieved"] and fresh["kept"]["msa-scatter/bf16"]["value"] is None
    assert "kv-outer/bf16" in fresh["achieved"]


def test_the_profile_names_the_points_it_was_fitted_on_and_validation_leaves_them_out(cosel, load_script):
    from msa_bench.harness.calibration.calibrate import fit_prefill, fitted_points, merge_fitted
    dev = devices.load_device("h200")
    fit = fit_prefill(cosel, dev)
    points = sorted(set(cosel.status["point_key"]))
    prof = replace(dev, fitted=merge_fitted({}, fit, "co-selection", points))
    assert fitted_points(prof) == set(points)
    run, dropped = load_script("auto-validation").out_of_sample(cosel, fitted_points(prof))
    assert dropped == 14 and run.status.empty


# ---- units above their roofline -----------------------------------------------------------------

def test_a_unit_above_its_roofline_is_flagged_in_the_summary(tmp_path):
    from msa_bench.harness.report.summary import above_roofline_table, write_report
    from msa_bench.harness.store.results import load_run
    run = load_run(ROOT / "results" / "h200" / "drift")
    dev = devices.load_device("h200")
    held = above_roofline_table(run, dev)          # FlashInfer bf16 over the measured L2 plateau: flagged
    assert set(held["backend"]) <= {"flashinfer"}
    slow = replace(dev, hbm_bytes_per_s=dev.hbm_bytes_per_s / 4, l2_bytes_per_s=dev.l2_bytes_per_s / 4,
                   mma_flops={k: v / 4 for k, v in dev.mma_flops.items()})
    flagged = above_roofline_table(run, slow)
    assert len(flagged) > len(held) and (flagged["roofline / measured"].fillna(0).clip(lower=0) > 1).any()
    summary = write_report(ROOT / "results" / "h200" / "drift", tmp_path / "report", slow).read_text()
    assert f"**{len(flagged)} unit(s) above their roofline: model defects.**" in summary


def test_the_bound_is_compulsory_traffic_and_a_miss_estimate_over_count_is_named_apart(tmp_path):
    """q-packed-cute bf16 on the H100's co-selection ran faster than its roofline with the model's L2-capacity
    misses, never faster than compulsory traffic: the bound holds, the miss estimate over-counts there.
    `auto` is held to its pick's bound."""
    from msa_bench.harness.report.summary import above_roofline_table, write_report
    from msa_bench.harness.report.tables import unit_bound
    from msa_bench.harness.store.results import load_run
    from msa_bench.harness.report.tables import ok_units
    run = load_run(ROOT / "results" / "h100" / "co-selection")
    dev = devices.load_device(str(ROOT / "results" / "h100" / "calibration" / "profile.json"))
    assert above_roofline_table(run, dev).empty
    over = above_roofline_table(run, dev, l2_capacity=True)
    assert not over.empty and set(over["backend"]) <= {"q-packed-cute", "auto"}
    t = ok_units(run)
    picks = {i: json.loads(r["plan_info"])["auto"]["picked"] for i, r in t[t["backend"] == "auto"].iterrows()}
    i = next(i for i, p in picks.items() if p != "hybrid")      # the hybrid's roofline is a sum of two: none
    mine = t[(t["backend"] == picks[i]) & (t["point_key"] == t.loc[i, "point_key"])].iloc[0]
    assert unit_bound(t.loc[i], dev).time_s == pytest.approx(unit_bound(mine, dev).time_s)
    summary = write_report(ROOT / "results" / "h100" / "co-selection", tmp_path / "report", dev,
                           figures=False).read_text()
    assert "None: every modelled unit is at or under its roofline." in summary
    assert f"{len(over)} unit(s) ran faster than the roofline with the model's L2-capacity misses" in summary


def test_an_incomplete_packed_run_says_where_its_units_are_before_the_resume():
    """A packed run is never resumed as it is: the report's line says where its unit folders are (or that
    they were not kept) before the resume command, and the other way when they cannot come back."""
    from dataclasses import replace
    from msa_bench.harness.report.summary import incomplete
    from msa_bench.harness.store.results import load_run
    run = load_run(ROOT / "results" / "h100" / "sparsity")
    line = incomplete(run)
    assert line.startswith("run incomplete: 21 of 364 planned unit(s) missing; a packed run is not resumed "
                           "(raw samples not kept")
    assert "--resume; else sweep the missing points into a new folder" in line
    kept = replace(run, meta={**run.meta, "samples_removed": "raw samples at abc123: git checkout abc123 -- u"})
    assert "(raw samples at abc123: git checkout abc123 -- u): with its unit folders back, msa-bench sweep" \
        in incomplete(kept)
