"""Load a prebuilt CuTe attention library (either kind, manifest.py) with ctypes and launch it; no DSL
needed here.

`resolve_library(cfg, device)` finds a library that may run (manifest arch, source hash and checksum
match), or compiles one on the spot where the DSL is installed, or raises BackendUnavailable with
the build command. `CuteLibrary.launch` passes raw data pointers, the scalars and the current stream.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ..base import BackendUnavailable
from .manifest import DEFAULT_BUILD_DIR, MANIFEST_NAME, SUPPORTED_ARCHS, LibraryConfig, device_arch, find_library

BUILD_DIR_ENV = "MSA_BENCH_CUTE_DIR"
SCALAR_CTYPES = {"i32": ctypes.c_int32, "f32": ctypes.c_float}      # manifest.Abi scalar kinds
_LOADED: dict[str, "CuteLibrary"] = {}
_CUDART = None


def cuda_error_text(code: int) -> str:
    """'cudaErrorXxx (code): message' through the loaded libcudart, or the bare code."""
    try:
        _CUDART.cudaGetErrorName.restype = ctypes.c_char_p
        _CUDART.cudaGetErrorString.restype = ctypes.c_char_p
        name = _CUDART.cudaGetErrorName(ctypes.c_int(code)).decode()
        text = _CUDART.cudaGetErrorString(ctypes.c_int(code)).decode()
        return f"{name} ({code}): {text}"
    except Exception:  # noqa: BLE001  (no libcudart loaded: the code is all there is)
        return f"cudaError {code}"


def build_dir() -> Path:
    """Where prebuilt libraries are looked for: $MSA_BENCH_CUTE_DIR if set; else the first of
    build/cute next to the package (an editable checkout) and ./build/cute (the checkout the command
    runs in, when the package is installed elsewhere) that holds a manifest; else the former."""
    if os.environ.get(BUILD_DIR_ENV):
        return Path(os.environ[BUILD_DIR_ENV])
    for cand in (DEFAULT_BUILD_DIR, Path.cwd() / "build" / "cute"):
        if (cand / MANIFEST_NAME).is_file():
            return cand
    return DEFAULT_BUILD_DIR


def _load_cudart() -> None:
    """The libraries link libcudart.so.13 dynamically; make it visible process-wide first."""
    import sys
    names = ["libcudart.so.13"]
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    names += [str(Path(home) / sub / "libcudart.so.13") for sub in ("lib64", "lib")]
    for site in sys.path:                     # pip's CUDA runtime wheels (nvidia/cu13, nvidia/cuda_runtime)
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_runtime/lib"):
            cand = Path(site or ".") / sub / "libcudart.so.13"
            if cand.is_file():
                names.append(str(cand))
    errors = []
    for name in names:
        try:
            global _CUDART
            _CUDART = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError as exc:
            errors.append(str(exc))
    raise BackendUnavailable(f"cannot load libcudart.so.13 for the CuTe libraries ({errors[0]})")


class CuteLibrary:
    """One configuration's shared library, of either kind: `<name>_load()` once, then `<name>_launch(ptrs,
    rows, scalars..., stream)` per call, with the arguments of the configuration's manifest.Abi."""

    def __init__(self, path: Path, cfg: LibraryConfig):
        _load_cudart()
        self.path, self.cfg = Path(path), cfg
        try:
            self.lib = ctypes.CDLL(str(self.path))
            self._load = getattr(self.lib, f"{cfg.name}_load")
            self._launch = getattr(self.lib, f"{cfg.name}_launch")
        except (OSError, AttributeError) as exc:
            raise BackendUnavailable(f"cannot load CuTe library {self.path}: {exc}") from exc
        self._load.restype = ctypes.c_int
        self._load.argtypes = []
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int32)] + \
            [SCALAR_CTYPES[kind] for _, kind in cfg.abi.scalars] + [ctypes.c_void_p]
        self.module_loaded = False

    def load_module(self) -> None:
        """Load the embedded GPU module (needs a CUDA context; done once, before any launch or capture)."""
        if not self.module_loaded:
            err = self._load()
            if err:
                raise RuntimeError(f"{self.cfg.name}: loading the CUDA module failed: {cuda_error_text(err)}")
            self.module_loaded = True

    def pack(self, tensors: list, device):
        """ctypes arrays of the tensors' data pointers and leading extents (pack_arguments); build once per
        plan and keep the tensors alive while the arrays are used."""
        return pack_arguments(self.cfg, tensors, device)

    def launch(self, packed, scalars: tuple, stream: int) -> None:
        """Launch with the ABI's scalars on `stream` (a cudaStream_t as an int: pass
        torch.cuda.current_stream().cuda_stream at each call, so that a CUDA-graph capture records the
        launch); raises on a launch error."""
        if not self.module_loaded:
            raise RuntimeError(f"{self.cfg.name}: load_module() must run (outside any graph capture) before launch")
        if len(scalars) != len(self.cfg.abi.scalars):
            raise ValueError(f"{self.cfg.name}: expected {len(self.cfg.abi.scalars)} scalars, got {len(scalars)}")
        err = self._launch(packed[0], packed[1], *scalars, ctypes.c_void_p(stream))
        if err:
            raise RuntimeError(f"{self.cfg.name}: launch failed: {cuda_error_text(err)}")


def pack_arguments(cfg: LibraryConfig, tensors: list, device):
    """(pointers, extents) as ctypes arrays for `cfg`'s launch: each tensor of cfg.abi, in order, by its data
    pointer and its leading extent (numel over its row width); every tensor contiguous on `device`."""
    names = cfg.abi.tensor_names
    if len(tensors) != len(names):
        raise ValueError(f"expected {len(names)} tensors ({', '.join(names)}), got {len(tensors)}")
    for t in tensors:
        if not t.is_contiguous() or t.device != device:
            raise BackendUnavailable(f"the {cfg.kind} CuTe stage needs contiguous tensors on the workload's device")
    rows = [t.numel() // cols for t, cols in zip(tensors, cfg.abi.columns(cfg))]
    for r in rows:
        if not 0 <= r < 2 ** 31:
            raise ValueError(f"tensor extent {r} does not fit int32")
    n = len(names)
    return (ctypes.c_void_p * n)(*[t.data_ptr() for t in tensors]), (ctypes.c_int32 * n)(*rows)


def resolve_library(cfg: LibraryConfig, device) -> CuteLibrary:
    """A loaded library for `cfg` on `device`: a prebuilt one, else one compiled on the spot where the DSL
    is installed, else BackendUnavailable saying what to build."""
    arch = device_arch(device)
    if arch not in SUPPORTED_ARCHS:
        raise BackendUnavailable(f"the CuTe attention stages are built for {', '.join(SUPPORTED_ARCHS)}; "
                                 f"this GPU is {arch}")
    where = build_dir()
    path, reason = find_library(cfg, where, arch)
    if path is None:
        from .build import dsl_unavailable_reason
        if dsl_unavailable_reason() is not None:
            raise BackendUnavailable(reason)
        from .build import build_all                     # DSL and GPU here: compile on the spot
        build_all([cfg], where, arch, log=lambda *_: None)
        path, reason = find_library(cfg, where, arch)
        if path is None:
            raise BackendUnavailable(reason)
    key = str(path.resolve())
    if key not in _LOADED:
        _LOADED[key] = CuteLibrary(path, cfg)
    return _LOADED[key]


def library_unavailable_reason(cfg: LibraryConfig, arch: str) -> str | None:
    """Why `cfg` cannot run on `arch` here: no library may run and the DSL is not installed to build one."""
    from .build import dsl_unavailable_reason
    _, why = find_library(cfg, build_dir(), arch)
    if why and dsl_unavailable_reason() is not None:
        return why
    return None
