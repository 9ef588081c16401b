"""The claim of docs/architecture.md ("Adding a backend"): a backend of a new schedule touches its module,
its test and the model's table of schedules in roofline/, and nothing else. The package is copied, the
edits the page shows are applied (read from it, so the page and this proof cannot drift apart), no other
file may differ, and the copy, imported on its own, runs the backend's test, passes the float64 check,
predicts the backend with the live model, has `auto` weigh it, sweeps it on the CPU with its roofline in
the rows and reports the run with its units in the model fidelity table."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
EDIT = re.compile(r"<!-- new-schedule edit: (\S+) -->\s*```python\n(.*?)```", re.S)
SKIP = {"results", "build", "notebooks", "docs", "__pycache__"}
# what the copy needs to import and to run its tests: the sources, the scenarios' data, the test settings
DATA = ("scenarios/", "pyproject.toml")

pytestmark = pytest.mark.slow         # a sweep, a report and two test runs in a fresh interpreter: about 40 s


def doc_edits() -> dict[str, str]:
    """{path: the code the page shows for it}, in the page's order."""
    edits = dict(EDIT.findall(DOC.read_text()))
    assert edits, f"{DOC}: no new-schedule edit blocks"
    return edits


def copy_package(dest: Path) -> list[str]:
    """The package's sources and the data it imports, copied under dest; their relative paths."""
    copied = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = Path(dirpath).relative_to(ROOT)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP)
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            if name.endswith(".py") or rel.startswith(DATA):
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, dest / rel)
                copied.append(rel)
    return copied


def insert(text: str, at: int, code: str) -> str:
    return text[:at] + code + text[at:]


def apply_edits(pkg: Path, edits: dict[str, str]) -> tuple[list[str], str, str]:
    """Apply the page's edits to the copy at `pkg`: (the files touched, the new schedule's member, its name)."""
    member, name = re.search(r'^\s+(\w+) = "([^"]+)"', edits["roofline/schedules.py"], re.M).groups()

    path = pkg / "roofline/schedules.py"           # the member, after the last one
    text = path.read_text()
    last = list(re.finditer(r'^    [A-Z0-9_]+ = "[^"]+".*\n', text, re.M))[-1]
    path.write_text(insert(text, last.end(), edits["roofline/schedules.py"]))

    path = pkg / "roofline/model.py"               # the traffic branch, before the others; ALL_SCHEDULES
    text = path.read_text()
    first = text.index("\n    if schedule == Schedule.", text.index("\ndef traffic(")) + 1
    text = insert(text, first, edits["roofline/model.py"] + "\n")
    text, n = re.subn(r"^(ALL_SCHEDULES = \(.*?)\)", rf"\1, Schedule.{member})", text, count=1, flags=re.M)
    assert n == 1, "roofline/model.py: no ALL_SCHEDULES tuple"
    path.write_text(text)

    new = [p for p in edits if p not in ("roofline/schedules.py", "roofline/model.py")]
    for rel in new:
        assert not (ROOT / rel).exists(), f"{rel} exists already: the proof adds it"
        (pkg / rel).write_text(edits[rel])
    return ["roofline/schedules.py", "roofline/model.py", *new], member, name


DRIVER = r'''
import json, math, sys
from msa_bench.harness.measure.check import check_backend, edge_case_workload   # sets TRITON_INTERPRET first
from msa_bench.kernels.auto import AutoBackend, candidate_names
from msa_bench.kernels.base import get_backend, registered_names
from msa_bench.roofline.devices import resolve_profile
from msa_bench.roofline.predict import predict_module
from msa_bench.scenarios.stats import ModelStats
from msa_bench.scenarios.workload import AttnShape

name = sys.argv[1]
backend = get_backend(name)
w = edge_case_workload(AttnShape(hq=4, hkv=2, head_dim=32, block=16, topk=4), "fp32", [256, 160], [12, 8],
                       False, hot=0.5, pad=0.25, empty=1, seed=5)
err, tol, _ = check_backend(name, w)
choice = resolve_profile("h200", None)
profile = choice.profile
live = predict_module(backend.facts, ModelStats(w), backend.model_record(w, profile), profile, w.dtype)
cands, skipped = AutoBackend().candidates(w, profile)
print(json.dumps({"registered": name in registered_names(), "schedule": str(backend.schedule),
                  "err": err, "tol": tol, "profile": choice.path,
                  "live_s": None if live is None else live.seconds,
                  "roofline_s": None if live is None or live.roofline is None else live.roofline.time_s,
                  "candidate": name in candidate_names(),
                  "auto_s": cands[name][1] if name in cands else None, "skipped": skipped.get(name)}))
'''

