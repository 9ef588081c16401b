"""The regression gate on committed runs: a real H200 run (the statistical path) and the CPU fixture
(host timings, never judged), on copies with planted changes and planted damage."""
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from msa_bench.errors import UserError
from msa_bench.harness.gate.compare import (IMPROVEMENT, NOISE, REGRESSION, UNCHANGED, compare_runs, judge_samples,
                                       parse_threshold)
from msa_bench.harness.store.results import load_run, write_meta
from msa_bench.harness.store.seal import seal_unit
from msa_bench.harness.measure.timing import summarize

ROOT = Path(__file__).resolve().parents[1] / "results"
FIXTURE = ROOT / "fixtures" / "smoke-run"          # CPU: host timings
GPU_RUN = ROOT / "h200" / "baseline"               # the gate's baseline, measured on the H200: CUDA-graph timings


def copy_run(tmp_path, source=GPU_RUN, name="new") -> Path:
    dest = tmp_path / name
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("report"))
    return dest


def timed_units(run: Path) -> list[Path]:
    return sorted(p for p in (run / "units").iterdir() if (p / "samples.parquet").is_file())


def tightest_unit(run: Path) -> Path:
    """The unit whose module samples spread least: a planted 20% slowdown must show there."""
    def spread(unit):
        s = pd.read_parquet(unit / "samples.parquet")
        m = s.loc[s["stage"] == "module", "seconds"]
        return (m.quantile(0.75) - m.quantile(0.25)) / m.median()
    return min(timed_units(run), key=spread)


def scale_samples(unit: Path, factor, stages=("module", "attention")):
    """Scale a unit's samples and rewrite its summary statistics to match: a consistent run whose
    times changed, which is what a real slowdown looks like to the gate."""
    s = pd.read_parquet(unit / "samples.parquet")
    mask = s["stage"].isin(stages)
    s.loc[mask, "seconds"] = s.loc[mask, "seconds"] * (factor(mask.sum()) if callable(factor) else factor)
    s.to_parquet(unit / "samples.parquet", index=False)
    stats = pd.read_parquet(unit / "stats.parquet")
    for stage, group in s.groupby("stage"):
        for statistic, value in summarize(group["seconds"].tolist()).items():
            stats.loc[(stats["stage"] == stage) & (stats["statistic"] == statistic), "value"] = value
    stats.to_parquet(unit / "stats.parquet", index=False)
    seal_unit(unit)                          # as the sweep that measured it would have


def test_fixtures_are_what_they_say():
    cpu = json.loads((FIXTURE / "run.json").read_text())
    assert cpu["timer"] == "cpu" and "NOT GPU timings" in cpu["note"] and cpu["complete"] is True
    gpu = load_run(GPU_RUN)
    assert gpu.timer == "cuda-graph" and "H200" in gpu.device_name


def test_identical_gpu_runs_go_through_the_statistical_path(cli):
    """The same samples on both sides: every timed stage is tested (a p-value) and comes out unchanged."""
    result = compare_runs(load_run(GPU_RUN), load_run(GPU_RUN))
    times = [f for f in result.findings if f.kind == "time"]
    assert times and getattr(result, "timings_judged", True)
    assert all(f.verdict == UNCHANGED and f.p_value is not None and f.p_value > 0.4 for f in times)
    code, out, err = cli("compare", GPU_RUN, GPU_RUN, "--all")
    assert code == 0, err
    assert "0 regression(s), 0 improvement(s)" in " ".join(out.split())


def test_planted_regression_fails(tmp_path, cli):
    new = copy_run(tmp_path)
    victim = tightest_unit(new)
    scale_samples(victim, 1.2)
    code, out, err = cli("compare", GPU_RUN, new)
    assert code == 1, out + err
    assert "regression" in out and victim.name.split("-")[0] in out
    # the same slowdown below the threshold is not a regression
    code, out, _ = cli("compare", GPU_RUN, new, "--max-regression", "25%")
    assert code == 0, out


