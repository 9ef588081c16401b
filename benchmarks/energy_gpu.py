"""What one attention-stage launch's energy is made of, against the energy the targets allow at the
board's power limit.

    source scripts/gpu-setup.sh && python3 benchmarks/energy_gpu.py [--out DIR] [--dtypes bf16,fp8]
        [--impls v23,v28,v23ko-softmax,v23ko-o-store,v23ko-bare] [--alias 0,256] [--seconds 2]
        [--rounds 2] [--idle-s 2]

Workload: cute_gpu.py's perf point (N 16384, 1024 blocks per KV head, uniform top-16), whose useful
FLOPs are 2^40, exactly those of one 8192^3 matmul. Each item runs back to back (warm, no L2 flush,
no gaps) for about --seconds between two reads of the board's energy counter (NVML total energy),
with the SM clock, power and slowdown reasons polled meanwhile:
- `matmul`: a dense 8192^3 matmul on random data (bf16: torch.matmul; fp8: torch._scaled_mm, e4m3,
  unit scales, bf16 out): the tensor cores' own energy for the stage's FLOPs;
- `write`: the stage's partials (o_part, m_part, l_part) written once by a plain Triton store kernel:
  the energy of the bytes the contract makes the stage write;
- `matmul+write`: both at once on two streams (each launch = one of each);
- each stage implementation (vN = kv-outer-cute generation N, a knock-out such as v23ko-softmax, either
  with an optional tile order such as v23+1:0 (default: the backend's order for the workload),
  `triton` = the Triton stage), with the real csr_query (alias 0) and with every query index taken
  mod A (Q gathers from A tokens, L2-resident at A 256), as bounds_gpu.py does.
Each item is also timed in bursts, as the harness times a unit (after --rest seconds idle: median of
--reps launches, the L2 flushed before each), so the table shows both regimes of a power-capped board:
a burst that ends before the power controller settles, and the sustained run whose speed its energy
sets. The idle board is measured before and after (nothing launched for --idle-s seconds). Rounds
interleave all items so drift falls on all alike; the summary gives medians over rounds, then
roofline/energy.py's budget: at target time T* = FLOPs / target the board can spend
(P_limit - P_idle) x T* above idle, and each item's energy above idle is shown as a share of that.
Shares are estimates, not bounds: energy per operation falls with the clock, and idle draw understates
static draw under load (both caveats favour the target). Writes DIR/energy_gpu.json and
DIR/energy_gpu.log (DIR: --out, $OUT, or results/energy-gpu). Budget: about 4 minutes on the H200
with the defaults.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bounds_gpu import PARTIALS, ColdTimer, Repeater, energy_of, parse_aliases, plan_for, store_zeros  # noqa: E402
from cute_gpu import PERF, TARGET_TFLOPS, gpu_environment, perf_workload, useful_flops  # noqa: E402

from msa_bench.harness.tee_log import TeeLog as Log  # noqa: E402
from msa_bench.harness.telemetry import Poller, is_throttled, open_telemetry  # noqa: E402
from msa_bench.roofline.energy import EnergyBudget, above_idle_j  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BURST_POLL_S = 0.005      # NVML polls during a burst (energy_of polls at bounds_gpu.ENERGY_POLL_S)
MATMUL_N = 8192           # 2 x 8192^3 = 2^40 FLOPs = the perf point's useful FLOPs


def idle_power(tel, seconds: float, settle_s: float = 1.0) -> dict:
    """The board's draw with nothing launched: energy over `seconds` after `settle_s` of quiet."""
    torch.cuda.synchronize()
    time.sleep(settle_s)
    poller = Poller(tel.sample, interval_s=0.05).start()
    e0, t0 = tel.energy_j(), time.perf_counter()
    time.sleep(seconds)
    e1, t1 = tel.energy_j(), time.perf_counter()
    polls = poller.stop()
    return {"watts": (e1 - e0) / (t1 - t0), "seconds": t1 - t0,
            "sm_clock_mean_mhz": statistics.fmean(p["sm_clock_mhz"] for p in polls) if polls else None}


