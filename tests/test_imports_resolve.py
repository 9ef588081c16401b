"""Every relative import in the package names a module that exists: code that only a GPU host runs (a
lazy import inside `calibrate --fixed-costs-only`, say) is never imported by the CPU tests, so a module
moved between rooms would break it unseen."""
import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _relative_imports():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".git", "build") or rel.parts[0].startswith("."):
            continue
        package = ["msa_bench", *rel.parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                yield rel, node.lineno, ".".join(base + ([node.module] if node.module else []))


def test_every_relative_import_names_a_module_that_exists():
    missing = [f"{rel}:{line} imports {module}" for rel, line, module in _relative_imports()
               if importlib.util.find_spec(module) is None]
    assert not missing, missing


def test_the_fixed_costs_steps_measure_the_candidates_and_the_dense_baselines():
    from msa_bench.harness.calibration.fixed_costs import calibrated_names
    from msa_bench.kernels.auto import candidate_names
    names = calibrated_names()
    assert names[: len(candidate_names())] == candidate_names()
    assert "dense-floor" in names and "dense-masked" in names
    assert "auto" not in names and "dense-gather" not in names and "reference" not in names
