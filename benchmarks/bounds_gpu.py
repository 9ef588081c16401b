"""What bounds the attention stage at the perf point: its time with Q's DRAM reads taken away, and the
time the GPU needs just to write the partials the contract asks for.

    source scripts/gpu-setup.sh && python3 benchmarks/bounds_gpu.py [--out DIR] [--dtypes bf16,fp8]
        [--impls v18,triton] [--alias 0,2048,256] [--rounds 3] [--reps 20]

Workload: cute_gpu.py's perf point (N 16384, 1024 blocks per KV head, uniform top-16). For each dtype
and implementation (vN = kv-outer-cute generation N or a knock-out build such as v23ko-bare, with an
optional tile order vN+ORDER, e.g. v23+1:0; `triton` = the kv-outer Triton stage with its tuned
configuration) the module runs once, then the attention stage alone is timed with the harness
protocol (CUDA graph replay, L2 flushed before every sample) with the index map's csr_query as
computed (alias 0) and with every query index replaced by its value mod A (alias A). An aliased stage
walks the same tiles, issues the same MMAs and softmax, and stores the same partials at the same rows;
only its Q gathers come from A tokens (A x Hq x D elements, 4 MiB bf16 at A 256), which stay in L2.
So alias 0 minus alias A is what Q's DRAM reads cost, and at a fixed clock (under ncu) the alias-A
time bounds what any schedule that keeps Q in L2 could reach with that kernel. At boost clocks the
board's power cap moves the clock too, so every measurement records the SM clock NVML reports while
it runs (polled every 5 ms: mean, lowest, and the share of polls with a power or thermal slowdown
reason). Aliased outputs are not attention of the workload and are not checked (cute_gpu.py and the
harness check the real stage). With --energy-launches N, each implementation then runs N warm launches
back to back between two reads of the board's energy counter: joules and mean power per launch.

The write floor: o_part, m_part and l_part (the partials the combine reads) written once by torch's
fill_ and by a plain Triton store kernel, and copied once with copy_ (a check against the measured
copy rate), all cold and eager; their bytes over the fastest write's time bound the stage whatever
it computes. TFLOP/s everywhere are the perf point's useful FLOPs over the time. Rounds interleave
all measurements so clock drift falls on all alike; the summary gives medians over rounds. Writes
DIR/bounds_gpu.json and DIR/bounds_gpu.log (DIR: --out, $OUT, or results/bounds-gpu). Budget: under
a minute on the H200 with the defaults (15 s of measurement at three rounds).
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

from msa_bench.kernels.kv_outer import triton_mode  # noqa: F401  (before triton: the interpreter on a CPU)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cute_gpu import PERF, TARGET_TFLOPS, gpu_environment, perf_workload, useful_flops  # noqa: E402

from msa_bench.harness.tee_log import TeeLog as Log  # noqa: E402
from msa_bench.harness.telemetry import Poller, is_throttled, open_telemetry  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PARTIALS = ("o_part", "m_part", "l_part")
POLL_S = 0.005             # NVML polls while one measurement (about 25 stage runs) is timed
# ways to move the partials' bytes (dst, a same-shaped src): the write floor is the fastest write
FLOORS = {
    "fill": lambda dst, src: dst.fill_(1.0),
    "triton-store": lambda dst, src: store_zeros(dst),
    "copy": lambda dst, src: dst.copy_(src),
}


def backend_for(impl: str):
    """impl: `triton`, or a CuTe generation or diagnostic build with an optional tile order, GEN[+ORDER]
    (config.tile_order's notation; without one, the backend's order for the workload)."""
    if impl == "triton":
        from msa_bench.kernels.kv_outer.backend import KVOuterBackend
        return KVOuterBackend()
    from msa_bench.kernels.cute.backend import KVOuterCuteBackend
    from msa_bench.kernels.cute.manifest import diagnostic_base
    variant, _, order = impl.partition("+")
    return KVOuterCuteBackend(variant=diagnostic_base(variant) or variant, order=order or None)


def plan_for(impl: str, w):
    """The module plan of an implementation; a knock-out (manifest.KNOCKOUT_VARIANTS) is its base
    generation's plan with the attention stage swapped for the knock-out library on the same buffers."""
    from msa_bench.kernels.cute.manifest import diagnostic_base
    plan = backend_for(impl).plan(w)
    variant = impl.partition("+")[0]
    if diagnostic_base(variant):
        from msa_bench.kernels.cute.backend import diagnostic_stage
        plan.stages["attention"] = diagnostic_stage(plan, w, variant)
    return plan


