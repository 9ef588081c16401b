"""No backend name as a literal outside kernels/ and tests/: what a backend is, it declares (kernels/base.py);
the rest of the project asks the registry or the backend's class."""
import ast
from pathlib import Path

from msa_bench.kernels.base import registered_names
from msa_bench.roofline.names import base_name
from msa_bench.roofline.schedules import Schedule

ROOT = Path(__file__).resolve().parents[1]
# a schedule's name is the model's vocabulary (roofline/schedules.py), not a backend's, though some match
SCHEDULE_NAMES = {str(s) for s in Schedule}
# (file, literal): Python packages the provenance names, which share a backend's name
PACKAGES = {("harness/measure/provenance.py", "flashinfer"), ("harness/report/summary.py", "flashinfer")}


def _docstrings(tree) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            out.add(id(body[0].value))
    return out


def literals(path: Path):
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def test_no_backend_name_literal_outside_kernels_and_tests():
    names = set(registered_names())
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("kernels", "tests") or any(p.startswith(".") for p in rel.parts):
            continue
        for line, text in literals(path):
            if base_name(text) in names and text not in SCHEDULE_NAMES and (str(rel), text) not in PACKAGES:
                found.append(f"{rel}:{line}: {text!r}")
    assert found == []
