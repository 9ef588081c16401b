"""FlashInfer Q-outer on the GPU: check every variant against the float64 oracle, then time it.

    source scripts/gpu-setup.sh && python3 benchmarks/flashinfer_gpu.py [--out DIR] [--quick]
    python3 benchmarks/flashinfer_gpu.py --dry-run [--quick]      # CPU: build and validate every workload

Writes DIR/flashinfer_gpu.json (environment, checks, timings) and DIR/flashinfer_gpu.log; DIR is
--out, else $OUT, else results/flashinfer-gpu. Each variant/dtype/shape that fails is logged and
skipped; the summary table comes last. Budget on the H200: under 6 minutes including JIT builds
(first run on a fresh host: FA2 about 70 s, FA3 about 165 s, built in parallel first; with the JIT cache
restored by scripts/gpu-setup.sh from .fi-cache/ they load in seconds).

--dry-run needs neither a GPU nor FlashInfer: it builds every check and timing workload on the CPU
(selections are drawn on the CPU in both modes, so they are the ones the GPU run uses), validates
the selection contract, folds each for both FlashInfer layouts, and writes DIR/flashinfer_gpu_dry_run.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from msa_bench.harness.tee_log import TeeLog as Log

from msa_bench.scenarios.reference import reference_attention, relative_error
from msa_bench.harness.timing import TimingConfig, summarize, time_plan
from msa_bench.scenarios.workload import AttnShape, Workload, build_workload
from msa_bench.kernels.flashinfer_q_outer import VARIANTS, FlashInferQOuter, import_flashinfer

SHAPE = AttnShape()                        # Hq 64, Hkv 4, D 128, block 128, top-16
TOL = {"bf16": 1e-2, "fp8": 5e-2}
# Earlier measurements on this H200 (shared/measured/h200.json, 2026-11-29), bf16, same fold and
# workload: for comparison only, never used as results.
KNOWN_TFLOPS = {("prefill-fa2", "bf16", 2048): 112, ("prefill-fa2", "bf16", 16384): 83,
                ("decode-tc", "bf16", 2048): 93, ("decode-tc", "bf16", 16384): 83}
TIMED = [(2048, 256), (16384, 1024)]     # (tokens N, blocks per KV head in the pool)




# ---- workloads ---------------------------------------------------------------------------------

def pool_workload(n: int, kv_len: int, dtype: str, seed: int, device) -> Workload:
    """One request of kv_len keys, non-causal; each (KV head, query) keeps min(topk, blocks) distinct
    uniformly random blocks of the whole pool (-1 padded when the pool is smaller than topk).
    The selection is drawn on the CPU whatever the device, so a CPU dry run builds the same one."""
    nb = math.ceil(kv_len / SHAPE.block)
    gen = torch.Generator().manual_seed(seed)
    k = min(SHAPE.topk, nb)
    sel = torch.full((SHAPE.hkv, n, SHAPE.topk), -1, dtype=torch.int32)
    picks = torch.rand((SHAPE.hkv, n, nb), generator=gen).topk(k, dim=-1).indices
    sel[..., :k] = picks.to(torch.int32)
    page_table = torch.randperm(nb, generator=torch.Generator().manual_seed(seed + 1)).view(1, nb).to(torch.int32)
    return build_workload(SHAPE, dtype, sel, page_table, torch.zeros(n, dtype=torch.int32),
                          torch.full((n,), kv_len - 1, dtype=torch.int32), nb, causal=False, seed=seed,
                          device=device, meta={"kind": "pool", "kv_len": kv_len})


def causal_selection(q_limit: torch.Tensor, nb: int, gen: torch.Generator) -> torch.Tensor:
    """[Hkv, n, topk] int32: per (KV head, query) up to topk-1 distinct random blocks before the query's local
    block, then the local block (the last valid entry), then -1 padding up to topk (there are fewer than
    topk-1 earlier blocks near the start of the context)."""
    n, topk = q_limit.numel(), SHAPE.topk
    local = (q_limit // SHAPE.block).long()
    score = torch.rand((SHAPE.hkv, n, nb), generator=gen)
    later = torch.arange(nb).view(1, 1, -1) >= local.view(1, -1, 1)
    score = score.masked_fill(later, 2.0)                                   # only earlier blocks
    hist = score.argsort(-1)[..., :topk - 1]                                # min(topk - 1, nb) columns
    hist_ok = hist < local.view(1, -1, 1)                                   # a prefix, by the sort
    sel = torch.full((SHAPE.hkv, n, topk), -1, dtype=torch.long)
    sel[..., :hist.shape[-1]] = torch.where(hist_ok, hist, torch.full_like(hist, -1))
    count = hist_ok.sum(-1, keepdim=True)                                   # <= topk - 1: the local slot exists
    sel.scatter_(-1, count, local.view(1, -1, 1).expand(SHAPE.hkv, n, 1))
    return sel.to(torch.int32)


def causal_workload(n: int, context: int, dtype: str, seed: int, device) -> Workload:
    """A causal chunk: queries at positions context-n .. context-1; each keeps its local block (last,
    partially visible) plus up to topk-1 distinct random earlier blocks (-1 padded when fewer exist)."""
    if not 0 < n <= context:
        raise ValueError(f"causal chunk of {n} queries does not fit a context of {context}")
    nb = math.ceil(context / SHAPE.block)
    gen = torch.Generator().manual_seed(seed)
    q_limit = torch.arange(context - n, context, dtype=torch.int32)
    sel = causal_selection(q_limit, nb, gen)
    page_table = torch.randperm(nb, generator=gen).view(1, nb).to(torch.int32)
    return build_workload(SHAPE, dtype, sel, page_table, torch.zeros(n, dtype=torch.int32),
                          q_limit, nb, causal=True, seed=seed, device=device,
                          meta={"kind": "causal", "context": context})


def check_shapes(device) -> list[tuple[str, "Callable[[str], Workload]"]]:
    """(label, dtype -> workload) for the correctness checks."""
    return [("pool N512 64blk", lambda d: pool_workload(512, 64 * 128, d, 1, device)),
            ("causal N700 ctx3000", lambda d: causal_workload(700, 3000, d, 2, device)),
            ("causal N700 ctx1000 (pad)", lambda d: causal_workload(700, 1000, d, 4, device)),
            ("pool N300 kv1317 (11blk, pad)", lambda d: pool_workload(300, 10 * 128 + 37, d, 3, device))]


def timed_shapes(device, quick: bool) -> list[tuple[int, int, "Callable[[str], Workload]"]]:
    """(tokens N, blocks per KV head, dtype -> workload) for the timings."""
    return [(n, nb, (lambda d, n=n, nb=nb: pool_workload(n, nb * SHAPE.block, d, 11, device)))
            for n, nb in (TIMED[:1] if quick else TIMED)]


def validate_workload(w) -> dict:
    """The selection contract and FlashInfer's fold for one workload, on whatever device it lives (CPU in a dry
    run): valid entries first and distinct, -1 padding after, causal: local block the last valid entry; both folds
    build, every (token, KV head) request sees a key. Raises ValueError with a one-line reason."""
    from msa_bench.kernels.flashinfer_q_outer import fold_requests
    sel = w.selection.long().cpu()
    hkv, n, topk = sel.shape
    if (hkv, topk) != (SHAPE.hkv, SHAPE.topk):
        raise ValueError(f"selection shape {tuple(sel.shape)}")
    valid = sel >= 0
    if bool((valid[..., 1:] & ~valid[..., :-1]).any()):
        raise ValueError("a -1 pad precedes a valid entry")
    if bool((sel < -1).any()) or int(sel.max()) >= w.page_table.shape[1]:
        raise ValueError("selection entry out of range")
    srt = torch.where(valid, sel, -2 - torch.arange(topk).view(1, 1, -1)).sort(-1).values    # pads all distinct
    if bool((srt[..., 1:] == srt[..., :-1]).any()):
        raise ValueError("a block is selected twice by one (KV head, query)")
    count = valid.sum(-1)
    if bool((count == 0).any()):
        raise ValueError("a (KV head, query) selects nothing")
    if w.causal:
        last = sel.gather(-1, (count - 1).unsqueeze(-1)).squeeze(-1)
        local = (w.q_limit.long().cpu() // SHAPE.block).view(1, -1).expand(hkv, n)
        if not torch.equal(last, local):
            raise ValueError("causal: the local block is not the last valid entry")
        if bool((torch.where(valid, sel, torch.zeros_like(sel)) > local.unsqueeze(-1)).any()):
            raise ValueError("causal: a block after the local one is selected")
    folds = {}
    for fold in ("heads", "rows"):
        f = fold_requests(w.pages.cpu(), w.q_limit.cpu(), w.page_block.cpu(), SHAPE.block, SHAPE.group, fold)
        empty = int((f.kv_indptr[1:] == f.kv_indptr[:-1]).sum())
        if empty:
            raise ValueError(f"fold {fold}: {empty} requests see no key")
        folds[fold] = {"requests": f.num_requests, "pages": int(f.kv_indices.numel()),
                       "dropped_blocks": f.dropped_blocks, "kv_tokens": int(f.kv_lens(SHAPE.block).sum())}
    return {"tokens": n, "num_pages": w.num_pages, "valid_per_row_min": int(count.min()),
            "valid_per_row_max": int(count.max()), "padded_rows": int((count < topk).sum()), "folds": folds,
            "useful_flops": useful_flops(w)}


def useful_flops(w) -> float:
    """4 x G x D x visible selected keys, summed over (KV head, query): QK^T and PV, 2 flops per MAC."""
    pages = w.pages.long()
    start = w.page_block.long()[pages.clamp(min=0)] * SHAPE.block
    vis = (w.q_limit.long().view(1, -1, 1) - start + 1).clamp(0, SHAPE.block)
    vis = torch.where(pages >= 0, vis, torch.zeros_like(vis))
    return 4.0 * SHAPE.group * SHAPE.head_dim * float(vis.sum())


# ---- steps -----------------------------------------------------------------------------------------

def prebuild(variants, dtypes, log):
    """Build the FlashInfer JIT modules the variants need, in parallel (each build is an nvcc subprocess)."""
    from flashinfer.prefill import get_batch_prefill_module
    jobs = set()
    for variant in variants:
        for dtype in dtypes:
            backend = "fa3" if variant == "prefill-fa3" else "fa2"
            if backend == "fa3" and dtype == "fp8":
                q = kv = torch.float8_e4m3fn
            else:
                q, kv = torch.bfloat16, (torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16)
            jobs.add((backend, q, kv))

    def build(job):
        backend, q, kv = job
        t = time.perf_counter()
        get_batch_prefill_module(backend, q, kv, torch.bfloat16, torch.int32, SHAPE.head_dim, SHAPE.head_dim,
                                 0, False, False, False)
        return job, time.perf_counter() - t

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(build, j) for j in sorted(jobs, key=str)]
        for fut in futures:
            try:
                (backend, q, kv), sec = fut.result()
                log(f"built {backend} q={q} kv={kv} in {sec:.0f} s")
            except Exception as exc:
                log(f"prebuild failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                    "the plan will build it")


def check(variant, w, label, log, rows=48) -> dict:
    rec = {"variant": variant, "dtype": w.dtype, "shape": label, "tol": TOL[w.dtype]}
    try:
        plan = FlashInferQOuter(variant, name=f"flashinfer:{variant}").plan(w)
        torch.cuda.synchronize()
        out = plan.run()
        torch.cuda.synchronize()
        idx = torch.randperm(w.n_tokens, generator=torch.Generator().manual_seed(7))[:rows].sort().values
        ref, _ = reference_attention(w, idx.to(w.device))
        err = relative_error(out[idx.to(w.device)], ref)
        rec.update(rel_error=err, ok=err <= TOL[w.dtype], info=plan.info)
        log(f"check {variant:12s} {w.dtype:5s} {label:28s} rel.err {err:.2e} {'ok' if rec['ok'] else 'FAIL'}")
    except Exception as exc:
        rec.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        log(f"check {variant:12s} {w.dtype:5s} {label:28s} ERROR {type(exc).__name__}: {str(exc)[:300]}")
    return rec


def timed(variant, w, n, nb, log, reps) -> dict:
    rec = {"variant": variant, "dtype": w.dtype, "tokens": n, "blocks_per_head": nb}
    try:
        plan = FlashInferQOuter(variant, name=f"flashinfer:{variant}").plan(w)
        samples = time_plan(plan, TimingConfig(warmup=5, reps=reps, max_reps=4 * reps), w.device)
        stage = summarize(samples["attention"].seconds)
        module = summarize(samples["module"].seconds)
        flops = useful_flops(w)
        idx = torch.arange(0, w.n_tokens, max(1, w.n_tokens // 32), device=w.device)
        ref, _ = reference_attention(w, idx)
        err = relative_error(plan.output[idx], ref)
        known = KNOWN_TFLOPS.get((variant, w.dtype, n))
        rec.update(attention=stage, module=module, plan_seconds=plan.plan_seconds, useful_flops=flops,
                   tflops=flops / stage["median_s"] / 1e12, rel_error=err, ok=err <= TOL[w.dtype],
                   converged=samples["attention"].converged, known_tflops=known, info=plan.info)
        log(f"time  {variant:12s} {w.dtype:5s} N {n:6d} pool {nb:5d}: {stage['median_s'] * 1e3:8.3f} ms "
            f"(cv {stage['cv']:.3f}, n {int(stage['n_reps'])}) {rec['tflops']:7.1f} TFLOP/s"
            + (f" (earlier: {known})" if known else "") + f", rel.err {err:.1e}, plan {plan.plan_seconds:.2f} s")
        del plan
    except Exception as exc:
        rec.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        log(f"time  {variant:12s} {w.dtype:5s} N {n:6d} pool {nb:5d}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
    torch.cuda.empty_cache()
    return rec


def build_or_log(make, dtype, label, log, records, variants, **extra):
    """make(dtype), or None after logging the failure and adding one failed record per variant."""
    try:
        return make(dtype)
    except Exception as exc:
        log(f"workload {label} {dtype}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
        for variant in variants:
            records.append({"variant": variant, "dtype": dtype, "shape": label, **extra, "ok": False,
                            "error": f"workload: {type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        return None


def dry_run(out: Path, dtypes, quick: bool) -> int:
    """Build every check and timing workload on the CPU and validate it (no GPU, no FlashInfer)."""
    log = Log(out / "flashinfer_gpu_dry_run.log")
    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    items = [(label, make) for label, make in check_shapes(cpu)]
    items += [(f"timed N{n} pool{nb}", make) for n, nb, make in timed_shapes(cpu, quick)]
    records = []
    for label, make in items:
        for dtype in dtypes:
            t = time.perf_counter()
            rec = {"shape": label, "dtype": dtype}
            try:
                w = make(dtype)
                rec.update(validate_workload(w), ok=True)
                rows = torch.arange(0, w.n_tokens, max(1, w.n_tokens // 4))[:4]
                ref, _ = reference_attention(w, rows)
                rec["reference_finite"] = bool(torch.isfinite(ref).all())
                rec["ok"] = rec["reference_finite"]
                del w
                log(f"workload {label:30s} {dtype:5s} ok: {rec['tokens']} tokens, {rec['num_pages']} pages, "
                    f"{rec['valid_per_row_min']}-{rec['valid_per_row_max']} valid blocks per row "
                    f"({rec['padded_rows']} rows padded), {rec['folds']['heads']['pages']} folded pages, "
                    f"{time.perf_counter() - t:.1f} s")
            except Exception as exc:
                rec.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
                log(f"workload {label:30s} {dtype:5s} ERROR {type(exc).__name__}: {str(exc)[:300]}")
            records.append(rec)
    (out / "flashinfer_gpu_dry_run.json").write_text(json.dumps({"workloads": records}, indent=2) + "\n")
    fails = [r for r in records if not r["ok"]]
    log(f"dry run: {len(records) - len(fails)}/{len(records)} workloads ok in {time.perf_counter() - t0:.0f} s")
    return 0 if not fails else 1


def environment(fi) -> dict:
    props = torch.cuda.get_device_properties(0)
    env = {"gpu": props.name, "sms": props.multi_processor_count, "l2_bytes": props.L2_cache_size,
           "torch": torch.__version__, "cuda": torch.version.cuda, "flashinfer": getattr(fi, "__version__", "?"),
           "FLASHINFER_CUDA_ARCH_LIST": os.environ.get("FLASHINFER_CUDA_ARCH_LIST"),
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import pynvml
        pynvml.nvmlInit()
        env["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        pass
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/flashinfer-gpu")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--quick", action="store_true", help="only the N 2048 timing point")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU only, no FlashInfer: build and validate every workload, then stop")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        dtypes = [d for d in args.dtypes.split(",") if d]
        if any(d not in TOL for d in dtypes):
            print(f"error: unknown dtype in {args.dtypes!r}; use {', '.join(TOL)}", file=sys.stderr)
            return 2
        return dry_run(out, dtypes, args.quick)
    log = Log(out / "flashinfer_gpu.log")
    if not torch.cuda.is_available():
        log("error: this script needs a CUDA GPU")
        return 2
    variants = [v for v in args.variants.split(",") if v]
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [v for v in variants if v not in VARIANTS] + [d for d in dtypes if d not in TOL]
    if bad:
        log(f"error: unknown variant or dtype {', '.join(bad)}")
        return 2
    t0 = time.perf_counter()
    fi = import_flashinfer()
    env = environment(fi)
    log(f"environment: {json.dumps(env)}")
    result = {"environment": env, "checks": [], "timings": []}

    def save():
        result["elapsed_s"] = time.perf_counter() - t0
        (out / "flashinfer_gpu.json").write_text(json.dumps(result, indent=2, default=str) + "\n")

    prebuild(variants, dtypes, log)
    save()
    dev = torch.device("cuda")
    for label, make in check_shapes(dev):
        for dtype in dtypes:
            w = build_or_log(make, dtype, label, log, result["checks"], variants)
            if w is None:
                save()
                continue
            for variant in variants:
                result["checks"].append(check(variant, w, label, log))
            save()
            del w
    for n, nb, make in timed_shapes(dev, args.quick):
        for dtype in dtypes:
            w = build_or_log(make, dtype, f"timed N{n} pool{nb}", log, result["timings"], variants,
                             tokens=n, blocks_per_head=nb)
            if w is None:
                save()
                continue
            for variant in variants:
                result["timings"].append(timed(variant, w, n, nb, log, args.reps))
                save()
            del w
            torch.cuda.empty_cache()
    save()
    log("")
    log("summary (attention stage, CUDA-graph replay, L2 flushed, median)")
    log(f"{'variant':12s} {'dtype':5s} {'N':>6s} {'pool':>5s} {'ms':>9s} {'TFLOP/s':>8s} {'earlier':>8s} {'rel.err':>8s}")
    for r in result["timings"]:
        if "attention" in r:
            log(f"{r['variant']:12s} {r['dtype']:5s} {r['tokens']:6d} {r['blocks_per_head']:5d} "
                f"{r['attention']['median_s'] * 1e3:9.3f} {r['tflops']:8.1f} {str(r['known_tflops'] or '-'):>8s} "
                f"{r['rel_error']:8.1e}{'' if r['ok'] else '  FAIL'}")
        else:
            log(f"{r['variant']:12s} {r['dtype']:5s} {r['tokens']:6d} {r['blocks_per_head']:5d} failed: {r['error'][:120]}")
    fails = [c for c in result["checks"] if not c.get("ok")]
    log(f"checks: {len(result['checks']) - len(fails)}/{len(result['checks'])} passed"
        + ("; failed: " + ", ".join(f"{c['variant']}/{c['dtype']}/{c['shape']}" for c in fails) if fails else ""))
    log(f"wrote {out / 'flashinfer_gpu.json'} in {time.perf_counter() - t0:.0f} s")
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
