"""The package's layers import only downward: errors <- roofline <- scenarios <- kernels <- harness <- cli, and
the recorder a user's engine imports (capture) over scenarios, whose trace format it writes, and nothing else;
inside harness/, its rooms too: measure <- store <- running <- {report, gate, calibration}, the three top rooms
importing none of each other.

Every import counts, also one made inside a function: a lazy import is still a dependency.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"errors": 0, "roofline": 1, "scenarios": 2, "capture": 2.5, "kernels": 3, "harness": 4, "cli": 5}


def _layer_of(parts: tuple[str, ...]) -> str | None:
    head = parts[0] if parts else ""
    head = head[:-3] if head.endswith(".py") else head
    return head if head in LAYERS else None


def _imported_modules(path: Path):
    """(line, module parts) of every msa_bench module the file imports, relative imports resolved."""
    rel = path.relative_to(ROOT).parts
    package = rel[:-1]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = base + tuple((node.module or "").split(".")) if node.module else base
                names = [target + (a.name,) for a in node.names] if not node.module else [target]
            elif node.module and node.module.startswith("msa_bench"):
                names = [tuple(node.module.split(".")[1:])]
            else:
                continue
        elif isinstance(node, ast.Import):
            names = [tuple(a.name.split(".")[1:]) for a in node.names if a.name.startswith("msa_bench.")]
        else:
            continue
        for target in names:
            yield node.lineno, tuple(p for p in target if p)


def _imported_layers(path: Path):
    """(line, layer) of every msa_bench module the file imports."""
    for line, target in _imported_modules(path):
        layer = _layer_of(target)
        if layer:
            yield line, layer


def _package_files():
    for layer in LAYERS:
        if layer in ("errors", "cli"):
            yield ROOT / f"{layer}.py"
        else:
            yield from sorted((ROOT / layer).rglob("*.py"))


@pytest.mark.parametrize("path", list(_package_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_points_upward(path):
    own = _layer_of(path.relative_to(ROOT).parts)
    upward = [f"line {line}: {own} imports {layer}" for line, layer in _imported_layers(path)
              if LAYERS[layer] > LAYERS[own]]
    assert not upward, f"{path.relative_to(ROOT)}: " + "; ".join(upward)


def test_every_import_names_a_module_that_exists():
    """Code that only a GPU host runs (a lazy import inside `calibrate --fixed-costs-only`, say) is never
    imported by the CPU tests, so a module moved between rooms would break it unseen."""
    import importlib
    import importlib.util

    def exists(parts: tuple[str, ...]) -> bool:
        # a module, or a name of its package (`from . import TILE_Q`)
        if importlib.util.find_spec(".".join(("msa_bench", *parts))) is not None:
            return True
        return bool(parts) and hasattr(importlib.import_module(".".join(("msa_bench", *parts[:-1]))), parts[-1])
    missing = [f"{path.relative_to(ROOT)}:{line} imports {'.'.join(parts)}" for path in _package_files()
               for line, parts in _imported_modules(path) if not exists(parts)]
    assert not missing, missing


def test_capture_stays_light_and_nothing_runs_on_it():
    """An engine imports capture: it reaches only the trace format below it, and no layer imports it."""
    for path in sorted((ROOT / "capture").rglob("*.py")):
        assert {layer for _, layer in _imported_layers(path)} <= {"roofline", "scenarios", "capture"}, path
    for path in _package_files():
        if _layer_of(path.relative_to(ROOT).parts) != "capture":
            assert "capture" not in {layer for _, layer in _imported_layers(path)}, path


def test_the_walker_sees_an_upward_import(tmp_path, monkeypatch):
    bad = ROOT / "roofline" / "_probe_upward.py"
    try:
        bad.write_text("def f():\n    from ..harness.running.sweep import run_sweep\n")
        assert [layer for _, layer in _imported_layers(bad)] == ["harness"]
    finally:
        bad.unlink()


# harness/'s rooms, bottom up: a room imports only rooms of a lower rank
ROOMS = {"measure": 0, "store": 1, "running": 2, "report": 3, "gate": 3, "calibration": 3}


def _room_of(parts: tuple[str, ...]) -> str | None:
    return parts[1] if len(parts) > 2 and parts[0] == "harness" and parts[1] in ROOMS else None


@pytest.mark.parametrize("path", sorted((ROOT / "harness").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_harness_rooms_import_only_lower_rooms(path):
    own = _room_of(path.relative_to(ROOT).parts)
    if own is None:
        assert path.name == "__init__.py", f"{path.relative_to(ROOT)} is in no room of harness/"
        return
    wrong = [f"line {line}: {own} imports {room}" for line, target in _imported_modules(path)
             if (room := _room_of(target)) and room != own and ROOMS[room] >= ROOMS[own]]
    assert not wrong, f"{path.relative_to(ROOT)}: " + "; ".join(wrong)


def test_each_room_stays_small():
    for room in ROOMS:
        lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "harness" / room).rglob("*.py"))
        assert lines <= 2200, f"harness/{room}: {lines} lines"
