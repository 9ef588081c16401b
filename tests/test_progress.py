"""The sweep's progress: an ETA from the units that ran (not the ones answered at once), a plain line
at a fixed interval off a terminal, and SIGTERM ending a sweep like Ctrl-C with the resume command."""
import io
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from msa_bench.harness.running.progress import EtaModel, SweepProgress
from msa_bench.harness.store.results import finished_units


def test_eta_counts_the_units_that_ran_not_the_instant_unavailable_ones():
    model = EtaModel(["kv", "fi", "ms"] * 4)
    assert model.seconds_left(1) is None                      # nothing ran yet: unknown, not zero
    model.finished("fi", "unavailable", 0.001)
    assert model.seconds_left(1) is None
    model.finished("kv", "ok", 10.0)
    # kv: 3 left at 10 s; fi: only answered unavailable, free; ms: not seen, at the mean of what ran (10 s)
    assert model.seconds_left(1) == 3 * 10.0 + 4 * 10.0
    model.finished("ms", "failed", 2.0)
    assert model.seconds_left(2) == (3 * 10.0 + 3 * 2.0) / 2
    model.requeued("kv")
    assert model.seconds_left(1) == 4 * 10.0 + 3 * 2.0


def test_off_a_terminal_a_plain_line_comes_at_every_interval():
    buf = io.StringIO()
    progress = SweepProgress(Console(file=buf, width=80, force_terminal=False), ["gpu0", "gpu1"], interval_s=0.05)
    progress.begin("sweep", ["kv"] * 4)
    with progress:
        progress.working("gpu0", "synthetic N16 T256 r1 fp32 · kv")
        progress.finished("gpu1", "kv", "ok", 1.0)
        time.sleep(0.4)
    heads = [ln for ln in buf.getvalue().splitlines() if ln.startswith("sweep: ")]
    assert len(heads) >= 4, buf.getvalue()
    assert heads[-1].startswith("sweep: 1/4 units") and "ETA 0:00:0" in heads[-1]
    assert "  gpu0  synthetic N16 T256 r1 fp32 · kv" in buf.getvalue()
    assert all(len(ln) <= 80 for ln in buf.getvalue().splitlines())


def test_sigterm_ends_a_sweep_with_the_folder_and_the_resume_command(tmp_path):
    run = tmp_path / "run"
    exe = Path(sys.executable).parent / "msa-bench"
    proc = subprocess.Popen([str(exe), "sweep", "--scenario", "smoke", "--backend", "kv-outer", "--dtype", "fp32",
                             "--reps", "1", "--out", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not finished_units(run) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert f"units finished in {run}" in err and "terminated (SIGTERM)" in err
    assert f"resume with: msa-bench sweep --scenario smoke --dtype fp32 --backend kv-outer --reps 1 --out {run} " \
           "--resume" in err
    assert "Traceback" not in err


def test_off_a_terminal_a_finished_unit_prints_a_whole_line_once_the_gap_has_passed():
    buf = io.StringIO()
    progress = SweepProgress(Console(file=buf, width=80, force_terminal=False), ["main"], interval_s=100, gap_s=0)
    progress.begin("sweep", ["kv"] * 3)
    what = "synthetic N16384 T131072 r0.25 z1 causal share0.5-G8 bf16 · kv-outer-cute@v28+2:p+delay5"
    with progress:
        for n in range(3):
            progress.working("main", what)
            progress.finished("main", "kv", "ok", 1.0)
            assert buf.getvalue().splitlines()[-1].startswith(f"sweep: {n + 1}/3 units")   # as it goes
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3 and all(ln.endswith(f" · {what}") and len(ln) > 80 for ln in lines)   # whole, once


def test_notes_of_a_sweep_off_a_terminal_are_whole_lines(tmp_path, cli):
    from msa_bench.harness.running.run_folder import CPU_NOTE
    code, _, err = cli("sweep", "--scenario", "smoke", "--backend", "reference", "--dtype", "fp32", "--reps", "1",
                       "--out", tmp_path / "run", env={"MSA_BENCH_INTERRUPT_AFTER_UNITS": "1"})
    assert code == 130 and f"note: {CPU_NOTE}\n" in err