def dense_matmul(dtype: str, device):
    """A callable doing one 8192^3 matmul of `dtype` on random data (2^40 FLOPs)."""
    g = torch.Generator(device=device).manual_seed(5)
    a = torch.randn(MATMUL_N, MATMUL_N, device=device, generator=g)
    b = torch.randn(MATMUL_N, MATMUL_N, device=device, generator=g)
    if dtype == "bf16":
        a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        c = torch.empty_like(a)
        return lambda: torch.matmul(a, b, out=c)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)   # b8.t() is the column-major B _scaled_mm wants
    one = torch.ones((), device=device, dtype=torch.float32)
    return lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def two_streams(first, second):
    """One launch of each, the second on a side stream, joined before the next pair."""
    side = torch.cuda.Stream()

    def both():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            second()
        first()
        main.wait_stream(side)
    return both


def build_items(dtype: str, impls: list[str], aliases: list[int], log) -> tuple[dict, dict, float, int | None]:
    """The callables of one dtype: {name: (Repeater, setup)}, where setup() puts the plan's csr_query in
    place for an aliased item; also the per-item errors, the useful FLOPs and the partials' bytes."""
    w = perf_workload(dtype, "cuda")
    flops = useful_flops(w)
    items, errors, partial_bytes = {}, {}, None
    mm = dense_matmul(dtype, w.device)
    items["matmul"] = (Repeater(mm, graph=False), None)
    first = None
    for impl in impls:
        try:
            plan = plan_for(impl, w)
            plan.run()
            torch.cuda.synchronize()
        except Exception as exc:
            errors[impl] = f"{type(exc).__name__}: {exc}"
            log(f"{dtype:4s} {impl}: ERROR {type(exc).__name__}: {str(exc)[:300]}")
            log(traceback.format_exc().splitlines()[-1])
            continue
        first = first or plan
        q = plan.buffers["csr_query"]
        original = q.clone()
        stage = Repeater(plan.stages["attention"], graph=True)
        for a in aliases:
            items[f"{impl} Q~{a}" if a else impl] = (
                stage, (lambda q=q, o=original, a=a: q.copy_(o % a if a else o)))
    if first is not None:
        b = first.buffers
        write = lambda: [store_zeros(b[k]) for k in PARTIALS]  # noqa: E731
        items["write"] = (Repeater(write, graph=False), None)
        items["matmul+write"] = (Repeater(two_streams(mm, write), graph=False), None)
        partial_bytes = sum(b[k].numel() * b[k].element_size() for k in PARTIALS)
    return items, errors, flops, partial_bytes


def burst_of(timer: ColdTimer, tel, reps: int, rest_s: float) -> dict:
    """The harness protocol after `rest_s` idle: median of `reps` launches, each after an L2 flush."""
    torch.cuda.synchronize()
    time.sleep(rest_s)
    poller = Poller(tel.sample, interval_s=BURST_POLL_S).start()
    s = timer.median_s(reps)
    polls = poller.stop()
    rec = {"s": s}
    if polls:
        rec.update(sm_clock_mean_mhz=statistics.fmean(p["sm_clock_mhz"] for p in polls),
                   slowdown_poll_share=sum(is_throttled(int(p["clock_event_reasons"])) for p in polls) / len(polls))
    return rec


