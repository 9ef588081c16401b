"""What a sweep tells its user: a failed unit fails the command, impossible sizes are refused before
anything runs, an interrupt names the folder and the command that resumes it, `--resume` alone finds
that folder, and the progress line and notes stay readable."""
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from msa_bench.harness.store.results import finished_units, load_run
from msa_bench.harness.running.sweep import INTERRUPT_HOOK

GRID = ["--scenario", "smoke", "--backend", "reference", "--dtype", "fp32", "--reuse", "0.5",
        "--generator", "synthetic", "--no-causal", "--reps", "1"]          # 2 points: skew 0 and skew 1


def test_a_failed_unit_fails_the_sweep_and_is_listed(tmp_path, cli, monkeypatch):
    """A backend whose output disagrees with the reference: every unit fails; the sweep says which
    and exits 1 (it used to exit 0 with the failures only in status files)."""
    from msa_bench.kernels.reference_backend import ReferenceBackend
    plan_of = ReferenceBackend._plan

    def wrong(self, w):
        plan = plan_of(self, w)
        combine = plan.stages["combine"]
        plan.stages["combine"] = lambda: (combine(), plan.output.mul_(2.0))      # planted bug
        return plan
    monkeypatch.setattr(ReferenceBackend, "_plan", wrong)
    code, out, err = cli("sweep", *GRID, "--out", tmp_path / "r")
    assert code == 1, out + err
    assert out.count("FAILED: reference at synthetic/") == 2 and "output disagrees" in out
    assert "2 unit(s) failed" in err
    assert (load_run(tmp_path / "r").status["status"] == "failed").all()


SHAPE = '[shape]\nhq = 4\nhkv = 2\nhead_dim = 32\nblock = 16\ntopk = 4\n'
GRID_TOML = '[grid]\ngenerator = "synthetic"\ntokens = 64\ncontext = 512\nreuse = 0.5\n'


@pytest.mark.parametrize("edit, key", [
    (lambda t: t.replace("block = 16", f"block = {2**30}").replace('"synthetic"', '"indexer"')
     .replace("reuse = 0.5", "causal = true"), "GiB, more than the"),
    (lambda t: t.replace("head_dim = 32", f"head_dim = {2**24}"), "GiB, more than the"),
    (lambda t: t.replace("hq = 4", f"hq = {2**22}"), "GiB, more than the"),
    (lambda t: t + f"seed = {2**64}\n", "grid.seed: seed must be in [0, 2^63)"),
    (lambda t: t.replace("context = 512", "context = 4000000000"), "overflows int32 key positions"),
], ids=["block-2^30", "head_dim-2^24", "hq-2^22", "seed-2^64", "context-4e9"])
def test_impossible_sizes_are_refused_before_anything_runs(tmp_path, cli, one_error_line, edit, key):
    scenario = tmp_path / "huge.toml"
    scenario.write_text(edit(f'description = "x"\nbackends = ["reference"]\n{SHAPE}{GRID_TOML}'))
    out = tmp_path / "r"
    code, _, err = cli("sweep", "--scenario", scenario, "--out", out)
    line = one_error_line(err)
    assert code == 2 and key in line, line
    assert not out.exists()                                   # refused before a run folder was made


def test_points_too_large_for_this_device_are_unavailable_and_the_rest_runs(tmp_path, cli):
    """A scenario sized for a larger GPU still runs where some of its points fit: the others' units are
    recorded unavailable with the memory they need, a note counts them, and the sweep exits 0."""
    scenario = tmp_path / "mixed.toml"
    grid = GRID_TOML.replace("context = 512", "context = [512, 1073741824]")
    scenario.write_text(f'description = "x"\nbackends = ["reference"]\n{SHAPE}{grid}')
    code, _, err = cli("sweep", "--scenario", scenario, "--out", tmp_path / "r")
    assert code == 0, err
    assert "1 of 2 points do not fit" in " ".join(err.split())
    status = load_run(tmp_path / "r").status.set_index("context")
    assert status.loc[512, "status"] == "ok"
    assert status.loc[1073741824, "status"] == "unavailable"
    assert "does not fit on this device" in status.loc[1073741824, "reason"]


def test_interrupt_names_the_folder_and_the_command_that_resumes_it(tmp_path, cli, monkeypatch):
    run = tmp_path / "run"
    code, _, err = cli("sweep", *GRID, "--out", run, env={INTERRUPT_HOOK: "1"})
    assert code == 130
    text = " ".join(err.split())
    assert f"1 of 2 units finished in {run}" in text
    command = re.search(r"resume with: (.*)$", err.strip(), re.M).group(1)
    args = shlex.split(command)
    assert args[:2] == ["msa-bench", "sweep"] and args[-3:] == ["--out", str(run), "--resume"]
    code, _, err = cli(*args[1:])                             # exactly that command
    assert code == 0, err
    assert json.loads((run / "run.json").read_text())["complete"] is True


def test_resume_without_out_continues_the_latest_unfinished_run(tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, _ = cli("sweep", *GRID, env={INTERRUPT_HOOK: "1"})
    assert code == 130
    runs = list((tmp_path / "results" / "runs").iterdir())
    assert len(runs) == 1 and len(finished_units(runs[0])) == 1
    code, out, err = cli("sweep", *GRID, "--resume")
    assert code == 0, err
    assert list((tmp_path / "results" / "runs").iterdir()) == runs          # no new folder
    assert len(finished_units(runs[0])) == 2 and "1 of 2 units already finished" in " ".join(err.split())
    code, _, err = cli("sweep", *GRID, "--resume")                       # nothing left to resume
    assert code == 2 and "nothing to resume" in err


def test_resume_redoes_a_damaged_unit(tmp_path, cli):
    run = tmp_path / "run"
    code, _, err = cli("sweep", *GRID, "--out", run)
    assert code == 0, err
    victim = sorted((run / "units").iterdir())[0]
    data = (victim / "samples.parquet").read_bytes()
    (victim / "samples.parquet").write_bytes(data[:len(data) // 2])      # a truncated write
    code, _, err = cli("sweep", *GRID, "--out", run, "--resume")
    assert code == 0, err
    assert "damaged" in err and (run / "units" / f".damaged-{victim.name}").is_dir()
    assert len(load_run(run).status) == 2                                 # whole again


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def test_progress_line_keeps_count_bar_and_eta_at_80_columns(tmp_path):
    from rich.console import Console

    from msa_bench.harness.running.sweep import SweepRequest, run_sweep
    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=True, color_system=None)
    run_sweep(SweepRequest(scenario="smoke", backends=["reference"], dtypes=["fp32"], reuse=[0.5],
                           generator="synthetic", causal=False, reps=1, out=str(tmp_path / "r")), console=console)
    lines = [ln for ln in re.split(r"[\r\n]", _plain(buf.getvalue())) if "━" in ln]
    assert lines, buf.getvalue()
    last = lines[-1]
    assert len(last) <= 80 and "2/2" in last and "ETA" in last and "━━━━━━━━" in last, last


def test_notes_and_an_unavailable_backend_are_said_once(tmp_path, cli):
    code, out, err = cli("sweep", *GRID[:2], "--backend", "reference,flashinfer", *GRID[4:], "--out", tmp_path / "r")
    assert code == 0, err
    text = " ".join((out + err).split())
    assert text.count("NOT GPU timings") == 1 and text.count("telemetry unavailable") == 1
    fi = [ln for ln in out.splitlines() if "flashinfer" in ln]
    assert len(fi) == 1 and "2 units" in fi[0] and "no GPU" in fi[0], out
