"""Where a consumer warp's cycles go, tile by tile: the CuTe stage's phase-trace build at the perf point.

    source scripts/gpu-setup.sh && python3 benchmarks/trace_gpu.py [--out DIR] [--dtypes bf16,fp8]
        [--impls v22tr,v18tr] [--alias 0,256] [--plot-cta 66]

A trace build (manifest.TRACE_VARIANTS) is its base generation with every consumer warp reading the SM
clock at eight points of each pipelined iteration (manifest.TRACE_PHASES: loop top, Q and K/V
ready, S(t+1) and P(t) V issued, S done, softmax done, P V done, O stored, P(t+1) ready) and writing them
to m_part in place of the row maxima. This script plans cute_gpu.py's perf point (N 16384, 1024 blocks
per KV head) with the base generation, swaps the trace library in as the attention stage, runs it warm,
and reads the stamps back. Per phase: median and mean cycles per iteration, for each consumer
warpgroup, and their share of the iteration (top to next top). Whether the two warpgroups run in step:
the offset between their `issued` stamps on the same tile, as a share of the iteration. A trace build
only adds reads of the clock and eight stores per warp and tile; the log gives its stage time next to
the base generation's so the perturbation is visible. --alias A replaces every query index by its value
mod A first (bounds_gpu.py's alias: Q then comes from L2). Writes DIR/trace_gpu.json, DIR/trace_gpu.log
and DIR/trace_<impl>_<dtype>_a<A>.png, a timeline of one CTA's eight consumer warps over a stretch of
tiles (DIR: --out, $OUT, or results/trace-gpu). Budget: about 20 s on the H200.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cute_gpu import PERF, gpu_environment, perf_workload, useful_flops  # noqa: E402

from msa_bench.harness.tee_log import TeeLog as Log  # noqa: E402
from msa_bench.kernels.cute.manifest import TRACE_PHASES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PHASES = TRACE_PHASES
# (name, from stamp, to stamp): consecutive stamps, then the loop's tail to the next iteration's top
SPANS = (("wait Q, K/V", "top", "q_ready"), ("issue S, PV", "q_ready", "issued"),
         ("wait S", "issued", "s_done"), ("softmax", "s_done", "softmax_done"),
         ("wait PV", "softmax_done", "pv_done"), ("store O", "pv_done", "stored"),
         ("P to operand", "stored", "p_ready"), ("loop tail", "p_ready", "next top"))
WARPS, ROWS = 8, 128


def stamps_of(m_part: torch.Tensor, cta_range: torch.Tensor) -> list[torch.Tensor]:
    """Per CTA, its traced iterations' stamps as a (iterations, warps, phases) float64 tensor of cycles
    since the consumers' common start. Iteration i is tile begin + i; a CTA's last tile has none."""
    m = m_part.double().view(-1, WARPS, 16)[:, :, :len(PHASES)]
    out = []
    for begin, end in cta_range.tolist():
        out.append(m[begin:max(begin, end - 1)])
    return out


def summarize(per_cta: list[torch.Tensor]) -> dict:
    """Phase durations (cycles) per consumer warpgroup, the iteration length, and the warpgroups' offset."""
    spans = {name: {0: [], 1: []} for name, _, _ in SPANS}
    iteration, offset_share = {0: [], 1: []}, []
    for st in per_cta:
        if st.shape[0] < 2:
            continue
        body, nxt = st[:-1], st[1:, :, 0]          # the last traced iteration has no next top
        for name, a, b in SPANS:
            d = (nxt if b == "next top" else body[:, :, PHASES.index(b)]) - body[:, :, PHASES.index(a)]
            for wg in (0, 1):
                spans[name][wg] += d[:, 4 * wg:4 * wg + 4].reshape(-1).tolist()
        it = nxt - body[:, :, 0]
        for wg in (0, 1):
            iteration[wg] += it[:, 4 * wg:4 * wg + 4].reshape(-1).tolist()
        issued = body[:, :, PHASES.index("issued")]
        off = (issued[:, 4] - issued[:, 0]).abs() / it[:, 0].clamp(min=1)
        offset_share += off.tolist()
    if not iteration[0]:
        return {"iterations": 0}
    rec = {"iterations": len(iteration[0]) // 4, "iteration_cycles": {}, "phases": {}}
    for wg in (0, 1):
        rec["iteration_cycles"][f"wg{wg}"] = {"median": statistics.median(iteration[wg]),
                                              "mean": statistics.fmean(iteration[wg])}
    for name in spans:
        rec["phases"][name] = {}
        for wg in (0, 1):
            v = spans[name][wg]
            rec["phases"][name][f"wg{wg}"] = {"median": statistics.median(v), "mean": statistics.fmean(v),
                                              "share": statistics.fmean(v) / rec["iteration_cycles"][f"wg{wg}"]["mean"]}
    q = sorted(offset_share)
    rec["wg_issue_offset_share"] = {"median": statistics.median(q), "p10": q[len(q) // 10], "p90": q[9 * len(q) // 10]}
    return rec


def plot_timeline(st: torch.Tensor, path: Path, title: str, first: int = 20, count: int = 8) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = ["#bbbbbb", "#4c72b0", "#8172b2", "#dd8452", "#937860", "#55a868", "#c44e52", "#64b5cd"]
    st = st[first:first + count + 1]
    fig, ax = plt.subplots(figsize=(12, 3.6))
    for w in range(WARPS):
        for i in range(st.shape[0] - 1):
            for k, (name, a, b) in enumerate(SPANS):
                x0 = float(st[i, w, PHASES.index(a)])
                x1 = float(st[i + 1, w, 0] if b == "next top" else st[i, w, PHASES.index(b)])
                ax.broken_barh([(x0 / 1e3, max(x1 - x0, 0.0) / 1e3)], (w - 0.4, 0.8), color=colors[k],
                               label=name if (w == 0 and i == 0) else None)
    ax.set_yticks(range(WARPS), [f"WG{w // 4} warp {w % 4}" for w in range(WARPS)])
    ax.invert_yaxis()
    ax.set_xlabel("SM clock, thousands of cycles since the consumers' start")
    ax.set_title(title, fontsize=9)
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def stage_ms(stage, reps: int = 10) -> float:
    """Median warm time of one attention-stage launch (CUDA events)."""
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        stage()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])


def trace_one(dtype: str, impl: str, aliases: list[int], plot_cta: int, out: Path, log) -> list[dict]:
    from msa_bench.kernels.cute.backend import KVOuterCuteBackend, diagnostic_stage
    from msa_bench.kernels.cute.manifest import trace_base
    base = trace_base(impl)
    w = perf_workload(dtype, "cuda")
    flops = useful_flops(w)
    plan = KVOuterCuteBackend(variant=base).plan(w)
    plan.run()
    base_stage = plan.stages["attention"]
    traced = diagnostic_stage(plan, w, impl)
    q = plan.buffers["csr_query"]
    original = q.clone()
    recs = []
    for a in aliases:
        q.copy_(original if a == 0 else original % a)
        t_base, t_trace = stage_ms(base_stage), stage_ms(traced)
        traced()
        torch.cuda.synchronize()
        per_cta = stamps_of(plan.buffers["m_part"].cpu(), plan.buffers["cta_range"].cpu())
        rec = {"dtype": dtype, "impl": impl, "base": base, "alias": a, "base_ms": t_base, "trace_ms": t_trace,
               "base_tflops": flops / t_base / 1e9, **summarize(per_cta)}
        cta = min(plot_cta, len(per_cta) - 1)
        rec["plot_cta"] = cta
        rec["plot_cta_stamps"] = per_cta[cta][:40].tolist()
        png = out / f"trace_{impl}_{dtype}_a{a}.png"
        plot_timeline(per_cta[cta], png, f"{impl} ({base} traced) {dtype}, perf point N {PERF['tokens']}, "
                      f"alias {a}: CTA {cta}, tiles 20-27")
        log(f"{dtype:4s} {impl} alias {a}: stage {t_base:.3f} ms ({base}, {rec['base_tflops']:.0f} TFLOP/s warm), "
            f"traced {t_trace:.3f} ms; {rec['iterations']} iterations")
        for wg in ("wg0", "wg1"):
            it = rec["iteration_cycles"][wg]
            parts = ", ".join(f"{name} {p[wg]['mean']:.0f} ({p[wg]['share']:.0%})" for name, p in rec["phases"].items())
            log(f"     {wg}: iteration {it['mean']:.0f} cycles (median {it['median']:.0f}): {parts}")
        o = rec["wg_issue_offset_share"]
        log(f"     warpgroups' issue offset on a tile, share of the iteration: median {o['median']:.2f} "
            f"(p10 {o['p10']:.2f}, p90 {o['p90']:.2f}); {png.name}")
        recs.append(rec)
    q.copy_(original)
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/trace-gpu")
    ap.add_argument("--build-dir", default=os.environ.get("MSA_BENCH_CUTE_DIR") or str(REPO / "build" / "cute"))
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--impls", default="", help="trace builds (manifest.TRACE_VARIANTS); default: each dtype's "
                                                "default generation's trace")
    ap.add_argument("--alias", default="0", help="query index moduli; 0 = the real csr_query")
    ap.add_argument("--plot-cta", type=int, default=66, help="the CTA whose warps the timeline shows")
    args = ap.parse_args(argv)
    from msa_bench.kernels.cute.backend import default_variant
    from msa_bench.kernels.cute.manifest import DTYPES, TRACE_VARIANTS, VARIANT_CTAS, trace_base
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "trace_gpu.log")
    dtypes = [d for d in args.dtypes.split(",") if d]
    impls = [i for i in args.impls.split(",") if i]
    try:
        aliases = [int(a) for a in args.alias.split(",") if a]
    except ValueError:
        log(f"error: --alias wants integers, got {args.alias!r}")
        return 2
    bad = [d for d in dtypes if d not in DTYPES] or [i for i in impls if i not in TRACE_VARIANTS]
    if bad or any(a < 0 for a in aliases) or args.plot_cta < 0:
        log(f"error: --dtypes from {', '.join(DTYPES)}, --impls from {', '.join(TRACE_VARIANTS)}, --alias and "
            f"--plot-cta >= 0" + (f" (got {bad[0]!r})" if bad else ""))
        return 2
    env = gpu_environment(args.build_dir, log)
    if env is None:
        return 2
    result, t0 = {"environment": env, "args": vars(args), "traces": []}, time.perf_counter()
    for dtype in dtypes:
        wanted = impls or [f"{default_variant(dtype)}tr"]
        for impl in wanted:
            if impl not in TRACE_VARIANTS or not VARIANT_CTAS[(trace_base(impl), dtype)]:
                log(f"{dtype:4s} {impl}: no trace build for this dtype, skipped")
                continue
            result["traces"] += trace_one(dtype, impl, aliases, args.plot_cta, out, log)
            (out / "trace_gpu.json").write_text(json.dumps(result, indent=1))
    result["seconds"] = time.perf_counter() - t0
    (out / "trace_gpu.json").write_text(json.dumps(result, indent=1))
    log(f"wrote {out / 'trace_gpu.json'} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
