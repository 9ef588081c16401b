"""What limits the attention stage: one Nsight Compute profile per implementation at the perf point.

    source scripts/gpu-setup.sh && python3 benchmarks/cute_ncu.py [--impls triton,v4,v9@4:8,v18~256]
                                                                  [--dtypes bf16,fp8] [--out DIR] [--source] [--spread]

For each (implementation, dtype) an `ncu` process profiles a child of this script that builds the
benchmarks/cute_gpu.py perf workload (N 16384, 1024 blocks per KV head, top-16 uniform picks), plans
the stage (`triton` = the kv-outer Triton stage on 8-token tiles, vN = kv-outer-cute generation N; a
suffix @S:k or @S:p sets the scheduler's tile order (config.tile_order's notation, see order_gpu.py); a knock-out
build such as v18ko-exp swaps its library into the base generation's plan, see bounds_gpu.py; a suffix ~A
replaces every query index by its value mod A after the first run, bounds_gpu.py's alias), runs
it once unprofiled, then once inside the NVTX range `msa-ncu`, the only launch profiled. Sections
SpeedOfLight, ComputeWorkloadAnalysis, MemoryWorkloadAnalysis and WarpStateStats plus the tensor-pipe
and DRAM byte metrics (ncu locks the clocks at base, so times compare across builds whatever the
board's power cap does at boost); the SM clock, issue-slot, MUFU (XU pipe) and L1 LSU data-pipe
(shared-memory and global wavefronts) utilizations are read from those sections;
the raw CSV of each profile is kept under DIR, and a line per profile gives time, DRAM bytes and
throughput, L2 hit rate, tensor-pipe activity and the largest warp stall reasons. With --source, a
second profile per implementation samples warp stalls per SASS instruction (SourceCounters) and
writes the instructions where most samples fell, with their stall reasons, to DIR/stalls_<impl>_<dtype>.txt.
With --spread, the profile also reads the max and mean over DRAM channels and L2 slices of the bytes
and sectors they served: max / mean near 1 means the traffic is spread evenly, near 4 that a quarter
of them carry it.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

RANGE = "msa-ncu"
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum",
           "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed", "lts__t_sector_hit_rate.pct")
SPREAD = ("dram__bytes_read.max", "dram__bytes_read.avg", "lts__t_sectors.max", "lts__t_sectors.avg")
STALL_KEY = "_issue_stalled_"          # smsp__average_warp(s|_latency)_issue_stalled_<reason>_per_issue_active.ratio


def plan_stage(spec: str, dtype: str):
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cute_gpu import perf_workload
    spec, _, alias = spec.partition("~")
    impl, _, order = spec.partition("@")
    from msa_bench.kernels.kv_outer.config import tile_order
    order_kw = tile_order(order or "1:0")          # S:k, S:p or phases, as in order_gpu.py
    w = perf_workload(dtype, "cuda")
    if impl == "triton":
        from msa_bench.kernels.kv_outer.backend import KVOuterBackend
        from msa_bench.kernels.kv_outer.config import default_config
        plan = KVOuterBackend(config=default_config(dtype).with_(tile_q=8, attn_chunk=0, attn_chunk_grid=0,
                                                                 attn_maxnreg=0, **order_kw)).plan(w)
    else:
        from bounds_gpu import plan_for          # a knock-out's library swapped into its base's plan
        plan = plan_for(f"{impl}+{order or '1:0'}", w)
    plan.run()
    if alias:
        q = plan.buffers["csr_query"]
        q.copy_(q % int(alias))
    torch.cuda.synchronize()
    return plan


def child(impl: str, dtype: str) -> None:
    import torch
    plan = plan_stage(impl, dtype)
    torch.cuda.nvtx.range_push(RANGE)
    plan.stages["attention"]()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def parse_raw(text: str) -> list[dict]:
    """Rows of ncu `--page raw --csv` (header, units row, one row per kernel) as {metric: (value, unit)}."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units = rows[0], rows[1]
    out = []
    for row in rows[2:]:
        if len(row) == len(header):
            out.append({h: (v, u) for h, v, u in zip(header, row, units)})
    return out


def number(cell) -> float | None:
    """A raw-page cell (value, unit) as a plain number, None when absent or not a number."""
    from msa_bench.harness.counters import _number
    return None if cell is None else _number(cell[0])


