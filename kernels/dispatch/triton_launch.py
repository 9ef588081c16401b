"""Triton launches as C can replay them: the compiled kernel's CUfunction, its grid and block, and its
arguments packed as the kernel's launcher packs them (Triton 3.6's nvidia driver: every argument of the
compiled signature that is not a constexpr, in order, then the global and profile scratch pointers).

The Triton stages launch through `launch()`; inside `recording()` each launch is also kept, so that a
program can replay the same binary with the same arguments (kernels/dispatch/program.py).
"""
from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass

from ..base import BackendUnavailable

# Triton signature type -> struct format of the C type its launcher passes (driver.ty_to_cpp; floats as their
# storage, FLOAT_STORAGE_TYPE: fp16 as IEEE half, bf16 as a float32's top 16 bits, fp32 as float32)
_FORMATS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q", "u1": "B", "u8": "B", "u16": "H",
            "u32": "I", "u64": "Q", "fp16": "e", "fp32": "f", "f32": "f", "fp64": "d"}
_SCRATCH = 2                # global_scratch, profile_scratch: null pointers (the kernels here need none)
_recorded: list | None = None


@dataclass
class TritonLaunch:
    function: int                       # CUfunction
    grid: tuple[int, int, int]
    threads: int
    shared: int                         # dynamic shared memory bytes (the function's attribute is set at load)
    blob: bytes                         # the arguments, each at its offset
    offsets: tuple[int, ...]
    name: str


def pack_arguments(signature: dict, arg_names: list[str], values: dict) -> tuple[bytes, tuple[int, ...]]:
    """The launcher's parameters of a compiled signature (name -> Triton type, 'constexpr' for constants),
    8-byte aligned: pointers as their address (a tensor's data_ptr), scalars as their C type; then the two
    scratch pointers."""
    blob, offsets = b"", []
    for name in arg_names:
        ty = signature[name]
        if ty == "constexpr":
            continue
        value = values[name]
        if ty.startswith("*"):
            fmt, value = "Q", (value.data_ptr() if hasattr(value, "data_ptr") else int(value or 0))
        elif ty == "bf16":          # the launcher's pack_bf16: the float32's bits, truncated
            fmt, value = "H", struct.unpack("<I", struct.pack("<f", value))[0] >> 16
        elif ty in _FORMATS:
            fmt = _FORMATS[ty]
        else:
            raise BackendUnavailable(f"the C++ dispatch cannot pass a Triton argument of type {ty} ({name})")
        offsets.append(len(blob))
        blob += struct.pack("<" + fmt, value).ljust(8, b"\0")
    for _ in range(_SCRATCH):
        offsets.append(len(blob))
        blob += bytes(8)
    return blob, tuple(offsets)


def replayable(kernel, compiled, grid, args: tuple, kwargs: dict) -> TritonLaunch:
    """The launch `kernel[grid](*args, **kwargs)` made, from the CompiledKernel it returned; BackendUnavailable
    where the launcher would do more than a plain launch (scratch memory, clusters, PDL, cooperative)."""
    meta = compiled.metadata
    extra = [what for what, on in (("global scratch", getattr(meta, "global_scratch_size", 0)),
                                   ("profile scratch", getattr(meta, "profile_scratch_size", 0)),
                                   ("a cluster", getattr(meta, "num_ctas", 1) != 1),
                                   ("programmatic dependent launch", getattr(meta, "launch_pdl", False)),
                                   ("a cooperative grid", getattr(meta, "launch_cooperative_grid", False))) if on]
    if extra:
        raise BackendUnavailable(f"the C++ dispatch cannot replay {meta.name}: it needs {extra[0]}")
    defaults = {p.name: p.default for p in kernel.params if p.has_default}
    values = defaults | dict(zip(kernel.arg_names, args)) | kwargs
    blob, offsets = pack_arguments(compiled.src.signature, list(kernel.arg_names), values)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    compiled._init_handles()
    return TritonLaunch(int(compiled.function), grid, meta.num_warps * 32, meta.shared, blob, offsets, meta.name)


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs), kept inside recording() (a compiled launch only: the interpreter
    returns nothing to replay)."""
    compiled = kernel[grid](*args, **kwargs)
    if _recorded is not None and compiled is not None:
        consts = {k: v for k, v in kwargs.items() if k in kernel.arg_names}
        _recorded.append(replayable(kernel, compiled, grid, args, consts))
    return compiled


@contextlib.contextmanager
def recording():
    """The launches made through launch() in the block, in order (a list filled as they run)."""
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = outer
