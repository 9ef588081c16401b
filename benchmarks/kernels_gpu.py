"""GPU check and tuning of the kv-outer and msa-scatter Triton stacks (run unattended on the H200).

    python benchmarks/kernels_gpu.py --out DIR [--quick] [--sweep-s 90] [--variants NAME ...]

(a) correctness, bf16 and fp8, both backends: small edge-case shapes (padding, hot block, empty
    queries, several requests, causal, N % 8 != 0) and the study shape (sampled rows); each stage's
    own check (kernels/kv_outer/stage_checks.py); CUDA-graph capture + replay equals eager.
(b) timing at the study shape (Hq 64, Hkv 4, D 128, block 128, top-16, N 16384, 1024 blocks per KV
    head, nsb/N = 0.25): the attention variants of ATTN_VARIANTS (tile rows, warps, stages, grid
    mode, register cap), each checked against the float64 reference on sampled rows (a failing one
    is not timed) and timed alone by CUDA-graph replay after an L2 flush (median of >= 20); then
    every stage and the whole module with the best variant through harness.timing. The summary
    ends with a TFLOP/s table per variant and dtype and the winner's TUNED line for config.py.
Writes DIR/kernels_gpu.json and DIR/kernels_gpu.log; one failing variant is logged and skipped.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path


def _import_package():
    """msa_bench from the installed (editable) package, else from this checkout via a temp symlink."""
    try:
        import msa_bench  # noqa: F401
        return
    except ImportError:
        pass
    import tempfile
    root = Path(__file__).resolve().parents[1]
    shim = Path(tempfile.mkdtemp()) / "msa_bench"
    shim.symlink_to(root)
    sys.path.insert(0, str(shim.parent))


_import_package()

import torch  # noqa: E402

from msa_bench.harness.check import check_backend, edge_case_workload, sample_rows  # noqa: E402
from msa_bench.scenarios.workload import AttnShape  # noqa: E402
from msa_bench.kernels.base import get_backend  # noqa: E402
from msa_bench.kernels.kv_outer.config import KVOuterConfig, default_config  # noqa: E402

STUDY = AttnShape(hq=64, hkv=4, head_dim=128, block=128, topk=16)
STUDY_TOKENS, STUDY_CONTEXT, STUDY_REUSE = 16384, 1024 * 128, 0.25
BACKENDS = ("kv-outer", "msa-scatter")
DTYPES = ("bf16", "fp8")


class Log:
    def __init__(self, path: Path):
        self.f = open(path, "w")
        self.t0 = time.time()

    def __call__(self, msg: str = "", quiet: bool = False):
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        self.f.write(line + "\n")
        self.f.flush()
        if not quiet:
            print(line, flush=True)

    def error(self, what: str, exc: BaseException):
        self(f"FAILED {what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        self.f.write(traceback.format_exc() + "\n")
        self.f.flush()

    def elapsed(self) -> float:
        return time.time() - self.t0


def study_workload(dtype: str, tokens: int = STUDY_TOKENS, seed: int = 0):
    """Each KV head's pool is all 1024 blocks; each query picks 16 distinct ones (nsb/N = 0.25)."""
    from msa_bench.scenarios.selection import synthetic_workload
    return synthetic_workload(STUDY, dtype, tokens, STUDY_CONTEXT, STUDY_REUSE * STUDY_TOKENS / tokens,
                              seed=seed, device="cuda")


def useful_flops(w) -> float:
    try:
        from msa_bench.scenarios.stats import useful_flops as stats_flops
        return stats_flops(w)
    except ImportError:       # 4 x G x D x visible selected tokens, summed over queries and KV heads
        s = w.shape
        start = w.selection.long() * s.block
        vis = (w.q_limit.long().view(1, -1, 1) - start + 1).clamp(0, s.block)
        return 4.0 * s.group * s.head_dim * float(torch.where(w.selection >= 0, vis, 0).sum())


def combine_bytes(backend: str, w) -> float:
    """HBM bytes the combine must move: every valid partial row read once, out and lse written."""
    s = w.shape
    edges = float((w.pages >= 0).sum())
    part = 4 if w.dtype == "fp32" else 2
    out = s.hq * s.head_dim * part + s.hq * 4
    if backend == "kv-outer":     # o rows + m, l; combine_index
        per_edge = s.group * (s.head_dim * part + 8)
        index = w.n_tokens * s.hkv * s.topk * 4
    else:                         # o_slot rows + lse_slot; pages read to count valid slots
        per_edge = s.group * (s.head_dim * part + 4)
        index = w.n_tokens * s.hkv * s.topk * 4
    return edges * per_edge + index + w.n_tokens * out