def measure_dtype(dtype: str, impls, aliases, rounds: int, seconds: float, tel, idle_w: float, limit_w: float,
                  log, reps: int = 20, rest_s: float = 0.5) -> dict:
    items, errors, flops, partial_bytes = build_items(dtype, impls, aliases, log)
    rec = {"dtype": dtype, **PERF, "useful_flops": flops, "target_tflops": TARGET_TFLOPS[dtype],
           "partial_bytes": partial_bytes, "errors": errors, "samples": {}}
    timers = {}
    for r in range(rounds):
        for name, (call, setup) in items.items():
            if setup is not None:
                setup()
            if name not in timers:
                timers[name] = ColdTimer(call, "cuda", graph=False)
            b = burst_of(timers[name], tel, reps, rest_s)
            e = energy_of(call, tel, seconds)
            e["burst_s"], e["burst_sm_clock_mhz"] = b["s"], b.get("sm_clock_mean_mhz", 0.0)
            rec["samples"].setdefault(name, []).append(e)
            log(f"{dtype:4s} round {r} {name:22s} burst {b['s'] * 1e3:6.3f} ms (SM {e['burst_sm_clock_mhz']:4.0f} MHz); "
                f"back to back {e['joules_per_launch']:6.3f} J  {e['s_per_launch'] * 1e3:6.3f} ms  "
                f"{e['mean_power_w']:4.0f} W  SM {e.get('sm_clock_mean_mhz', 0):4.0f} MHz "
                f"(min {e.get('sm_clock_min_mhz', 0):4.0f}), slowdown in {e.get('slowdown_poll_share', 0):.0%} of polls; "
                f"{e['launches']} launches")
        for name, (call, setup) in items.items():   # leave every plan's csr_query real
            if setup is not None and "~" not in name:
                setup()
    rec["median"] = {name: {k: statistics.median(s[k] for s in samples) for k in samples[0]
                            if isinstance(samples[0][k], (int, float))}
                     for name, samples in rec["samples"].items()}
    budget = EnergyBudget(flops, TARGET_TFLOPS[dtype], limit_w, idle_w)
    rec["budget"] = {"target_s": budget.target_s, "joules_at_limit": budget.joules_at_limit,
                     "above_idle_j": budget.above_idle_j, "gflop_per_j": budget.gflop_per_j,
                     "power_limit_w": limit_w, "idle_w": idle_w}
    for name, m in rec["median"].items():
        m["above_idle_j"] = above_idle_j(m["joules_per_launch"], m["s_per_launch"], idle_w)
        m["budget_share"] = budget.share(m["above_idle_j"])
        m["tflops"] = flops / m["s_per_launch"] / 1e12
        m["burst_tflops"] = flops / m["burst_s"] / 1e12
        m["tflops_at_cap"] = budget.tflops_at_cap(m["above_idle_j"])
        m["gflop_per_j"] = flops / m["joules_per_launch"] / 1e9
    del items, timers
    torch.cuda.empty_cache()
    return rec


