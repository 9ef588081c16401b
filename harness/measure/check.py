"""`msa-bench check`: run one backend on one workload and compare it with the float64 reference.

check_backend() is the reusable part; the sweep compares the output its timed runs left (compare_output)
and discards the timings of an arm that disagrees.
Without a GPU the Triton backends run in Triton's CPU interpreter; importing this module sets
TRITON_INTERPRET=1 first (before triton is imported) when no CUDA device is visible.
"""
from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ...errors import UserError
from ...scenarios.reference import reference_attention, relative_error
from ...scenarios.grid import SERVING, Point, check_point_fits, make_workload, point_from_options
from ...scenarios.workload import (AttnShape, Workload, build_workload, check_fits, footprint_bytes,
                                   full_context)

TOLERANCE = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 1e-2, "fp8": 5e-2}
SAMPLED_ROWS = 512          # rows compared with the reference when the workload is bigger than this


def tolerance(dtype: str) -> float:
    return TOLERANCE[dtype]


def sample_rows(n_tokens: int, count: int = SAMPLED_ROWS) -> torch.Tensor | None:
    """Evenly spread rows (first and last included) when n_tokens > count, else None (all rows)."""
    if n_tokens <= count:
        return None
    return torch.linspace(0, n_tokens - 1, count).round().long().unique()


def _lse_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative LSE error over rows that see a key; rows that see none must be -inf in both."""
    got, ref = got.double().cpu(), ref.double().cpu()
    empty = torch.isinf(ref)
    if not torch.equal(torch.isinf(got) & (got < 0), empty):
        return math.inf
    return relative_error(got[~empty], ref[~empty]) if (~empty).any() else 0.0


def poison(plan) -> None:
    """NaN-fill the plan's output (and LSE): a row no stage writes then fails the comparison."""
    plan.output.fill_(float("nan"))
    if plan.lse is not None:
        plan.lse.fill_(float("nan"))


def compare_output(plan, workload: Workload, rows=None, backend_name: str = ""):
    """(max_rel_err, tol, details) of the output (and LSE) the plan's last run left, against the
    float64 reference on `rows` (all rows when None)."""
    if workload.device.type == "cuda":
        torch.cuda.synchronize(workload.device)
    idx = None if rows is None else torch.as_tensor(rows, device=workload.device).long()
    # a plan that ignores the selection is checked on the workload whose selection is every visible block
    ref_out, ref_lse = (reference_attention(full_context(workload, idx)) if plan.full_context
                        else reference_attention(workload, idx))
    out = plan.output if idx is None else plan.output[idx]
    tol = tolerance(workload.dtype)
    details = {"backend": backend_name, "rows": workload.n_tokens if idx is None else int(idx.numel()),
               "out_rel_err": relative_error(out, ref_out), "info": plan.info,
               "stages": list(plan.stages), "plan_seconds": plan.plan_seconds}
    errs = [details["out_rel_err"]]
    if plan.lse is not None:
        lse = plan.lse if idx is None else plan.lse[idx]
        details["lse_rel_err"] = _lse_error(lse, ref_lse)
        errs.append(details["lse_rel_err"])
    return max(errs), tol, details


def check_backend(backend_name: str, workload: Workload, rows=None, stages: bool = False):
    """Plan and run `backend_name` on `workload` (outputs poisoned with NaN first) and compare with
    the reference on `rows` (all rows when None).

    Returns (max_rel_err, tol, details): max_rel_err is the larger of the output's and the LSE's
    relative errors (norm of the difference over norm of the reference); details holds both, the
    plan's info and, with stages=True, each stage's own check where the backend has them
    (Backend.stage_checks).
    Raises BackendUnavailable when the backend cannot run here.
    """
    from ...kernels.base import get_backend
    try:
        backend = get_backend(backend_name)
    except KeyError as exc:
        raise UserError(str(exc.args[0])) from None
    plan = backend.plan(workload)
    poison(plan)
    plan.run()
    err, tol, details = compare_output(plan, workload, rows, backend_name)
    if stages:
        check_rows = torch.arange(workload.n_tokens) if rows is None else torch.as_tensor(rows).long()
        checks = backend.stage_checks(plan, workload, check_rows.to(workload.device), tol)
        if checks:
            details["stage_checks"] = checks
    return err, tol, details


