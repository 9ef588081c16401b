"""The docs and committed results stay what a newcomer needs: no diary words, results/ small, links
that resolve, notebooks and scripts that use the installed package."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Numbered work periods and call ids: dates and commits say when, not these.
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            "thirteenth|fourteenth|fifteenth|\\d+(?:st|nd|rd|th)")
DIARY = re.compile(
    rf"\b(?:{ORDINALS})[- ]session\b"           # "ninth session", "10th-session"
    r"|\bsessions? ?#?\d+\b"                    # "session 9"
    r"|\bs\d+-call\d+\b"                        # "s10-call3"
    r"|\bcalls? ?#?\d+\b"                       # "call 2", "call3"
    r"|-call\d+\b"                              # "h200-call3.sh", "2026-11-29-call2"
    r"|\bwork periods?\b",
    re.IGNORECASE)

# Where the diary words must not appear: every tracked source and doc but the run folders (results/ has
# its own READMEs checked) and this file, which holds the patterns.
SKIP_DIRS = ("results/", "build/")
SOURCE_SUFFIXES = (".py", ".md", ".sh", ".toml", ".txt", ".cfg")


def _tracked(*paths: str) -> list[str]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", *paths],
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout")
    return [p for p in out.decode().split("\0") if p]


def _checked_files() -> list[Path]:
    files = []
    for rel in _tracked("."):
        path = ROOT / rel
        if rel == "tests/test_docs.py" or not path.is_file():
            continue
        readme_in_results = rel.startswith("results/") and Path(rel).name == "README.md"
        if rel.startswith(SKIP_DIRS) and not readme_in_results:
            continue
        if rel.endswith(SOURCE_SUFFIXES) or rel.startswith((".ci/", "scripts/")):
            files.append(path)
    return files


def test_no_diary_words_in_docs_scripts_or_source():
    hits = []
    for path in _checked_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = DIARY.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not hits, "diary words (say when with a date or a commit):\n" + "\n".join(hits)


def test_diary_pattern_catches_what_it_should():
    for text in ("the ninth session", "Tenth-session runs", "session 9", "s10-call3", "call 2",
                 "raw outputs in bench/2026-11-29-call2", "scripts/h200-call3.sh", "a work period"):
        assert DIARY.search(text), text
    for text in ('@pytest.fixture(scope="session")', "call-weighted", "14,805 production calls",
                 "a function call", "recall 0.9", "syscall"):
        assert not DIARY.search(text), text


def test_results_are_under_10_mb_as_tracked_by_git():
    files = _tracked("results")
    size = sum((ROOT / p).stat().st_size for p in files if (ROOT / p).is_file())
    assert size < 10 * 2**20, f"results/ holds {size / 2**20:.1f} MiB in {len(files)} tracked files"


def test_the_gate_baseline_is_committed():
    baseline = ROOT / "results" / "h200" / "baseline"
    assert (baseline / "run.json").is_file() and any((baseline / "units").iterdir())


def test_the_gate_baseline_set_holds_the_gate_scenarios_units():
    """A plain `sweep --scenario gate-prefill` run must hold every unit of the committed set, or the gate
    exits 2 on every change."""
    from msa_bench.harness.gate.baseline import load_baseline
    from msa_bench.scenarios.grid import load_scenario
    want = set(load_scenario("gate-prefill").backends)
    runs = load_baseline(ROOT / "results" / "h200" / "gate" / "baseline-set")
    assert len(runs) >= 3 and all(set(r.status["backend"]) == want for r in runs)


def test_relative_links_in_the_docs_resolve():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "README.md"]:
        for target in link.findall(doc.read_text()):
            if "://" in target:
                continue
            if not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not missing, "\n".join(missing)


def test_notebooks_and_scripts_use_the_installed_package():
    for rel in _tracked("notebooks", "scripts"):
        text = (ROOT / rel).read_text(errors="replace")
        assert "sys.path" not in text, f"{rel} edits sys.path"
        assert not re.search(r"\bln\s+-s", text), f"{rel} makes a symlink"
