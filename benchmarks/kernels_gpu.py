"""GPU check and tuning of the kv-outer and msa-scatter Triton stacks (run unattended on the H200).

    python benchmarks/kernels_gpu.py --out DIR [--quick] [--sweep-s 60]

(a) correctness, bf16 and fp8, both backends: small edge-case shapes (padding, hot block, empty
    queries, several requests, causal, N % 8 != 0) and the study shape (sampled rows); each stage's
    own check (kernels/kv_outer/stage_checks.py); CUDA-graph capture + replay equals eager.
(b) timing at the study shape (Hq 64, Hkv 4, D 128, block 128, top-16, N 16384, 1024 blocks per KV
    head, nsb/N = 0.25): a sweep of attention configs (num_warps x num_stages x CTAs per SM), each
    timed alone by CUDA-graph replay after an L2 flush (median of >= 20); then every stage and the
    whole module with the best config through harness.timing (the sweep's protocol).
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
from msa_bench.harness.workload import AttnShape  # noqa: E402
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
    from msa_bench.harness.selection import synthetic_workload
    return synthetic_workload(STUDY, dtype, tokens, STUDY_CONTEXT, STUDY_REUSE * STUDY_TOKENS / tokens,
                              seed=seed, device="cuda")


def useful_flops(w) -> float:
    try:
        from msa_bench.harness.stats import useful_flops as stats_flops
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


def sweep_attention(log: Log, w, flops: float, flush: Flusher, variants, reps: int, deadline: float) -> list[dict]:
    """Time the kv-outer attention stage alone for each (warps, stages, ctas_per_sm), reusing one plan's
    buffers per grid size (only the schedule depends on it)."""
    from msa_bench.kernels.kv_outer.attention import STORE_TILES, Attention
    out = []
    by_grid: dict[int, list] = {}
    for v in variants:
        by_grid.setdefault(v[2], []).append(v)
    for ctas_per_sm, group in by_grid.items():
        try:
            plan = get_backend("kv-outer").__class__(config=default_config(w.dtype).with_(ctas_per_sm=ctas_per_sm,
                                                                                          num_ctas=None)).plan(w)
            plan.stages["index_map"]()
            plan.stages["schedule"]()
            torch.cuda.synchronize()
        except Exception as exc:
            log.error(f"plan for ctas_per_sm={ctas_per_sm}", exc)
            continue
        num_ctas = plan.info["config"]["num_ctas"]
        for warps, stages, _ in group:
            rec = dict(dtype=w.dtype, num_warps=warps, num_stages=stages, ctas_per_sm=ctas_per_sm, num_ctas=num_ctas)
            if time.time() > deadline:
                log(f"skip attention variant {rec}: time budget spent")
                rec["status"] = "skipped"
                out.append(rec)
                continue
            try:
                t0 = time.time()
                att = Attention(w, plan.buffers, plan.info["config"]["tile_q"], num_ctas, warps, stages, STORE_TILES)
                att()
                torch.cuda.synchronize()
                compile_s = time.time() - t0
                secs = time_graph(att, flush, reps)
                med = statistics.median(secs)
                rec.update(status="ok", median_s=med, tflops=flops / med / 1e12, compile_s=compile_s)
                log(f"  attention {w.dtype} warps={warps} stages={stages} ctas={num_ctas}: {med * 1e3:.3f} ms "
                    f"= {flops / med / 1e12:.0f} TFLOP/s (compile+first {compile_s:.1f}s)")
            except Exception as exc:
                log.error(f"attention variant {rec}", exc)
                rec.update(status="error", error=repr(exc)[:300])
            out.append(rec)
        del plan
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


def time_module(log: Log, backend: str, w, config: KVOuterConfig | None, flops: float, reps: int) -> dict:
    from msa_bench.harness.timing import MODULE, TimingConfig, time_plan
    cls = get_backend(backend).__class__
    plan = cls(config=config).plan(w)
    samples = time_plan(plan, TimingConfig(warmup=3, reps=reps, max_reps=2 * reps, cv_target=0.03), "cuda")
    med = {name: statistics.median(s.seconds) for name, s in samples.items()}
    stage_sum = sum(med[n] for n in plan.stages)
    overhead = sum(med[n] for n in ("index_map", "schedule", "combine"))
    cbytes = combine_bytes(backend, w)
    rec = dict(backend=backend, dtype=w.dtype, config=plan.info["config"], median_s=med,
               converged={n: s.converged for n, s in samples.items()},
               attention_tflops=flops / med["attention"] / 1e12, module_tflops=flops / med[MODULE] / 1e12,
               combine_gbps=cbytes / med["combine"] / 1e9, combine_bytes=cbytes,
               overhead_share=overhead / stage_sum, useful_flops=flops)
    try:
        from msa_bench.harness.stats import workload_stats
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
    ap.add_argument("--sweep-s", type=float, default=60.0,
                    help="per dtype: stop starting new attention/combine sweep variants after this many seconds")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-correctness", action="store_true")
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
    # (num_warps, num_stages, ctas_per_sm), most promising first: at 8 warps the kernel takes ~255
    # registers per thread (ptxas, sm_90a), so only one 8-warp CTA fits per SM; 4-warp CTAs fit two.
    variants = ([(8, 2, 1), (8, 3, 1), (4, 2, 2)] if args.quick else
                [(8, 2, 1), (8, 3, 1), (4, 2, 2), (4, 3, 2), (8, 4, 1), (4, 2, 1), (4, 3, 1), (8, 2, 2)])
    combine_variants = ([(4, 4), (1, 4), (8, 8)] if args.quick else
                        [(p_, w_) for p_ in (1, 2, 4, 8) for w_ in (4, 8)] + [(2, 2)])
    for dtype in DTYPES:
        try:
            w = study_workload(dtype)
            flops = useful_flops(w)
            log(f"{dtype}: useful FLOPs {flops:.4g}, tokens {w.n_tokens}, pages {w.num_pages}")
        except Exception as exc:
            log.error(f"study workload {dtype}", exc)
            continue
        deadline = time.time() + args.sweep_s
        sweep = sweep_attention(log, w, flops, flush, variants, args.reps, deadline)
        result["sweep"] += sweep
        save()
        good = [r for r in sweep if r.get("status") == "ok"]
        best_cfg = default_config(dtype)
        if good:
            b = min(good, key=lambda r: r["median_s"])
            best_cfg = best_cfg.with_(attn_num_warps=b["num_warps"], attn_num_stages=b["num_stages"],
                                      ctas_per_sm=b["ctas_per_sm"], num_ctas=None)
            result["best"][dtype] = dict(attn_num_warps=b["num_warps"], attn_num_stages=b["num_stages"],
                                         ctas_per_sm=b["ctas_per_sm"], tflops=b["tflops"])
            log(f"best attention config {dtype}: num_warps={b['num_warps']} num_stages={b['num_stages']} "
                f"ctas_per_sm={b['ctas_per_sm']} -> {b['tflops']:.0f} TFLOP/s "
                f"(write into kernels/kv_outer/config.py TUNED['{dtype}'])")
        csweep = sweep_combine(log, w, best_cfg, flush, combine_variants, args.reps, time.time() + args.sweep_s / 3)
        result["combine_sweep"] += csweep
        cgood = [r for r in csweep if r.get("status") == "ok"]
        if cgood:
            c = min(cgood, key=lambda r: r["median_s"])
            best_cfg = best_cfg.with_(combine_pairs=c["combine_pairs"], combine_num_warps=c["combine_num_warps"])
            result["best"].setdefault(dtype, {}).update(combine_pairs=c["combine_pairs"],
                                                        combine_num_warps=c["combine_num_warps"], combine_gbps=c["gbps"])
            log(f"best combine config {dtype}: pairs={c['combine_pairs']} num_warps={c['combine_num_warps']} "
                f"-> {c['gbps']:.0f} GB/s")
        for backend in BACKENDS:
            try:
                result["module"].append(time_module(log, backend, w, best_cfg, flops, args.reps))
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
    save()
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
