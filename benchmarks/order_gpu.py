"""Tile order on the GPU: check the scheduler's grouped orders, then time the attention stage over them.

    source scripts/gpu-setup.sh && python3 benchmarks/order_gpu.py [--out DIR] [--dtypes bf16,fp8]
        [--impls v9,triton] [--orders 1:0,1:8,2:8,4:8,8:8] [--check-orders 3:5,4:8] [--reps 20]

An order S:k is the kv-outer config (q_ranges S, order_chunk k): tiles grouped by (KV head, one of S
query ranges) and, for persistent CTAs, dealt round-robin in chunks of k tiles (scheduler.py); 1:0 is
key order, the default. S:p deals the groups in phases instead (order_phases: part c of every group
to CTA c, key runs kept whole). Implementations: vN = kv-outer-cute generation N (persistent), `triton` =
the kv-outer Triton stage with its tuned configuration for the dtype (bf16: 64-tile chunks, one
program each, so k does not apply; fp8: persistent).

Checks (benchmarks/cute_gpu.py's check shapes, bf16 and fp8, each --check-orders order and
implementation): the stage checks of index_map, schedule (every tile at one position, run ends,
CTA ranges) and the partials read through the position-addressed combine index against the float64
reference, the module output against the reference, and for CuTe a CUDA-graph replay. Timing: the
perf point of cute_gpu.py (N 16384, 1024 blocks per KV head, uniform top-16), harness protocol
(CUDA graphs, L2 flushed), median attention, schedule and module times, with the K/V block loads the
order costs (runs of one key inside a CTA's range). Writes DIR/order_gpu.json and DIR/order_gpu.log.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cute_gpu import (TARGET_TFLOPS, TOL, gpu_environment, graph_replay_check, perf_workload,  # noqa: E402
                      stage_summaries, useful_flops, workloads)

from msa_bench.harness.tee_log import TeeLog as Log  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def parse_orders(text: str) -> list[tuple[int, int | str]]:
    """"S:k" -> (S, k); "S:p" -> (S, "p"), the phased deal."""
    out = []
    for item in filter(None, text.split(",")):
        s, _, k = item.partition(":")
        out.append((int(s), "p" if k == "p" else int(k or 0)))
    return out


def backend_for(impl: str, dtype: str, order: tuple[int, int]):
    from msa_bench.kernels.kv_outer.config import default_config, tile_order
    kw = tile_order(order_label(order))
    if impl == "triton":
        from msa_bench.kernels.kv_outer.backend import KVOuterBackend
        return KVOuterBackend(config=default_config(dtype).with_(**kw))
    from msa_bench.kernels.cute.backend import DEFAULT_CTAS_PER_SM, KVOuterCuteBackend, cute_kv_config
    cfg = cute_kv_config(dtype, DEFAULT_CTAS_PER_SM[impl]).with_(**kw)
    return KVOuterCuteBackend(config=cfg, variant=impl)


def order_label(order) -> str:
    return f"{order[0]}:{order[1]}"


def kv_loads(plan) -> int:
    """K/V block loads of one launch: runs of equal keys inside each CTA's range (chunked Triton
    launches: inside each chunk)."""
    b, cfg = plan.buffers, plan.info["config"]
    key = b["tile_key"].long()
    total = int(b["tile_ptr"][-1])
    start = torch.zeros(key.numel(), dtype=torch.bool, device=key.device)
    start[0] = True
    start[1:] = key[1:] != key[:-1]
    if cfg["attn_chunk"] and not cfg["attn_chunk_grid"]:
        start[:: cfg["attn_chunk"]] = True
    else:
        start[b["cta_range"][:, 0].long().clamp(max=key.numel() - 1)] = True
    return int(start[:total].sum())


def check(dtype, impl, order, label, make, log) -> dict:
    from msa_bench.scenarios.reference import reference_attention, relative_error
    from msa_bench.kernels.kv_outer.stage_checks import stage_checks
    rec = {"dtype": dtype, "impl": impl, "order": order_label(order), "case": label, "tol": TOL[dtype]}
    try:
        w = make()
        plan = backend_for(impl, dtype, order).plan(w)
        for k in ("o_part", "m_part", "l_part"):
            plan.buffers[k].fill_(float("nan"))
        plan.run()
        torch.cuda.synchronize()
        idx = torch.randperm(w.n_tokens, generator=torch.Generator().manual_seed(7))[:48].sort().values.to(w.device)
        stages = stage_checks(plan, w, idx, TOL[dtype])
        ref, _ = reference_attention(w, idx)
        err = relative_error(plan.output[idx], ref)
        rec["stages"] = {k: {"ok": ok, "message": msg} for k, (ok, msg) in stages.items()}
        rec["output_rel_error"] = err
        ok = all(ok for ok, _ in stages.values()) and math.isfinite(err) and err <= TOL[dtype]
        graph = ""
        if impl != "triton":
            g = rec["graph_replay"] = graph_replay_check(plan)
            ok = ok and g["identical"]
            graph = f"; graph {'same' if g['identical'] else 'DIFFERS'}"
        rec["ok"] = bool(ok)
        bad = [f"{k}: {m}" for k, (o, m) in stages.items() if not o]
        log(f"check {dtype:4s} {impl:6s} {order_label(order):5s} {label:30s} out {err:.2e}{graph} "
            f"-> {'ok' if ok else 'FAIL ' + '; '.join(bad)}")
        del plan, w
    except Exception as exc:
        rec.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        log(f"check {dtype:4s} {impl:6s} {order_label(order):5s} {label:30s} ERROR {type(exc).__name__}: {str(exc)[:300]}")
    torch.cuda.empty_cache()
    return rec


def time_one(w, flops, dtype, impl, order, reps, log) -> dict:
    rec = {"dtype": dtype, "impl": impl, "order": order_label(order)}
    try:
        plan = backend_for(impl, dtype, order).plan(w)
        plan.run()
        torch.cuda.synchronize()
        rec["kv_loads"] = kv_loads(plan)
        rec["tiles"] = int(plan.buffers["tile_ptr"][-1])
        med = stage_summaries(plan, reps, w.device)
        rec["stages_s"] = {k: v["median_s"] for k, v in med.items()}
        rec["attention_cv"] = med["attention"]["cv"]
        rec["tflops"] = flops / med["attention"]["median_s"] / 1e12
        rec["module_tflops"] = flops / med["module"]["median_s"] / 1e12
        log(f"time  {dtype:4s} {impl:6s} {order_label(order):5s} attention {med['attention']['median_s'] * 1e3:7.3f} ms "
            f"({rec['tflops']:5.1f} TFLOP/s, cv {med['attention']['cv']:.3f}); schedule "
            f"{med['schedule']['median_s'] * 1e6:6.1f} us; module {med['module']['median_s'] * 1e3:7.3f} ms "
            f"({rec['module_tflops']:5.1f}); K/V loads {rec['kv_loads']} for {rec['tiles']} tiles")
        del plan
    except Exception as exc:
        rec.update(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        log(f"time  {dtype:4s} {impl:6s} {order_label(order):5s} ERROR {type(exc).__name__}: {str(exc)[:300]}")
    torch.cuda.empty_cache()
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/order-gpu")
    ap.add_argument("--build-dir", default=os.environ.get("MSA_BENCH_CUTE_DIR") or str(REPO / "build" / "cute"))
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--impls", default="v9,triton")
    ap.add_argument("--orders", default="1:0,1:8,2:8,4:8,8:8,16:8,4:32,4:0")
    ap.add_argument("--check-orders", default="3:5,4:8")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "order_gpu.log")
    try:
        orders, check_orders = parse_orders(args.orders), parse_orders(args.check_orders)
    except ValueError:
        log(f"error: orders are S:k pairs of integers (or S:p), got {args.orders!r} / {args.check_orders!r}")
        return 2
    env = gpu_environment(args.build_dir, log)
    if env is None:
        return 2
    dtypes = [d for d in args.dtypes.split(",") if d]
    impls = [i for i in args.impls.split(",") if i]
    result = {"environment": env, "checks": [], "timing": [], "targets": TARGET_TFLOPS}
    t0 = time.perf_counter()
    for dtype in dtypes:
        for label, make in workloads(dtype, "cuda", quick=True):
            for impl in impls:
                for order in check_orders:
                    result["checks"].append(check(dtype, impl, order, label, make, log))
        (out / "order_gpu.json").write_text(json.dumps(result, indent=2, default=str))
    for dtype in dtypes:
        failed = {(c["impl"], c["order"]) for c in result["checks"] if c["dtype"] == dtype and not c.get("ok")}
        w = perf_workload(dtype, "cuda")
        flops = useful_flops(w)
        for impl in impls:
            for order in orders:
                grouped = order != (1, 0)
                if grouped and any(i == impl for i, _ in failed):
                    log(f"time  {dtype:4s} {impl:6s} {order_label(order):5s} not timed: a grouped-order check failed")
                    continue
                result["timing"].append(time_one(w, flops, dtype, impl, order, args.reps, log))
                (out / "order_gpu.json").write_text(json.dumps(result, indent=2, default=str))
        del w
        torch.cuda.empty_cache()
    result["seconds"] = time.perf_counter() - t0
    (out / "order_gpu.json").write_text(json.dumps(result, indent=2, default=str))
    log("")
    log("summary: attention TFLOP/s by order (module TFLOP/s), N 16384, 1024 blocks per KV head")
    for t in result["timing"]:
        if "tflops" in t:
            log(f"  {t['dtype']:4s} {t['impl']:6s} {t['order']:5s} {t['tflops']:6.1f} ({t['module_tflops']:5.1f})  "
                f"K/V loads {t['kv_loads']}")
    log(f"wrote {out / 'order_gpu.json'} ({result['seconds']:.0f} s)")
    return 0 if all(c.get("ok") for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