def graph_equal_to_eager(plan) -> bool:
    plan.run()
    torch.cuda.synchronize()
    eager_out, eager_lse = plan.output.clone(), plan.lse.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run()
    plan.output.fill_(float("nan"))
    plan.lse.fill_(float("nan"))
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(plan.output, eager_out) and torch.equal(plan.lse, eager_lse)


# ---- (a) correctness ---------------------------------------------------------------------------

def correctness_cases(quick: bool):
    small = AttnShape(hq=8, hkv=2, head_dim=64, block=32, topk=4)
    cases = [
        ("small-padded-2req", lambda dt: edge_case_workload(small, dt, [400, 250], [37, 22], False, 0.0, 0.4, 2,
                                                            seed=1, device="cuda")),
        ("study-heads-causal-hot", lambda dt: edge_case_workload(STUDY, dt, [4096, 2600], [203, 100], True, 0.7,
                                                                 0.2, 1, seed=2, device="cuda")),
    ]
    if not quick:
        cases.append(("study-heads-random", lambda dt: edge_case_workload(STUDY, dt, [8192], [301], False, 0.0,
                                                                          0.1, 0, seed=3, device="cuda")))
    cases.append(("study-N16384-sampled", lambda dt: study_workload(dt)))
    return cases


def run_correctness(log: Log, quick: bool) -> list[dict]:
    rows = []
    for case, make in correctness_cases(quick):
        for dtype in DTYPES:
            try:
                w = make(dtype)
            except Exception as exc:
                log.error(f"building {case} {dtype}", exc)
                rows.append(dict(case=case, dtype=dtype, status="build-failed", error=repr(exc)[:300]))
                continue
            for backend in BACKENDS:
                rec = dict(case=case, dtype=dtype, backend=backend, n_tokens=w.n_tokens)
                try:
                    err, tol, det = check_backend(backend, w, rows=sample_rows(w.n_tokens, 256), stages=True)
                    plan = get_backend(backend).plan(w)
                    graph_ok = graph_equal_to_eager(plan)
                    del plan
                    stages = {k: dict(ok=ok, msg=msg) for k, (ok, msg) in det.get("stage_checks", {}).items()}
                    ok = err <= tol and graph_ok and all(v["ok"] for v in stages.values())
                    rec.update(status="ok" if ok else "FAIL", max_rel_err=err, tol=tol, rows=det["rows"],
                               out_rel_err=det["out_rel_err"], lse_rel_err=det.get("lse_rel_err"),
                               graph_replay_equal=graph_ok, stage_checks=stages)
                    log(f"{'ok  ' if ok else 'FAIL'} {backend:<11} {dtype:<4} {case:<24} max rel err {err:.2e} "
                        f"(tol {tol:g}) graph {'=' if graph_ok else '!='} eager; "
                        + "; ".join(f"{k}: {'ok' if v['ok'] else 'FAIL ' + v['msg']}" for k, v in stages.items()))
                    for k, v in stages.items():
                        log(f"      {k}: {v['msg']}", quiet=True)
                except Exception as exc:
                    log.error(f"{backend} {dtype} {case}", exc)
                    rec.update(status="error", error=repr(exc)[:300])
                rows.append(rec)
            del w
            torch.cuda.empty_cache()
    return rows


# ---- (b) timing --------------------------------------------------------------------------------

class Flusher:
    def __init__(self):
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        self.buf = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")

    def __call__(self):
        self.buf.zero_()


