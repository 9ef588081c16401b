"""How the Triton kernels run here: compiled on a CUDA GPU, or in Triton's CPU interpreter.

Triton picks interpreter or compiler when a kernel is *decorated* (reading TRITON_INTERPRET then), so
on a machine without CUDA this module sets TRITON_INTERPRET=1 before the kernel modules are
imported (they import this module first). A user who exported TRITON_INTERPRET=0 keeps that choice
and gets a clear "unavailable" reason instead of a crash.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def triton_unavailable_reason(device) -> str | None:
    """None if the Triton kernels can run on `device`, else one line saying why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    kind = torch.device(device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            return "the workload is on CUDA but no CUDA device is visible"
        if interpreting():
            return "TRITON_INTERPRET=1 is set on a GPU machine; unset it to run the compiled kernels"
        return None
    if kind == "cpu":
        if not interpreting():
            return ("Triton kernels on CPU need the interpreter: set TRITON_INTERPRET=1 before "
                    "triton is imported")
        return None
    return f"Triton kernels cannot run on device type {kind!r}"
