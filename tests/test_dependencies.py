"""Every third-party module the package imports is declared in pyproject.toml (a fresh virtualenv
gets it from `pip install -e .`), and .ci/run pins one torch."""
import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ["cli.py", "errors.py", "__init__.py", "capture", "harness", "kernels", "roofline", "scenarios"]
# import name -> distribution, where they differ (or where the distribution is not installed here)
DISTRIBUTION = {"pynvml": "nvidia-ml-py", "PIL": "pillow", "flashinfer": "flashinfer-python",
                "cutlass": "nvidia-cutlass-dsl", "cuda": "nvidia-cutlass-dsl", "yaml": "pyyaml"}


def imported_modules() -> set[str]:
    names = set()
    for part in PACKAGE:
        path = ROOT / part
        for file in ([path] if path.is_file() else path.rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "msa_bench"}


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    return {re.split(r"[\[<>=!~; ]", s, maxsplit=1)[0].lower() for s in specs}


def test_every_import_is_declared():
    from importlib.metadata import packages_distributions
    installed = packages_distributions()
    have = declared()
    for module in sorted(imported_modules()):
        dist = DISTRIBUTION.get(module) or (installed.get(module) or [module])[0]
        assert dist.lower() in have, f"{module} (distribution {dist}) is imported but not in pyproject.toml"


def test_ci_pins_one_torch_that_the_package_accepts():
    """CI installs an exact torch version (the README's), before the package, within pyproject's bound."""
    ci = (ROOT / ".ci" / "run").read_text()
    pin = tuple(int(x) for x in re.search(r"^TORCH_VERSION=(\d+\.\d+\.\d+)$", ci, re.M).group(1).split("."))
    assert ci.index('"torch==${TORCH_VERSION}"') < ci.index("-e \".[test")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(d for d in deps if d.startswith("torch>="))[len("torch>="):]
    assert pin >= tuple(int(x) for x in floor.split("."))


def test_readme_torch_install_gives_up_fast_and_falls_back():
    """The README's CPU torch line bounds its wait on PyTorch's index and names a fallback."""
    readme = (ROOT / "README.md").read_text()
    line = re.search(r"^pip install (.*)--index-url https://download.pytorch.org/whl/cpu \\\n\s*\|\| (pip install .*)$",
                     readme, re.M)
    assert line, "the CPU torch line and its fallback"
    assert "--timeout 5" in line.group(1) and "--retries 1" in line.group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    version = re.search(r"^TORCH_VERSION=(\S+)$", ci, re.M).group(1)
    assert f"torch=={version}" in line.group(1) and line.group(2) == f"pip install torch=={version}"


def test_ci_runs_every_test_and_the_default_command_leaves_out_the_slow_ones():
    """`python3 -m pytest` deselects `slow` (pyproject's addopts); .ci/run selects every test, and the
    README names both commands."""
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-m 'not slow'" in addopts
    ci = (ROOT / ".ci" / "run").read_text()
    runs = [line for line in ci.splitlines() if line.startswith("python3 -m pytest")]
    assert runs == ['python3 -m pytest -m "slow or not slow"']
    readme = (ROOT / "README.md").read_text()
    assert '`python3 -m pytest -m "slow or not slow"`' in readme and "| `python3 -m pytest` |" in readme
