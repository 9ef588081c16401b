"""Combine functions of tl.associative_scan that more than one Triton kernel uses (a running min or max)."""
from __future__ import annotations

from . import triton_common  # noqa: F401  (before triton: the interpreter on a CPU)
import triton
import triton.language as tl


@triton.jit
def scan_min(a, b):
    return tl.minimum(a, b)


@triton.jit
def scan_max(a, b):
    return tl.maximum(a, b)