def summarize(rec: dict, log) -> None:
    b, med = rec["budget"], rec["median"]
    log(f"{rec['dtype']}: target {rec['target_tflops']} TFLOP/s = {b['target_s'] * 1e3:.3f} ms per launch; at the "
        f"{b['power_limit_w']:.0f} W limit that is {b['joules_at_limit']:.3f} J ({b['gflop_per_j']:.0f} GFLOP/J), "
        f"{b['above_idle_j']:.3f} J above the {b['idle_w']:.0f} W idle draw")
    log("  item                   | burst: TFLOP/s-eq., SM MHz | back to back: J, ms, TFLOP/s-eq., W, SM MHz "
        "| above idle: J, share of the budget, TFLOP/s-eq. at the cap")
    for name, m in med.items():
        burst = (f"{m['burst_tflops']:6.1f}  {m.get('burst_sm_clock_mhz', 0):4.0f}" if "burst_tflops" in m
                 else " " * 12)
        log(f"  {name:22s} | {burst} | {m['joules_per_launch']:6.3f} J  {m['s_per_launch'] * 1e3:6.3f} ms  "
            f"{m['tflops']:6.1f}  {m['mean_power_w']:4.0f} W  {m.get('sm_clock_mean_mhz', 0):4.0f} | "
            f"{m['above_idle_j']:6.3f} J  {m['budget_share']:5.0%}  {m['tflops_at_cap']:6.1f}")
    if "matmul" in med and "write" in med:
        apart = med["matmul"]["above_idle_j"] + med["write"]["above_idle_j"]
        log(f"  dense matmul + partial write, measured apart: {apart:.3f} J above idle = {apart / b['above_idle_j']:.0%} "
            f"of the budget")
        if "matmul+write" in med:
            m = med["matmul+write"]
            log(f"  the two together (two streams): {m['s_per_launch'] * 1e3:.3f} ms, {m['above_idle_j']:.3f} J above "
                f"idle = {m['budget_share']:.0%} of the budget")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/energy-gpu")
    ap.add_argument("--build-dir", default=os.environ.get("MSA_BENCH_CUTE_DIR") or str(REPO / "build" / "cute"))
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--impls", default="v23,v28,v23ko-softmax,v23ko-o-store,v23ko-bare",
                    help="vN[+ORDER] (kv-outer-cute generation or knock-out build, optional tile order) or triton, "
                         "comma-separated")
    ap.add_argument("--alias", default="0,256", help="query index moduli; 0 = the real csr_query")
    ap.add_argument("--seconds", type=float, default=2.0, help="back-to-back run per item and round (s)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=2.0, help="idle measurement before and after (s)")
    ap.add_argument("--reps", type=int, default=20, help="burst: flushed launches per item and round (median)")
    ap.add_argument("--rest", type=float, default=0.5, help="burst: idle seconds before each burst")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "energy_gpu.log")
    aliases = parse_aliases(args.alias, log)
    if aliases is None:
        return 2
    if any(a < 0 for a in aliases) or args.rounds < 1 or args.reps < 1 or args.seconds <= 0 or args.idle_s <= 0 \
            or args.rest < 0:
        log("error: --alias values must be >= 0, --rounds and --reps >= 1, --seconds and --idle-s > 0, --rest >= 0")
        return 2
    env = gpu_environment(args.build_dir, log)
    if env is None:
        return 2
    tel = open_telemetry("cuda")
    if not tel.available or tel.energy_j() is None or tel.power_limit_w() is None:
        log(f"error: NVML gives no energy counter or power limit here ({tel.reason or 'not supported'})")
        return 2
    limit = tel.power_limit_w()
    result = {"environment": env, "args": vars(args), "power_limit_w": limit, "dtypes": []}
    result["idle_before"] = idle_power(tel, args.idle_s)
    log(f"power limit {limit:.0f} W; idle {result['idle_before']['watts']:.1f} W "
        f"(SM {result['idle_before']['sm_clock_mean_mhz'] or 0:.0f} MHz)")
    idle_w = result["idle_before"]["watts"]
    t0 = time.perf_counter()
    for dtype in [d for d in args.dtypes.split(",") if d]:
        result["dtypes"].append(measure_dtype(dtype, [i for i in args.impls.split(",") if i], aliases, args.rounds,
                                              args.seconds, tel, idle_w, limit, log, args.reps, args.rest))
        (out / "energy_gpu.json").write_text(json.dumps(result, indent=2, default=str))
    result["idle_after"] = idle_power(tel, args.idle_s)
    result["seconds"] = time.perf_counter() - t0
    (out / "energy_gpu.json").write_text(json.dumps(result, indent=2, default=str))
    log("")
    log(f"summary (perf point N {PERF['tokens']}, {PERF['blocks_per_head']} blocks per KV head, back to back; medians "
        f"over {args.rounds} rounds; idle {idle_w:.1f} W before, {result['idle_after']['watts']:.1f} W after)")
    for rec in result["dtypes"]:
        summarize(rec, log)
    log("shares of the budget are estimates: energy per operation falls with the clock, and idle draw "
        "understates static draw under load (both favour the target)")
    log(f"wrote {out / 'energy_gpu.json'} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
