"""The token-packed backends on the GPU: the float64 gate on every workload kind, then route timings.

    source scripts/gpu-setup.sh && python3 -m msa_bench.harness.packed_gpu_check --out DIR
    python3 -m msa_bench.harness.packed_gpu_check --dry-run --out DIR     # CPU: build and plan everything

Checks (check_backend, 512 sampled rows against the float64 reference, the gate `msa-bench check`
applies) flashinfer-packed on both routes and both tile sizes, and dense-gather (auto and @flash), in
bf16 and fp8, on: synthetic (non-causal and causal), indexer (causal), the real-prefill case
prefill_c17ccf7fbbb5d1ee5648 (batch 1, N 16384) and two multi-request workloads (real-prefill rule
with unaligned prefixes; random edge-case selections with -1 padding, hot blocks and tokens that
select nothing). `msa-bench check` builds only synthetic workloads, hence this module. dense-gather
must report itself unavailable, in one line, wherever query blocks do not share their blocks.
Then times each route, dense-gather's kernels and the one-request-per-token `flashinfer` on the
real-prefill case through harness.timing (CUDA graphs, cold L2), bf16 and fp8.

Writes DIR/packed_gpu_check.json and DIR/packed_gpu_check.log; exit status 1 if a check fails.
--dry-run needs no GPU: it builds every workload on the CPU (the same selections) and runs the
planners, printing what each backend would execute (tile size, mask modes, union ratio, SDPA runs).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import torch

from ..errors import BackendUnavailable
from ..kernels.base import get_backend
from ..kernels.dense_gather import dense_plan
from ..kernels.flashinfer_packed import packed_plan
from ..scenarios.indexer import indexer_workload
from ..scenarios.prefill_cases import PrefillCase, get_case, prefill_workload
from ..scenarios.selection import synthetic_workload
from ..scenarios.stats import useful_flops
from ..scenarios.workload import AttnShape
from .check import check_backend, edge_case_workload, sample_rows
from .tee_log import TeeLog
from .timing import TimingConfig, summarize, time_plan

SHAPE = AttnShape()
TIMED_CASE = "prefill_c17ccf7fbbb5d1ee5648"
PACKED = ["flashinfer-packed", "flashinfer-packed@bsr", "flashinfer-packed@p16", "flashinfer-packed@bsr+p16"]
DENSE = ["dense-gather", "dense-gather@flash"]
TIMED = ["flashinfer-packed@paged+p8", "flashinfer-packed@paged+p16", "flashinfer-packed@bsr+p8",
         "flashinfer-packed@bsr+p16", "dense-gather@cudnn", "dense-gather@flash", "flashinfer"]
MULTI_PREFILL = PrefillCase("multi-request-4", query_lens=(3000, 1537, 2048, 700), prefix_lens=(5000, 0, 12345, 130))
TIMING = TimingConfig(warmup=3, reps=20, max_reps=40)


class Budget:
    """Wall-clock budget: work past it is skipped with a log line (the JSON is still written)."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def cases(device, with_tensors: bool):
    """(label, shares query blocks, dtype -> workload). Selections are drawn on the CPU either way."""
    def real(case):
        return lambda d: prefill_workload(case, SHAPE, d, 0, device, with_tensors)
    return [
        ("synthetic N4096 T32768 reuse0.25", False,
         lambda d: synthetic_workload(SHAPE, d, 4096, 32768, 0.25, causal=False, seed=0, device=device,
                                      with_tensors=with_tensors)),
        ("synthetic causal N4096 T32768 reuse0.25", False,
         lambda d: synthetic_workload(SHAPE, d, 4096, 32768, 0.25, causal=True, seed=1, device=device,
                                      with_tensors=with_tensors)),
        ("indexer causal N4096 T32768", False, lambda d: indexer_workload(SHAPE, d, 4096, 32768, True, 2, device)),
        (f"real-prefill {TIMED_CASE} (batch 1)", True, real(get_case(TIMED_CASE))),
        ("real-prefill rule, 4 requests, unaligned prefixes", True, real(MULTI_PREFILL)),
        ("edge cases, 3 requests, padding, hot, empty", False,
         lambda d: edge_case_workload(SHAPE, d, [9000, 4100, 20000], [700, 300, 500], True, hot=0.2, pad=0.3,
                                      empty=4, seed=5, device=device)),
    ]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _brief(info: dict) -> str:
    keys = ("route", "tile_size", "mask_modes", "union_ratio", "sdpa_kernel", "runs", "sdpa_calls")
    return ", ".join(f"{k} {info[k]}" for k in keys if k in info)


