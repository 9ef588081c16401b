"""Shared test helpers."""
import contextlib
import io
import sys

import pytest


def _run_cli(*args, env=None):
    """Run the real `msa-bench` entry point (cli.main) in-process: (exit code, stdout, stderr)."""
    from msa_bench.cli import main
    out, err = io.StringIO(), io.StringIO()
    old_argv = sys.argv
    sys.argv = ["msa-bench", *map(str, args)]
    mp = pytest.MonkeyPatch()
    for k, v in (env or {}).items():
        mp.setenv(k, v)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
            main()
    finally:
        sys.argv = old_argv
        mp.undo()
    return exc.value.code, out.getvalue(), err.getvalue()


def _one_error_line(err: str) -> str:
    """Assert the command failed with exactly one line 'error: ...' and no traceback; return it."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="session")
def cli():
    return _run_cli


@pytest.fixture(scope="session")
def one_error_line():
    return _one_error_line
