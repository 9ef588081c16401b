"""Load a prebuilt CuTe attention library with ctypes and launch it; no DSL needed here.

`resolve_library(cfg, device)` finds a library that may run (manifest arch, source hash and checksum
match), or compiles one on the spot where the DSL is installed, or raises BackendUnavailable with
the build command. `CuteAttentionLibrary.launch` passes raw data pointers and the current stream.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ..base import BackendUnavailable
from .manifest import DEFAULT_BUILD_DIR, MANIFEST_NAME, SUPPORTED_ARCHS, CuteConfig, device_arch, find_library

BUILD_DIR_ENV = "MSA_BENCH_CUTE_DIR"
N_TENSORS = 13
_LOADED: dict[str, "CuteAttentionLibrary"] = {}
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


class CuteAttentionLibrary:
    """One configuration's shared library: `<name>_load()` once, then `<name>_launch(...)` per call."""

    def __init__(self, path: Path, cfg: CuteConfig):
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
        self._launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int32),
                                 ctypes.c_int32, ctypes.c_int32, ctypes.c_float, ctypes.c_float,
                                 ctypes.c_void_p]
        self.module_loaded = False

    def load_module(self) -> None:
        """Load the embedded GPU module (needs a CUDA context; done once, before any launch)."""
        if not self.module_loaded:
            err = self._load()
            if err:
                raise RuntimeError(f"{self.cfg.name}: loading the CUDA module failed: {cuda_error_text(err)}")
            self.module_loaded = True

    @staticmethod
    def pack(ptrs: list[int], rows: list[int]):
        """ctypes arrays for launch(); build once per plan."""
        if len(ptrs) != N_TENSORS or len(rows) != N_TENSORS:
            raise ValueError(f"expected {N_TENSORS} tensors, got {len(ptrs)} pointers and {len(rows)} extents")
        for r in rows:
            if not 0 <= r < 2 ** 31:
                raise ValueError(f"tensor extent {r} does not fit int32")
        return (ctypes.c_void_p * N_TENSORS)(*ptrs), (ctypes.c_int32 * N_TENSORS)(*rows)

    def launch(self, packed, hkv: int, num_pages: int, scale: float, out_scale: float, stream: int) -> None:
        """Launch on `stream` (a cudaStream_t as an int: pass torch.cuda.current_stream().cuda_stream
        at each call, so that a CUDA-graph capture records the launch); raises on a launch error."""
        if not self.module_loaded:
            raise RuntimeError(f"{self.cfg.name}: load_module() must run (outside any graph capture) before launch")
        err = self._launch(packed[0], packed[1], hkv, num_pages, scale, out_scale, ctypes.c_void_p(stream))
        if err:
            raise RuntimeError(f"{self.cfg.name}: launch failed: {cuda_error_text(err)}")


def resolve_library(cfg: CuteConfig, device) -> CuteAttentionLibrary:
    """A loaded library for `cfg` on `device`, or BackendUnavailable saying what to build."""
    arch = device_arch(device)
    if arch not in SUPPORTED_ARCHS:
        raise BackendUnavailable(f"the CuTe attention stage is built for {', '.join(SUPPORTED_ARCHS)}; "
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
        _LOADED[key] = CuteAttentionLibrary(path, cfg)
    return _LOADED[key]