def run_checks(log, dtypes, record, budget: Budget) -> int:
    failures = 0
    for label, shares, make in cases("cuda", True):
        for dtype in dtypes:
            if budget.left() < 60:
                log(f"SKIP  {label} {dtype}: out of time budget")
                record.append({"case": label, "dtype": dtype, "status": "skipped (time budget)"})
                failures += 1
                continue
            t0 = time.perf_counter()
            try:
                w = make(dtype)
            except Exception as exc:  # a workload that cannot be built fails every backend on it
                log(f"FAIL  build {label} {dtype}: {_first_line(exc)}")
                record.append({"case": label, "dtype": dtype, "status": "error", "error": _first_line(exc)})
                failures += 1
                continue
            log(f"case  {label} {dtype}: N {w.n_tokens}, built in {time.perf_counter() - t0:.1f} s")
            for name in PACKED + DENSE:
                row = {"case": label, "dtype": dtype, "backend": name}
                try:
                    err, tol, det = check_backend(name, w, rows=sample_rows(w.n_tokens))
                    ok = err <= tol
                    row.update(status="pass" if ok else "fail", rel_err=err, tol=tol, info=det["info"],
                               plan_seconds=det["plan_seconds"])
                    failures += not ok
                    log(f"{'PASS' if ok else 'FAIL'}  {name:<28} {dtype}  rel err {err:.2e} (tol {tol:g})  {_brief(det['info'])}")
                except BackendUnavailable as exc:
                    expected = name.startswith("dense-gather") and not shares
                    row.update(status="unavailable (expected)" if expected else "unavailable", reason=str(exc))
                    failures += not expected
                    log(f"{'ok  ' if expected else 'FAIL'}  {name:<28} {dtype}  unavailable: {exc}")
                except Exception as exc:
                    row.update(status="error", error=_first_line(exc), traceback=traceback.format_exc()[-3000:])
                    failures += 1
                    log(f"FAIL  {name:<28} {dtype}  error: {_first_line(exc)}")
                record.append(row)
                torch.cuda.empty_cache()
            del w
            torch.cuda.empty_cache()
    return failures


def run_timings(log, dtypes, record, budget: Budget):
    for dtype in dtypes:
        if budget.left() < 20:
            log(f"SKIP  timings {dtype}: out of time budget")
            continue
        w = prefill_workload(get_case(TIMED_CASE), SHAPE, dtype, 0, "cuda")
        flops = useful_flops(w)
        log(f"time  {TIMED_CASE} {dtype}: N {w.n_tokens}, useful {flops / 1e9:.1f} GFLOP")
        for name in TIMED:
            row = {"case": TIMED_CASE, "dtype": dtype, "backend": name, "useful_flops": flops}
            if budget.left() < 10:
                log(f"SKIP  {name} {dtype}: out of time budget")
                continue
            try:
                plan = get_backend(name).plan(w)
                samples = time_plan(plan, TIMING, w.device)
                stats = {st: summarize(s.seconds) | {"converged": s.converged} for st, s in samples.items()}
                module = stats["module"]["median_s"]
                row.update(status="ok", stages=stats, module_median_s=module, tflops=flops / module / 1e12,
                           info=plan.info)
                parts = "  ".join(f"{st} {v['median_s'] * 1e3:.3f} ms" for st, v in stats.items()
                                  if st not in ("plan", "module"))
                log(f"      {name:<28} {dtype}  {parts}  module {module * 1e3:.3f} ms  "
                    f"{flops / module / 1e12:.0f} TFLOP/s  ({_brief(plan.info)})")
                del plan
            except BackendUnavailable as exc:
                row.update(status="unavailable", reason=str(exc))
                log(f"      {name:<28} {dtype}  unavailable: {exc}")
            except Exception as exc:
                row.update(status="error", error=_first_line(exc), traceback=traceback.format_exc()[-3000:])
                log(f"      {name:<28} {dtype}  error: {_first_line(exc)}")
            record.append(row)
            torch.cuda.empty_cache()
        del w
        torch.cuda.empty_cache()


