"""A planned module as a torch op: `torch.ops.msa_bench.run_program(out, lse, handle)` runs every stage of a
registered program in one call into the C++ dispatch library, so it can sit in a model's forward under
torch.compile (an opaque op that writes out and lse) and inside CUDA-graph capture (no allocation, no sync).

It is registered with torch.library and its kernel is the prebuilt C library through ctypes, not a
TORCH_LIBRARY extension: that would tie the build to one torch's C++ ABI, and the library is built without
torch (no GPU either).

    handle = register(program)                 # kernels/dispatch/program.Program of a plan
    torch.ops.msa_bench.run_program(plan.output, plan.lse, handle)
"""
from __future__ import annotations

import torch

OP = "msa_bench::run_program"
_PROGRAMS: dict[int, object] = {}


@torch.library.custom_op(OP, mutates_args=("out", "lse"))
def run_program(out: torch.Tensor, lse: torch.Tensor, handle: int) -> None:
    """Run registered program `handle`, which writes the module's output `out` and `lse`."""
    program = _PROGRAMS.get(handle)
    if program is None:
        raise ValueError(f"{OP}: no program registered as {handle}")
    program.run(-1)


@run_program.register_fake
def _(out: torch.Tensor, lse: torch.Tensor, handle: int) -> None:
    return None


def register(program) -> int:
    """A handle for run_program; the program stays registered (and alive) until unregister(handle)."""
    handle = id(program)
    _PROGRAMS[handle] = program
    return handle


def unregister(handle: int) -> None:
    _PROGRAMS.pop(handle, None)
