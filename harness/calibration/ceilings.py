"""Device calibration: measure the ceilings the roofline divides by and write a device profile.

Microbenchmarks (GPU, CUDA events, warm-up, medians):
  HBM read   a Triton kernel that sums a >= 4 GiB fp32 buffer (the sum is stored, so no load is
             optimized away); a few (tile, grid) configurations, the best is kept.
  HBM copy   torch copy_ of a large bf16 tensor; bytes read + written.
  L2 sweep   the same read kernel, but with L1-bypassing loads (`cache_modifier=".cg"`), over working
             sets from 1 MiB to 2 GiB, the buffer read repeatedly within one launch (>= 1 GiB of loads
             per launch, chunk order rotating so no load is loop-invariant): the L2 plateau at small
             sizes, the HBM plateau at large ones.
  L2 best    the read kernel at a working set of L2/4 under a few (tile, grid, warps) configurations, and a
             gather of random 32 KiB blocks (one K or V block of 128 tokens x 128 bf16) from it: the L2
             ceiling is the highest of these and the sweep's plateau (a kernel reading blocks from L2 above
             the plateau alone showed it under the hardware's rate).
  MMA        8192^3 torch.matmul (bf16) and torch._scaled_mm (fp8 e4m3, bf16 out).
Pure parts (plateau detection, profile assembly, JSON and PNG writing) run anywhere.

L2 plateau rule (`l2_and_hbm_plateaus`): the plateau is searched only among working sets in the window
[L2/8, L2/2] (about 7.5 .. 30 MiB on a 60 MiB L2). Below L2/8 the SMs' L1 caches (132 SMs x up to
256 KiB, ~33 MiB in all) serve part of the repeated reads, even with .cg loads nothing guarantees the
smallest sets are pure L2, and launch overheads weigh more; a first H200 run without .cg showed 16.9 TB/s
at 1 MiB and 12.7 TB/s at 2-4 MiB, which is L1, not L2. Above L2/2 the working set starts to spill
(set conflicts, the two L2 partitions). Inside the window the widest run of points within 10% of its
median is the plateau (ties: the higher one). HBM: the same rule among working sets >= 2x the L2 (ties:
the larger sizes), reaching 4x the L2; a quick H200 run whose partly resident 60-90 MiB points chained
into the tail and cut its last point off had failed the earlier "run that ends at the largest set"
rule. The profile's hbm_bytes_per_s is the read stream (the read kernel, or the sweep's HBM plateau where
higher): the access pattern the kernels run; the copy_ (read + write) and both reads are recorded under
measured["hbm"], and `msa-bench calibrate` adds the vendor's figures of a matching preset under "vendor".
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import UserError
from ...roofline.devices import DeviceProfile, load_device, profile_from_dict

MIB = 1 << 20
GIB = 1 << 30


# ---- plateau detection (pure) ------------------------------------------------------------------

@dataclass(frozen=True)
class Plateau:
    first: int          # index of the first point in the run
    last: int           # index of the last point (inclusive)
    level: float        # median value over the run

    def sizes(self, sizes):
        return sizes[self.first], sizes[self.last]


def find_plateaus(values, rel_tol: float = 0.1, min_points: int = 2) -> list[Plateau]:
    """Maximal runs of consecutive points that stay within rel_tol of the run's median (greedy, left to
    right). Runs shorter than min_points are dropped."""
    runs, i, n = [], 0, len(values)
    while i < n:
        j = i + 1
        while j < n:
            med = statistics.median(values[i:j + 1])
            if any(abs(v - med) > rel_tol * med for v in values[i:j + 1]):
                break
            j += 1
        if j - i >= min_points:
            runs.append(Plateau(i, j - 1, float(statistics.median(values[i:j]))))
        i = j
    return runs


def l2_window(l2_bytes: int) -> tuple[int, int]:
    """The working-set window [L2/8, L2/2] in which the L2 plateau is looked for (see the module docstring)."""
    return l2_bytes // 8, l2_bytes // 2


def _plateaus_among(bandwidths, indices: list[int], rel_tol: float) -> list[Plateau]:
    """find_plateaus over the contiguous points `indices` (sorted), with indices into the whole sweep."""
    if not indices:
        return []
    first = indices[0]
    return [Plateau(p.first + first, p.last + first, p.level)
            for p in find_plateaus(bandwidths[first:indices[-1] + 1], rel_tol)]


def l2_and_hbm_plateaus(sizes, bandwidths, l2_bytes: int, rel_tol: float = 0.1) -> tuple[Plateau, Plateau]:
    """(L2 plateau, HBM plateau) of a bandwidth-versus-working-set sweep; indices refer to the points sorted
    by size.

    L2: among the points with L2/8 <= working set <= L2/2 only (large enough that L1 does not serve the
    repeated reads, small enough to stay resident in L2), the widest run within rel_tol of its median; ties
    go to the higher level. Points below L2/8 are ignored however fast they are (L1 hits).
    HBM: among the points with working set >= 2x the L2 only (past the partly resident sizes), the widest
    run within rel_tol of its median (ties: the larger sizes); it must reach 4x the L2. A noisy last point
    does not void the plateau before it.
    Raises UserError when the sweep does not show both."""
    if len(sizes) != len(bandwidths) or len(sizes) < 4:
        raise UserError("L2 sweep needs at least 4 (size, bandwidth) points")
    order = sorted(range(len(sizes)), key=lambda k: sizes[k])
    sizes = [sizes[k] for k in order]
    bandwidths = [bandwidths[k] for k in order]
    lo, hi = l2_window(l2_bytes)
    inside = [k for k in range(len(sizes)) if lo <= sizes[k] <= hi]
    small = _plateaus_among(bandwidths, inside, rel_tol)   # the window is contiguous in the sorted order
    if not small:
        raise UserError(f"L2 sweep shows no plateau below half the L2 in the window L2/8 .. L2/2 "
                        f"({lo / MIB:.1f} .. {hi / MIB:.1f} MiB, {len(inside)} points there); "
                        "add sizes in that window")
    l2 = max(small, key=lambda p: (p.last - p.first, p.level))
    big = _plateaus_among(bandwidths, [k for k in range(len(sizes)) if sizes[k] >= 2 * l2_bytes], rel_tol)
    hbm = max(big, key=lambda p: (p.last - p.first, p.last)) if big else None
    if hbm is None or sizes[hbm.last] < 4 * l2_bytes or hbm.level >= l2.level:
        raise UserError("L2 sweep shows no HBM plateau beyond 4x the L2; extend the sweep to larger sizes")
    return l2, hbm


# ---- fixed costs (pure) -------------------------------------------------------------------------

def theil_sen(xs, ys) -> tuple[float, float]:
    """(intercept, slope) of y against x, robust to outliers: the slope is the median of the pairwise
    slopes, the intercept the median of y - slope x (a packed module's time against its tile's blocks:
    the intercept is its fixed cost, the slope one block's walk)."""
    pts = [(float(x), float(y)) for x, y in zip(xs, ys)]
    if len(pts) < 2:
        raise UserError("a fixed-cost fit needs at least 2 (roofline time, measured time) points")
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pts) for x2, y2 in pts[i + 1:] if x2 != x1]
    if not slopes:
        raise UserError("a fixed-cost fit needs points at 2 or more roofline times")
    slope = statistics.median(slopes)
    return statistics.median(y - slope * x for x, y in pts), slope


