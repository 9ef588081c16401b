"""Edited results never pass (issue 60, section 1): every part of a run is sealed when it is written
(harness/store/seal.py) and the rules that follow from other data are derived, never read. Each edit below,
on a copy of the CPU fixture, is refused by compare (both ways), merge and report with exit 2 and one
line naming the unit (or run.json) and what changed: as edited, and again after resealing it as its
writer would have (the derived rules alone)."""
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from msa_bench.errors import UserError
from msa_bench.harness.store.results import load_run, seal_run, write_meta
from msa_bench.harness.store.seal import SEAL_FIELD, SEAL_FILE, seal_unit

FIXTURE = Path(__file__).resolve().parents[1] / "results" / "fixtures" / "smoke-run"
GRID = ["--backend", "reference", "--dtype", "fp32", "--reuse", "0.5", "--reps", "3"]


def _ok_unit(run: Path, dtype: str) -> Path:
    return next(u for u in sorted((run / "units").iterdir()) if (u / "stats.parquet").is_file()
                and json.loads((u / "status.json").read_text())["dtype"] == dtype)


def _edit_status(unit: Path, reseal: bool, **changes) -> Path:
    status = json.loads((unit / "status.json").read_text())
    status.update(changes)
    (unit / "status.json").write_text(json.dumps(status))
    if reseal:
        seal_unit(unit)
    return unit


def _edit_meta(run: Path, reseal: bool, edit) -> Path:
    meta = json.loads((run / "run.json").read_text())
    edit(meta)
    if reseal:
        write_meta(run, meta)
    else:
        (run / "run.json").write_text(json.dumps(meta))
    return run / "run.json"


# Each edit changes a copy of the fixture and returns (the part it names, a word of what changed).

def max_rel_err_negative(run, reseal):
    return _edit_status(_ok_unit(run, "fp16"), reseal, max_rel_err=-1.0), "max_rel_err"


def tol_raised_over_a_large_error(run, reseal):
    return _edit_status(_ok_unit(run, "fp16"), reseal, max_rel_err=5.0, tol=10.0), "tol"


def status_dtype_fp16_to_fp32(run, reseal):
    return _edit_status(_ok_unit(run, "fp16"), reseal, dtype="fp32"), "dtype"


def samples_dtype_column(run, reseal):
    unit = _ok_unit(run, "fp16")
    samples = pd.read_parquet(unit / "samples.parquet")
    samples["dtype"] = "fp32"
    samples.to_parquet(unit / "samples.parquet", index=False)
    if reseal:
        seal_unit(unit)
    return unit, "dtype"


def provenance_h200_on_a_cpu_run(run, reseal):
    def edit(meta):
        meta["provenance"].update(device_kind="cuda", device_name="NVIDIA H200", gpu_name="NVIDIA H200",
                                  sm_count=132, driver="570.00")
    return _edit_meta(run, reseal, edit), "provenance"


def grid_unit_dropped(run, reseal):
    return _edit_meta(run, reseal, lambda meta: meta["grid_units"].pop(3)), "grid_units"


def backends_edited(run, reseal):
    return _edit_meta(run, reseal, lambda meta: meta.update(backends=["kv-outer", "flashinfer"])), "backends"


def timer_removed(run, reseal):
    return _edit_meta(run, reseal, lambda meta: meta.pop("timer")), "timer"


EDITS = [max_rel_err_negative, tol_raised_over_a_large_error, status_dtype_fp16_to_fp32, samples_dtype_column,
         provenance_h200_on_a_cpu_run, grid_unit_dropped, backends_edited, timer_removed]


def _edited_copy(tmp_path, edit, reseal):
    run = tmp_path / "edited"
    shutil.copytree(FIXTURE, run)
    part, what = edit(run, reseal)
    return run, part.name, what


@pytest.mark.parametrize("reseal", [False, True], ids=["as-edited", "resealed"])
@pytest.mark.parametrize("edit", EDITS, ids=lambda f: f.__name__)
def test_each_edit_is_refused_by_every_reader(tmp_path, cli, one_error_line, edit, reseal):
    run, part, what = _edited_copy(tmp_path, edit, reseal)
    for command in (("compare", FIXTURE, run), ("compare", run, FIXTURE), ("merge", tmp_path / "merged", run),
                    ("report", run, "--out", tmp_path / "report")):
        code, _, err = cli(*command)
        line = one_error_line(err)
        assert code == 2 and part in line and what in line, (command, line)
    assert not (tmp_path / "merged").exists() and not (tmp_path / "report").exists()


