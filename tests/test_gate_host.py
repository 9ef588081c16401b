"""The gate on eager runs: a slowdown no larger than the host launch probe's own is the host's (verdict
HOST, exit 2), a larger one is a regression (exit 1), and runs without the probe are judged as they are.
Runs are built in memory: the probe's bookkeeping on a real sweep is tests/test_eager_timer.py's."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from msa_bench.harness.gate.compare import HOST, IMPROVEMENT, NOISE, REGRESSION, UNCHANGED, compare_runs
from msa_bench.harness.gate.compare_formats import as_json, exit_code, render_markdown, subject, text
from msa_bench.harness.store.results import Run

N = 40


def eager_run(name: str, module_s: float, probe_s: float | None, seed: int) -> Run:
    """One GPU eager unit: N module samples about module_s (1 % jitter), each with its host probe."""
    rng = np.random.default_rng(seed)
    rows = {"point_key": "p1", "backend": "q-packed-cute", "dtype": "bf16", "stage": "module",
            "rep": np.arange(N), "seconds": module_s * rng.uniform(0.99, 1.01, N), "timer": "cuda-eager"}
    if probe_s is not None:
        rows["host_probe_s"] = probe_s * rng.uniform(0.98, 1.02, N)
    meta = {"timer": "cuda-eager", "scenario": "real-prefill", "provenance": {"device_name": "NVIDIA H100"},
            "timing": {"cold_l2": True, "l2_flush": "write+read"}}
    status = pd.DataFrame([{"point_key": "p1", "backend": "q-packed-cute", "dtype": "bf16", "status": "ok"}])
    return Run(Path(name), meta, status, pd.DataFrame(), pd.DataFrame(rows))


def time_finding(result):
    (f,) = [f for f in result.findings if f.kind == "time"]
    return f


@pytest.mark.parametrize("module, probe, verdict, code", [
    (100e-6, 5e-6, UNCHANGED, 0),          # same code, same host
    (150e-6, 5e-6, REGRESSION, 1),         # slower on the same host: the code's
    (150e-6, 10e-6, HOST, 2),              # slower by less than the host: cannot tell
    (250e-6, 10e-6, REGRESSION, 1),        # slower by more than the host could make it
    (60e-6, 2.5e-6, NOISE, 0),             # faster by no more than the host got faster
    (40e-6, 5e-6, IMPROVEMENT, 0),         # faster on the same host
])
def test_the_host_probe_bounds_what_the_host_explains(module, probe, verdict, code):
    result = compare_runs(eager_run("base", 100e-6, 5e-6, 0), eager_run("new", module, probe, 1))
    f = time_finding(result)
    assert f.verdict == verdict and exit_code(result) == code
    assert ("host probe" in f.note) == (verdict in (HOST, NOISE))


def test_a_slower_host_is_said_in_every_format():
    result = compare_runs(eager_run("base", 100e-6, 5e-6, 0), eager_run("new", 150e-6, 10e-6, 1))
    sub = subject("base", "new")
    assert any("cannot tell a regression from the host's state" in w for w in result.warnings)
    assert "1 on a slower host" in text(result, sub)
    md = render_markdown(result, sub)
    assert "Slower on a slower host" in md and "exit code 2" in md
    doc = as_json(result, sub)
    assert doc["exit_code"] == 2 and doc["counts"][HOST] == 1


def test_runs_without_the_probe_are_judged_as_they_are():
    result = compare_runs(eager_run("base", 100e-6, None, 0), eager_run("new", 150e-6, None, 1))
    assert time_finding(result).verdict == REGRESSION and exit_code(result) == 1
    assert any("without the host launch probe" in w for w in result.warnings)