SCENARIO = '''description = "one point of the new schedule and the Q-outer arm, on the CPU"
backends = ["{name}", "q-outer-torch"]

[shape]
hq = 4
hkv = 2
head_dim = 32
block = 16
topk = 4

[timing]
reps = 2

[[grid]]
generator = "synthetic"
tokens = 16
context = 256
reuse = 0.5
causal = false
dtypes = "fp32"
'''


def run_in(copy: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(copy.parent)}
    env.pop("MSA_BENCH_PROFILE", None)
    got = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=600)
    assert got.returncode == 0, f"{args}\n{got.stdout}\n{got.stderr}"
    return got


def test_a_new_schedule_is_its_module_its_test_and_the_models_table(tmp_path):
    pkg = tmp_path / "pkg" / "msa_bench"
    copied = copy_package(pkg)
    edits = doc_edits()
    touched, member, schedule = apply_edits(pkg, edits)
    name = re.search(r'@register\("([^"]+)"\)', next(c for p, c in edits.items() if p.startswith("kernels/"))).group(1)

    # the edits are the four the page names, and nothing else differs from this checkout
    assert touched == ["roofline/schedules.py", "roofline/model.py", f"kernels/{name.replace('-', '_')}.py",
                       f"tests/test_{name.replace('-', '_')}.py"]
    differ = [rel for rel in copied if (pkg / rel).read_bytes() != (ROOT / rel).read_bytes()]
    added = {p.relative_to(pkg).as_posix() for p in pkg.rglob("*") if p.is_file()} - set(copied)
    assert sorted(differ) + sorted(added) == sorted(touched[:2]) + sorted(touched[2:])

    # its test and the contract every backend is taken through, in the copy
    cli = ["-c", "from msa_bench.cli import main; main()"]
    tests = run_in(pkg, "-m", "pytest", "-vv", "-p", "no:cacheprovider", "-m", "not cuda", touched[3],
                   "tests/test_backend_names.py", "tests/test_backend_conformance.py",
                   "-k", f"{name} or {Path(touched[3]).stem} or no_backend_name", cwd=pkg).stdout
    for test in (f"{touched[3]}::test_", "test_no_backend_name_literal_outside_kernels_and_tests",
                 f"test_plan_runs_its_stages_and_passes_the_float64_check[{name}]"):
        assert re.search(rf"{re.escape(test)}\S* PASSED", tests), tests
    assert " failed" not in tests and " error" not in tests, tests

    # registered, exact, predicted by the live model, weighed by `auto`
    got = json.loads(run_in(pkg, "-c", DRIVER, name, cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert got["registered"] and got["schedule"] == schedule and got["candidate"]
    assert got["err"] <= got["tol"]
    assert got["profile"] == "preset:h200"               # a profile that measured no backend: all are weighed
    assert got["skipped"] is None and got["live_s"] > 0 and got["roofline_s"] > 0
    assert got["auto_s"] == got["live_s"]

    # a CPU sweep stores its roofline in the rows; the report predicts its units
    scenario = tmp_path / "new-schedule.toml"
    scenario.write_text(SCENARIO.format(name=name))
    run = tmp_path / "run"
    run_in(pkg, *cli, "sweep", "--scenario", scenario, "--device", "h200", "--out", run, cwd=tmp_path)
    rows = run_in(pkg, "-c", "import json, sys; from msa_bench.harness.store.results import load_run; "
                  "r = load_run(sys.argv[1]); s = r.stats; m = s[s['statistic'].isin(['model_time_s', "
                  "'model_hbm_bytes'])]; print(json.dumps({'status': dict(zip(r.status['backend'], "
                  "r.status['status'])), 'model': {f'{b}/{k}': v for b, k, v in zip(m['backend'], "
                  "m['statistic'], m['value'])}}))", run, cwd=tmp_path)
    rows = json.loads(rows.stdout.strip().splitlines()[-1])
    assert rows["status"] == {name: "ok", "q-outer-torch": "ok"}
    assert rows["model"][f"{name}/model_time_s"] > 0 and rows["model"][f"{name}/model_hbm_bytes"] > 0
    run_in(pkg, *cli, "report", run, "--no-figures", cwd=tmp_path)
    summary = (run / "report" / "summary.md").read_text()
    fidelity = summary.split("## Model fidelity")[1].split("\n## ")[0]
    assert f"| {name} |" in fidelity, fidelity