def test_noise_only_differences_pass(tmp_path, cli):
    new = copy_run(tmp_path)
    rng = np.random.default_rng(0)
    for unit in timed_units(new):
        scale_samples(unit, lambda n: rng.uniform(0.995, 1.005, n))
    code, out, err = cli("compare", GPU_RUN, new)
    assert code == 0, out + err


def test_improvement_is_reported_and_passes(tmp_path, cli):
    new = copy_run(tmp_path)
    scale_samples(tightest_unit(new), 0.8)
    code, out, err = cli("compare", GPU_RUN, new)
    assert code == 0, err
    assert "improvement" in out and "0 regression(s)" in " ".join(out.split())


@pytest.mark.parametrize("source", [GPU_RUN, FIXTURE], ids=["gpu", "cpu"])
def test_newly_failing_unit_is_a_regression(tmp_path, cli, source):
    new = copy_run(tmp_path, source)
    unit = timed_units(new)[0]
    status = json.loads((unit / "status.json").read_text())
    status.update(status="failed", reason="output disagrees with the reference (planted by the test)")
    (unit / "status.json").write_text(json.dumps(status))
    (unit / "samples.parquet").unlink()
    (unit / "stats.parquet").unlink()
    seal_unit(unit)
    code, out, _ = cli("compare", source, new)
    assert code == 1 and "now failed" in out


def test_cpu_timings_are_listed_not_judged(tmp_path, cli):
    """Host timings are no performance signal: a planted 50% slowdown of a CPU run is not a regression,
    and the output says why, in either order."""
    new = copy_run(tmp_path, FIXTURE)
    for unit in timed_units(new):
        scale_samples(unit, 1.5)
    for a, b in ((FIXTURE, new), (new, FIXTURE)):
        code, out, err = cli("compare", a, b, "--all", env={"COLUMNS": "80"})
        text = " ".join(out.split())
        assert code == 0, out + err
        assert "timings not judged" in text and "0 regression(s)" in text and "\nnot judged: kv-outer" in out


def test_more_bytes_moved_is_a_regression(tmp_path, cli):
    """One unit's module HBM bytes set in both copies; 3% more HBM bytes > 2% tolerance."""
    base, new = copy_run(tmp_path, name="base"), copy_run(tmp_path, name="new")
    for run, hbm in ((base, 1.0e6), (new, 1.03e6)):
        unit = timed_units(run)[0]
        stats = pd.read_parquet(unit / "stats.parquet")
        row = stats[stats["stage"] == "module"].iloc[[0]].copy()
        stats = stats[~((stats["stage"] == "module") & (stats["statistic"] == "hbm_bytes"))]  # the run's own
        row["statistic"], row["value"] = "hbm_bytes", hbm
        pd.concat([stats, row]).to_parquet(unit / "stats.parquet", index=False)
        seal_unit(unit)
    code, out, _ = cli("compare", base, new)
    assert code == 1 and "hbm_bytes" in out
    code, out, _ = cli("compare", base, new, "--counter-tolerance", "5%")
    assert code == 0


def test_different_scenario_is_only_a_warning(tmp_path, cli):
    new = copy_run(tmp_path)
    meta = json.loads((new / "run.json").read_text())
    meta["scenario"] = 'renamed [error] {"v": [2]}'                  # brackets are text, not markup
    write_meta(new, meta)
    code, out, _ = cli("compare", GPU_RUN, new)
    assert code == 0 and "different scenario" in out and 'renamed [error] {"v": [2]}' in out


def test_unusable_input_exits_2(tmp_path, cli, one_error_line):
    code, _, err = cli("compare", FIXTURE, tmp_path / "nope")
    assert code == 2 and "no run folder" in one_error_line(err)
    code, _, err = cli("compare", FIXTURE, FIXTURE, "--max-regression", "5")
    assert code == 2 and "ambiguous" in one_error_line(err)
    broken = copy_run(tmp_path, FIXTURE)
    (broken / "run.json").write_text("{not json")
    code, _, err = cli("compare", FIXTURE, broken)
    assert code == 2 and "corrupt results file" in one_error_line(err)


