"""The gate against baseline sets and under clock modes, on small synthetic runs with known medians."""
import json

import numpy as np
import pandas as pd
import pytest

from msa_bench.errors import UserError
from msa_bench.harness.gate.baseline import clocked_samples, cycles_seconds, load_baseline
from msa_bench.harness.gate.compare import IMPROVEMENT, NOISE, REGRESSION, UNCHANGED, compare_runs, judge_set
from msa_bench.harness.store.results import load_run

RNG = np.random.default_rng(0)


def samples(median, n=40, spread=0.002):
    return list(median * (1 + RNG.uniform(-spread, spread, n)))


def test_judge_set_needs_the_new_median_outside_the_baseline_spread():
    bases = [np.array(samples(m)) for m in (1.00, 1.03, 1.09)]
    # 6 % over the median of medians and significant against the pooled samples, but inside the spread
    verdict, ratio, p, spread = judge_set(bases, np.array(samples(1.03 * 1.055)), 0.05)
    assert verdict == NOISE and ratio == pytest.approx(1.055, abs=0.01) and spread == pytest.approx(1.09, abs=0.01)
    verdict, ratio, _, _ = judge_set(bases, np.array(samples(1.15)), 0.05)
    assert verdict == REGRESSION
    assert judge_set(bases, np.array(samples(0.90)), 0.05)[0] == IMPROVEMENT
    assert judge_set(bases, np.array(samples(1.03)), 0.05)[0] == UNCHANGED


def test_judge_set_flags_at_half_the_threshold_outside_a_tight_spread():
    bases = [np.array(samples(m)) for m in (1.000, 1.004, 1.008)]
    assert judge_set(bases, np.array(samples(1.035)), 0.05)[0] == REGRESSION      # a 3.1 % slowdown
    assert judge_set(bases, np.array(samples(1.020)), 0.05)[0] == UNCHANGED       # 1.6 %: under half of 5 %
    assert judge_set(bases, np.array(samples(0.97)), 0.05)[0] == IMPROVEMENT


def make_set(tmp_path, fake_run, medians, grid="g1", name="set"):
    root = tmp_path / name
    for i, m in enumerate(medians):
        fake_run(root / f"run-{i + 1:02d}", {"a": samples(m), "b": samples(2 * m)}, grid=grid)
    return root


def test_baseline_set_on_the_cli(tmp_path, fake_run, cli):
    base = make_set(tmp_path, fake_run, (1e-3, 1.04e-3, 1.12e-3))
    inside = fake_run(tmp_path / "inside", {"a": samples(1.04e-3 * 1.06), "b": samples(2.08e-3)})
    code, out, err = cli("compare", base / "run-01", inside)
    assert code == 1, out + err              # one run: the between-run move reads as a regression
    code, out, err = cli("compare", base, inside, "--all")
    assert code == 0, out + err
    assert "spread" in out and "3 baseline runs" in " ".join(out.split())
    outside = fake_run(tmp_path / "outside", {"a": samples(1.25e-3), "b": samples(2.08e-3)})
    code, out, err = cli("compare", base, outside)
    assert code == 1 and "regression" in out, out + err


def test_baseline_set_with_mismatched_grids_is_unusable(tmp_path, fake_run, cli, one_error_line):
    base = make_set(tmp_path, fake_run, (1e-3, 1e-3))
    fake_run(base / "run-03", {"a": samples(1e-3)}, grid="other")
    code, _, err = cli("compare", base, base / "run-01")
    assert code == 2 and "different grid" in one_error_line(err)
    code, _, err = cli("compare", tmp_path, base / "run-01")   # a folder of no runs
    assert code == 2 and "neither a run folder nor a baseline set" in one_error_line(err)


def test_clock_modes_undo_a_clock_step(tmp_path, fake_run, cli):
    base = fake_run(tmp_path / "base", {"a": samples(1e-3)})
    # the same work, every sample 10 % slower because the SMs ran 10 % slower
    stepped = fake_run(tmp_path / "stepped", {"a": (samples(1.1e-3), [1800.0] * 40)})
    assert cli("compare", base, stepped, "--clock", "raw")[0] == 1
    code, out, err = cli("compare", base, stepped)          # the default (both): normalize sees no change
    assert code == 0, out + err
    # half the samples clock-stepped: the floor drops them and says how many
    mixed = fake_run(tmp_path / "mixed", {"a": (samples(1e-3, 20) + samples(1.2e-3, 20), [1980.0] * 20 + [1650.0] * 20)})
    assert cli("compare", base, mixed, "--clock", "raw")[0] == 1
    code, out, err = cli("compare", base, mixed, "--clock", "floor")
    assert code == 0, out + err
    assert "dropped 40 sample(s)" in " ".join(out.split())     # 20 per stage, module and attention