def time_graph(fn, flush: Flusher, reps: int, warmup: int = 3) -> list[float]:
    """Seconds per replay of `fn` captured in a CUDA graph, L2 flushed before each replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        flush()
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]


# Attention variants compared in one run (kernels/kv_outer/attention.py; docs/perf-log.md, Triton
# section, has each one's prediction). Fields: tile_q (query tokens per tile: 8 -> 128 rows, 4 -> 64
# rows), warps, stages, chunk (0 = persistent over the scheduler's cta_range; k = work items of k
# tiles in tile order), chunk_grid (0 = one program per chunk, 1 = SMs x ctas_per_sm programs
# striding over chunks), ctas_per_sm (persistent grids only), maxnreg (0 = compiler's choice).
# Resources from ptxas (triton 3.6, sm_90a, compiled offline) noted per line.
ATTN_VARIANTS = {
    "bf16": [
        # v1 as measured (235 TFLOP/s): 255 regs, 166 KB smem -> 1 CTA/SM
        dict(name="v1-persist-128r-w8s3", tile_q=8, warps=8, stages=3, chunk=0, ctas_per_sm=1),
        # 64-row tiles, 1 warpgroup: 255 regs, 107 KB smem -> 2 CTAs/SM; head-coherent chunks
        dict(name="v2-chunk64-64r-w4s2", tile_q=4, warps=4, stages=2, chunk=64),
        dict(name="v2-chunk32-64r-w4s2", tile_q=4, warps=4, stages=2, chunk=32),
        # v1's tile with head-coherent chunks (isolates the L2 ordering effect)
        dict(name="v3-chunk32-128r-w8s3", tile_q=8, warps=8, stages=3, chunk=32),
        # 64-row tiles, persistent, 2 CTAs/SM (isolates the occupancy effect)
        dict(name="v4-persist-64r-w4s2-2cta", tile_q=4, warps=4, stages=2, chunk=0, ctas_per_sm=2),
        dict(name="v2-chunk64-64r-w4s3", tile_q=4, warps=4, stages=3, chunk=64),
        dict(name="v5-strided-chunk64-64r-w4s2", tile_q=4, warps=4, stages=2, chunk=64, chunk_grid=1,
             ctas_per_sm=2),
        dict(name="v3-chunk16-128r-w8s4", tile_q=8, warps=8, stages=4, chunk=16),
    ],
    "fp8": [
        # v1 best as measured (443): 255 regs + 40 B stack, 75 KB smem -> 2 CTAs/SM
        dict(name="v1-persist-128r-w4s4-2cta", tile_q=8, warps=4, stages=4, chunk=0, ctas_per_sm=2),
        # 64-row tiles capped at 168 regs (no spills, 59 KB smem) -> 3 CTAs/SM, head-coherent chunks
        dict(name="v2-chunk64-64r-w4s3-r168", tile_q=4, warps=4, stages=3, chunk=64, maxnreg=168),
        # same uncapped: 187 regs -> 2 CTAs/SM
        dict(name="v2-chunk64-64r-w4s3", tile_q=4, warps=4, stages=3, chunk=64),
        # v1's tile with head-coherent chunks (Q fp8 of one KV head = 32 MB fits in L2)
        dict(name="v3-chunk32-128r-w4s4", tile_q=8, warps=4, stages=4, chunk=32),
        dict(name="v2-chunk32-64r-w4s3-r168", tile_q=4, warps=4, stages=3, chunk=32, maxnreg=168),
        dict(name="v4-persist-64r-w4s3-r168-3cta", tile_q=4, warps=4, stages=3, chunk=0, ctas_per_sm=3,
             maxnreg=168),
        dict(name="v5-strided-chunk64-64r-w4s3-r168", tile_q=4, warps=4, stages=3, chunk=64, chunk_grid=1,
             ctas_per_sm=3, maxnreg=168),
        dict(name="v2-chunk128-64r-w4s4-r168", tile_q=4, warps=4, stages=4, chunk=128, maxnreg=168),
    ],
}


def variant_config(dtype: str, v: dict) -> KVOuterConfig:
    """The KVOuterConfig equal to a variant (what TUNED[dtype] should hold if it wins)."""
    return default_config(dtype).with_(tile_q=v["tile_q"], attn_num_warps=v["warps"], attn_num_stages=v["stages"],
                                       ctas_per_sm=v.get("ctas_per_sm", 1), num_ctas=None,
                                       attn_chunk=v.get("chunk", 0), attn_chunk_grid=v.get("chunk_grid", 0),
                                       attn_maxnreg=v.get("maxnreg", 0))


def tuned_line(dtype: str, cfg: KVOuterConfig) -> str:
    base = KVOuterConfig()
    fields = ("tile_q", "ctas_per_sm", "attn_num_warps", "attn_num_stages", "attn_chunk", "attn_chunk_grid",
              "attn_maxnreg", "combine_pairs", "combine_num_warps")
    args = ", ".join(f"{f}={getattr(cfg, f)}" for f in fields if getattr(cfg, f) != getattr(base, f))
    return f'    "{dtype}": KVOuterConfig({args}),'


def make_attention(w, plan, v: dict):
    from msa_bench.kernels.kv_outer.attention import STORE_TILES, Attention
    return Attention(w, plan.buffers, v["tile_q"], plan.info["config"]["num_ctas"], v["warps"], v["stages"],
                     STORE_TILES, chunk=v.get("chunk", 0), chunk_grid=v.get("chunk_grid", 0),
                     maxnreg=v.get("maxnreg", 0))


def sweep_attention(log: Log, w, flops: float, flush: Flusher, variants, reps: int, deadline: float,
                    check_rows: int = 96) -> list[dict]:
    """Each attention variant alone: checked against the float64 reference on sampled rows (o, m, l
    of every partial of those rows; NaN-poisoned first), then timed. A variant failing its check is
    not timed. One plan per (tile_q, ctas_per_sm), its index_map and schedule run once."""
    from msa_bench.harness.check import tolerance
    from msa_bench.kernels.kv_outer import stage_checks
    out = []
    plans: dict = {}
    picked = sample_rows(w.n_tokens, check_rows)
    rows = torch.arange(w.n_tokens) if picked is None else picked
    rows = rows.to(w.device)
    tol = tolerance(w.dtype)
    for v in variants:
        rec = dict(dtype=w.dtype, **v)
        if time.time() > deadline:
            log(f"skip attention variant {v['name']}: time budget spent")
            rec["status"] = "skipped"
            out.append(rec)
            continue
        try:
            key = (v["tile_q"], v.get("ctas_per_sm", 1))
            if key not in plans:
                plans.clear()
                torch.cuda.empty_cache()
                plan = get_backend("kv-outer").__class__(config=variant_config(w.dtype, v)).plan(w)
                plan.stages["index_map"]()
                plan.stages["schedule"]()
                torch.cuda.synchronize()
                plans[key] = plan
            plan = plans[key]
            t0 = time.time()
            att = make_attention(w, plan, v)
            rec.update(grid=att.grid, num_ctas=plan.info["config"]["num_ctas"])
            for name in ("o_part", "m_part", "l_part"):
                plan.buffers[name].fill_(float("nan"))
            att()
            torch.cuda.synchronize()
            compile_s = time.time() - t0
            ok, msg = stage_checks.check_partials(plan, w, rows, tol)
            rec.update(check_ok=ok, check=msg, compile_s=compile_s)
            if not ok:
                rec["status"] = "check-failed"
                log(f"  FAIL attention {w.dtype} {v['name']}: {msg} (not timed)")
                out.append(rec)
                continue
            secs = time_graph(att, flush, reps)
            med = statistics.median(secs)
            rec.update(status="ok", median_s=med, min_s=min(secs), tflops=flops / med / 1e12)
            log(f"  attention {w.dtype} {v['name']:<34} grid {att.grid:>6}: {med * 1e3:.3f} ms = "
                f"{flops / med / 1e12:.0f} TFLOP/s (check {msg.split(' on ')[0]}; compile+first {compile_s:.1f}s)")
        except Exception as exc:
            log.error(f"attention variant {v['name']}", exc)
            rec.update(status="error", error=repr(exc)[:300])
        out.append(rec)
    plans.clear()
    torch.cuda.empty_cache()
    return out


def sweep_combine(log: Log, w, config: KVOuterConfig, flush: Flusher, variants, reps: int, deadline: float) -> list[dict]:
    """Time the kv-outer combine alone for each (pairs per program, num_warps) on one plan's partials."""
    from msa_bench.kernels.kv_outer.combine import Combine
    out = []
    try:
        plan = get_backend("kv-outer").__class__(config=config).plan(w)
        plan.run()
        torch.cuda.synchronize()
    except Exception as exc:
        log.error("plan for the combine sweep", exc)
        return out
    cbytes = combine_bytes("kv-outer", w)
    for pairs, warps in variants:
        rec = dict(dtype=w.dtype, combine_pairs=pairs, combine_num_warps=warps)
        if time.time() > deadline:
            rec["status"] = "skipped"
            out.append(rec)
            continue
        try:
            comb = Combine(w, plan.buffers, plan.output, plan.lse, pairs, warps)
            med = statistics.median(time_graph(comb, flush, reps))
            rec.update(status="ok", median_s=med, gbps=cbytes / med / 1e9)
            log(f"  combine {w.dtype} pairs={pairs} warps={warps}: {med * 1e3:.3f} ms = {cbytes / med / 1e9:.0f} GB/s")
        except Exception as exc:
            log.error(f"combine variant {rec}", exc)
            rec.update(status="error", error=repr(exc)[:300])
        out.append(rec)
    del plan
    torch.cuda.empty_cache()
    return out