def with_fixed_costs(data: dict, fixed_costs: dict, origin: str) -> DeviceProfile:
    """The profile JSON object `data` with its fixed_costs replaced, validated as a profile."""
    return profile_from_dict({**data, "fixed_costs": fixed_costs}, origin)


# ---- profile assembly and output (pure) ----------------------------------------------------------

def build_profile(name: str, m: dict) -> DeviceProfile:
    """A DeviceProfile from the measurement dict `run_calibration` returns (validated by devices.py)."""
    read, copy = float(m["hbm_read_bytes_per_s"]), float(m["hbm_copy_bytes_per_s"])
    plateau = float(m["hbm_plateau"]["bytes_per_s"]) if "hbm_plateau" in m else None
    # the ceiling is the highest rate measured for the access pattern the kernels run, a read stream: the
    # read kernel or the sweep's HBM plateau; the copy_ (read + write) is recorded beside it, never used (on
    # the H200 it read 4.19-4.25 TB/s against 4.49 read, and measured decode points ran above it)
    hbm = max(read, plateau or 0.0)
    m = dict(m)
    m["hbm"] = {"rule": "hbm_bytes_per_s = the highest read stream measured: max(read kernel, sweep HBM plateau)",
                "chosen": "read" if read >= (plateau or 0.0) else "sweep plateau", "bytes_per_s": hbm,
                "read_bytes_per_s": read,       # Triton sum kernel over a >= 4 GiB buffer, bytes read
                "copy_bytes_per_s": copy,       # torch copy_, (bytes read + bytes written) / time: recorded only
                "sweep_plateau_bytes_per_s": plateau}
    # the L2 ceiling, like HBM's, is the highest rate measured: the sweep's plateau or the best block read
    l2 = max(float(m["l2_plateau"]["bytes_per_s"]), float((m.get("l2_best") or {}).get("bytes_per_s", 0.0)))
    data = {"name": name, "hbm_bytes_per_s": float(hbm), "l2_bytes_per_s": l2,
            "mma_flops": {"bf16": float(m["matmul"]["bf16_flops"]), "fp8": float(m["matmul"]["fp8_flops"])},
            "l2_bytes": int(m["l2_bytes"]), "sms": int(m["sms"]),
            "source": f"measured by `msa-bench calibrate` on {m['gpu']} ({m['date']}); hbm = the read stream",
            "measured": m}
    return profile_from_dict(data, f"calibration of {m['gpu']}")