def test_unit_timed_in_the_baseline_and_unavailable_now_is_unusable(tmp_path, cli, one_error_line):
    new = copy_run(tmp_path)
    unit = timed_units(new)[0]
    status = json.loads((unit / "status.json").read_text())
    status.update(status="unavailable", reason="flashinfer is not importable (planted by the test)")
    (unit / "status.json").write_text(json.dumps(status))
    (unit / "samples.parquet").unlink()
    (unit / "stats.parquet").unlink()
    seal_unit(unit)
    code, _, err = cli("compare", GPU_RUN, new)
    assert code == 2 and "unavailable in the new run" in one_error_line(err)


def test_an_internal_error_is_not_a_verdict(monkeypatch, cli, one_error_line):
    """A crash (a bug, a broken installation) exits 3: never 1, the gate's regression code."""
    from msa_bench.harness.gate import compare

    def broken(*args, **kwargs):
        raise RuntimeError("planted bug")
    monkeypatch.setattr(compare, "mannwhitneyu", broken)
    code, _, err = cli("compare", GPU_RUN, GPU_RUN)
    assert code == 3 and "internal error: RuntimeError: planted bug" in one_error_line(err)

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'scipy'", name="scipy")
    monkeypatch.setattr(compare, "compare_runs", missing)
    code, _, err = cli("compare", GPU_RUN, GPU_RUN)
    assert code == 3 and "'scipy' is not installed" in one_error_line(err)


def test_judge_samples_needs_size_and_significance():
    rng = np.random.default_rng(1)
    base = 1.0 + 0.01 * rng.standard_normal(20)
    assert judge_samples(base, base * 1.2, 0.05)[0] == REGRESSION
    assert judge_samples(base, base * 0.8, 0.05)[0] == IMPROVEMENT
    assert judge_samples(base, base * 1.03, 0.05)[0] == UNCHANGED        # real but below the threshold
    wide = rng.uniform(0.5, 1.5, 8)
    noisy = np.concatenate([wide[:4] * 1.25, wide[4:]])                    # median up, not distinguishable
    verdict, ratio, p = judge_samples(wide, noisy, 0.05)
    assert ratio > 1.05 and verdict == NOISE and p > 0.05


@pytest.mark.parametrize("bad", [[float("nan")] * 20, [1.0] * 10 + [float("nan")] * 10, [-1.0] * 20, []])
def test_judge_samples_refuses_impossible_times(bad):
    with pytest.raises(UserError, match="finite, positive"):
        judge_samples(np.ones(20), np.asarray(bad), 0.05)


def test_parse_threshold():
    assert parse_threshold("5%") == pytest.approx(0.05) and parse_threshold("0.05") == pytest.approx(0.05)
    for bad in ("5", "x", "-1%"):
        with pytest.raises(UserError):
            parse_threshold(bad)


def test_compare_all_never_cuts_a_value(cli):
    """At 80 columns (COLUMNS is honoured in a pipe too) the wide table falls back to one record per
    finding, every number, backend and point in full; where it fits, it is a table."""
    # raw times: the medians the run holds (where samples carry clocks, --clock both shows normalized ones)
    code, out, _ = cli("compare", GPU_RUN, GPU_RUN, "--all", "--clock", "raw", env={"COLUMNS": "80"})
    run = load_run(GPU_RUN)
    medians = run.value("median_s").query("stage == 'module'")
    assert code == 0 and "…" not in out
    assert all(f"{v * 1e6:.2f} µs -> {v * 1e6:.2f} µs" in out for v in medians["value"])
    assert all(key in out for key in medians["point_key"]) and all(b in out for b in set(medians["backend"]))
    code, wide, _ = cli("compare", GPU_RUN, GPU_RUN, "--all", env={"COLUMNS": "300"})
    assert code == 0 and "┃ verdict" in wide and "…" not in wide
