"""Ahead-of-time build of the CuTe DSL attention stages, both kinds of library (manifest.py): DSL compile ->
export_to_c -> shared library.

Needs nvidia-cutlass-dsl[cu13]==4.8.1, g++ and the CUDA 13 headers/libcudart; no GPU (the target
arch comes from CUTE_DSL_ARCH, set here before cutlass is imported). Each configuration becomes
lib<name>.so: the exported object, the DSL's static CUDA-dialect runtime and a small C shim
(shim_template.py, one per kind) that loads the module once and launches on a caller-given stream.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ...errors import UserError
from .manifest import DEFAULT_ARCH, SUPPORTED_ARCHS, LibraryConfig, config_entry, write_manifest

DSL_PIP = 'pip install "nvidia-cutlass-dsl[cu13]==4.8.1"'


class BuildError(UserError):
    """A kernel build (the CuTe libraries, the dispatch library) could not be done; the message is one line."""


def dsl_unavailable_reason() -> str | None:
    import importlib.util
    if importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("cuda.bindings") is None:
        return f"nvidia-cutlass-dsl is not installed ({DSL_PIP})"
    return None


def _import_dsl(arch: str):
    if arch not in SUPPORTED_ARCHS:
        raise BuildError(f"unsupported arch {arch!r}; the CuTe attention stage targets {', '.join(SUPPORTED_ARCHS)}")
    reason = dsl_unavailable_reason()
    if reason:
        raise BuildError(reason)
    prior = os.environ.get("CUTE_DSL_ARCH")
    if "cutlass" in sys.modules and prior not in (None, arch):
        raise BuildError(f"cutlass was already imported for {prior}; build {arch} in a fresh process")
    os.environ["CUTE_DSL_ARCH"] = arch
    import cutlass  # noqa: F401  (reads CUTE_DSL_ARCH on import)


def dsl_version() -> str:
    from importlib.metadata import version
    return version("nvidia-cutlass-dsl")


def cuda_home() -> Path:
    return Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")


def cuda_version() -> str:
    header = cuda_home() / "include" / "cuda_runtime_api.h"
    try:
        found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", header.read_text())
    except OSError:
        found = None
    if not found:
        raise BuildError(f"CUDA headers not found at {header.parent} (set CUDA_HOME)")
    v = int(found.group(1))
    return f"{v // 1000}.{(v % 1000) // 10}"


def dsl_runtime_lib() -> Path:
    import cutlass
    major = cuda_version().split(".")[0]
    lib = Path(cutlass.__file__).resolve().parents[2] / f"cu{major}" / "lib" / "libcuda_dialect_runtime_static.a"
    if not lib.is_file():
        raise BuildError(f"DSL runtime {lib} not found: install the cu{major} flavour ({DSL_PIP})")
    return lib


ELEMENTS = {"bf16": "BFloat16", "i32": "Int32", "f32": "Float32"}          # manifest.Abi element -> cutlass type


def _fake_args(cfg: LibraryConfig):
    """Argument descriptions for cute.compile, in the order of cfg.abi (the kernel's __call__): leading
    extents dynamic, rows contiguous, aligned to their size up to 16 bytes; then the scalars and the stream."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor as fake

    from .layouts import DSL_DTYPES
    args = []
    for (name, element, _), cols in zip(cfg.abi.tensors, cfg.abi.columns(cfg)):
        if name in cfg.omitted:
            args.append(None)
            continue
        dtype = DSL_DTYPES[cfg.dtype] if element == "data" else getattr(cutlass, ELEMENTS[element])
        if cols == 1:
            args.append(fake(dtype, (cute.SymInt(),), assumed_align=dtype.width // 8))
        else:
            args.append(fake(dtype, (cute.SymInt(), cols), stride_order=(1, 0),
                             assumed_align=min(16, cols * dtype.width // 8)))
    scalars = {"i32": lambda: cutlass.Int32(1), "f32": lambda: cutlass.Float32(1.0)}
    return args + [scalars[kind]() for _, kind in cfg.abi.scalars] + [cuda.CUstream(0)]


def _check_header(header: Path, cfg: LibraryConfig) -> None:
    text = header.read_text()
    for arg in (a for a in cfg.abi.tensor_names if a not in cfg.omitted):
        body = re.search(r"typedef struct \{([^}]*)\}\s*" + re.escape(f"{cfg.name}_Tensor_{arg}_t;"), text)
        if body is None or "dynamic_strides" in body.group(1) or "dynamic_shapes[1]" not in body.group(1):
            raise BuildError(f"{header.name}: tensor {arg} is not exported as data + one dynamic extent; "
                             "shim_template.py needs updating")


def _link(cfg: LibraryConfig, obj_dir: Path, out: Path) -> None:
    from .shim_template import shim_source
    shim = obj_dir / f"{cfg.name}_shim.cpp"
    shim.write_text(shim_source(cfg.kind, cfg.name, cfg.omitted))
    cuda = cuda_home()
    cmd = [cxx(), "-shared", "-fPIC", "-O2", "-o", str(out), str(shim), str(obj_dir / f"{cfg.name}.o"),
           str(dsl_runtime_lib()), f"-I{obj_dir}", f"-I{cuda / 'include'}", f"-L{cuda / 'lib64'}",
           "-lcudart", "-Wl,--no-undefined", "-Wl,--exclude-libs,ALL"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        first = (proc.stderr.strip().splitlines() or ["(no output)"])[0]
        raise BuildError(f"linking {out.name} failed: {first}")


def cxx() -> str:
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not found:
        raise BuildError("no C++ compiler found (g++ or $CXX) to link the CuTe libraries")
    return found


def cxx_version() -> str:
    proc = subprocess.run([cxx(), "--version"], capture_output=True, text=True)
    return (proc.stdout.strip().splitlines() or ["unknown"])[0]


def make_kernel(cfg: LibraryConfig):
    """The DSL kernel object of a configuration: its class, given the dtype, the geometry and the options."""
    import importlib
    module, _, cls = cfg.kernel_class.rpartition(".")
    kernel_cls = getattr(importlib.import_module(f".{module}", __package__), cls)
    return kernel_cls(cfg.dtype, *cfg.geometry, **cfg.kernel_options)


def build_config(cfg: LibraryConfig, out_dir: Path, arch: str = DEFAULT_ARCH) -> tuple[Path, str | None]:
    """Compile one configuration for `arch` into out_dir/lib<name>.so; returns the library path and the
    kernel's kernel_version (None where it has none)."""
    _import_dsl(arch)
    import cutlass.cute as cute

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{cfg.name}_") as tmp:
        tmp = Path(tmp)
        try:
            kernel = make_kernel(cfg)
            compiled = cute.compile(kernel, *_fake_args(cfg))
            compiled.export_to_c(file_path=str(tmp), file_name=cfg.name, function_prefix=cfg.name)
        except Exception as exc:  # a DSL compile error: report its first line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise BuildError(f"CuTe compile of {cfg.name} for {arch} failed: {first}") from exc
        _check_header(tmp / f"{cfg.name}.h", cfg)
        lib = out_dir / cfg.library
        _link(cfg, tmp, lib)
    return lib, getattr(kernel, "kernel_version", None)


def build_all(configs: list[LibraryConfig], out_dir: Path, arch: str = DEFAULT_ARCH, log=print) -> dict:
    """Build every configuration (of either kind) and write the manifest; returns a summary dict."""
    _import_dsl(arch)
    out_dir = Path(out_dir)
    entries, start = [], time.perf_counter()
    for cfg in configs:
        t0 = time.perf_counter()
        lib, version = build_config(cfg, out_dir, arch)
        entries.append(config_entry(cfg, lib, version))
        log(f"built {lib} ({lib.stat().st_size // 1024} KiB, {time.perf_counter() - t0:.1f} s)")
    toolchain = dict(dsl_version=dsl_version(), cuda_version=cuda_version(), cxx_version=cxx_version())
    manifest = write_manifest(out_dir, arch, toolchain, entries)
    return dict(manifest=str(manifest), libraries=[e["library"] for e in entries],
                seconds=round(time.perf_counter() - start, 1))