def dry_run(log, dtypes, record):
    """Every workload built on the CPU and planned: what each backend would execute, no kernels."""
    for label, shares, make in cases("cpu", False):
        w = make(dtypes[0])
        row = {"case": label, "tokens": w.n_tokens}
        for route in ("paged", "bsr"):
            for tile in (None, 16):
                pp = packed_plan(w, route, tile)
                key = f"{route}@p{tile or 'auto'}"
                row[key] = {"tile": pp.tile, "modes": [h.mask_mode for h in pp.heads], "union_ratio": pp.union_ratio,
                            "requests_per_head": pp.heads[0].num_requests,
                            "mask_bytes": sum(0 if h.packed_mask is None else h.packed_mask.numel() for h in pp.heads)}
                log(f"plan  {label}  {key}: tile {pp.tile}, masks {row[key]['modes']}, union {pp.union_ratio:.3f}, "
                    f"mask {row[key]['mask_bytes'] / 2**20:.1f} MiB")
        try:
            dp = dense_plan(w)
            row["dense"] = {"runs": len(dp.runs), "query_blocks": dp.groups, "full": dp.full_groups}
            log(f"plan  {label}  dense-gather: {dp.groups} query blocks ({dp.full_groups} full), {len(dp.runs)} runs")
        except BackendUnavailable as exc:
            row["dense"] = str(exc)
            log(f"plan  {label}  dense-gather unavailable{' (UNEXPECTED)' if shares else ''}: {exc}")
        record.append(row)


def environment() -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    try:
        import flashinfer
        env["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
    except Exception as exc:
        env["flashinfer"] = f"not importable: {_first_line(exc)}"
    env["commit"] = os.environ.get("MSA_BENCH_GIT_COMMIT")
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results/packed-gpu-check"), help="output folder")
    ap.add_argument("--dry-run", action="store_true", help="CPU only: build and plan every workload, no kernels")
    ap.add_argument("--dtypes", default="bf16,fp8", help="comma-separated: bf16, fp8")
    ap.add_argument("--skip-timing", action="store_true", help="checks only")
    ap.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget in seconds; later work is skipped")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = TeeLog(out / "packed_gpu_check.log")
    dtypes = args.dtypes.split(",")
    result = {"environment": environment(), "checks": [], "timings": [], "plans": []}
    log(f"environment: {result['environment']}")
    failures = 0
    start = time.perf_counter()
    try:
        if args.dry_run:
            dry_run(log, dtypes, result["plans"])
        else:
            if not torch.cuda.is_available():
                log("error: no CUDA GPU (use --dry-run on a CPU)")
                return 2
            budget = Budget(args.budget_s)
            failures = run_checks(log, dtypes, result["checks"], budget)
            log(f"checks: {failures} failed of {len(result['checks'])} ({time.perf_counter() - start:.0f} s)")
            if not args.skip_timing:
                run_timings(log, dtypes, result["timings"], budget)
    finally:
        result["seconds"] = time.perf_counter() - start
        (out / "packed_gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
        log(f"wrote {out / 'packed_gpu_check.json'} ({result['seconds']:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