def test_an_edit_no_rule_derives_is_caught_by_the_seal(tmp_path, cli, one_error_line):
    """A consistent speed-up (samples and stats scaled together) and an edited note: only the digests
    taken at write time can tell, and the line says which file or field changed."""
    run = tmp_path / "edited"
    shutil.copytree(FIXTURE, run)
    unit = _ok_unit(run, "fp32")
    for name, column in (("samples.parquet", "seconds"), ("stats.parquet", "value")):
        table = pd.read_parquet(unit / name)
        timed = table["stage"] != "plan" if name == "samples.parquet" else table["statistic"].str.endswith("_s")
        table.loc[timed & (table["stage"] != "plan"), column] *= 0.5
        table.to_parquet(unit / name, index=False)
    code, _, err = cli("compare", FIXTURE, run)
    line = one_error_line(err)
    assert code == 2 and unit.name in line and "file samples.parquet changed" in line, line
    shutil.rmtree(run)
    shutil.copytree(FIXTURE, run)
    meta = json.loads((run / "run.json").read_text())
    meta["notes"] = ["timed on a quiet machine"]
    (run / "run.json").write_text(json.dumps(meta))
    code, _, err = cli("report", run, "--out", tmp_path / "report")
    line = one_error_line(err)
    assert code == 2 and "run.json" in line and "field notes changed" in line, line


def test_an_unsealed_run_is_refused_until_sealed_once(tmp_path, cli, one_error_line):
    run = tmp_path / "old"
    shutil.copytree(FIXTURE, run)
    for f in (run / "units").glob(f"*/{SEAL_FILE}"):
        f.unlink()
    meta = json.loads((run / "run.json").read_text())
    del meta[SEAL_FIELD]
    (run / "run.json").write_text(json.dumps(meta))
    code, _, err = cli("compare", FIXTURE, run)
    assert code == 2 and "unsealed" in one_error_line(err) and "msa-bench seal" in err
    code, out, err = cli("seal", run)
    assert code == 0 and "sealed 25 part(s)" in out, err
    code, out, _ = cli("seal", run)
    assert code == 0 and "sealed already" in out
    assert len(load_run(run).status) == len(load_run(FIXTURE).status)


def test_seal_refuses_an_edited_run(tmp_path, cli, one_error_line):
    """Sealing is for runs written before the record; a sealed part that changed is not resealed."""
    run, part, _ = _edited_copy(tmp_path, lambda r, _: (_edit_status(_ok_unit(r, "fp32"), False, reason="x"),
                                                        "reason"), False)
    code, _, err = cli("seal", run)
    line = one_error_line(err)
    assert code == 2 and part in line and "file status.json changed" in line, line
    with pytest.raises(UserError, match="status.json changed"):
        seal_run(run)


def test_a_fresh_resumed_and_merged_sweep_loads_clean(tmp_path, cli):
    """Round trip: a CPU smoke sweep, interrupted and resumed, and a merge of it, are sealed by their
    writers and load without a word; `seal` finds nothing to do."""
    from msa_bench.harness.running.sweep import INTERRUPT_HOOK
    run = tmp_path / "run"
    code, _, err = cli("sweep", "--scenario", "smoke", *GRID, "--out", run, env={INTERRUPT_HOOK: "2"})
    assert code == 130, err
    code, _, err = cli("sweep", "--scenario", "smoke", *GRID, "--out", run, "--resume")
    assert code == 0, err
    code, _, err = cli("merge", tmp_path / "merged", run)
    assert code == 0, err
    for folder in (run, tmp_path / "merged"):
        units = sorted((folder / "units").iterdir())
        assert units and all((u / SEAL_FILE).is_file() for u in units)
        assert SEAL_FIELD in json.loads((folder / "run.json").read_text())
        assert load_run(folder).meta["complete"] is True
        code, out, err = cli("seal", folder)
        assert code == 0 and "sealed already" in out, err
    code, _, err = cli("compare", run, tmp_path / "merged")
    assert code == 0, err
