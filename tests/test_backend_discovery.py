"""Backends are found by walking the kernels package: a module that registers one is imported, a kernel
source of the CuTe DSL is not, and a module whose optional dependency is missing is left out."""
import subprocess
import sys
from pathlib import Path

import pytest

from msa_bench.kernels import base

KERNELS = Path(base.__file__).resolve().parent


def test_every_backend_is_found_sorted_without_importing_the_dsl():
    code = ("import sys; from msa_bench.kernels.base import registered_names; "
            "print(','.join(registered_names())); print('cutlass' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    names = out[0].split(",")
    assert names == sorted(names)
    assert {"auto", "dense-gather", "dense-masked", "flashinfer", "flashinfer-fa3", "flashinfer-packed", "hybrid",
            "kv-outer", "kv-outer-cute", "msa-scatter", "q-packed", "q-packed-cute", "reference"} <= set(names)
    assert out[1] == "False"


@pytest.fixture
def fresh_discovery(monkeypatch):
    """Discovery runs again over a copy of the registry; probe modules written by a test are removed."""
    base.registered_names()
    monkeypatch.setattr(base, "_discovered", False)
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setattr(base, "_LEFT_OUT", {})
    written = []

    def write(name: str, text: str) -> None:
        path = KERNELS / f"{name}.py"
        path.write_text(text)
        written.append((path, f"msa_bench.kernels.{name}"))
    yield write
    for path, module in written:
        path.unlink()
        sys.modules.pop(module, None)


PROBE = '''from .reference_backend import ReferenceBackend
from .base import register
{extra}

@register("probe-{name}")
class Probe(ReferenceBackend):
    pass
'''


def test_a_module_that_registers_is_found_by_existing(fresh_discovery):
    fresh_discovery("_probe_found", PROBE.format(extra="", name="found"))
    assert "probe-found" in base.registered_names()
    assert base.get_backend("probe-found").name == "probe-found"


def test_a_missing_optional_dependency_leaves_its_module_out(fresh_discovery):
    fresh_discovery("_probe_missing", PROBE.format(extra="import no_such_dependency_here  # noqa: F401", name="missing"))
    names = base.registered_names()
    assert "probe-missing" not in names and "kv-outer" in names
    with pytest.raises(KeyError, match="msa_bench.kernels._probe_missing left out .no module 'no_such_dependency_here'"):
        base.get_backend("probe-missing")


def test_a_missing_module_of_the_package_is_an_error(fresh_discovery):
    fresh_discovery("_probe_broken", PROBE.format(extra="import msa_bench.kernels.no_such_kernel_module  # noqa: F401",
                                                  name="broken"))
    with pytest.raises(ModuleNotFoundError, match="no_such_kernel_module"):
        base.registered_names()
