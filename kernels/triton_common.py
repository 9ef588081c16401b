"""What every Triton backend shares: how its kernels run here (compiled on a CUDA GPU, or in Triton's CPU
interpreter), why they cannot, and the dtype of their partial outputs.

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


def triton_dtype_reason(name: str, dtype: str, device) -> str | None:
    """triton_unavailable_reason, and for bf16 on a CPU why backend `name` cannot check it there."""
    reason = triton_unavailable_reason(device)
    if reason is None and dtype == "bf16" and torch.device(device).type == "cpu":
        reason = (f"{name}: bf16 tl.dot gives wrong results in Triton's CPU interpreter; "
                  "check bf16 on a GPU (fp32, fp16 and fp8 run here)")
    return reason


def partial_dtype(dtype: str) -> torch.dtype:
    """The dtype of the partial and packed outputs the Triton stages write for data in `dtype`."""
    return torch.float32 if dtype == "fp32" else torch.bfloat16
