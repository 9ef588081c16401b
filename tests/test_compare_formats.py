"""`compare --format json|markdown --output`: one Comparison rendered for tools and for a pull request, the
exit code the gate's; and `gate baseline`, a set made in one command and checked against itself."""
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from msa_bench.harness.gate.compare import IMPROVEMENT, REGRESSION, compare_runs
from msa_bench.harness.store.results import load_run

ROOT = Path(__file__).resolve().parents[1]
GATE_SET = ROOT / "results" / "h200" / "gate" / "baseline-set"

TOP_KEYS = {"schema_version", "verdict", "exit_code", "error", "baseline", "new", "settings", "timings_judged",
            "noise_band", "counts", "warnings", "report_url", "comparisons"}
COMPARISON_KEYS = {"point", "backend", "dtype", "stage", "what", "unit", "verdict", "baseline", "new", "ratio",
                   "p_value", "pass_band", "note"}


def samples(median, n=40, spread=0.002):
    return list(np.random.default_rng(int(median * 1e7)).normal(median, median * spread, n))


@pytest.fixture
def planted(tmp_path, fake_run):
    """A set of three runs, a clean new run and one whose backend `a` is 25 % slower and `b` 25 % faster."""
    root = tmp_path / "set"
    for i, m in enumerate((1e-3, 1.01e-3, 1.02e-3)):
        fake_run(root / f"run-{i + 1:02d}", {"a": samples(m), "b": samples(2 * m)})
    clean = fake_run(tmp_path / "clean", {"a": samples(1.005e-3), "b": samples(2.01e-3)})
    slow = fake_run(tmp_path / "slow", {"a": samples(1.25e-3), "b": samples(1.5e-3)})
    return root, clean, slow


def test_json_keys_are_the_schemas_whatever_the_verdict(planted, cli, tmp_path):
    root, clean, slow = planted
    docs = {}
    for name, new in (("pass", clean), ("regression", slow), ("error", tmp_path / "nowhere")):
        code, out, err = cli("compare", root, new, "--format", "json")
        docs[name] = doc = json.loads(out)
        assert set(doc) == TOP_KEYS and doc["schema_version"] == 1
        assert (doc["verdict"], doc["exit_code"]) == (name, code), err
    ok, bad = docs["pass"], docs["regression"]
    assert ok["settings"] == {"max_regression": 0.05, "counter_tolerance": 0.02, "alpha": 0.05, "clock": "both",
                              "floor": 0.97}
    assert ok["baseline"] == {"path": str(root), "runs": 3} and ok["new"]["device"] == "NVIDIA H200"
    assert ok["noise_band"]["rule"] == "set" and ok["noise_band"]["flag"] == pytest.approx(0.025)
    assert ok["counts"]["compared"] == len(ok["comparisons"]) == 4 and ok["counts"]["regression"] == 0
    for c in ok["comparisons"] + bad["comparisons"]:
        assert set(c) == COMPARISON_KEYS and set(c["baseline"]) == {"value", "run_spread"} and set(c["new"]) == {"value"}
        assert c["unit"] == "s" and len(c["pass_band"]) == 2
    slower = [c for c in bad["comparisons"] if c["backend"] == "a"]
    assert {c["verdict"] for c in slower} == {REGRESSION} and all(c["ratio"] > c["pass_band"][1] for c in slower)
    assert bad["counts"][REGRESSION] == 2 and bad["counts"][IMPROVEMENT] == 2
    assert docs["error"]["error"].startswith("no run folder") and docs["error"]["comparisons"] == []


def test_pass_band_is_the_verdicts_rule(planted):
    """A time outside its pass band is flagged (its samples differ too); inside it never is."""
    root, clean, slow = planted
    from msa_bench.harness.gate.baseline import load_baseline
    for new in (clean, slow):
        for f in compare_runs(load_baseline(root), load_run(new)).findings:
            lo, hi = f.band
            assert (f.verdict == REGRESSION) == (f.ratio > hi) and (f.verdict == IMPROVEMENT) == (f.ratio < lo)


def test_markdown_of_a_pass(planted, cli):
    root, clean, _ = planted
    code, out, _ = cli("compare", root, clean, "--format", "markdown", "--report-url", "https://ci.example/run/7")
    assert code == 0
    head, *_ = out.split("\n### ")
    assert head.startswith("## msa-bench gate: pass\n") and "**0 regression(s)**" in head and "3 baseline runs" in head
    assert "### Regressions\n\nNone.\n" in out and "### Improvements\n\nNone.\n" in out
    assert "### Noise band" in out and "widened by 2.5%" in out and "run-to-run spread" in out
    assert "[the run's report](https://ci.example/run/7)" in out
    assert out.index("### Regressions") < out.index("### Improvements") < out.index("### Noise band") \
        < out.index("<details>")


def test_markdown_of_a_regression_lists_it_first(planted, cli):
    root, _, slow = planted
    code, out, _ = cli("compare", root, slow, "--format", "markdown")
    assert code == 1 and out.startswith("## msa-bench gate: regression\n")
    regressions = out.split("### Regressions\n\n")[1].split("\n### ")[0]
    rows = [ln for ln in regressions.splitlines() if ln.startswith("| a |")]
    assert len(rows) == 2 and {"module", "attention"} == {r.split(" | ")[2] for r in rows}
    improvements = out.split("### Improvements\n\n")[1].split("\n### ")[0]
    assert improvements.count("| b |") == 2
    assert f"`msa-bench report {slow}`" in out           # no --report-url, no report: how to make the figures
    (slow / "report").mkdir()
    (slow / "report" / "summary.md").write_text("# summary\n")
    _, out, _ = cli("compare", root, slow, "--format", "markdown")
    assert f"[the run's report]({slow}/report/)" in out