def time_module(log: Log, backend: str, w, config: KVOuterConfig | None, flops: float, reps: int,
                variant: dict | None = None) -> dict:
    from msa_bench.harness.timing import MODULE, TimingConfig, time_plan
    cls = get_backend(backend).__class__
    plan = cls(config=config).plan(w)
    if variant is not None and backend == "kv-outer":
        plan.stages["attention"] = make_attention(w, plan, variant)
    samples = time_plan(plan, TimingConfig(warmup=3, reps=reps, max_reps=2 * reps, cv_target=0.03), "cuda")
    med = {name: statistics.median(s.seconds) for name, s in samples.items()}
    stage_sum = sum(med[n] for n in plan.stages)
    overhead = sum(med[n] for n in ("index_map", "schedule", "combine"))
    cbytes = combine_bytes(backend, w)
    rec = dict(backend=backend, dtype=w.dtype, config=plan.info["config"], median_s=med,
               variant=(variant or {}).get("name") if backend == "kv-outer" else None,
               converged={n: s.converged for n, s in samples.items()},
               attention_tflops=flops / med["attention"] / 1e12, module_tflops=flops / med[MODULE] / 1e12,
               combine_gbps=cbytes / med["combine"] / 1e9, combine_bytes=cbytes,
               overhead_share=overhead / stage_sum, useful_flops=flops)
    try:
        from msa_bench.scenarios.stats import workload_stats
        st = workload_stats(w, "h200")
        rec["predicted_s"] = st.get(f"pred_{backend}_s")
        rec["predicted_binding"] = st.get(f"pred_{backend}_binding")
    except Exception as exc:  # the model is optional here
        log.error("roofline prediction", exc)
    log(f"{backend:<11} {w.dtype:<4} " + "  ".join(f"{n} {med[n] * 1e3:.3f}ms" for n in list(plan.stages) + [MODULE])
        + f" | attention {rec['attention_tflops']:.0f} TFLOP/s, module {rec['module_tflops']:.0f} TFLOP/s, "
        f"combine {rec['combine_gbps']:.0f} GB/s, index_map+schedule+combine {100 * rec['overhead_share']:.0f}%"
        + (f", predicted {rec['predicted_s'] * 1e3:.3f} ms ({rec['predicted_binding']})" if rec.get("predicted_s") else ""))
    del plan
    torch.cuda.empty_cache()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output directory (default $OUT)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and configs")
    ap.add_argument("--sweep-s", type=float, default=90.0,
                    help="per dtype: stop starting new attention/combine sweep variants after this many seconds")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--variants", nargs="*", default=None, help="only these attention variant names")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "kernels_gpu.log")
    if not torch.cuda.is_available():
        log("error: this script needs a CUDA GPU")
        return 2
    import triton
    props = torch.cuda.get_device_properties(0)
    env = dict(gpu=props.name, sms=props.multi_processor_count, l2_bytes=props.L2_cache_size,
               torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda, quick=args.quick)
    log(f"device {env}")
    result = dict(env=env, correctness=[], sweep=[], combine_sweep=[], module=[], best={})

    def save():
        (out / "kernels_gpu.json").write_text(json.dumps(result, indent=1, default=str))

    if not args.skip_correctness:
        log("== (a) correctness: bf16 / fp8, both backends, stage checks, CUDA-graph replay")
        result["correctness"] = run_correctness(log, args.quick)
        save()

    log("== (b) timing at the study shape: N 16384, 1024 blocks per KV head, nsb/N 0.25")
    flush = Flusher()
    combine_variants = ([(4, 4)] if args.quick else [(p_, w_) for p_ in (1, 2, 4, 8) for w_ in (4, 8)] + [(2, 2)])
    winners = {}
    for dtype in DTYPES:
        try:
            w = study_workload(dtype)
            flops = useful_flops(w)
            log(f"{dtype}: useful FLOPs {flops:.4g}, tokens {w.n_tokens}, pages {w.num_pages}")
        except Exception as exc:
            log.error(f"study workload {dtype}", exc)
            continue
        variants = [v for v in ATTN_VARIANTS[dtype] if not args.variants or v["name"] in args.variants]
        sweep = sweep_attention(log, w, flops, flush, variants, args.reps, time.time() + args.sweep_s)
        result["sweep"] += sweep
        save()
        good = [r for r in sweep if r.get("status") == "ok"]
        best_cfg, best_v = default_config(dtype), None
        if good:
            b = min(good, key=lambda r: r["median_s"])
            best_v = next(v for v in variants if v["name"] == b["name"])
            best_cfg = variant_config(dtype, best_v)
            winners[dtype] = (b["name"], b["tflops"])
            result["best"][dtype] = dict(variant=b["name"], tflops=b["tflops"], median_s=b["median_s"],
                                         config=dict(best_cfg.__dict__))
            log(f"best attention variant {dtype}: {b['name']} -> {b['tflops']:.0f} TFLOP/s")
        csweep = sweep_combine(log, w, best_cfg, flush, combine_variants, args.reps, time.time() + args.sweep_s / 3)
        result["combine_sweep"] += csweep
        cgood = [r for r in csweep if r.get("status") == "ok"]
        if cgood and not args.quick:
            c = min(cgood, key=lambda r: r["median_s"])
            best_cfg = best_cfg.with_(combine_pairs=c["combine_pairs"], combine_num_warps=c["combine_num_warps"])
            result["best"].setdefault(dtype, {}).update(combine_pairs=c["combine_pairs"],
                                                        combine_num_warps=c["combine_num_warps"], combine_gbps=c["gbps"])
        result["best"].setdefault(dtype, {})["tuned_line"] = tuned_line(dtype, best_cfg)
        for backend in BACKENDS:
            try:
                result["module"].append(time_module(log, backend, w, best_cfg, flops, args.reps, best_v))
            except Exception as exc:
                log.error(f"module timing {backend} {dtype}", exc)
            save()
        del w
        torch.cuda.empty_cache()

    log("== summary")
    bad = [r for r in result["correctness"] if r.get("status") != "ok"]
    log(f"correctness: {len(result['correctness']) - len(bad)}/{len(result['correctness'])} ok"
        + ("" if not bad else "; failing: " + ", ".join(f"{r.get('backend', '?')}/{r['dtype']}/{r['case']}"
                                                         for r in bad)))
    log(f"{'backend':<12}{'dtype':<6}{'index_map':>10}{'schedule':>10}{'attention':>10}{'combine':>10}{'module':>10}"
        f"{'attn TF/s':>10}{'mod TF/s':>10}{'comb GB/s':>10}{'ovh %':>7}{'pred ms':>9}")
    for r in result["module"]:
        m = r["median_s"]
        pred = r.get("predicted_s")
        log(f"{r['backend']:<12}{r['dtype']:<6}" + "".join(f"{m[n] * 1e3:>10.3f}" for n in
                                                        ("index_map", "schedule", "attention", "combine", "module"))
            + f"{r['attention_tflops']:>10.0f}{r['module_tflops']:>10.0f}{r['combine_gbps']:>10.0f}"
              f"{100 * r['overhead_share']:>7.1f}{(pred * 1e3 if pred else math.nan):>9.3f}")
    log("(times in ms, medians of CUDA-graph replays after an L2 flush; TFLOP/s of useful FLOPs; FlashInfer FA2 "
        "reference 83 TFLOP/s)")
    log("attention variants (checked vs the float64 reference on sampled rows, then timed alone):")
    log(f"{'dtype':<6}{'variant':<36}{'grid':>7}{'ms':>9}{'TFLOP/s':>9}  status")
    for r in result["sweep"]:
        ms = f"{r['median_s'] * 1e3:9.3f}" if "median_s" in r else f"{'-':>9}"
        tf = f"{r['tflops']:9.0f}" if "tflops" in r else f"{'-':>9}"
        log(f"{r['dtype']:<6}{r['name']:<36}{r.get('grid', '-')!s:>7}{ms}{tf}  {r.get('status')}")
    for dtype, (name, tf) in winners.items():
        log(f"winner {dtype}: {name} ({tf:.0f} TFLOP/s); kernels/kv_outer/config.py TUNED line:")
        log(result["best"][dtype]["tuned_line"])
    save()
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