# ---- workloads for the command -----------------------------------------------------------------

CPU_SHAPE = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)
# sizes not given on the command line: small on CPU (the interpreter is slow), the study's on a GPU
CPU_DEFAULTS = {"tokens": 40, "context": 256, "reuse": 0.5}
GPU_DEFAULTS = {"tokens": 4096, "context": 32768, "reuse": 0.25}
EDGE_HOT, EDGE_PAD = 0.2, 0.3     # --requests: share of queries that pick a hot block, of query rows padded with -1


def check_point(generator: str, shape: AttnShape, dtype: str, requests: int | None = None, on_gpu: bool = False,
                **given) -> Point:
    """The workload `msa-bench check` builds, its options refused as `msa-bench workload` refuses them
    (grid.point_from_options), sizes not given from CPU_DEFAULTS or GPU_DEFAULTS. requests K: the synthetic
    point's tokens and context as K requests of edge-case selections (check_workload), which have no reuse
    target."""
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    if generator in SERVING:                 # --requests: the point's decode requests
        return point_from_options(generator, shape, dtype, defaults, requests=requests, **given)
    if requests is None:
        return point_from_options(generator, shape, dtype, defaults, **given)
    if generator != "synthetic":
        raise UserError(f"--requests does not apply to --generator {generator} (it draws its own selection)")
    if given.get("reuse") is not None:
        raise UserError("--reuse does not apply to --requests (edge-case selections have no reuse target)")
    p = point_from_options("synthetic", shape, dtype, {**defaults, "reuse": None}, **given)
    if not 0 < requests <= p.tokens:
        raise UserError(f"--requests must be between 1 and the {p.tokens} query tokens, got {requests}")
    return p


