"""sweep --gpus on CPU workers (the smoke scenario, PyTorch reference backend): one queue, no unit run
twice, a killed worker's unit redone, a unit that kills two workers recorded failed, SIGTERM to the
parent stopping every worker with the resume command printed; and --gpus's grammar and refusals."""
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from msa_bench.errors import UserError
from msa_bench.harness.running.pool import Gpu, one_model, parse_gpus
from msa_bench.harness.store.results import finished_units, load_run
from msa_bench.harness.running.worker import KILL_HOOK, UNIT_LOG_HOOK

GRID = ["--scenario", "smoke", "--backend", "reference", "--dtype", "fp32", "--reuse", "0.5", "--reps", "1"]
N_UNITS = 6


def _starts(log: Path) -> list[tuple[str, str]]:
    return [tuple(line.split()) for line in log.read_text().splitlines()] if log.exists() else []


def test_two_workers_share_one_queue_and_run_each_unit_once(tmp_path, cli):
    run, log = tmp_path / "run", tmp_path / "starts"
    code, out, err = cli("sweep", *GRID, "--gpus", "2", "--out", run, env={UNIT_LOG_HOOK: str(log)})
    assert code == 0, err
    r = load_run(run)
    assert r.meta["complete"] and sorted(r.status["unit"]) == sorted(r.meta["units_planned"])
    assert len(r.status) == N_UNITS and (r.status["status"] == "ok").all()
    counts = Counter(uid for _, uid in _starts(log))
    assert set(counts) == set(r.meta["units_planned"]) and set(counts.values()) == {1}, counts
    assert set(r.status["worker"]) <= {"cpu0", "cpu1"}
    assert (r.status["nth_on_workload"] == 0).all()                      # one backend: each unit first
    assert [w["worker"] for w in r.meta["workers"]] == ["cpu0", "cpu1"]
    assert "2 CPU worker(s)" in " ".join(err.split())


def test_a_killed_worker_is_reported_and_its_unit_redone(tmp_path, cli):
    """The first unit any worker starts kills that worker (whichever started first: a worker that starts
    late may get no unit at all); the other runs it again and the rest."""
    run, log = tmp_path / "run", tmp_path / "starts"
    code, out, err = cli("sweep", *GRID, "--gpus", "2", "--out", run,
                         env={UNIT_LOG_HOOK: str(log), KILL_HOOK: f"once:{tmp_path / 'claimed'}"})
    assert code == 0, err
    starts = _starts(log)
    counts = Counter(uid for _, uid in starts)
    twice = [uid for uid, n in counts.items() if n == 2]
    assert len(twice) == 1 and all(n == 1 for uid, n in counts.items() if uid != twice[0]), starts
    killed = twice[0]
    dead, other = [who for who, uid in starts if uid == killed]
    assert dead != other and [who for who, _ in starts].count(dead) == 1, starts      # it died in its first unit
    r = load_run(run)
    assert r.meta["complete"] and len(r.status) == N_UNITS and (r.status["status"] == "ok").all()
    assert set(r.status["worker"]) == {other}
    text = " ".join((out + err).split())
    assert f"worker {dead} died (signal 9)" in text and "goes back to the queue" in text


