"""CuTe DSL attention stage on the GPU: check it against the Triton stage and the float64 oracle, then time it.

    source scripts/gpu-setup.sh && python3 benchmarks/cute_gpu.py [--out DIR] [--build-dir DIR] [--quick]
                                                                 [--variants v18,v10,...] [--rounds R]

Needs the prebuilt libraries (`msa-bench build-kernels` on the CPU machine writes build/cute; carry it
in the checkout) and no CuTe DSL. Writes DIR/cute_gpu.json and DIR/cute_gpu.log; DIR is --out, else
$OUT, else results/cute-gpu. Checks (small, masked/padded and study shapes, bf16 and fp8): the CuTe
partials (o_part, m_part, l_part on live rows) vs the Triton stage's, the partials vs the float64
reference through combine_index, the combined output vs the reference, and that the stage replays
identically from a CUDA graph (outputs NaN-poisoned before the replay; compared on the rows of real
tiles, the only rows either stage writes; the Triton stage gets the same check as a control). Every
built CuTe configuration (manifest.VARIANT_CTAS: kernel generation x CTAs per SM) is checked; only
those whose every check passed are timed. Generations run one after another (checks, then timing),
the JSON rewritten after each phase. Timing: the attention stage at N 16384, 1024 blocks per KV head, top-16
uniform picks (useful FLOPs 4 x Hq x D x 16 x 128 per query), CuTe and Triton, median of >= 20 CUDA-event
samples, both with the harness protocol (CUDA graphs, L2 flushed) and back to back (L2 warm).
With --rounds R every generation is checked first and then all that passed are timed R times,
interleaved, so that clock and thermal drift fall on all of them alike; the summary then gives each
one's median over the rounds. The summary table is printed last. Budget: under 5 minutes on the H200.
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

import torch

from msa_bench.harness.tee_log import TeeLog as Log

REPO = Path(__file__).resolve().parents[1]
SHAPE_KW = dict(hq=64, hkv=4, head_dim=128, block=128, topk=16)
TOL = {"bf16": 1e-2, "fp8": 5e-2}
TARGET_TFLOPS = {"bf16": 600, "fp8": 900}
PERF = dict(tokens=16384, blocks_per_head=1024)


def cute_configs(dtype: str) -> list[tuple[str, int]]:
    """(kernel variant, CTAs per SM) of every CuTe configuration built for `dtype` (manifest.VARIANT_CTAS):
    v2 c2 (P in Q's smem, 2 CTAs/SM; the default), v2 c1, then the v3 pipelined kernel's, then the v4
    warp-specialized (TMA K/V, mbarrier rings) kernel's (c1 only)."""
    from msa_bench.kernels.cute.manifest import VARIANT_CTAS, VARIANTS
    return [(v, c) for v in VARIANTS for c in sorted(VARIANT_CTAS[(v, dtype)], reverse=True)]


def config_label(variant: str, ctas: int) -> str:
    return f"{variant}-c{ctas}"




# ---- workloads ---------------------------------------------------------------------------------

def masked_padded_workload(dtype: str, seed: int, device):
    """64 queries over a 1000-token request (8 blocks, the last partial): each (head, query) keeps 3..8
    distinct random blocks (-1 padded to top-16), and each query sees keys up to a random limit, so
    blocks are partly or wholly masked (wholly masked partials must come out m = -inf, l = 0)."""
    from msa_bench.scenarios.workload import AttnShape, build_workload
    shape = AttnShape(**SHAPE_KW)
    n, kv_len = 64, 1000
    nb = math.ceil(kv_len / shape.block)
    gen = torch.Generator().manual_seed(seed)
    sel = torch.full((shape.hkv, n, shape.topk), -1, dtype=torch.int32)
    for h in range(shape.hkv):
        for q in range(n):
            k = int(torch.randint(3, nb + 1, (1,), generator=gen))
            sel[h, q, :k] = torch.randperm(nb, generator=gen)[:k].to(torch.int32)
    q_limit = torch.randint(0, kv_len, (n,), generator=gen, dtype=torch.int32)
    page_table = torch.randperm(nb, generator=gen).view(1, nb).to(torch.int32)
    return build_workload(shape, dtype, sel, page_table, torch.zeros(n, dtype=torch.int32), q_limit, nb,
                          causal=False, seed=seed, device=device, meta={"kind": "masked+padded"})


def workloads(dtype: str, device, quick: bool):
    """(label, workload factory) pairs for the checks, smallest first."""
    from msa_bench.scenarios.selection import synthetic_workload
    from msa_bench.scenarios.workload import AttnShape
    shape = AttnShape(**SHAPE_KW)
    cases = [
        ("small pool N64 ctx2048", lambda: synthetic_workload(shape, dtype, 64, 2048, 1.0, seed=1, device=device)),
        ("small causal N64 ctx4096", lambda: synthetic_workload(shape, dtype, 64, 4096, 1.0, causal=True,
                                                                seed=2, device=device)),
        ("masked+padded N64 ctx1000", lambda: masked_padded_workload(dtype, 3, device)),
        ("study causal N2048 ctx32768", lambda: synthetic_workload(shape, dtype, 2048, 32768, 0.25, causal=True,
                                                                   seed=4, device=device)),
    ]
    if not quick:
        cases.append(("study zipf N4096 ctx65536", lambda: synthetic_workload(
            shape, dtype, 4096, 65536, 0.5, skew=1.0, seed=5, device=device)))
    return cases


def perf_workload(dtype: str, device):
    from msa_bench.scenarios.selection import synthetic_workload
    from msa_bench.scenarios.workload import AttnShape
    n, nb = PERF["tokens"], PERF["blocks_per_head"]
    shape = AttnShape(**SHAPE_KW)
    # reuse nsb/N = Hkv * pool / N gives a pool of nb blocks per KV head, picks uniform and distinct
    return synthetic_workload(shape, dtype, n, nb * shape.block, shape.hkv * nb / n, seed=11, device=device)


def useful_flops(w) -> float:
    s = w.shape
    return 4.0 * s.hq * s.head_dim * s.topk * s.block * w.n_tokens


# ---- checks ------------------------------------------------------------------------------------

def live_rows(plan, w) -> torch.Tensor:
    """Partial rows that hold a real (query, head): row = tile * TILE_Q * G + slot * G + g, slot < count."""
    b, g = plan.buffers, w.shape.group
    tile_q = plan.info["config"]["tile_q"]
    rows = b["o_part"].shape[0]
    r = torch.arange(rows, device=w.device)
    tile, slot = r // (tile_q * g), (r % (tile_q * g)) // g
    return r[(b["tile_key"].long()[tile] >= 0) & (slot < b["tile_count"].long()[tile])]


def compare_with_triton(pc, pt, w) -> dict:
    from msa_bench.scenarios.reference import relative_error
    rows = live_rows(pt, w)
    bc, bt = pc.buffers, pt.buffers
    out = {"live_rows": int(rows.numel())}
    mc, mt = bc["m_part"][rows], bt["m_part"][rows]
    out["m_inf_mismatch"] = int(((mc == -math.inf) != (mt == -math.inf)).sum())
    fin = mt > -math.inf
    out["o"] = relative_error(bc["o_part"][rows], bt["o_part"][rows])
    out["m"] = relative_error(mc[fin], mt[fin])
    out["l"] = relative_error(bc["l_part"][rows], bt["l_part"][rows])
    return out


def graph_replay_check(plan) -> dict:
    """Capture the attention stage in a CUDA graph, poison its outputs with NaN, replay once and
    compare with the eager result on the rows the stage owns (all TILE_Q * G rows of every real tile,
    tile_key >= 0; rows of the unused tail of o_part/m_part/l_part are never written by either stage,
    they hold whatever torch.empty gave). Reports whether the replay wrote anything at all."""
    b = plan.buffers
    names = ("o_part", "m_part", "l_part")
    real_tiles = b["tile_key"] >= 0
    rows_per_tile = b["m_part"].numel() // b["tile_key"].numel()
    real = real_tiles.repeat_interleave(rows_per_tile)
    eager = {k: b[k][real].clone() for k in names}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.stages["attention"]()
    for k in names:
        b[k].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()

    def rowwise(t):
        return t if t.dim() == 1 else t.all(dim=1)

    rec = {"real_rows": int(real.sum()), "rows_per_tile": rows_per_tile}
    rec["replay_wrote_rows"] = int(rowwise(~torch.isnan(b["m_part"][real])).sum())
    rec["replay_wrote_outside_rows"] = int(rowwise(~torch.isnan(b["m_part"][~real])).sum())
    for k in names:
        same = rowwise(b[k][real] == eager[k]) | rowwise(torch.isnan(b[k][real]) & torch.isnan(eager[k]))
        rec[f"{k}_differing_rows"] = int((~same).sum())
    rec["identical"] = all(rec[f"{k}_differing_rows"] == 0 for k in names)
    del graph
    return rec


def graph_summary(g: dict) -> str:
    if g["identical"]:
        return f"graph same ({g['replay_wrote_rows']}/{g['real_rows']} rows rewritten by the replay)"
    return (f"graph DIFFERS: replay wrote {g['replay_wrote_rows']}/{g['real_rows']} real rows "
            f"({g['replay_wrote_outside_rows']} outside), differing rows o {g['o_part_differing_rows']} "
            f"m {g['m_part_differing_rows']} l {g['l_part_differing_rows']}")


def check_case(label, make, dtype, log, configs: list[tuple[str, int]]) -> list[dict]:
    """Every CuTe configuration of `dtype` on one workload: vs the Triton stage, vs the float64
    reference, and CUDA-graph replay (also run on the Triton stage, as a control of the check)."""
    from msa_bench.scenarios.reference import reference_attention, relative_error
    from msa_bench.kernels.cute.backend import KVOuterCuteBackend
    from msa_bench.kernels.kv_outer.backend import KVOuterBackend
    from msa_bench.kernels.kv_outer.stage_checks import check_partials
    recs = []
    try:
        w = make()
        # the tile sequence (tile_key/edge/count) does not depend on the CTA count, so one Triton
        # plan serves as the partial-by-partial reference of every CuTe configuration
        # same 8-token tiles as the CuTe kernel (the Triton stage's tuned bf16 tile is 4 tokens, whose
        # partial rows would not line up with the CuTe stage's); otherwise the Triton defaults
        from msa_bench.kernels.kv_outer.config import default_config
        pt = KVOuterBackend(config=default_config(w.dtype).with_(tile_q=8, attn_chunk=0, attn_chunk_grid=0,
                                                                 attn_maxnreg=0)).plan(w)
        for k in ("o_part", "m_part", "l_part"):      # rows neither run writes (dead slots) stay NaN in both,
            pt.buffers[k].fill_(float("nan"))          # as for the CuTe plans: the graph control compares like with like
        pt.run()
        torch.cuda.synchronize()
        idx = torch.randperm(w.n_tokens, generator=torch.Generator().manual_seed(7))[:48].sort().values.to(w.device)
        ref, _ = reference_attention(w, idx)
        triton_err = relative_error(pt.output[idx], ref)
    except Exception as exc:
        log(f"check {dtype:4s} {label:30s} ERROR (workload / Triton) {type(exc).__name__}: {str(exc)[:400]}")
        return [{"case": label, "dtype": dtype, "variant": v, "ctas_per_sm": c, "tol": TOL[dtype], "ok": False,
                 "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
                for v, c in configs]
    for variant, ctas in configs:
        name = config_label(variant, ctas)
        rec = {"case": label, "dtype": dtype, "variant": variant, "ctas_per_sm": ctas, "tol": TOL[dtype],
               "tokens": w.n_tokens, "triton_output_rel_error": triton_err}
        try:
            pc = KVOuterCuteBackend(ctas_per_sm=ctas, variant=variant).plan(w)
            for k in ("o_part", "m_part", "l_part"):      # stale Triton-like values must not pass
                pc.buffers[k].fill_(float("nan"))
            pc.run()
            torch.cuda.synchronize()
            rec["info"] = {k: v for k, v in pc.info.items() if k != "config"}
            rec["vs_triton"] = compare_with_triton(pc, pt, w)
            ok_p, msg_p = check_partials(pc, w, idx, TOL[dtype])
            rec["partials_vs_reference"] = {"ok": ok_p, "message": msg_p}
            rec["output_rel_error"] = relative_error(pc.output[idx], ref)
            g = rec["graph_replay"] = graph_replay_check(pc)
            rec["graph_replay_identical"] = g["identical"]
            vt = rec["vs_triton"]
            finite = math.isfinite(rec["output_rel_error"]) and all(math.isfinite(vt[k]) for k in ("o", "m", "l"))
            rec["ok"] = bool(finite and ok_p and rec["output_rel_error"] <= TOL[dtype] and g["identical"]
                             and vt["m_inf_mismatch"] == 0 and max(vt["o"], vt["m"], vt["l"]) <= TOL[dtype])
            log(f"check {dtype:4s} {name:6s} {label:30s} out {rec['output_rel_error']:.2e} (triton {triton_err:.2e}) "
                f"vs triton o {vt['o']:.1e} m {vt['m']:.1e} l {vt['l']:.1e} inf-mismatch {vt['m_inf_mismatch']}; "
                f"partials: {msg_p}; {graph_summary(g)} -> {'ok' if rec['ok'] else 'FAIL'}")
            del pc
        except Exception as exc:
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
            log(f"check {dtype:4s} {name:6s} {label:30s} ERROR {type(exc).__name__}: {str(exc)[:400]}")
        recs.append(rec)
        torch.cuda.synchronize()
    try:        # control: the same graph check on the Triton stage (last: it rewrites pt's partials)
        triton_graph = graph_replay_check(pt)
        log(f"check {dtype:4s} triton {label:30s} out {triton_err:.2e}; control: {graph_summary(triton_graph)}")
    except Exception as exc:
        triton_graph = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"check {dtype:4s} triton {label:30s} control graph check ERROR {type(exc).__name__}: {str(exc)[:200]}")
    for rec in recs:
        rec["triton_graph_replay"] = triton_graph
    del pt, w
    torch.cuda.empty_cache()
    return recs


# ---- timing ------------------------------------------------------------------------------------

def events_median(fn, warmup: int, reps: int) -> dict:
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return {"median_s": ms[len(ms) // 2] / 1e3, "min_s": ms[0] / 1e3, "max_s": ms[-1] / 1e3, "n_reps": reps}


def stage_summaries(plan, reps: int, device) -> dict:
    """The harness protocol (time_plan: CUDA graphs, L2 flushed before every sample), at least `reps`
    samples and at most 3x that while the cv is above target: summarize() of each stage and the module."""
    from msa_bench.harness.timing import TimingConfig, summarize, time_plan
    reps = max(reps, 20)
    samples = time_plan(plan, TimingConfig(warmup=5, reps=reps, max_reps=3 * reps), device)
    return {k: summarize(v.seconds) for k, v in samples.items() if k != "plan"}


def time_dtype(dtype, reps, log, configs: list[tuple[str, int]], passed: list[tuple[str, int]],
               with_triton: bool) -> dict:
    """Time the CuTe configurations in `passed` (those of `configs` whose every check was ok) and,
    with_triton, the Triton stage."""
    from msa_bench.kernels.cute.backend import KVOuterCuteBackend
    from msa_bench.kernels.kv_outer.backend import KVOuterBackend
    rec = {"dtype": dtype, **PERF, "target_tflops": TARGET_TFLOPS[dtype]}
    try:
        w = perf_workload(dtype, "cuda")
        flops = useful_flops(w)
        rec["useful_flops"] = flops
        impls = [(f"cute-{config_label(v, c)}", KVOuterCuteBackend(ctas_per_sm=c, variant=v)) for v, c in passed]
        if with_triton:
            impls.append(("triton", KVOuterBackend()))
        rec["not_timed"] = [f"cute-{config_label(v, c)}" for v, c in configs if (v, c) not in passed]
        for name in rec["not_timed"]:
            log(f"time  {dtype:4s} {name:11s} not timed: a check failed")
        rec["impls"] = [name for name, _ in impls]
        for impl, backend in impls:
            r = rec[impl] = {}
            try:
                plan = backend.plan(w)
                plan.run()
                torch.cuda.synchronize()
                warm = events_median(plan.stages["attention"], 5, max(reps, 20))
                r["warm_l2_events"] = warm
                r["warm_tflops"] = flops / warm["median_s"] / 1e12
                med = stage_summaries(plan, reps, w.device)
                cold = r["graph_cold_l2"] = med["attention"]
                r["tflops"] = flops / cold["median_s"] / 1e12
                r["module_s"] = med["module"]["median_s"]
                r["stages_s"] = {k: v["median_s"] for k, v in med.items()}
                log(f"time  {dtype:4s} {impl:11s} attention {cold['median_s'] * 1e3:8.3f} ms cold-L2 graph "
                    f"({r['tflops']:6.1f} TFLOP/s, cv {cold['cv']:.3f}, n {int(cold['n_reps'])}); "
                    f"{warm['median_s'] * 1e3:8.3f} ms warm events ({r['warm_tflops']:6.1f} TFLOP/s); "
                    f"module {r['module_s'] * 1e3:.3f} ms")
                del plan
            except Exception as exc:
                r.update(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
                log(f"time  {dtype:4s} {impl:11s} ERROR {type(exc).__name__}: {str(exc)[:400]}")
            torch.cuda.empty_cache()
        del w
    except Exception as exc:
        rec.update(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        log(f"time  {dtype:4s} ERROR {type(exc).__name__}: {str(exc)[:400]}")
    torch.cuda.empty_cache()
    return rec


def passed_configs(result: dict, dtype: str, configs: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The configurations of `configs` whose every check (for dtype) passed."""
    return [(v, c) for v, c in configs
            if all(r.get("ok") for r in result["checks"]
                   if r["dtype"] == dtype and r["variant"] == v and r["ctas_per_sm"] == c)]


def rounds_summary(timing: list[dict]) -> dict:
    """Per (dtype, implementation): the cold-L2 TFLOP/s of every round, and their median, min, max."""
    per = {}
    for rec in timing:
        for impl in rec.get("impls", []):
            if "tflops" in rec.get(impl, {}):
                per.setdefault(f"{rec['dtype']} {impl}", []).append(rec[impl]["tflops"])
    out = {}
    for key, xs in per.items():
        out[key] = {"tflops": xs, "median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
    return out


# ---- main --------------------------------------------------------------------------------------

def environment(build_dir: Path) -> dict:
    props = torch.cuda.get_device_properties(0)
    env = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "build_dir": str(build_dir)}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        env["manifest"] = json.loads((build_dir / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        env["manifest"] = f"unreadable: {exc}"
    return env


def gpu_environment(build_dir: str, log) -> dict | None:
    """What every benchmark script does before its GPU work: None (one logged error line) without a
    CUDA GPU; else the CuTe build directory exported for kernels/cute/loader.build_dir() and the
    environment record (environment()), summed up in one log line."""
    if not torch.cuda.is_available():
        log("error: no CUDA GPU visible")
        return None
    from msa_bench.kernels.cute.manifest import source_hash
    build = Path(build_dir).resolve()
    os.environ["MSA_BENCH_CUTE_DIR"] = str(build)
    env = environment(build)
    log(f"{env['gpu']} ({env['sms']} SMs), torch {env['torch']} (CUDA {env['cuda']}), triton {env.get('triton')}; "
        f"CuTe build {build}; checkout source hash {source_hash()}")
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/cute-gpu")
    ap.add_argument("--build-dir", default=os.environ.get("MSA_BENCH_CUTE_DIR") or str(REPO / "build" / "cute"))
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="fewer check shapes")
    ap.add_argument("--variants", default="v2,v3", help="CuTe kernel generations to check and time, in order (manifest.VARIANTS)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="R > 1: check every generation first, then time all that passed R times, interleaved "
                         "(round r times each one once), and report each one's median over the rounds")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "cute_gpu.log")
    env = gpu_environment(args.build_dir, log)
    if env is None:
        return 2
    from msa_bench.kernels.cute.manifest import CuteConfig, device_arch, find_library
    build_dir = Path(env["build_dir"])
    dtypes = [d for d in args.dtypes.split(",") if d]
    result = {"environment": env, "checks": [], "timing": []}
    for dtype in dtypes:
        for v, c in cute_configs(dtype):
            path, reason = find_library(CuteConfig(dtype, ctas_per_sm=c, variant=v), build_dir, device_arch(0))
            log(f"library {dtype} {config_label(v, c)}: {path if path else 'UNAVAILABLE: ' + reason}")
    t0 = time.perf_counter()
    # one kernel generation at a time, checks then timing, the JSON rewritten after each: a new
    # kernel that faults (and poisons the CUDA context) cannot take the older one's results with it
    variants = [v for v in args.variants.split(",") if v]
    from msa_bench.kernels.cute.manifest import VARIANTS
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        log(f"error: unknown CuTe kernel variant(s) {', '.join(unknown)} (have {', '.join(VARIANTS)})")
        return 2
    for i, variant in enumerate(variants):
        for dtype in dtypes:
            configs = [(v, c) for v, c in cute_configs(dtype) if v == variant]
            for label, make in workloads(dtype, "cuda", args.quick):
                result["checks"].extend(check_case(label, make, dtype, log, configs))
            (out / "cute_gpu.json").write_text(json.dumps(result, indent=2, default=str))
        if args.rounds > 1:
            continue
        for dtype in dtypes:
            configs = [(v, c) for v, c in cute_configs(dtype) if v == variant]
            result["timing"].append(time_dtype(dtype, args.reps, log, configs, passed_configs(result, dtype, configs),
                                               with_triton=i == 0))
            (out / "cute_gpu.json").write_text(json.dumps(result, indent=2, default=str))
    if args.rounds > 1:
        for r in range(args.rounds):
            for dtype in dtypes:
                configs = [(v, c) for v, c in cute_configs(dtype) if v in variants]
                configs.sort(key=lambda vc: variants.index(vc[0]))
                rec = time_dtype(dtype, args.reps, log, configs, passed_configs(result, dtype, configs), with_triton=r == 0)
                rec["round"] = r
                result["timing"].append(rec)
                (out / "cute_gpu.json").write_text(json.dumps(result, indent=2, default=str))
        result["rounds_summary"] = rounds_summary(result["timing"])
    result["seconds"] = time.perf_counter() - t0
    (out / "cute_gpu.json").write_text(json.dumps(result, indent=2, default=str))

    log("")
    log("summary (CuTe DSL attention stage, sm_90a, kernel "
        f"{env['manifest'].get('kernel_version') if isinstance(env['manifest'], dict) else '?'})")
    for c in result["checks"]:
        err = c.get("output_rel_error")
        log(f"  check {c['dtype']:4s} {config_label(c['variant'], c['ctas_per_sm']):6s} {c['case']:30s} {'ok  ' if c.get('ok') else 'FAIL'} "
            + (f"rel.err {err:.2e} (tol {c['tol']:g})" if err is not None else c.get("error", "")[:120]))
    for t in result["timing"]:
        for impl in t.get("impls", []):
            r = t.get(impl, {})
            if "tflops" in r:
                log(f"  time  {t['dtype']:4s} {impl:11s} N {t['tokens']} pool {t['blocks_per_head']}: "
                    f"{r['graph_cold_l2']['median_s'] * 1e3:.3f} ms = {r['tflops']:.0f} TFLOP/s cold L2, "
                    f"{r['warm_tflops']:.0f} warm (target {t['target_tflops']})")
            else:
                log(f"  time  {t['dtype']:4s} {impl:11s} ERROR {r.get('error', t.get('error', '?'))[:120]}")
    for key, v in result.get("rounds_summary", {}).items():
        log(f"  rounds {key:22s} median {v['median']:6.1f} TFLOP/s over {v['n']} rounds "
            f"(min {v['min']:.1f}, max {v['max']:.1f}): {', '.join(f'{x:.0f}' for x in v['tflops'])}")
    log(f"wrote {out / 'cute_gpu.json'} ({result['seconds']:.0f} s)")
    return 0 if all(c.get("ok") for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
