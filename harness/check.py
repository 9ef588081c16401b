"""`msa-bench check`: run one backend on one workload and compare it with the float64 reference.

check_backend() is the reusable part; the sweep compares the output its timed runs left (compare_output)
and discards the timings of an arm that disagrees.
Without a GPU the Triton backends run in Triton's CPU interpreter; importing this module sets
TRITON_INTERPRET=1 first (before triton is imported) when no CUDA device is visible.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ..errors import UserError
from ..scenarios.reference import reference_attention, relative_error
from ..scenarios.workload import AttnShape, Workload, WorkloadError, build_workload

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
    ref_out, ref_lse = reference_attention(workload, idx)
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
    plan's info and, with stages=True for KV-stationary backends, each stage's own check.
    Raises BackendUnavailable when the backend cannot run here.
    """
    from ..kernels.base import get_backend
    try:
        backend = get_backend(backend_name)
    except KeyError as exc:
        raise UserError(str(exc.args[0])) from None
    plan = backend.plan(workload)
    poison(plan)
    plan.run()
    err, tol, details = compare_output(plan, workload, rows, backend_name)
    if stages and {"csr_ptr", "tile_key"} <= set(plan.buffers):
        from ..kernels.kv_outer.stage_checks import stage_checks
        idx = None if rows is None else torch.as_tensor(rows, device=workload.device).long()
        check_rows = torch.arange(workload.n_tokens) if idx is None else idx
        details["stage_checks"] = stage_checks(plan, workload, check_rows.to(workload.device), tol)
    return err, tol, details


# ---- workloads for the command -----------------------------------------------------------------

@dataclass(frozen=True)
class CheckRequest:
    backend: str
    dtype: str
    tokens: int
    context: int
    reuse: float
    causal: bool
    seed: int
    shape: AttnShape


CPU_SHAPE = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)
CPU_TOKENS, CPU_CONTEXT, CPU_REUSE = 40, 256, 0.5
GPU_TOKENS, GPU_CONTEXT, GPU_REUSE = 4096, 32768, 0.25


def default_request(backend: str, dtype: str, tokens, context, reuse, causal, seed, shape=None,
                    on_gpu: bool | None = None) -> CheckRequest:
    """Fill unset sizes: small on CPU (the interpreter is slow), the study shape on a GPU."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    shape = shape or (AttnShape() if on_gpu else CPU_SHAPE)
    tokens = tokens or (GPU_TOKENS if on_gpu else CPU_TOKENS)
    context = context or (GPU_CONTEXT if on_gpu else CPU_CONTEXT)
    if reuse is None:
        reuse = GPU_REUSE if on_gpu else CPU_REUSE
    return CheckRequest(backend, dtype, tokens, context, reuse, causal, seed, shape)


def random_workload(shape: AttnShape, dtype: str, tokens: int, context: int, reuse: float, causal: bool,
                    seed: int, device) -> Workload:
    """Synthetic selection at the requested reuse (harness.selection) when available, else
    edge_case_workload's plain random one (one request)."""
    try:
        from ..scenarios.selection import synthetic_workload
    except ImportError:
        synthetic_workload = None
    if synthetic_workload is not None:
        return synthetic_workload(shape, dtype, tokens, context, reuse, causal=causal, seed=seed, device=device)
    if tokens <= 0 or context <= 0 or (causal and context < tokens):
        raise WorkloadError(f"need 0 < tokens <= context (causal), got tokens={tokens}, context={context}")
    return edge_case_workload(shape, dtype, [context], [tokens], causal, seed=seed, device=device)


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


def run_check(req: CheckRequest):
    """Build the request's workload on this machine's device and check the backend on it."""
    from ..kernels.base import get_backend
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        get_backend(req.backend)
    except KeyError as exc:
        raise UserError(str(exc.args[0])) from None
    w = random_workload(req.shape, req.dtype, req.tokens, req.context, req.reuse, req.causal, req.seed, device)
    return w, check_backend(req.backend, w, rows=sample_rows(w.n_tokens), stages=True)
