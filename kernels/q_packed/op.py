"""q-packed-cute dispatched from C++ (`q-packed-cute@op`): the schedule's Triton launch, recorded as the
Python stage made it, and the CuTe attention launch through its library's C entry point, as one program of
kernels/dispatch replayed whole from one ctypes call, or a stage alone from one call each (the same binaries and
arguments: the same bits).
The hybrid (`hybrid@op`) is its packed schedule and KV-outer's index map and schedule as one stage, both
attention launches as the next, and the merging combine."""
from __future__ import annotations

from ..base import BackendUnavailable
from ..dispatch.program import Program, dispatch_plan
from ..kv_outer.op import add_combine, add_cute, add_index_map, add_schedule, recorded


def add_packed_schedule(prog: Program, at: int, schedule) -> None:
    prog.triton(at, recorded(schedule, 1 if schedule.num_tiles else 0, "the packed schedule"))


def dispatch(plan, graph: bool = False) -> None:
    """The plan's stages ({schedule, attention}, or attention alone for one-token tiles) replayed from one
    program."""
    names = tuple(plan.stages)
    if names not in (("schedule", "attention"), ("attention",)):
        raise BackendUnavailable(f"the C++ dispatch runs q-packed's stages, not {names}")

    def fill(prog: Program) -> None:
        for at, name in enumerate(names):
            (add_packed_schedule if name == "schedule" else add_cute)(prog, at, plan.stages[name])
    dispatch_plan(plan, fill, graph)


def dispatch_hybrid(plan, packed, kv_stages: dict, parts_in_order: tuple, combine, graph: bool = False) -> None:
    """The hybrid's stages (schedule, attention[, combine]) replayed from one program: its Python stages'
    parts, in their order (the packed schedule writes the residual selection KV-outer's index map reads)."""
    def fill(prog: Program) -> None:
        add_packed_schedule(prog, 0, packed)
        add_index_map(prog, 0, kv_stages["index_map"])
        add_schedule(prog, 0, kv_stages["schedule"])
        for part in parts_in_order:
            add_cute(prog, 1, part)
        if combine is not None:
            add_combine(prog, 2, combine)
    dispatch_plan(plan, fill, graph)
