"""A packed run (harness/store/results.py pack_run): one file instead of a folder per unit, read by load_run
with the same tables and the same checks, read-only."""
import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from msa_bench.errors import UserError
from msa_bench.harness.store.results import (PACKED_FILE, SAMPLES_REMOVED, grid_digest, load_run, pack_run, unit_id,
                                      write_meta)
from msa_bench.harness.store.seal import seal_unit

SMOKE = Path(__file__).resolve().parents[1] / "results" / "fixtures" / "smoke-run"


def _sample_less(dst: Path) -> Path:
    shutil.copytree(SMOKE, dst)
    for f in (dst / "units").glob("*/samples.parquet"):
        f.unlink()
    meta = json.loads((dst / "run.json").read_text())
    meta[SAMPLES_REMOVED] = "a test copy"
    write_meta(dst, meta)
    return dst


def test_a_packed_run_loads_the_same_tables(tmp_path, cli):
    run_dir = _sample_less(tmp_path / "run")
    before = load_run(run_dir)
    assert pack_run(run_dir) == len(before.status)
    assert not (run_dir / "units").exists() and (run_dir / PACKED_FILE).is_file()
    after = load_run(run_dir)
    key = ["unit"]
    pd.testing.assert_frame_equal(before.status.sort_values(key).reset_index(drop=True)[sorted(before.status)],
                                  after.status.sort_values(key).reset_index(drop=True)[sorted(before.status)],
                                  check_dtype=False)
    cols = ["point_key", "backend", "stage", "statistic"]
    pd.testing.assert_frame_equal(before.stats.sort_values(cols).reset_index(drop=True)[sorted(before.stats)],
                                  after.stats.sort_values(cols).reset_index(drop=True)[sorted(before.stats)],
                                  check_dtype=False)
    code, _, err = cli("report", run_dir, "--out", tmp_path / "rep")
    assert code == 0, err
    with pytest.raises(UserError, match="packed already"):
        pack_run(run_dir)


def test_pack_refuses_a_run_that_keeps_samples(tmp_path):
    shutil.copytree(SMOKE, tmp_path / "run")
    with pytest.raises(UserError, match="keeps raw timing samples"):
        pack_run(tmp_path / "run")
    assert (tmp_path / "run" / "units").is_dir()


def test_a_damaged_packed_unit_fails_the_load(tmp_path):
    run_dir = _sample_less(tmp_path / "run")
    pack_run(run_dir)
    path = run_dir / PACKED_FILE
    lines = gzip.open(path, "rt").read().splitlines()
    rec = next(json.loads(x) for x in lines if json.loads(x)["stats"])
    rec["stats"][0]["value"] = float("nan")
    bad = [json.dumps(rec) if json.loads(x)["unit"] == rec["unit"] else x for x in lines]
    path.write_bytes(gzip.compress(("\n".join(bad) + "\n").encode()))
    with pytest.raises(UserError, match="not finite"):
        load_run(run_dir)
    path.write_bytes(b"not gzip")
    with pytest.raises(UserError, match="corrupt results file"):
        load_run(run_dir)


def test_a_packed_run_is_not_resumed(tmp_path, cli, one_error_line):
    run_dir = _sample_less(tmp_path / "run")
    pack_run(run_dir)
    code, _, err = cli("sweep", "--scenario", "smoke", "--out", run_dir, "--resume", "--reps", "3")
    assert code == 2 and "packed" in one_error_line(err)


def test_update_puts_a_newer_runs_units_in_place(tmp_path):
    from msa_bench.harness.store.results import update_packed
    run_dir = _sample_less(tmp_path / "run")
    pack_run(run_dir)
    newer = tmp_path / "newer"
    shutil.copytree(SMOKE, newer)
    uid = sorted(p.name for p in (newer / "units").iterdir() if (p / "stats.parquet").is_file())[0]
    for p in (newer / "units").iterdir():
        if p.name != uid:
            shutil.rmtree(p)
    stats = pd.read_parquet(newer / "units" / uid / "stats.parquet")
    timed = stats["statistic"].str.endswith("_s")
    stats.loc[timed, "value"] = stats.loc[timed, "value"] * 2
    stats.to_parquet(newer / "units" / uid / "stats.parquet", index=False)
    (newer / "units" / uid / "samples.parquet").unlink(missing_ok=True)
    seal_unit(newer / "units" / uid)
    meta = json.loads((newer / "run.json").read_text())
    meta.update(complete=False, units_planned=[uid], backends=[*meta["backends"], "kv-outer-cute@plain"],
                **{SAMPLES_REMOVED: "a test copy"})
    write_meta(newer, meta)
    before = load_run(run_dir).stats
    assert update_packed(run_dir, newer) == 1
    after = load_run(run_dir).stats
    backend = uid.rsplit("-", 1)[0]
    old_rows = before[before.backend == backend]
    new_rows = after[after.backend == backend]
    assert len(after) == len(before) and (new_rows["value"].sum() > old_rows["value"].sum())
    assert json.loads((run_dir / "run.json").read_text())["updated_from"][0]["units"] == 1
    # a backend the run did not have, at one of its points, is added and listed
    status = json.loads((newer / "units" / uid / "status.json").read_text())
    added = unit_id(status["point_key"], "kv-outer-cute@plain")
    (newer / "units" / uid).rename(newer / "units" / added)
    (newer / "units" / added / "status.json").write_text(json.dumps({**status, "backend": "kv-outer-cute@plain"}))
    stats.assign(backend="kv-outer-cute@plain").to_parquet(newer / "units" / added / "stats.parquet", index=False)
    seal_unit(newer / "units" / added)
    assert update_packed(run_dir, newer) == 1
    assert len(load_run(run_dir).stats) > len(after)
    assert "kv-outer-cute@plain" in json.loads((run_dir / "run.json").read_text())["backends"]
    (newer / "units" / added).rename(newer / "units" / uid)
    (newer / "units" / uid / "status.json").write_text(json.dumps(status))
    stats.to_parquet(newer / "units" / uid / "stats.parquet", index=False)
    seal_unit(newer / "units" / uid)
    # a packed run that never planned the newer unit's point refuses it
    path = run_dir / PACKED_FILE
    lines = [x for x in gzip.open(path, "rt").read().splitlines()
             if json.loads(x)["status"]["point_key"] != status["point_key"]]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    meta = json.loads((run_dir / "run.json").read_text())
    meta.update(complete=False, units_planned=[u for u in meta.get("units_planned", []) if u != uid],
                grid_units=[u for u in meta.get("grid_units", []) if u != uid])
    meta["grid_sha256"] = grid_digest(meta["grid_units"])
    write_meta(run_dir, meta)
    with pytest.raises(UserError, match="no point of"):
        update_packed(run_dir, newer)