def test_clock_both_flags_only_what_raw_and_normalize_both_see(tmp_path, fake_run, cli):
    base = fake_run(tmp_path / "base", {"a": (samples(1e-3), [1850.0] * 40)})
    # a stage bound by memory: the same time at a 5.4 % higher clock, which normalize reads as a slowdown
    quicker_clock = fake_run(tmp_path / "q", {"a": (samples(1e-3), [1950.0] * 40)})
    assert cli("compare", base, quicker_clock, "--clock", "normalize")[0] == 1
    assert cli("compare", base, quicker_clock, "--clock", "raw")[0] == 0
    code, out, err = cli("compare", base, quicker_clock, "--clock", "both")
    assert code == 0 and "0 regression(s)" in out, out + err
    # a clock step: 10 % slower at a 10 % lower clock, which raw reads as a slowdown
    stepped = fake_run(tmp_path / "s", {"a": (samples(1.1e-3), [1850.0 / 1.1] * 40)})
    assert cli("compare", base, stepped, "--clock", "raw")[0] == 1
    assert cli("compare", base, stepped, "--clock", "both")[0] == 0
    # a real slowdown at the same clock: both see it
    slower = fake_run(tmp_path / "r", {"a": (samples(1.1e-3), [1850.0] * 40)})
    code, out, err = cli("compare", base, slower, "--clock", "both")
    assert code == 1 and "2 regression(s)" in " ".join(out.split()), out + err     # module and attention


def test_clock_modes_need_the_clock_columns(tmp_path, fake_run, cli, one_error_line):
    old = fake_run(tmp_path / "old", {"a": samples(1e-3)}, clocks=False)
    code, out, _ = cli("compare", old, old)           # runs without the columns still load and compare raw
    assert code == 0 and "raw times are compared" in " ".join(out.split())
    new = fake_run(tmp_path / "new", {"a": samples(1e-3)})
    code, out, _ = cli("compare", old, new)           # one run without clocks is enough to fall back
    assert code == 0 and "raw times are compared" in " ".join(out.split())
    code, _, err = cli("compare", old, old, "--clock", "sometimes")
    assert code == 2 and "--clock must be one of" in one_error_line(err)


def test_cycles_seconds():
    assert cycles_seconds([2e-3], [990.0], 1980.0)[0] == pytest.approx(1e-3)


@pytest.mark.parametrize("column,value", [("sm_clock_mhz", -5.0), ("sm_clock_mhz", float("nan")),
                                          ("sm_clock_mhz", float("inf")), ("clock_event_reasons", 0.5)])
def test_load_run_validates_the_clock_columns(tmp_path, fake_run, column, value):
    run = fake_run(tmp_path / "r", {"a": samples(1e-3)})
    path = next((run / "units").iterdir()) / "samples.parquet"
    s = pd.read_parquet(path)
    s[column] = s[column].astype(float)
    s.loc[3, column] = value
    s.to_parquet(path, index=False)
    with pytest.raises(UserError, match=column):
        load_run(run)


def test_floor_is_per_unit(tmp_path, fake_run):
    run = load_run(fake_run(tmp_path / "r", {"a": (samples(1e-3, 4), [2000.0, 1990, 1900, 1980]),
                                             "b": (samples(1e-3, 4), [1500.0] * 4)}))
    kept, dropped = clocked_samples(run, "floor", 0.97)
    assert dropped == 2 and len(kept[kept["backend"] == "b"]) == 8


def test_sweep_rows_carry_the_clock_columns_and_load_back(tmp_path):
    """The sweep's sample rows: GPU stages get sm_clock_mhz and clock_event_reasons, the host `plan` row
    leaves them empty, and the unit written through the results format loads back validated."""
    import torch
    from msa_bench.harness.store import results
    from msa_bench.harness.running.runner import Runner
    from msa_bench.harness.measure.timing import StageSamples, TimingConfig
    from msa_bench.scenarios.grid import Point
    from msa_bench.scenarios.workload import AttnShape
    point = Point("synthetic", 16, 256, 0.5, 0.0, False, "bf16", 0, None, 1.0, AttnShape())
    runner = Runner(tmp_path, torch.device("cpu"), TimingConfig(), False, [])
    timed = {"plan": StageSamples("plan", [0.1], "host", True),
             "module": StageSamples("module", [1e-3, 1.1e-3], "cuda-graph", True, [1980.0, 1800.0], [0, 4])}
    stats, rows = runner._timing_rows(point, "reference", timed, {})
    module = [r for r in rows if r["stage"] == "module"]
    assert [r["sm_clock_mhz"] for r in module] == [1980.0, 1800.0] and module[1]["clock_event_reasons"] == 4
    assert "sm_clock_mhz" not in next(r for r in rows if r["stage"] == "plan")
    uid = results.unit_id(point.key(), "reference")
    results.write_unit(tmp_path, uid, {"status": "ok", "point_key": point.key(), "backend": "reference",
                                       "dtype": "bf16", "max_rel_err": 0.0, "tol": 1e-2}, stats, rows)
    results.write_meta(tmp_path, {"scenario": "t", "units_planned": [uid], "backends": ["reference"],
                                  "timer": "cuda-graph", "provenance": {"device_name": "NVIDIA H200"}})
    s = load_run(tmp_path).samples
    assert s.loc[s["stage"] == "module", "sm_clock_mhz"].tolist() == [1980.0, 1800.0]


def test_bad_floor_is_one_line(cli, one_error_line, tmp_path, fake_run):
    run = fake_run(tmp_path / "r", {"a": samples(1e-3)})
    code, _, err = cli("compare", run, run, "--clock", "floor", "--floor", "1.5")
    assert code == 2 and "--floor" in one_error_line(err)
