"""A committed run whose raw samples were removed to keep results/ small: it says so in run.json, and only
then do load_run and the report read it without samples; the gate and merge refuse it with one line."""
import json
import shutil
from pathlib import Path

import pytest

from msa_bench.errors import UserError
from msa_bench.harness.store.results import SAMPLES_REMOVED, load_run, write_meta

ROOT = Path(__file__).resolve().parents[1] / "results"
H200 = ROOT / "h200"


def _without_samples(src: Path, dst: Path, declare: bool) -> Path:
    shutil.copytree(src, dst)
    for f in (dst / "units").glob("*/samples.parquet"):
        f.unlink()
    if declare:
        meta = json.loads((dst / "run.json").read_text())
        meta[SAMPLES_REMOVED] = "a test copy"
        write_meta(dst, meta)
    return dst


def test_removed_samples_load_only_where_the_run_says_so(tmp_path, cli):
    src = ROOT / "fixtures" / "smoke-run"
    with pytest.raises(UserError, match="samples.parquet: missing"):
        load_run(_without_samples(src, tmp_path / "silent", declare=False))
    run = load_run(_without_samples(src, tmp_path / "declared", declare=True))
    whole = load_run(src)
    assert run.samples.empty and run.stats.equals(whole.stats)
    code, _, err = cli("report", tmp_path / "declared", "--out", tmp_path / "rep")
    assert code == 0, err
    # the gate judges samples: it refuses such a run either way round, in one line
    for args in ((src, tmp_path / "declared"), (tmp_path / "declared", src)):
        code, _, err = cli("compare", *args)
        assert code == 2 and "keeps no raw timing samples" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("merge", tmp_path / "merged", tmp_path / "declared", src)
    assert code == 2 and "keeps no raw timing samples" in err


def test_damaged_stats_still_fail_without_samples(tmp_path):
    import pandas as pd
    run_dir = _without_samples(ROOT / "fixtures" / "smoke-run", tmp_path / "run", declare=True)
    unit = next(u for u in sorted((run_dir / "units").iterdir()) if (u / "stats.parquet").is_file())
    stats = pd.read_parquet(unit / "stats.parquet")
    stats["value"] = float("nan")
    stats.to_parquet(unit / "stats.parquet", index=False)
    with pytest.raises(UserError, match="not finite"):
        load_run(run_dir)


def test_the_gate_baseline_keeps_its_samples():
    for run in sorted(p for p in H200.iterdir() if (p / "run.json").is_file()):
        meta = json.loads((run / "run.json").read_text())
        if run.name == "baseline":
            assert SAMPLES_REMOVED not in meta and not load_run(run).samples.empty
        if SAMPLES_REMOVED in meta:
            assert not any((run / "units").glob("*/samples.parquet")), run


def test_results_stay_under_10_mb_on_disk():
    """What a checkout of results/ takes: each file rounded up to 4 KiB, and 4 KiB a folder."""
    block = 4096
    total = 0
    for p in ROOT.rglob("*"):
        total += block if p.is_dir() else -(-p.stat().st_size // block) * block
    assert total < 10e6, f"results/ takes {total / 1e6:.1f} MB"