def test_a_unit_that_kills_two_workers_is_recorded_failed(tmp_path, cli):
    import torch

    from msa_bench.harness.store import results
    from msa_bench.harness.running.request import SweepRequest, resolve
    run = tmp_path / "run"
    grid = resolve(SweepRequest(scenario="smoke", backends=["reference"], dtypes=["fp32"], reuse=[0.5], reps=1),
                   torch.device("cpu"), [])
    first = grid.mine_ids[0]
    code, out, err = cli("sweep", *GRID, "--gpus", "2", "--out", run, env={KILL_HOOK: first})
    assert code == 1, err                                   # both workers gone with units left
    status = results.read_unit_status(run, first)
    assert status["status"] == "failed" and "died 2 times" in status["reason"]
    text = " ".join(err.split())
    assert "every worker died" in text and f"--out {run} --resume" in text


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("target", ["parent", "worker"])
def test_sigterm_stops_every_worker_and_prints_the_resume_command(tmp_path, cli, target):
    """SIGTERM to the parent (`timeout`), or to a worker (`scancel` signals every process of a job)."""
    run, log = tmp_path / "run", tmp_path / "starts"
    exe = Path(sys.executable).parent / "msa-bench"
    # kv-outer runs in Triton's interpreter: seconds per unit, so the run is still going when SIGTERM comes
    args = [str(exe), "sweep", "--scenario", "smoke", "--backend", "kv-outer", "--dtype", "fp32", "--reuse", "0.5",
            "--reps", "1", "--gpus", "2", "--out", str(run)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, UNIT_LOG_HOOK: str(log)})
    deadline = time.monotonic() + 240
    while not finished_units(run) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    workers = _children(proc.pid)
    assert len(workers) == 2 and proc.poll() is None
    if target == "parent":
        proc.send_signal(signal.SIGTERM)
    else:
        os.kill(workers[0], signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM)" in err and f"resume with: msa-bench sweep --scenario smoke" in err
    resume = err.split("resume with: ", 1)[1].strip()
    assert "--gpus 2" in resume and resume.endswith(f"--out {run} --resume")
    time.sleep(0.5)
    assert not any(_alive(pid) for pid in workers)
    assert json.loads((run / "run.json").read_text())["complete"] is False
    if target == "worker":
        return
    before = finished_units(run)
    log.unlink()
    code, _, err = cli(*resume.split()[1:], env={UNIT_LOG_HOOK: str(log)})
    assert code == 0, err
    redone = {uid for _, uid in _starts(log)}
    assert not redone & before and redone | before == set(load_run(run).meta["units_planned"])


@pytest.mark.parametrize("args, needle", [
    (["--gpus", "all"], "no CUDA GPU here"),
    (["--gpus", "0"], "no CUDA GPU here"),
    (["--gpus", "2", "--counters"], "--counters runs ncu after timing"),
])
def test_bad_gpus_input_is_one_line(tmp_path, args, needle, cli, one_error_line):
    code, _, err = cli("sweep", *GRID, *args, "--out", tmp_path / "r")
    assert code == 2 and needle in one_error_line(err)


def test_gpus_grammar():
    assert parse_gpus("all", 4) == [0, 1, 2, 3]
    assert parse_gpus("2", 4) == [0, 1]
    assert parse_gpus("3,1", 4) == [3, 1] and parse_gpus("2,", 4) == [2]
    for bad in ("5", "0", "1,1", "4,", "x", "1-2"):
        with pytest.raises(UserError):
            parse_gpus(bad, 4)


def test_mixed_gpu_models_are_refused_in_one_line():
    h200 = [Gpu(f"gpu{i}", i, str(i), "NVIDIA H200") for i in range(2)]
    one_model(h200, "all")
    with pytest.raises(UserError) as exc:
        one_model(h200 + [Gpu("gpu2", 2, "2", "NVIDIA H100 80GB HBM3")], "all")
    msg = str(exc.value)
    assert "\n" not in msg and "0, 1: NVIDIA H200" in msg and "2: NVIDIA H100" in msg and "--gpus 0,1" in msg


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_every_unit_names_its_gpu(tmp_path, cli):
    import torch
    run = tmp_path / "run"
    code, _, err = cli("sweep", "--scenario", "smoke", "--backend", "reference", "--dtype", "fp32", "--reuse", "0.5",
                       "--gpus", "all", "--out", run)
    assert code == 0, err
    s = load_run(run).status
    assert s["gpu_uuid"].str.startswith("GPU-").all() and s["gpu_index"].isin(range(torch.cuda.device_count())).all()
    assert (s["gpu_sm_clock_max_mhz"] > 0).all() and set(s["worker"]) <= {f"gpu{i}" for i in s["gpu_index"]}
    workers = {w["worker"]: w for w in load_run(run).meta["workers"]}
    for r in s.itertuples():
        assert workers[r.worker]["gpu_uuid"] == r.gpu_uuid             # the worker ran where it was pinned


def test_a_cpu_unit_names_no_gpu():
    from msa_bench.harness.measure.provenance import gpu_identity
    assert gpu_identity("cpu") == {}
