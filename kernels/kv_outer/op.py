"""kv-outer-cute dispatched from C++ (`kv-outer-cute@op`): the plan's four stages as one program of
kernels/dispatch, replayed whole from one ctypes call (a stage alone from one call each).

The program is made from the Python plan itself: each stage runs once, in order, with its Triton launches
recorded (the same compiled kernels and arguments), and the torch operations between them become the
program's own steps with the same results (a stable sort is unique; the searches, counts and sums are
integer). So the two dispatches compute the same bits, which the tests compare. The hybrid adds the same
stages to a program of its own (kernels/q_packed/hybrid.py), hence one function per stage.
"""
from __future__ import annotations

import torch

from ..base import BackendUnavailable
from ..dispatch.program import Program, dispatch_plan
from ..dispatch.triton_launch import recording

STAGES = ("index_map", "schedule", "attention", "combine")


def recorded(stage, expected: int, name: str) -> list:
    """Run `stage` once and return its Triton launches, which must number `expected`."""
    with recording() as launches:
        stage()
    if len(launches) != expected:
        raise BackendUnavailable(f"the C++ dispatch expected {expected} Triton launches in {name}, "
                                 f"recorded {len(launches)}")
    return launches


def add_index_map(prog: Program, at: int, index_map) -> None:
    """Edge keys, then torch.sort / searchsorted / the tile counts / cumsum as program steps, then place."""
    device = prog.device
    n_edges = index_map.keys.numel()
    launches = recorded(index_map, 2 if n_edges else 1, "index_map")
    if n_edges:
        prog.triton(at, launches[:1])
    values = torch.arange(n_edges, dtype=torch.int64, device=device)
    prog.sort(at, index_map.keys, index_map.sorted_key, values, index_map.perm, top=index_map.num_keys)
    prog.lower_bound(at, index_map.sorted_key, index_map.csr_ptr)
    tiles = torch.empty(index_map.num_keys, dtype=torch.int32, device=device)
    prog.tile_counts(at, index_map.csr_ptr, tiles, index_map.tile_q)
    prog.zero(at, index_map.tile_ptr[:1])
    prog.scan(at, tiles, index_map.tile_ptr[1:])
    prog.triton(at, launches[-1:])


def add_schedule(prog: Program, at: int, schedule) -> None:
    """Range counts and their prefix sum (query ranges > 1), then the placement launches."""
    if not schedule.closed_form:
        raise BackendUnavailable("the C++ dispatch replays the closed-form schedule only")
    ranges = schedule.q_ranges > 1
    expected = (int(ranges) + int(schedule.phases) + 1
                + int(schedule.grouped) * (1 + int(schedule.combine_index is not None)))
    launches = recorded(schedule, expected, "schedule")
    if ranges:
        prog.triton(at, launches[:1])
        prog.scan(at, schedule._counts, schedule._group_start)
        launches = launches[1:]
    prog.triton(at, launches)


def add_cute(prog: Program, at: int, attention) -> None:
    """A CuTe attention stage through its library's C entry point (run once, as the others are)."""
    if getattr(attention, "num_tiles", 1) == 0:              # a packed stage with no tiles launches nothing
        return
    prog.cute(at, attention)
    attention()


def add_combine(prog: Program, at: int, combine) -> None:
    prog.triton(at, recorded(combine, 1, "combine"))


def dispatch(plan, graph: bool = False) -> None:
    """The plan's stages replayed from one program (its buffers, its CuTe library); graph: the module one
    graph launch (dispatch_plan)."""
    if tuple(plan.stages) != STAGES:
        raise BackendUnavailable(f"the C++ dispatch runs kv-outer's stages {STAGES}, not {tuple(plan.stages)}")

    def fill(prog: Program) -> None:
        for at, (name, add) in enumerate(zip(STAGES, (add_index_map, add_schedule, add_cute, add_combine))):
            add(prog, at, plan.stages[name])
    dispatch_plan(plan, fill, graph)
