"""q-packed-cute dispatched from C++ (`q-packed-cute@op`): the schedule's Triton launch, recorded as the
Python stage made it, and the CuTe attention launch through its library's C entry point, as one program of
kernels/dispatch replayed per stage from one ctypes call each (the same binaries and arguments: the same bits)."""
from __future__ import annotations

import torch

from ..base import BackendUnavailable
from ..dispatch.program import Program, ProgramStage
from ..dispatch.triton_launch import recording


def program_stages(plan) -> dict:
    """The plan's stages ({schedule, attention}, or attention alone for one-token tiles) as ProgramStages."""
    names = tuple(plan.stages)
    if names not in (("schedule", "attention"), ("attention",)):
        raise BackendUnavailable(f"the C++ dispatch runs q-packed's stages, not {names}")
    device = plan.output.device
    prog = Program(device)
    prog.keep.append(plan)
    for i, name in enumerate(names):
        stage = plan.stages[name]
        if name == "schedule":
            with recording() as launches:
                stage()
            if len(launches) != (1 if stage.num_tiles else 0):
                raise BackendUnavailable(f"the C++ dispatch recorded {len(launches)} launches of the q-packed schedule")
            prog.triton(i, launches)
        elif stage.num_tiles:
            prog.cute(i, stage.library, stage.packed, stage.scalars)
    torch.cuda.synchronize(device)
    return {name: ProgramStage(prog, i) for i, name in enumerate(names)}
