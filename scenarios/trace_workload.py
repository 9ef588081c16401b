"""A trace call as a workload: its selection, request layout and page table as captured, Q/K/V drawn at its
shape (seeded, like every generator's).

An engine's top-k comes in its own order; the workload contract (workload.py) wants the valid ids first
and, causal, the query's own block last. The selection is put in that order here, nothing else changed:
an id past its request's context, a block after the query's own, a repeated id or a query without its own
block is refused in one line naming the call, the head and the token.
"""
from __future__ import annotations

import torch

from .selection import assemble, local_blocks, scattered_page_table
from .trace import TraceCall, TraceError, TraceInfo, read_call
from .workload import Workload, WorkloadError


def _at(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(x) for x in mask.nonzero()[0].tolist())


def check_layout(where: str, c: TraceCall) -> None:
    """The call's request layout: contexts positive, every token in one of its requests and at a position
    inside that request's context. Its selection gets the contract's one check (selection.check_selection,
    where the workload is assembled): ids below -1, blocks past a request's context, repeats, causality."""
    ctx, req, pos = c.context.long(), c.q_request.long(), c.q_position.long()
    if (ctx <= 0).any():
        raise TraceError(f"{where}: request {_at(ctx <= 0)[0]} has context {int(ctx[ctx <= 0][0])}, not positive")
    bad = (req < 0) | (req >= ctx.numel())
    if bad.any():
        t = _at(bad)[0]
        raise TraceError(f"{where}: token {t} names request {int(req[t])}; the call holds {ctx.numel()}")
    bad = (pos < 0) | (pos >= ctx[req])
    if bad.any():
        t = _at(bad)[0]
        raise TraceError(f"{where}: token {t} sits at position {int(pos[t])}, outside its request's context "
                         f"of {int(ctx[req[t]])} tokens")


def canonical(where: str, selection: torch.Tensor, position: torch.Tensor, block: int) -> torch.Tensor:
    """The selection in the contract's order: history blocks first (their order kept), then the query's own
    block, then -1 padding."""
    sel = selection.long()
    own = local_blocks(position, block).view(1, -1, 1)
    is_own = sel == own
    missing = ~is_own.any(-1)
    if missing.any():
        h, t = _at(missing)
        raise TraceError(f"{where}: (head {h}, token {t}) does not select its own block {int(own[0, t, 0])}; a "
                         "causal query keeps it (docs/trace-format.md)")
    rank = torch.where(sel < 0, 2, torch.where(is_own, 1, 0))
    return sel.gather(-1, rank.argsort(dim=-1, stable=True)).to(torch.int32)


def compact_pages(table: torch.Tensor, context: list[int], block: int) -> tuple[torch.Tensor, int]:
    """A recorded page table on pages 0..P-1 (the engine's ids renumbered, pages two requests share kept
    shared); entries past a request's blocks become -1."""
    table = table.long().clone()
    for r, c in enumerate(context):
        blocks = -(-c // block)
        table[r, blocks:] = -1
        if (table[r, :blocks] < 0).any():
            raise TraceError(f"request {r}'s page table has no page for one of its {blocks} blocks")
    used = table >= 0
    ids, inverse = torch.unique(table[used], return_inverse=True)
    table[used] = inverse
    return table.to(torch.int32), max(1, int(ids.numel()))


def call_workload(info: TraceInfo, call: int, dtype: str, seed: int = 0, device="cpu",
                  with_tensors: bool = True) -> Workload:
    """The workload of one call of the trace; a call that breaks the contract is a TraceError."""
    c = read_call(info, call)
    where = f"{info.path}: call {call}"
    shape = info.shape
    check_layout(where, c)
    sel = canonical(where, c.selection, c.q_position, shape.block)
    context = [int(x) for x in c.context.tolist()]
    if c.page_table is not None:
        if c.page_table.shape[1] < max(-(-x // shape.block) for x in context):
            raise TraceError(f"{where}: page_table has {c.page_table.shape[1]} columns, fewer than the longest "
                             "request's blocks")
        try:
            table, pages = compact_pages(c.page_table, context, shape.block)
        except TraceError as exc:
            raise TraceError(f"{where}: {exc}") from None
    else:
        table, pages = scattered_page_table(context, shape.block, torch.Generator().manual_seed(seed + 1))
    e = c.entry
    meta = {"generator": "trace", "trace": info.name, "call": call, "layer": e.layer, "step": e.step,
            "weight": e.weight, "seed": seed, "kv_lens": context}
    try:
        return assemble(shape, dtype, sel, table, c.q_request, c.q_position, pages, True, seed, device,
                        with_tensors, meta=meta)
    except WorkloadError as exc:
        raise TraceError(f"{where}: {exc}") from None


def check_calls(info: TraceInfo, calls) -> None:
    """Every check a call's workload gets, on each of `calls` (CallEntry), before anything runs: a
    selection-only workload of each is built, no K/V drawn."""
    for e in calls:
        call_workload(info, e.call, "fp32", with_tensors=False)