def scaled(cell, metric: str) -> float | None:
    """A raw-page cell in base units (bytes, seconds), with the harness's reading of ncu's units."""
    from msa_bench.harness.counters import _unit_factor
    v = number(cell)
    return None if v is None else v * _unit_factor(cell[1], metric)


CLOCK_UNITS_MHZ = {"hz": 1e-6, "khz": 1e-3, "mhz": 1.0, "ghz": 1e3, "cycle/second": 1e-6, "cycle/usecond": 1.0,
                   "cycle/nsecond": 1e3}


def clock_mhz(cell) -> float | None:
    """A frequency cell (value, unit) in MHz; None when absent or in a unit not known here."""
    v = number(cell)
    factor = CLOCK_UNITS_MHZ.get(cell[1].strip().lower()) if cell else None
    return None if v is None or factor is None else v * factor


def summarize(kernel: dict) -> dict:
    rec = {"kernel": kernel.get("Kernel Name", ("?",))[0][:80]}
    rec["time_s"] = scaled(kernel.get("gpu__time_duration.sum"), "gpu__time_duration.sum")
    rec["dram_read_bytes"] = scaled(kernel.get("dram__bytes_read.sum"), "dram__bytes_read.sum")
    rec["dram_write_bytes"] = scaled(kernel.get("dram__bytes_write.sum"), "dram__bytes_write.sum")
    rec["dram_pct_peak"] = number(kernel.get("dram__throughput.avg.pct_of_peak_sustained_elapsed"))
    rec["l2_hit_pct"] = number(kernel.get("lts__t_sector_hit_rate.pct"))
    rec["tensor_active_pct"] = number(kernel.get("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"))
    rec["sm_clock_mhz"] = clock_mhz(kernel.get("gpc__cycles_elapsed.avg.per_second"))
    for key, metric in (("issue_active_pct", "sm__issue_active.avg.pct_of_peak_sustained_elapsed"),
                        ("xu_pipe_pct", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
                        ("lsu_pipe_pct", "l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_elapsed")):
        rec[key] = number(kernel.get(metric))
    stalls = {k.split(STALL_KEY)[1].split("_per_issue_active")[0]: number(v) for k, v in kernel.items()
              if STALL_KEY in k and k.endswith("_per_issue_active.ratio") and "not_issued" not in k}
    rec["stalls_per_issue"] = dict(sorted(((k, v) for k, v in stalls.items() if v), key=lambda kv: -kv[1])[:6])
    for what in ("dram__bytes_read", "lts__t_sectors"):
        hi, mean = number(kernel.get(f"{what}.max")), number(kernel.get(f"{what}.avg"))
        if hi is not None and mean:
            rec[f"{what}_max_over_mean"] = hi / mean
    return rec


def file_tag(impl: str) -> str:
    return impl.replace("@", "_o").replace(":", "-").replace("~", "_a")


def profile(impl: str, dtype: str, out: Path, ncu: str, spread: bool = False) -> dict:
    metrics = METRICS + (SPREAD if spread else ())
    cmd = [ncu, "--csv", "--page", "raw", "--nvtx", "--nvtx-include", f"{RANGE}/", "--target-processes", "all",
           "--section", "SpeedOfLight", "--section", "ComputeWorkloadAnalysis", "--section", "MemoryWorkloadAnalysis",
           "--section", "WarpStateStats",
           "--metrics", ",".join(metrics), sys.executable, __file__, "--child", impl, "--dtypes", dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    (out / f"ncu_{file_tag(impl)}_{dtype}.csv").write_text(proc.stdout)
    kernels = parse_raw(proc.stdout)
    if proc.returncode or not kernels:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
        return {"impl": impl, "dtype": dtype, "error": f"ncu rc {proc.returncode}: {' | '.join(tail)}"}
    return {"impl": impl, "dtype": dtype, **summarize(kernels[-1]), "n_kernels": len(kernels)}


def source_hotspots(impl: str, dtype: str, out: Path, ncu: str, top: int = 40) -> str:
    """Profile once more with warp-stall sampling per instruction; the `top` SASS lines by samples."""
    rep = out / f"src_{file_tag(impl)}_{dtype}"
    cmd = [ncu, "-f", "-o", str(rep), "--nvtx", "--nvtx-include", f"{RANGE}/", "--target-processes", "all",
           "--section", "SourceCounters", "--section", "WarpStateStats",
           sys.executable, __file__, "--child", impl, "--dtypes", dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        return f"source profile failed (rc {proc.returncode}): {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
    page = subprocess.run([ncu, "-i", f"{rep}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                          capture_output=True, text=True, timeout=600)
    (out / f"source_{file_tag(impl)}_{dtype}.csv").write_text(page.stdout)
    rows = list(csv.reader(io.StringIO(page.stdout)))
    start = next((i for i, r in enumerate(rows) if r and ("Source" in r or "# Address" in r)), None)
    if start is None:
        return "source page: no table\n" + page.stdout[:2000]
    header = rows[start]
    col = {h: i for i, h in enumerate(header)}
    samples = next((h for h in header if h.startswith("Warp Stall Sampling (All")), None)
    if samples is None:
        return "source page: no stall-sampling column; columns: " + ", ".join(header)
    reasons = [h for h in header if h.startswith("stall_") or h.endswith("_samples")] or []
    body = [r for r in rows[start + 1:] if len(r) == len(header)]

    def num(x):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0
    total = sum(num(r[col[samples]]) for r in body) or 1.0
    lines = [f"{impl} {dtype}: {int(total)} stall samples over {len(body)} SASS lines; columns: {'; '.join(header)}",
             f"top {top} by {samples}:"]
    for r in sorted(body, key=lambda r: -num(r[col[samples]]))[:top]:
        why = sorted(((h, num(r[col[h]])) for h in reasons if h != samples and num(r[col[h]]) > 0), key=lambda kv: -kv[1])[:3]
        src = r[col["Source"]] if "Source" in col else r[1]
        lines.append(f"{100 * num(r[col[samples]]) / total:5.1f}%  {r[0]:>6s}  {src[:70]:70s}  "
                     + ", ".join(f"{h} {int(v)}" for h, v in why))
    return "\n".join(lines)


def line(r: dict) -> str:
    if "error" in r:
        return f"ncu {r['dtype']:4s} {r['impl']:6s} ERROR {r['error'][:300]}"
    t, rd, wr = r["time_s"] or float("nan"), r["dram_read_bytes"] or 0.0, r["dram_write_bytes"] or 0.0
    stalls = ", ".join(f"{k} {v:.2f}" for k, v in r["stalls_per_issue"].items())
    spread = "".join(f"  {k.split('_max')[0]} max/mean {v:.2f}" for k, v in r.items() if k.endswith("_max_over_mean"))
    return (f"ncu {r['dtype']:4s} {r['impl']:6s} {t * 1e3:7.3f} ms  DRAM read {rd / 1e9:5.2f} GB write {wr / 1e9:5.2f} GB "
            f"= {(rd + wr) / t / 1e12:4.2f} TB/s ({r['dram_pct_peak']}% of peak)  L2 hit {r['l2_hit_pct']}%  "
            f"tensor pipe {r['tensor_active_pct']}% active  SM clock {r.get('sm_clock_mhz') or 0:.1f} MHz  issue "
            f"{r.get('issue_active_pct')}%  XU {r.get('xu_pipe_pct')}%  L1 LSU {r.get('lsu_pipe_pct')}%{spread}  "
            f"stalls/issue: {stalls}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="triton,v4")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--out", default=os.environ.get("OUT") or "results/cute-ncu")
    ap.add_argument("--source", action="store_true", help="also sample warp stalls per SASS instruction")
    ap.add_argument("--spread", action="store_true", help="also read max / mean over DRAM channels and L2 slices")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.dtypes)
        return 0
    from msa_bench.harness.counters import find_ncu
    ncu = find_ncu()
    if ncu is None:
        print("error: ncu not found", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        for impl in [i for i in args.impls.split(",") if i]:
            r = profile(impl, dtype, out, ncu, args.spread)
            results.append(r)
            print(line(r), flush=True)
            (out / "cute_ncu.json").write_text(json.dumps(results, indent=2))
            if args.source:
                text = source_hotspots(impl, dtype, out, ncu)
                (out / f"stalls_{file_tag(impl)}_{dtype}.txt").write_text(text + "\n")
                print(text, flush=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
