"""Scenario files: the shipped ones load into valid grids; bad files are one-line UserErrors naming
file and key; overrides; workloads from points; the `workload` and `scenarios` commands."""
import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from msa_bench.cli import app
from msa_bench.errors import UserError
from msa_bench.scenarios.grid import (Point, list_scenarios, load_scenario, make_workload,
                                         with_overrides)
from msa_bench.scenarios.selection import check_selection
from msa_bench.scenarios.stats import workload_stats
from msa_bench.scenarios.workload import AttnShape

SHIPPED = {"default", "smoke", "reuse-sweep", "skew", "real-prefill", "long-context", "co-selection", "indexer",
           "gate-prefill"}

GOOD = """
description = "a test grid"
backends = ["kv-outer"]
[shape]
hq = 4
hkv = 2
head_dim = 16
block = 8
topk = 3
[grid]
generator = "synthetic"
tokens = 24
context = 160
reuse = [0.25, 0.5]
dtypes = ["fp32", "fp16"]
"""


def write(tmp_path, text, name="s.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_shipped_scenarios_load_with_unique_keys():
    listed = dict(list_scenarios())
    assert SHIPPED <= set(listed)
    for name in SHIPPED:
        assert listed[name] and "\n" not in listed[name]
        s = load_scenario(name)
        assert s.points and s.backends and s.name == name
        keys = [p.key() for p in s.points]
        assert len(set(keys)) == len(keys)
        row = s.points[0].as_dict()
        assert {"generator", "tokens", "context", "reuse", "dtype", "weight", "hq", "topk", "point"} <= set(row)
        assert not any(isinstance(v, (AttnShape, dict, list)) for v in row.values())


def test_study_scenarios_use_the_study_shape_and_h200_sized_grids():
    for name in SHIPPED - {"smoke"}:
        s = load_scenario(name)
        assert s.shape == AttnShape(64, 4, 128, 128, 16)
        assert {p.dtype for p in s.points} == {"bf16", "fp8"}
    prefill = load_scenario("real-prefill")
    assert all(p.case_id and p.causal and p.weight > 0 for p in prefill.points)
    assert sum(p.weight for p in prefill.points if p.dtype == "bf16") == 10434
    smoke = load_scenario("smoke")
    assert all(p.tokens <= 64 and p.dtype in ("fp32", "fp16") for p in smoke.points)
    assert {p.generator for p in smoke.points} == {"synthetic", "indexer"}


def test_point_key_is_stable_and_readable():
    p = Point("synthetic", 8192, 1048576, 0.25, 0.0, False, "bf16", 0, None, 1.0, AttnShape())
    assert p.key() == "synthetic/N8192/T1048576/reuse0.25/skew0/noncausal/bf16/seed0/hq64-hkv4-d128-b128-top16"
    q = Point("real-prefill", 171, 55339, None, 0.0, True, "fp8", 0, "prefill_4469427d069d9467c4ec", 1325.0,
              AttnShape())
    assert q.key() == "real-prefill/prefill_4469427d069d9467c4ec/fp8/seed0/hq64-hkv4-d128-b128-top16"


def test_file_scenario_grid(tmp_path):
    s = load_scenario(write(tmp_path, GOOD))
    assert len(s.points) == 4 and s.backends == ["kv-outer"] and s.timing == {}
    assert [(p.reuse, p.dtype) for p in s.points] == [(0.25, "fp32"), (0.25, "fp16"), (0.5, "fp32"), (0.5, "fp16")]


@pytest.mark.parametrize("edit, key, why", [
    (("[grid]", "speed = 3\n[grid]"), "speed", "unknown key"),
    (('generator = "synthetic"', 'generator = "synthetic"\nfoo = 1'), "foo", "unknown key"),
    (("tokens = 24", 'tokens = "many"'), "tokens", "must be an integer"),
    (("tokens = 24", "tokens = true"), "tokens", "must be an integer"),
    (("reuse = [0.25, 0.5]", "reuse = [0.25, 9.0]"), "reuse", "infeasible"),
    (("reuse = [0.25, 0.5]", "reuse = []"), "reuse", "empty"),
    (("hq = 4", "hq = 5"), "shape", "multiple of hkv"),
    (("topk = 3", "topk = 0"), "shape", "positive"),
    (("head_dim = 16", "head_dim = 16.5"), "head_dim", "must be an integer"),
    (('dtypes = ["fp32", "fp16"]', 'dtypes = ["fp64"]'), "dtypes", "unknown dtype"),
    (('generator = "synthetic"', 'generator = "magic"'), "generator", "unknown generator"),
    (('generator = "synthetic"', 'generator = "indexer"'), "reuse", "does not apply"),
    (("context = 160", "context = 16"), "context", "fewer than top-3"),
    (("tokens = 24", "tokens = 400\ncausal = true"), "context", "must hold"),
    (('backends = ["kv-outer"]', "backends = []"), "backends", "non-empty"),
    (('description = "a test grid"', ""), "description", "one-line"),
    (("[grid]", "[timing]\nreps = 0\n[grid]"), "reps", ">= 1"),
    (("[grid]", "[timing]\nflush = 1\n[grid]"), "flush", "unknown key"),
    (('generator = "synthetic"', 'generator = "real-prefill"\ncases = ["prefill_x"]'), "tokens", "does not apply"),
    (("reuse = [0.25, 0.5]", "reuse = [0.25, 0.5"), "TOML", "invalid TOML"),
])
def test_bad_files_are_one_line_user_errors(tmp_path, edit, key, why):
    path = write(tmp_path, GOOD.replace(*edit))
    with pytest.raises(UserError) as exc:
        load_scenario(path)
    msg = str(exc.value)
    assert path in msg and key in msg and why in msg, msg
    assert "\n" not in msg


def test_missing_and_empty_grids(tmp_path):
    no_grid = GOOD[:GOOD.index("[grid]")]
    with pytest.raises(UserError, match="grid would be empty"):
        load_scenario(write(tmp_path, no_grid))
    with pytest.raises(UserError, match="unknown prefill case"):
        load_scenario(write(tmp_path, no_grid + '[grid]\ngenerator = "real-prefill"\ncases = ["prefill_nope"]\n'))
    with pytest.raises(UserError, match="tokens is missing"):
        load_scenario(write(tmp_path, no_grid + '[grid]\ngenerator = "synthetic"\ncontext = 160\nreuse = 0.5\n'))
    with pytest.raises(UserError, match="unknown scenario"):
        load_scenario("no-such-scenario")
    with pytest.raises(UserError, match="does not exist"):
        load_scenario(str(tmp_path / "missing.toml"))


def test_overrides_replace_axes_and_are_validated(tmp_path):
    s = load_scenario(write(tmp_path, GOOD))
    o = with_overrides(s, reuse=[0.75], dtypes=["fp32"], backends=["msa-scatter"], causal=True)
    assert [(p.reuse, p.dtype, p.causal) for p in o.points] == [(0.75, "fp32", True)]
    assert o.backends == ["msa-scatter"] and len(s.points) == 4
    with pytest.raises(UserError, match="infeasible"):
        with_overrides(s, reuse=50.0)
    with pytest.raises(UserError, match="unknown dtype"):
        with_overrides(s, dtypes=["int4"])
    ix = with_overrides(s, generator="indexer")
    assert {p.generator for p in ix.points} == {"indexer"} and all(p.reuse is None for p in ix.points)
    with pytest.raises(UserError, match="does not apply"):
        with_overrides(load_scenario("real-prefill"), reuse=[1.0])
    smoke = with_overrides(load_scenario("smoke"), reuse=[0.5])        # applies to the synthetic grids only
    assert {p.reuse for p in smoke.points if p.generator == "synthetic"} == {0.5}


def test_make_workload_for_every_smoke_point():
    for p in load_scenario("smoke").points:
        w = make_workload(p)
        s = p.shape
        assert w.q.shape == (p.tokens, s.hq, s.head_dim) and w.dtype == p.dtype and w.causal == p.causal
        assert w.meta["point"] == p.key() and w.meta["with_tensors"]
        check_selection(w.selection, w.q_limit, s.block, w.causal)
        st = workload_stats(w)
        if p.reuse is not None:
            assert abs(st["nsb_per_n"] - p.reuse) <= 0.05 * p.reuse
        lite = make_workload(p, with_tensors=False)
        assert torch.equal(lite.selection, w.selection) and torch.equal(lite.pages, w.pages)


def test_real_prefill_point_workload_is_selection_only_when_asked():
    p = next(p for p in load_scenario("real-prefill").points if p.case_id == "prefill_4469427d069d9467c4ec")
    w = make_workload(p, with_tensors=False)
    assert not w.meta["with_tensors"] and w.n_tokens == 171 and w.q.stride() == (0, 0, 0)
    assert workload_stats(w)["weight"] == 1325


runner = CliRunner()


def test_workload_cli_json_reports_achieved_reuse():
    res = runner.invoke(app, ["workload", "--json", "--tokens", "4096", "--context", "65536", "--reuse", "0.5",
                              "--causal", "--skew", "1", "--device", "h200"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert abs(data["nsb_per_n"] - 0.5) <= 0.025 and data["causal"] and data["n_tokens"] == 4096
    assert data["pred_kv-outer_s"] > 0 and data["pred_q-outer_binding"] in ("hbm", "l2", "mma")


def test_workload_cli_table_and_real_prefill():
    res = runner.invoke(app, ["workload", "--generator", "real-prefill", "--case", "prefill_092e27340df8621a02f0"])
    assert res.exit_code == 0, res.output
    assert "nsb/N" in res.output and "predicted time (us)" in res.output and "kv-outer" in res.output


def test_scenarios_cli_lists_shipped():
    res = runner.invoke(app, ["scenarios"])
    assert res.exit_code == 0, res.output
    assert all(name in res.output for name in SHIPPED)


def test_workload_cli_bad_input_is_one_line():
    # through the real console entry point: one line on stderr, exit 2, no traceback
    args = ["--reuse", "3", "--tokens", "1024", "--context", "65536"]
    proc = subprocess.run([sys.executable, "-m", "msa_bench.cli", "workload", *args], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "feasible reuse is" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--generator", "real-prefill"], "needs --case"),
    (["--dtype", "int8"], "--dtype"),
    (["--generator", "oracle"], "--generator"),
    (["--case", "prefill_092e27340df8621a02f0"], "--case does not apply to --generator synthetic"),
])
def test_workload_cli_bad_input_raises_user_error(args, message):
    res = runner.invoke(app, ["workload", *args])
    assert isinstance(res.exception, UserError) and message in str(res.exception)