def test_output_file_keeps_the_gates_exit_code(planted, cli, tmp_path, one_error_line):
    root, clean, slow = planted
    for new, want in ((clean, 0), (slow, 1)):
        for fmt in ("json", "markdown", "text"):
            dest = tmp_path / f"gate-{want}.{fmt}"
            code, out, _ = cli("compare", root, new, "--format", fmt, "--output", dest)
            assert code == want and dest.is_file()
            assert "compared:" in out                   # the log shows the text table
            text = dest.read_text()
            if fmt == "json":
                assert json.loads(text)["exit_code"] == want
            elif fmt == "markdown":
                assert text.startswith(f"## msa-bench gate: {'pass' if want == 0 else 'regression'}")
            else:
                assert "compared:" in text and ("regression:" in text) == bool(want)
    dest = tmp_path / "gate-error.md"
    code, _, err = cli("compare", root, tmp_path / "nowhere", "--format", "markdown", "--output", dest)
    assert code == 2 and "no run folder" in one_error_line(err)
    assert dest.read_text().startswith("## msa-bench gate: error") and "no run folder" in dest.read_text()


def test_a_bad_format_is_one_line(planted, cli, one_error_line):
    root, clean, _ = planted
    code, _, err = cli("compare", root, clean, "--format", "html")
    assert code == 2 and "--format must be one of text, json, markdown" in one_error_line(err)


def test_the_docs_show_the_markdown_of_a_committed_gate_run(cli, tmp_path, monkeypatch):
    """docs/harness.md pastes run-01 of the committed set against the other four: it is what compare prints."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").symlink_to(ROOT / "results")
    rest = tmp_path / "rest-of-set"
    rest.mkdir()
    for i in (2, 3, 4, 5):
        (rest / f"run-0{i}").symlink_to(GATE_SET / f"run-0{i}")
    code, out, _ = cli("compare", "rest-of-set", "results/h200/gate/baseline-set/run-01", "--format", "markdown")
    assert code == 0 and "gate-prefill, NVIDIA H200" in out and "32 compared" in out
    assert f"````markdown\n{out}````" in (ROOT / "docs" / "harness.md").read_text()


# ---- gate baseline -------------------------------------------------------------------------------------
@pytest.fixture
def fake_sweeps(monkeypatch, fake_run):
    """Sweeps that write a fake run: module medians in order, one per sweep; the commands are kept."""
    from msa_bench.harness.gate import baseline
    calls, medians = [], []

    def sweep(cmd, **kwargs):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        m = medians.pop(0)
        if m is None:
            print("error: planted", file=kwargs["stdout"], flush=True)
            return subprocess.CompletedProcess(cmd, 2)
        fake_run(out, {"a": samples(m), "b": samples(2 * m)})
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(baseline.subprocess, "run", sweep)
    return calls, medians


def test_gate_baseline_makes_a_set_that_passes_against_itself(tmp_path, cli, fake_sweeps):
    calls, medians = fake_sweeps
    medians += [1e-3, 1.01e-3, 1.005e-3]
    code, out, err = cli("gate", "baseline", "--runs", "3", "--out", tmp_path / "set")
    assert code == 0, out + err
    assert [c[c.index("--out") + 1] for c in calls] == [str(tmp_path / "set" / f"run-0{i}") for i in (1, 2, 3)]
    assert all(c[3:6] == ["sweep", "--scenario", "gate-prefill"] for c in calls)
    assert "run-03 against the other 2: 4 compared, 0 regression(s)" in out
    code, out, _ = cli("compare", tmp_path / "set", tmp_path / "set" / "run-01")
    assert code == 0


def test_gate_baseline_fails_a_set_that_regresses_against_itself(tmp_path, cli, fake_sweeps):
    _, medians = fake_sweeps
    medians += [1e-3, 1.002e-3, 1.3e-3]
    code, out, err = cli("gate", "baseline", "--runs", "3", "--out", tmp_path / "set")
    assert code == 1 and "run-03" in err and "regression" in out


def test_gate_baseline_keeps_finished_runs_and_names_a_failed_sweeps_log(tmp_path, cli, fake_sweeps,
                                                                         one_error_line):
    calls, medians = fake_sweeps
    medians += [1e-3, None]
    code, _, err = cli("gate", "baseline", "--runs", "2", "--out", tmp_path / "set")
    line = one_error_line(err)
    assert code == 2 and "run 2/2: the sweep exited 2" in line and "run-02.log" in line and "planted" in line
    medians += [1.01e-3]
    code, out, err = cli("gate", "baseline", "--runs", "2", "--out", tmp_path / "set")
    assert code == 0, out + err
    assert len(calls) == 3 and "run-01 is complete, kept" in out


def test_gate_baseline_checks_the_committed_set(cli):
    code, out, err = cli("gate", "baseline", "--runs", "5", "--out", GATE_SET)
    assert code == 0, out + err
    assert out.count("is complete, kept") == 5 and out.count("32 compared, 0 regression(s)") == 5


@pytest.mark.parametrize("args, says", [(["--runs", "1"], "--runs must be 2 or more"),
                                        (["--clock", "fast"], "--clock must be one of")])
def test_gate_baseline_bad_input_is_one_line(tmp_path, cli, one_error_line, args, says):
    code, _, err = cli("gate", "baseline", "--out", tmp_path / "set", *args)
    assert code == 2 and says in one_error_line(err)
