"""Damaged results never pass: compare exits 2 naming the unit, merge and report refuse the same
damage, and `sweep --resume` redoes a damaged unit instead of stopping at it."""
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from msa_bench.harness.store.results import finished_units, load_run, write_meta

GPU_RUN = Path(__file__).resolve().parents[1] / "results" / "h200" / "baseline"


def _samples(unit: Path) -> pd.DataFrame:
    return pd.read_parquet(unit / "samples.parquet")


def nan_all(unit):
    s = _samples(unit)
    s["seconds"] = float("nan")
    s.to_parquet(unit / "samples.parquet", index=False)


def nan_half(unit):
    s = _samples(unit)
    s.loc[s.index[::2], "seconds"] = float("nan")
    s.to_parquet(unit / "samples.parquet", index=False)


def negative(unit):
    s = _samples(unit)
    s["seconds"] = -s["seconds"]
    s.to_parquet(unit / "samples.parquet", index=False)


def renamed_column(unit):
    _samples(unit).rename(columns={"seconds": "secs"}).to_parquet(unit / "samples.parquet", index=False)


def emptied(unit):
    _samples(unit).iloc[:0].to_parquet(unit / "samples.parquet", index=False)


def fewer_samples(unit):
    s = _samples(unit)
    s[s["rep"] != s["rep"].max()].to_parquet(unit / "samples.parquet", index=False)


def deleted_samples(unit):
    (unit / "samples.parquet").unlink()


def truncated(unit):
    data = (unit / "samples.parquet").read_bytes()
    (unit / "samples.parquet").write_bytes(data[:len(data) // 2])


def moved_folder(unit):
    return unit.rename(unit.with_name(unit.name[:-4] + "0000"))      # its status names another folder


def _edit_status(unit, **changes):
    status = json.loads((unit / "status.json").read_text())
    status.update(changes)
    (unit / "status.json").write_text(json.dumps(status))


def ok_beyond_its_tolerance(unit):
    _edit_status(unit, max_rel_err=5.0, tol=0.01)


def ok_with_nan_error(unit):
    _edit_status(unit, max_rel_err=float("nan"))


def failed_keeping_its_timings(unit):
    _edit_status(unit, status="failed", reason="planted")


def another_timer(unit):
    s = _samples(unit)
    s.loc[s.index[:3], "timer"] = "cpu"          # a GPU run's unit whose samples claim the host timer
    s.to_parquet(unit / "samples.parquet", index=False)


def another_timer_in_the_whole_unit(unit):
    s = _samples(unit)
    s["timer"] = "cpu"
    s.to_parquet(unit / "samples.parquet", index=False)
    _edit_status(unit, timer="cpu")


DAMAGE = [nan_all, nan_half, negative, renamed_column, emptied, fewer_samples, deleted_samples, truncated,
          moved_folder, ok_beyond_its_tolerance, ok_with_nan_error, failed_keeping_its_timings, another_timer,
          another_timer_in_the_whole_unit]


def damaged_copy(tmp_path, damage, name="new") -> tuple[Path, Path]:
    run = tmp_path / name
    shutil.copytree(GPU_RUN, run, ignore=shutil.ignore_patterns("report"))
    victim = sorted(p for p in (run / "units").iterdir() if p.name.startswith("kv-outer"))[0]
    return run, damage(victim) or victim


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_compare_report_and_merge_refuse_damage(tmp_path, cli, one_error_line, damage):
    new, victim = damaged_copy(tmp_path, damage)
    code, _, err = cli("compare", GPU_RUN, new)
    line = one_error_line(err)
    assert code == 2 and victim.name in line, line
    code, _, err = cli("report", new, "--out", tmp_path / "report")
    assert code == 2 and victim.name in one_error_line(err)
    code, _, err = cli("merge", tmp_path / "merged", new)
    assert code == 2 and victim.name in one_error_line(err)
    assert not (tmp_path / "merged").exists()


def test_a_deleted_unit_folder_fails_the_gate(tmp_path, cli, one_error_line):
    new, victim = damaged_copy(tmp_path, lambda unit: shutil.rmtree(unit))
    for command in (("compare", GPU_RUN, new), ("report", new, "--out", tmp_path / "report")):
        code, _, err = cli(*command)          # run.json says the run is complete: a unit is missing
        assert code == 2 and victim.name in one_error_line(err), command
    meta = json.loads((new / "run.json").read_text())
    meta["complete"] = False                  # an unfinished run may lack units, but not pass the gate
    write_meta(new, meta)
    status = json.loads((GPU_RUN / "units" / victim.name / "status.json").read_text())
    code, _, err = cli("compare", GPU_RUN, new)
    line = one_error_line(err)
    assert code == 2 and "lacks 1 unit(s)" in line and status["point_key"] in line


def test_merging_a_run_with_itself_needs_force_and_says_which_copy_it_kept(tmp_path, cli, one_error_line):
    code, _, err = cli("merge", tmp_path / "m1", GPU_RUN, GPU_RUN)
    assert code == 2 and "more than one folder" in one_error_line(err)
    code, out, err = cli("merge", tmp_path / "m2", GPU_RUN, GPU_RUN, "--force")
    assert code == 0, err
    assert f"kept the copies from {GPU_RUN}" in " ".join(out.split())
    assert finished_units(tmp_path / "m2") == finished_units(GPU_RUN)
    assert len(load_run(tmp_path / "m2").status) == len(load_run(GPU_RUN).status)


def test_damaged_units_names_each_one(tmp_path):
    from msa_bench.harness.store.results import damaged_units
    run, victim = damaged_copy(tmp_path, nan_half)
    assert list(damaged_units(run)) == [victim.name]
    assert "not finite" in damaged_units(run)[victim.name]
    assert damaged_units(GPU_RUN) == {}