@triton.jit
def store_zeros_kernel(ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + i, tl.zeros((BLOCK,), tl.int32), mask=i < n)


def store_zeros(t: torch.Tensor, block: int = 8192) -> None:
    """A plain streaming write of t's bytes (as int32 words) by a Triton kernel."""
    words = t.view(-1).view(torch.int32)
    store_zeros_kernel[(triton.cdiv(words.numel(), block),)](words, words.numel(), BLOCK=block)


class Repeater:
    """One callable, run once and then launched again and again: replayed from a CUDA graph captured
    after that first run (graph=True; the stage's ctypes launch is then one replay), or called eagerly
    (a graph turns torch's copy_ into a memcpy node that the copy engines run, which is not what a
    kernel's stores see)."""

    def __init__(self, fn, graph: bool):
        fn()
        torch.cuda.synchronize()
        self.fn, self.graph = fn, None
        if graph:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                fn()
            torch.cuda.synchronize()

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


class ColdTimer:
    """Launches of one callable (Repeater: from a CUDA graph, the harness protocol, or eagerly), the L2
    flushed (a 2 x L2 write) before each sample."""

    def __init__(self, fn, device, graph: bool = True):
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        self.flush = torch.empty(2 * l2, dtype=torch.uint8, device=device)
        self._call = Repeater(fn, graph)

    def median_s(self, reps: int, warmup: int = 3) -> float:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for _ in range(warmup):
            self.flush.zero_()
            self._call()
        for i in range(reps):
            self.flush.zero_()
            starts[i].record()
            self._call()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def measure_dtype(dtype: str, impls: list[str], aliases: list[int], rounds: int, reps: int, log,
                  energy_launches: int = 0) -> dict:
    w = perf_workload(dtype, "cuda")
    flops = useful_flops(w)
    rec = {"dtype": dtype, **PERF, "useful_flops": flops, "target_tflops": TARGET_TFLOPS[dtype],
           "samples": {}}
    timers, plans, originals = {}, {}, {}
    for impl in impls:
        try:
            plan = plan_for(impl, w)
            plan.run()
            torch.cuda.synchronize()
            plans[impl] = plan
            originals[impl] = plan.buffers["csr_query"].clone()
            timers[impl] = ColdTimer(plan.stages["attention"], w.device)
        except Exception as exc:
            rec[f"{impl} error"] = f"{type(exc).__name__}: {exc}"
            rec[f"{impl} trace"] = traceback.format_exc()
            log(f"{dtype:4s} {impl:7s} ERROR {type(exc).__name__}: {str(exc)[:300]}")
    # the write floor over the partial buffers of the first plan (both stages' are the same size)
    first = next(iter(plans.values()), None)
    if first is not None:
        b = first.buffers
        nbytes = sum(b[k].numel() * b[k].element_size() for k in PARTIALS)
        rec["partial_bytes"] = nbytes
        src = {k: torch.empty_like(b[k]) for k in PARTIALS}
        for name, fn in FLOORS.items():
            timers[name] = ColdTimer(lambda fn=fn: [fn(b[k], src[k]) for k in PARTIALS], w.device, graph=False)
    tel = open_telemetry(w.device)

    def timed(key: str, timer: ColdTimer) -> tuple[float, str]:
        """Median seconds of one measurement, with the SM clock NVML saw while it ran."""
        poller = Poller(tel.sample, interval_s=POLL_S).start() if tel.available else None
        s = timer.median_s(reps)
        polls = poller.stop() if poller else []
        rec["samples"].setdefault(key, []).append(s)
        if not polls:
            return s, "no telemetry"
        clocks = [p["sm_clock_mhz"] for p in polls]
        slowed = sum(is_throttled(int(p["clock_event_reasons"])) for p in polls) / len(polls)
        rec["clocks"].setdefault(key, []).append({"sm_clock_mean_mhz": statistics.fmean(clocks),
                                                  "sm_clock_min_mhz": min(clocks), "polls": len(polls),
                                                  "slowdown_poll_share": slowed,
                                                  "power_max_w": max(p["power_w"] for p in polls)})
        return s, f"SM clock mean {statistics.fmean(clocks):.0f} MHz (min {min(clocks):.0f}), slowdown in {slowed:.0%} of {len(polls)} polls"

    rec["clocks"] = {}
    for r in range(rounds):
        for impl, plan in plans.items():
            q = plan.buffers["csr_query"]
            for a in aliases:
                q.copy_(originals[impl] if a == 0 else originals[impl] % a)
                s, clock = timed(f"{impl} alias {a}", timers[impl])
                log(f"{dtype:4s} round {r} {impl:7s} alias {a:5d}: {s * 1e3:7.3f} ms = {flops / s / 1e12:6.1f} TFLOP/s; {clock}")
            q.copy_(originals[impl])
        for name in FLOORS:
            if name in timers:
                s, clock = timed(name, timers[name])
                moved = rec["partial_bytes"] * (2 if name == "copy" else 1)
                log(f"{dtype:4s} round {r} {name:12s} partials ({rec['partial_bytes'] / 1e9:.2f} GB): {s * 1e3:7.3f} ms "
                    f"= {moved / s / 1e12:.2f} TB/s moved" + ("" if name == "copy" else
                                                              f"; as the stage's floor {flops / s / 1e12:6.1f} TFLOP/s")
                    + f"; {clock}")
    if energy_launches:
        measure_energy(rec, plans, timers, tel, energy_launches, flops, log)
    rec["median_s"] = {k: statistics.median(v) for k, v in rec["samples"].items()}
    rec["tflops"] = {k: flops / v / 1e12 for k, v in rec["median_s"].items()}
    writes = [rec["median_s"][k] for k in FLOORS if k != "copy" and k in rec["median_s"]]
    if writes:
        rec["write_floor_s"] = min(writes)
        rec["write_tb_s"] = rec["partial_bytes"] / rec["write_floor_s"] / 1e12
        rec["write_floor_tflops"] = flops / rec["write_floor_s"] / 1e12
        rec["copy_tb_s"] = 2 * rec["partial_bytes"] / rec["median_s"]["copy"] / 1e12
    del timers, plans, originals, w
    torch.cuda.empty_cache()
    return rec


