"""`msa-bench slurm`'s script, run on CPU with the variables Slurm sets: each array task sweeps its shard
(a requeued one resumes), the merge job joins them, reports, and gates against an unsharded run of the
same grid; the submit step asks sbatch for the array and a merge that depends on it."""
import os
import subprocess
import sys
from pathlib import Path

from msa_bench.harness.store.results import load_run

GRID = ["--backend", "reference", "--dtype", "fp32"]


def _bash(script: Path, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "msa-bench"
    return subprocess.run(["bash", str(script)], env={**os.environ, "MSA_BENCH": str(exe), **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_array_tasks_then_merge_equal_one_run_and_pass_the_gate(tmp_path, cli):
    single = tmp_path / "single"
    code, _, err = cli("sweep", "--scenario", "smoke", *GRID, "--reps", "2", "--out", single)
    assert code == 0, err
    script, run = tmp_path / "smoke.sh", tmp_path / "cluster"
    code, out, err = cli("slurm", "smoke", "--array", "2", *GRID, "--out", run, "--baseline", single,
                         "--script", script)
    assert code == 0 and f"submit with: bash {script}" in out, err
    text = script.read_text()
    assert "--shard \"$i/${SLURM_ARRAY_TASK_COUNT:-$SHARDS}\"" in text and "--array=0-$((SHARDS - 1))" in text
    for i in range(2):
        env = {"MSA_BENCH_STEP": "shard", "SLURM_ARRAY_TASK_ID": str(i), "SLURM_ARRAY_TASK_COUNT": "2",
               "SLURM_JOB_ID": "7"}
        done = _bash(script, env, tmp_path)
        assert done.returncode == 0, done.stderr
    again = _bash(script, {"MSA_BENCH_STEP": "shard", "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"},
                  tmp_path)
    assert again.returncode == 0 and "resuming" in again.stderr, again.stderr     # a requeued task
    merged = _bash(script, {"MSA_BENCH_STEP": "merge", "SLURM_JOB_ID": "8"}, tmp_path)
    assert merged.returncode == 0, merged.stderr
    assert "0 regression(s)" in merged.stdout and (run / "merged" / "report" / "summary.md").is_file()
    a, b = load_run(single), load_run(run / "merged")
    assert sorted(a.status["unit"]) == sorted(b.status["unit"]) and b.meta["complete"]
    assert (b.status["status"] == "ok").all()


def test_submit_asks_for_the_array_and_a_dependent_merge(tmp_path, cli):
    script = tmp_path / "s.sh"
    code, _, err = cli("slurm", "smoke", "--array", "3", "--gpus-per-shard", "8", "--out", tmp_path / "r",
                       "--script", script)
    assert code == 0, err
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"                     # stands in for the scheduler: records its arguments
    fake.write_text(f'#!/bin/bash\necho "$@" >> {calls}\necho 4$(wc -l < {calls})\n')
    fake.chmod(0o755)
    done = _bash(script, {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, tmp_path)
    assert done.returncode == 0, done.stderr
    first, second = calls.read_text().splitlines()
    assert "--array=0-2" in first and "--gres=gpu:8" in first and "MSA_BENCH_STEP=shard" in first
    assert "--dependency=afterany:41" in second and "MSA_BENCH_STEP=merge" in second
    assert "--gpus all" in script.read_text().split("SWEEP_ARGS=(", 1)[1].splitlines()[0]


def test_slurm_bad_input_is_one_line(tmp_path, cli, one_error_line):
    code, _, err = cli("slurm", "smoke", "--array", "99")
    assert code == 2 and "has 8 point(s)" in one_error_line(err)
    code, _, err = cli("slurm", "no-such-scenario")
    assert code == 2 and one_error_line(err)
