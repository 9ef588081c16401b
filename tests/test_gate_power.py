"""scripts/gate-power.py on synthetic protocol runs with known medians: false regressions among clean
backends, catches of planted `X@delayP` units judged as `X`, per clock mode."""
from pathlib import Path

import numpy as np
import pytest

from msa_bench.harness.gate.gate_power import gate_power, planted
from msa_bench.harness.store.results import load_run

RNG = np.random.default_rng(1)


def samples(median, n=30):
    return list(median * (1 + RNG.uniform(-0.002, 0.002, n)))


def protocol_runs(root: Path, fake_run, moves=(1.0, 1.02, 0.99, 1.01, 1.07)):
    """Run i moves every time by moves[i] (run-to-run spread), except 'b' in the last run."""
    for i, m in enumerate(moves):
        fake_run(root / f"run-{i + 1:02d}", {
            "a": samples(1e-3 * m), "b": samples(2e-3 * (m if i < len(moves) - 1 else 1.0)),
            "a@delay5": samples(1e-3 * m * 1.05), "a@delay10": samples(1e-3 * m * 1.10)})
    return root


def test_planted_names():
    assert planted("kv-outer-cute@delay5") == ("kv-outer-cute", 5.0)
    assert planted("kv-outer-cute@v28+delay10") == ("kv-outer-cute@v28", 10.0)
    assert planted("kv-outer-cute@v28") is None and planted("auto") is None


def test_gate_power_counts(tmp_path, fake_run):
    runs = [load_run(d) for d in sorted(protocol_runs(tmp_path, fake_run).iterdir())]
    result = gate_power(runs, 3, modes=("raw",))["raw"]
    assert result.runs_judged == 2 and result.clean_comparisons == 8      # 2 runs x 2 backends x 2 stages
    # run 5: 'a' moved 7 % with everything else: outside the set's spread (0.99..1.02), so flagged
    # (module and attention); run 4 (1.01) is inside the spread
    assert result.false_regressions == 2
    # planted, judged as 'a': run 4 at 1.01 x 1.05 = 1.06 and 1.01 x 1.10 over the set's median 1.0 and
    # slowest 1.02: caught; run 5 too
    assert result.caught == {5.0: [2, 2], 10.0: [2, 2]}


def test_script_writes_one_table_per_mode(tmp_path, fake_run, load_script):
    root = protocol_runs(tmp_path / "out", fake_run)
    mod = load_script("gate-power")
    assert mod.main([str(root), "--baseline-runs", "3"]) == 0
    text = (root / "gate-power.md").read_text()
    for mode in ("raw", "normalize", "floor"):
        assert f"--clock {mode}" in text
    assert "planted 5 % caught/trials" in text and "planted 10 % caught/trials | 2/2" in text
    assert mod.main([str(root), "--baseline-runs", "5"]) == 2        # nothing left to judge


def test_script_refuses_an_empty_folder(tmp_path, capsys, load_script):
    mod = load_script("gate-power")
    assert mod.main([str(tmp_path), "--baseline-runs", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: no run-* folders")


def test_protocol_script_runs_separate_sweeps_and_resumes(tmp_path):
    """The shell loop, with a stand-in `msa-bench` and `nvidia-smi` on PATH that record their arguments:
    one sweep process per run with the clean and planted backends, finished runs skipped, an unfinished
    one resumed, OUTROOT packed into $OUT/gate.tgz."""
    import os
    import subprocess
    import tarfile
    bin_dir, out = tmp_path / "bin", tmp_path / "OUT"
    bin_dir.mkdir(), out.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho fake GPU\n")
    (bin_dir / "msa-bench").write_text(
        '#!/bin/sh\necho "$@" >> "$CALLS"\nwhile [ "$1" != "--out" ]; do shift; done\n'
        'mkdir -p "$2/units"\necho \'{"complete": true}\' > "$2/run.json"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    root = tmp_path / "gate"
    (root / "run-02").mkdir(parents=True)
    (root / "run-02" / "run.json").write_text('{"complete": false}')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "CALLS": str(tmp_path / "calls")}
    script = Path(__file__).resolve().parents[1] / "scripts" / "gate-protocol.sh"
    subprocess.run(["bash", str(script), str(root), "3"], env=env, check=True, capture_output=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 3 and all("--scenario gate-prefill" in c and "kv-outer-cute@delay10" in c for c in calls)
    assert ["--resume" in c for c in calls] == [False, True, False]
    subprocess.run(["bash", str(script), str(root), "3"], env=env, check=True, capture_output=True)
    assert len((tmp_path / "calls").read_text().splitlines()) == 3      # all complete: nothing rerun
    with tarfile.open(out / "gate.tgz") as tar:
        assert "gate/run-03/run.json" in tar.getnames()