ENERGY_POLL_S = 0.01       # NVML polls while energy_of runs


def energy_of(call, tel, seconds: float = 0.0, sync=None, launches: int | None = None) -> dict:
    """Joules, seconds, mean power and clocks per launch of `call`, run back to back between two reads
    of the board's energy counter (NVML) after three warm-up launches: `launches` of them, or as many
    as fill about `seconds` (timed from three more)."""
    sync = sync or torch.cuda.synchronize
    for _ in range(3):
        call()
    sync()
    if launches is None:
        t0 = time.perf_counter()
        for _ in range(3):
            call()
        sync()
        per = max((time.perf_counter() - t0) / 3, 1e-6)
        launches = max(5, math.ceil(seconds / per))
    poller = Poller(tel.sample, interval_s=ENERGY_POLL_S).start()
    e0, t0 = tel.energy_j(), time.perf_counter()
    for _ in range(launches):
        call()
    sync()
    e1, t1 = tel.energy_j(), time.perf_counter()
    polls = poller.stop()
    rec = {"launches": launches, "joules_per_launch": (e1 - e0) / launches, "s_per_launch": (t1 - t0) / launches,
           "mean_power_w": (e1 - e0) / (t1 - t0)}
    if polls:
        clocks = [p["sm_clock_mhz"] for p in polls]
        rec.update(sm_clock_mean_mhz=statistics.fmean(clocks), sm_clock_min_mhz=min(clocks), polls=len(polls),
                   slowdown_poll_share=sum(is_throttled(int(p["clock_event_reasons"])) for p in polls) / len(polls),
                   power_max_w=max(p["power_w"] for p in polls))
    return rec