def request_layout(tokens: int, context: int, requests: int) -> tuple[list[int], list[int]]:
    """(KV lengths, query tokens) of `requests` requests sharing `tokens`: as even a split as can be, so
    tiles cut at unaligned positions, on contexts from `context` down to about half of it (partial last
    blocks), each long enough to hold its queries."""
    counts = [tokens // requests + (r < tokens % requests) for r in range(requests)]
    kv_lens = [max(n, context * (2 * requests - r) // (2 * requests)) for r, n in enumerate(counts)]
    return kv_lens, counts


def check_workload(point: Point, requests: int | None, device) -> Workload:
    """The point's workload (grid.make_workload), or with `requests`: edge_case_workload on request_layout,
    with -1 padding, a hot block and (not causal: a causal token keeps its own block) tokens that select
    nothing."""
    if requests is None:
        return make_workload(point, device)
    kv_lens, counts = request_layout(point.tokens, point.context, requests)
    empty = 0 if point.causal else max(1, point.tokens // 32)
    return edge_case_workload(point.shape, point.dtype, kv_lens, counts, point.causal, hot=EDGE_HOT, pad=EDGE_PAD,
                              empty=empty, seed=point.seed, device=device)


def check_fits_here(point: Point, requests: int | None, device) -> None:
    """DoesNotFit (one line) when the workload would not fit in the memory free on `device`."""
    if requests is None:
        return check_point_fits(point, device)
    kv_lens, _ = request_layout(point.tokens, point.context, requests)
    pages = sum(-(-kv // point.shape.block) for kv in kv_lens) + 3        # edge_case_workload's spare pages
    check_fits(footprint_bytes(point.shape, point.dtype, point.tokens, pages), device, "this check's workload")


def plan_lines(info: dict, width: int = 80) -> list[str]:
    """A plan's info as one named entry per line (a nested table as "key value, ..."), wrapped to `width`."""
    import textwrap
    lines = []
    for key, value in info.items():
        text = ", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict) else str(value)
        lines += textwrap.wrap(text, width, initial_indent=f"  {key:<16} ", subsequent_indent=" " * 19,
                               break_on_hyphens=False) or [f"  {key}"]
    return lines


def describe(point: Point, requests: int | None) -> str:
    """The workload's generator and sizes, as the check's first line names them."""
    causal = " causal" if point.causal else ""
    if requests is not None:
        return f"context={point.context} {requests} requests (edge cases: padding, hot blocks){causal}"
    if point.generator == "real-prefill":
        return f"real-prefill {point.case_id} context={point.context}"
    if point.generator in SERVING:
        return "/".join(point.key().split("/")[:-3])
    if point.generator == "indexer":
        return f"context={point.context} indexer{causal}"
    share = f" share={point.share:g} group={point.share_group}" if point.share is not None else ""
    return f"context={point.context} reuse={point.reuse:g}{share}{causal}"


def edge_case_workload(shape: AttnShape, dtype: str, kv_lens: list[int], tokens: list[int], causal: bool,
                       hot: float = 0.0, pad: float = 0.0, empty: int = 0, seed: int = 0, device="cpu") -> Workload:
    """A small workload with the cases a schedule can get wrong: several requests on a scattered page
    table, -1 padding (each query keeps fewer than topk blocks with probability `pad`), a hot block
    (block 0 of each request, chosen by a fraction `hot` of the queries), `empty` queries with no
    block at all, and under `causal` the local block last (partially visible). The queries of
    request r sit at its last tokens[r] positions. Python loops: for small shapes only."""
    gen = torch.Generator().manual_seed(seed)
    b, topk = shape.block, shape.topk
    n_blocks = [-(-kv // b) for kv in kv_lens]
    num_pages = sum(n_blocks) + 3                              # a few pages that hold no request's block
    phys = torch.randperm(num_pages, generator=gen).int()
    table = torch.full((len(kv_lens), max(n_blocks)), -1, dtype=torch.int32)
    start = 0
    for r, nb in enumerate(n_blocks):
        table[r, :nb] = phys[start:start + nb]
        start += nb
    q_request = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, n in enumerate(tokens)])
    q_limit = torch.cat([torch.arange(kv - n, kv) if causal else torch.full((n,), kv - 1)
                         for kv, n in zip(kv_lens, tokens)]).int()
    n_total = int(q_request.numel())
    sel = torch.full((shape.hkv, n_total, topk), -1, dtype=torch.int32)
    no_blocks = set(torch.randperm(n_total, generator=gen)[:empty].tolist())
    for i in range(n_total):
        if i in no_blocks:
            continue
        own = int(q_limit[i]) // b
        for h in range(shape.hkv):
            keep = topk
            if torch.rand(1, generator=gen).item() < pad:
                keep = int(torch.randint(1, topk, (1,), generator=gen)) if topk > 1 else 1
            history = torch.randperm(own, generator=gen) if causal else torch.randperm(own + 1, generator=gen)
            if torch.rand(1, generator=gen).item() < hot and own > (0 if causal else -1):
                history = torch.cat([torch.tensor([0]), history[history != 0]])
            pick = history[:keep - 1] if causal else history[:keep]
            if causal:
                pick = torch.cat([pick, torch.tensor([own])])
            sel[h, i, :len(pick)] = pick.int()
    return build_workload(shape, dtype, sel, table, q_request, q_limit, num_pages, causal, seed, device,
                          meta={"generator": "edge-cases", "hot": hot, "pad": pad, "empty": empty})


def run_check(backend: str, point: Point, requests: int | None = None):
    """Build the workload on this machine's device and check the backend on it: (workload, check_backend's
    result)."""
    from ...kernels.base import get_backend
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        get_backend(backend)
    except KeyError as exc:
        raise UserError(str(exc.args[0])) from None
    w = check_workload(point, requests, device)
    return w, check_backend(backend, w, rows=sample_rows(w.n_tokens), stages=True)
