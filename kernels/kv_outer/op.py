"""kv-outer-cute dispatched from C++ (`kv-outer-cute@op`): the plan's four stages as one program of
kernels/dispatch, replayed per stage from one ctypes call each.

The program is made from the Python plan itself: each stage runs once, in order, with its Triton launches
recorded (the same compiled kernels and arguments), and the torch operations between them become the
program's own steps with the same results (a stable sort is unique; the searches, counts and sums are
integer). So the two dispatches compute the same bits, which the tests compare.
"""
from __future__ import annotations

import torch

from ..base import BackendUnavailable
from ..dispatch.program import Program, ProgramStage
from ..dispatch.triton_launch import recording

STAGES = ("index_map", "schedule", "attention", "combine")


def _recorded(stage, expected: int, name: str) -> list:
    with recording() as launches:
        stage()
    if len(launches) != expected:
        raise BackendUnavailable(f"the C++ dispatch expected {expected} Triton launches in {name}, "
                                 f"recorded {len(launches)}")
    return launches


def program_stages(plan) -> dict:
    """The plan's stages as ProgramStages of one program (the plan's buffers, its CuTe library)."""
    if tuple(plan.stages) != STAGES:
        raise BackendUnavailable(f"the C++ dispatch runs kv-outer's stages {STAGES}, not {tuple(plan.stages)}")
    index_map, schedule, attention, combine = (plan.stages[s] for s in STAGES)
    if not schedule.closed_form:
        raise BackendUnavailable("the C++ dispatch replays the closed-form schedule only")
    device = plan.output.device
    prog = Program(device)
    prog.keep.append(plan)

    # stage 0: edge keys, then torch.sort / searchsorted / tile counts / cumsum as program steps, then place
    n_edges = index_map.keys.numel()
    launches = _recorded(index_map, 2 if n_edges else 1, "index_map")
    if n_edges:
        prog.triton(0, launches[:1])
    values = torch.arange(n_edges, dtype=torch.int64, device=device)
    prog.sort(0, index_map.keys, index_map.sorted_key, values, index_map.perm)
    prog.lower_bound(0, index_map.sorted_key, index_map.csr_ptr)
    tiles = torch.empty(index_map.num_keys, dtype=torch.int32, device=device)
    prog.tile_counts(0, index_map.csr_ptr, tiles, index_map.tile_q)
    prog.zero(0, index_map.tile_ptr[:1])
    prog.scan(0, tiles, index_map.tile_ptr[1:])
    prog.triton(0, launches[-1:])

    # stage 1: range counts and their prefix sum (query ranges > 1), then the placement launches
    ranges = schedule.q_ranges > 1
    expected = int(ranges) + int(schedule.phases) + 1 + (int(schedule.grouped) * (1 + int(schedule.combine_index is not None)))
    launches = _recorded(schedule, expected, "schedule")
    if ranges:
        prog.triton(1, launches[:1])
        prog.scan(1, schedule._counts, schedule._group_start)
        launches = launches[1:]
    prog.triton(1, launches)

    # stage 2: the CuTe attention launch through its library's C entry point
    prog.cute(2, attention.library, attention.packed, attention.scalars)
    attention()

    # stage 3: the combine
    prog.triton(3, _recorded(combine, 1, "combine"))
    torch.cuda.synchronize(device)
    return {name: ProgramStage(prog, i) for i, name in enumerate(STAGES)}