def measure_energy(rec: dict, plans: dict, timers: dict, tel, launches: int, flops: float, log) -> None:
    """Energy per stage launch with the real csr_query: `launches` warm graph replays back to back
    (energy_of). At the power cap, time per launch is about energy per launch over the cap's power."""
    if not tel.available or tel.energy_j() is None:
        rec["energy"] = "unavailable: NVML has no energy counter here"
        log(f"{rec['dtype']:4s} energy: NVML has no energy counter here")
        return
    rec["energy"] = {}
    for impl in plans:
        e = energy_of(timers[impl]._call, tel, launches=launches)
        e["gflop_per_joule"] = flops / e["joules_per_launch"] / 1e9
        rec["energy"][impl] = e
        log(f"{rec['dtype']:4s} energy {impl:14s} {e['joules_per_launch']:6.3f} J per launch over {launches} warm launches, "
            f"{e['s_per_launch'] * 1e3:.3f} ms each at {e['mean_power_w']:.0f} W mean "
            f"({e['gflop_per_joule']:.0f} GFLOP/J; SM clock {e.get('sm_clock_mean_mhz', 0):.0f} MHz)")


def parse_aliases(text: str, log) -> list[int] | None:
    """--alias: comma-separated query index moduli (0: the real csr_query); None after one logged error
    line. Callers check the range with their other arguments."""
    try:
        return [int(a) for a in text.split(",") if a]
    except ValueError:
        log(f"error: --alias wants integers, got {text!r}")
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/bounds-gpu")
    ap.add_argument("--build-dir", default=os.environ.get("MSA_BENCH_CUTE_DIR") or str(REPO / "build" / "cute"))
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--impls", default="v18,triton", help="vN[+ORDER] (kv-outer-cute generation or knock-out, optional tile order such as 1:0 or 4:p) or triton, comma-separated")
    ap.add_argument("--alias", default="0,2048,256",
                    help="query index moduli; 0 = the real csr_query (A tokens' Q: A x 16 KiB bf16)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20, help="samples per measurement and round (median)")
    ap.add_argument("--energy-launches", type=int, default=0,
                    help="also measure joules per stage launch over this many warm launches (0: off)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "bounds_gpu.log")
    aliases = parse_aliases(args.alias, log)
    if aliases is None:
        return 2
    if any(a < 0 for a in aliases) or args.rounds < 1 or args.reps < 1 or args.energy_launches < 0:
        log("error: --alias values must be >= 0, --rounds and --reps >= 1, --energy-launches >= 0")
        return 2
    env = gpu_environment(args.build_dir, log)
    if env is None:
        return 2
    impls = [i for i in args.impls.split(",") if i]
    result = {"environment": env, "args": vars(args), "dtypes": []}
    t0 = time.perf_counter()
    for dtype in [d for d in args.dtypes.split(",") if d]:
        result["dtypes"].append(measure_dtype(dtype, impls, aliases, args.rounds, args.reps, log, args.energy_launches))
        (out / "bounds_gpu.json").write_text(json.dumps(result, indent=2, default=str))
    result["seconds"] = time.perf_counter() - t0
    (out / "bounds_gpu.json").write_text(json.dumps(result, indent=2, default=str))
    log("")
    log(f"summary (perf point N {PERF['tokens']}, {PERF['blocks_per_head']} blocks per KV head; medians over "
        f"{args.rounds} rounds; TFLOP/s = useful FLOPs / time)")
    for rec in result["dtypes"]:
        for key, s in rec.get("median_s", {}).items():
            c = rec.get("clocks", {}).get(key, [])
            clock = (f"; SM clock {statistics.median(x['sm_clock_mean_mhz'] for x in c):.0f} MHz "
                     f"(slowdown in {statistics.fmean(x['slowdown_poll_share'] for x in c):.0%} of polls)") if c else ""
            log(f"  {rec['dtype']:4s} {key:20s} {s * 1e3:7.3f} ms  {rec['tflops'][key]:6.1f} TFLOP/s "
                f"(target {rec['target_tflops']}){clock}")
        if "write_tb_s" in rec:
            log(f"  {rec['dtype']:4s} partials {rec['partial_bytes'] / 1e9:.2f} GB: fastest write {rec['write_tb_s']:.2f} TB/s "
                f"= a floor of {rec['write_floor_tflops']:.0f} TFLOP/s; copy {rec['copy_tb_s']:.2f} TB/s (read + write)")
    log(f"wrote {out / 'bounds_gpu.json'} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