def write_profile(profile: DeviceProfile, path: Path) -> DeviceProfile:
    """Write the profile JSON through devices.py's writer and read it back the way `roofline --device` does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(path)
    return load_device(str(path))


def plot_sweep(m: dict, path: Path) -> None:
    """Bandwidth versus working set (log x) with the L2 size, the L2/8..L2/2 window the L2 plateau is taken
    from (shaded) and both plateaus marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sweep = m["l2_sweep"]
    x = [p["bytes"] / MIB for p in sweep]
    y = [p["bytes_per_s"] / 1e12 for p in sweep]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x, y, "o-", color="tab:blue", label="Triton read kernel (.cg loads, L1 bypassed)")
    lo, hi = m["l2_plateau"].get("window_bytes") or l2_window(m["l2_bytes"])
    ax.axvspan(lo / MIB, hi / MIB, color="tab:green", alpha=0.12,
               label=f"L2 window L2/8..L2/2 ({lo / MIB:.1f}-{hi / MIB:.0f} MiB)")
    for key, color, label in (("l2_plateau", "tab:green", "L2"), ("hbm_plateau", "tab:red", "HBM")):
        p = m[key]
        ax.hlines(p["bytes_per_s"] / 1e12, p["from_bytes"] / MIB, p["to_bytes"] / MIB, colors=color, lw=3,
                  label=f"{label} plateau {p['bytes_per_s'] / 1e12:.2f} TB/s")
    ax.axvline(m["l2_bytes"] / MIB, color="gray", ls="--", lw=1, label=f"L2 size {m['l2_bytes'] / MIB:.0f} MiB")
    ax.axhline(m["hbm_copy_bytes_per_s"] / 1e12, color="tab:orange", ls=":", lw=1.5,
               label=f"copy_ (read+write) {m['hbm_copy_bytes_per_s'] / 1e12:.2f} TB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("working set (MiB)")
    ax.set_ylabel("read bandwidth (TB/s)")
    ax.set_title(f"{m['gpu']}: bandwidth versus working set")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- GPU microbenchmarks ---------------------------------------------------------------------------

def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(x_ptr, out_ptr, n_chunks, total, BLOCK: tl.constexpr, BYPASS_L1: tl.constexpr):
        # program p loads chunks t = p, p + P, ... of the repeated sequence; chunk index t mod n_chunks.
        # BYPASS_L1: ld.global.cg (cache in L2 only), so repeated reads of a small working set are not L1 hits
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        lanes = tl.arange(0, BLOCK)
        for t in range(pid, total, nprog):
            c = (t % n_chunks).to(tl.int64)
            if BYPASS_L1:
                acc += tl.load(x_ptr + c * BLOCK + lanes, cache_modifier=".cg")
            else:
                acc += tl.load(x_ptr + c * BLOCK + lanes)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return read_sum


def _gather_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_sum(x_ptr, idx_ptr, out_ptr, total, BLOCK: tl.constexpr):
        # program p reads blocks idx[p], idx[p + P], ... whole, L1 bypassed (.cg), as an attention kernel
        # reads its selected K/V blocks
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        lanes = tl.arange(0, BLOCK)
        for t in range(pid, total, nprog):
            b = tl.load(idx_ptr + t).to(tl.int64)
            acc += tl.load(x_ptr + b * BLOCK + lanes, cache_modifier=".cg")
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return gather_sum


GATHER_BLOCK = 8192             # fp32 elements: 32 KiB, one K or V block of 128 tokens x 128 bf16


def _gather_bytes_per_s(kernel, buf, out, sms: int, reps: int) -> float:
    """Bytes per second of >= 1 GiB of random whole-block reads from `buf`."""
    import torch
    block_bytes = GATHER_BLOCK * 4
    total = GIB // block_bytes
    idx = torch.randint(0, max(1, buf.numel() * 4 // block_bytes), (total,), dtype=torch.int32, device=buf.device)
    grid = (8 * sms,)
    sec = _median_event_seconds(lambda: kernel[grid](buf, idx, out, total, BLOCK=GATHER_BLOCK, num_warps=8),
                                max(5, reps // 2))
    return total * block_bytes / sec


def _median_event_seconds(fn, reps: int, warmup: int = 3, flush=None) -> float:
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


class _Reader:
    def __init__(self, sms: int):
        import torch
        self.kernel = _read_kernel()
        self.sms = sms
        self.out = torch.empty(64 * sms, dtype=torch.float32, device="cuda")

    def launcher(self, buf, block: int, grid_mult: int, repeats: int, warps: int, bypass_l1: bool = False):
        n_chunks = buf.numel() // block
        grid = (min(grid_mult * self.sms, n_chunks * repeats),)
        out = self.out

        def launch():
            self.kernel[grid](buf, out, n_chunks, n_chunks * repeats, BLOCK=block, BYPASS_L1=bypass_l1,
                              num_warps=warps)
        return launch


def run_calibration(quick: bool = False, log=print) -> dict:
    """Run every microbenchmark on the current GPU; returns the measurement dict (see build_profile)."""
    import torch
    import triton
    from ...errors import require_cuda
    require_cuda("calibrate")
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms, l2_bytes = props.multi_processor_count, props.L2_cache_size
    reps = 7 if quick else 20
    m = {"gpu": props.name, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "sms": sms, "l2_bytes": l2_bytes,
         "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__},
         "quick": quick, "reps": reps}
    try:
        import pynvml
        pynvml.nvmlInit()
        m["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:  # NVML absent: the profile still records everything else
        m["driver"] = f"unknown ({type(exc).__name__})"
    reader = _Reader(sms)

    # HBM read: >= 4 GiB (1 GiB quick), best of a few kernel configurations
    size = (1 if quick else 4) * GIB
    buf = torch.ones(size // 4, dtype=torch.float32, device=dev)
    configs = [(4096, 4, 8), (4096, 8, 8), (8192, 4, 8), (2048, 8, 4), (8192, 8, 16)]
    tried = []
    for block, grid_mult, warps in configs[:2] if quick else configs:
        launch = reader.launcher(buf, block, grid_mult, 1, warps)
        sec = _median_event_seconds(launch, reps)
        tried.append({"block": block, "grid_per_sm": grid_mult, "num_warps": warps, "bytes_per_s": size / sec})
    launch = reader.launcher(buf, configs[0][0], configs[0][1], 1, configs[0][2])
    launch()
    torch.cuda.synchronize()
    expected = float(buf.numel())
    got = float(reader.out[: min(configs[0][1] * sms, buf.numel() // configs[0][0])].sum())
    if abs(got - expected) > 1e-3 * expected:
        raise RuntimeError(f"read kernel summed {got}, expected {expected}: the kernel does not read every element")
    best = max(tried, key=lambda t: t["bytes_per_s"])
    m["hbm_read_bytes_per_s"] = best["bytes_per_s"]
    m["hbm_read"] = {"bytes": size, "configs": tried, "best": best}
    log(f"HBM read {size / GIB:.0f} GiB: {best['bytes_per_s'] / 1e12:.2f} TB/s "
        f"(block {best['block']}, {best['grid_per_sm']} programs/SM, {best['num_warps']} warps)")
    del buf

    # HBM copy_: bytes read + written
    copy_elems = (512 if quick else 2048) * MIB // 2 * 2    # bf16 elements: 1 GiB / 4 GiB
    src = torch.randn(copy_elems, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    sec = _median_event_seconds(lambda: dst.copy_(src), reps)
    m["hbm_copy_bytes_per_s"] = 2 * src.numel() * 2 / sec
    m["hbm_copy"] = {"bytes_each_way": src.numel() * 2, "seconds": sec}
    log(f"HBM copy_ {src.numel() * 2 / GIB:.0f} GiB: {m['hbm_copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write)")
    del src, dst

    # L2 sweep: working sets 1 MiB .. 2 GiB (plus points around the L2 size), read repeatedly in one launch
    # (the L2 plateau is taken from [L2/8, L2/2] only: five points there, the lowest rounded up into it)
    block, grid_mult, warps = best["block"], best["grid_per_sm"], best["num_warps"]
    unit = block * 4
    lo, hi = l2_window(l2_bytes)
    sizes = sorted({s // unit * unit for s in
                    {1 << k for k in range(20, 32 if not quick else 31)}
                    | {3 * l2_bytes // 16, l2_bytes // 4, 3 * l2_bytes // 8, hi,
                       3 * l2_bytes // 4, l2_bytes, 3 * l2_bytes // 2, 2 * l2_bytes}}
                   | {-(-lo // unit) * unit})
    big = torch.ones(max(sizes) // 4, dtype=torch.float32, device=dev)
    sweep = []
    for s in sizes:
        view = big[: s // 4]
        repeats = max(1, GIB // s)
        launch = reader.launcher(view, block, grid_mult, repeats, warps, bypass_l1=True)
        sec = _median_event_seconds(launch, max(5, reps // 2))
        sweep.append({"bytes": s, "repeats": repeats, "bytes_per_s": s * repeats / sec})
        log(f"  working set {s / MIB:8.1f} MiB x{repeats:5d}: {s * repeats / sec / 1e12:6.2f} TB/s")
    del big
    m["l2_sweep"] = sweep
    l2p, hbmp = l2_and_hbm_plateaus([p["bytes"] for p in sweep], [p["bytes_per_s"] for p in sweep], l2_bytes)
    for key, p in (("l2_plateau", l2p), ("hbm_plateau", hbmp)):
        m[key] = {"bytes_per_s": p.level, "from_bytes": sweep[p.first]["bytes"], "to_bytes": sweep[p.last]["bytes"]}
    m["l2_plateau"]["window_bytes"] = list(l2_window(l2_bytes))
    log(f"L2 plateau {l2p.level / 1e12:.2f} TB/s ({m['l2_plateau']['from_bytes'] / MIB:.1f}-"
        f"{m['l2_plateau']['to_bytes'] / MIB:.1f} MiB, window L2/8..L2/2), HBM plateau {hbmp.level / 1e12:.2f} TB/s")

    # L2 best: the read kernel's configurations and the block gather at L2/4
    quarter = l2_bytes // 4 // (block * 4) * (block * 4)
    big = torch.ones(quarter // 4, dtype=torch.float32, device=dev)
    repeats = max(1, GIB // quarter)
    tried = []
    for blk, gm, wp in ([(block, grid_mult, warps), (8192, 8, 8)] if quick else
                        [(block, grid_mult, warps), (4096, 8, 8), (8192, 8, 8), (8192, 4, 16), (2048, 16, 4),
                         (16384, 4, 16)]):
        view = big[: big.numel() // blk * blk]
        sec = _median_event_seconds(reader.launcher(view, blk, gm, repeats, wp, bypass_l1=True), max(5, reps // 2))
        tried.append({"kernel": "read", "block": blk, "grid_per_sm": gm, "num_warps": wp,
                      "bytes_per_s": view.numel() * 4 * repeats / sec})
    gather_rate = _gather_bytes_per_s(_gather_kernel(), big, torch.empty(8 * sms, dtype=torch.float32, device=dev),
                                      sms, reps)
    tried.append({"kernel": "gather 32 KiB blocks", "bytes_per_s": gather_rate})
    m["l2_best"] = dict(max(tried, key=lambda t: t["bytes_per_s"]), working_set_bytes=quarter, tried=tried)
    log(f"L2 best at {quarter / MIB:.1f} MiB: {m['l2_best']['bytes_per_s'] / 1e12:.2f} TB/s "
        f"({m['l2_best']['kernel']}; plateau {l2p.level / 1e12:.2f})")
    del big

    # dense MMA peaks
    n = 4096 if quick else 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    sec_bf16 = _median_event_seconds(lambda: torch.matmul(a, b), reps)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32, device=dev)
    bt = b8.t()                                    # column-major second operand, as _scaled_mm requires
    sec_fp8 = _median_event_seconds(lambda: torch._scaled_mm(a8, bt, scale_a=one, scale_b=one,
                                                             out_dtype=torch.bfloat16), reps)
    flops = 2.0 * n ** 3
    m["matmul"] = {"n": n, "bf16_flops": flops / sec_bf16, "fp8_flops": flops / sec_fp8,
                   "bf16_seconds": sec_bf16, "fp8_seconds": sec_fp8}
    log(f"matmul {n}^3: bf16 {flops / sec_bf16 / 1e12:.0f} TFLOP/s, fp8 {flops / sec_fp8 / 1e12:.0f} TFLOP/s")
    m["method"] = {
        "hbm_read": "Triton kernel summing a fp32 buffer (sums stored and checked), best of the listed configs, "
                    f"median of {reps} CUDA-event timings",
        "hbm_copy": "torch copy_ of a bf16 tensor, bytes read + written",
        "l2_sweep": "same read kernel with the best config but .cg loads (L1 bypassed); each launch reads the "
                    "working set repeatedly (>= 1 GiB of loads, chunk order rotating), no flush; plateaus by "
                    "run detection (10%); L2 plateau = widest run among working sets in [L2/8, L2/2]",
        "matmul": f"{n}^3 torch.matmul bf16 and torch._scaled_mm fp8 e4m3 (bf16 out), median",
        "l2_best": "at L2/4: the read kernel under a few configs and a gather of random 32 KiB blocks (.cg), best",
        "profile": "hbm_bytes_per_s = the highest read stream (read kernel or sweep plateau; copy_ recorded "
                   "beside it under measured['hbm']); l2_bytes_per_s = the highest of the L2 plateau and the "
                   "L2 best; mma_flops = matmul peaks"}
    m["seconds"] = time.perf_counter() - t0
    return m


def calibrate(out_dir: Path, quick: bool = False, name: str | None = None, log=print) -> dict:
    """Measure, then write out_dir/profile.json, out_dir/bandwidth_vs_working_set.png. Returns paths and profile."""
    m = run_calibration(quick=quick, log=log)
    slug = name or (m["gpu"].lower().replace("nvidia", "").strip().replace(" ", "-") + "-calibrated")
    profile = write_profile(build_profile(slug, m), out_dir / "profile.json")
    png = out_dir / "bandwidth_vs_working_set.png"
    plot_sweep(m, png)
    return {"profile_path": out_dir / "profile.json", "png_path": png, "profile": profile, "seconds": m["seconds"]}


__all__ = ["theil_sen", "with_fixed_costs", "Plateau", "find_plateaus", "l2_window", "l2_and_hbm_plateaus", "build_profile", "write_profile", "plot_sweep",
           "run_calibration", "calibrate"]
