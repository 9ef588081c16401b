"""Measure what the model adds to a module's roofline time (`msa-bench calibrate`).

Launch: a CUDA graph of k one-element kernels, k = 1 .. 64; the cost of one launch is the Theil-Sen slope
of replay time against k.
Fixed costs: every `auto` candidate that runs here is planned and timed (harness/timing.py: CUDA graphs,
cold L2) on decode batches of FIXED_REQUESTS one-token requests, enough packed tiles or KV-outer pairs for
several per SM, so the module follows its roofline; a stage's fixed cost is the Theil-Sen intercept of its
time against the backend's roofline time (roofline/calibrate.py), the stage intercepts scaled to sum to the
module's (the stages are timed one graph each, the module as one); 1 / the module's slope is the
fraction of its roofline the backend reaches on decode work ("decode_achieved"). Kernel launches per
stage are counted with the PyTorch profiler on one eager run.
Items: a backend with work items (a packed tile: `Backend.item_blocks`) is timed on one request whose few
tiles cannot fill the GPU (ITEM_POINTS: 16 to about 120 blocks a tile); its module time less its fixed
cost, against the blocks a tile walks, gives the time one item takes alone (Theil-Sen: s + blocks x
block_s).
A candidate whose first plan would JIT-build a kernel (Backend.build_pending_reason), or whose plan and
timing on one workload take over CANDIDATE_SECONDS, is skipped with its reason printed, so the step stays
within its time.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..roofline.calibrate import fixed_costs_entry, theil_sen
from ..roofline.devices import DeviceProfile
from .timing import MODULE, TimingConfig, time_plan

FIXED_REQUESTS = (264, 528, 792, 1056)      # 2 to 8 one-token requests per SM: 8 to 32 packed tiles per SM
FIXED_CONTEXT = (8192, 16384)                # each request's context, uniform in this range
ITEM_POINTS = (("decode", {"requests": 1, "context": 16384}),       # (generator, options): 4 tiles of 16 blocks
               ("drift", {"tokens": 8, "context": 131072, "drift": 0.3}),   # one 8-token tile: ~50 blocks
               ("drift", {"tokens": 8, "context": 131072, "drift": 1.0}))   # ~115 blocks
LAUNCH_COUNTS = (1, 2, 4, 8, 16, 32, 64)
TIMING = TimingConfig(warmup=3, reps=20, max_reps=40)
# a candidate whose plan and timing on one workload takes longer built something or stalled: the step is
# meant to finish in about a minute, so it is dropped (the few ms its timing needs are far below this)
CANDIDATE_SECONDS = 20.0


def launch_seconds(device) -> tuple[float, list]:
    """(seconds per kernel launch inside a CUDA graph, [(launches, median replay seconds)])."""
    x = torch.zeros(1, device=device)
    points = []
    for k in LAUNCH_COUNTS:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(k):
                x.add_(1.0)
        for _ in range(3):
            graph.replay()
        times = []
        for _ in range(30):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        points.append((k, statistics.median(times)))
    _, slope = theil_sen([p[0] for p in points], [p[1] for p in points])
    return max(0.0, slope), points


def count_launches(fn) -> int:
    """GPU kernels (and memsets/copies) one eager call of `fn` issues, by the PyTorch profiler; 0 if it
    cannot tell (or off a GPU)."""
    if not torch.cuda.is_available():
        return 0
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if getattr(e, "device_type", None) is not None
                   and str(e.device_type).endswith("CUDA"))
    except Exception:   # a profiler that cannot start (another one running): the count is unknown
        return 0


def calibration_points(dtype: str, shape=None, requests=FIXED_REQUESTS, context=FIXED_CONTEXT):
    """The fixed-cost series: decode batches of `requests` one-token requests (module docstring)."""
    from ..scenarios.grid import point_from_options
    from ..scenarios.workload import AttnShape
    for n in requests:
        yield point_from_options("decode", shape or AttnShape(), dtype, requests=n, context_min=context[0],
                                 context=context[1])


def item_points(dtype: str, shape=None, points=ITEM_POINTS):
    """The item series: one request's few tiles (ITEM_POINTS)."""
    from ..scenarios.grid import point_from_options
    from ..scenarios.workload import AttnShape
    for generator, options in points:
        yield point_from_options(generator, shape or AttnShape(), dtype, **options)


def measure_series(profile: DeviceProfile, dtypes=("bf16", "fp8"), log=print, device="cuda", points=None,
                   timing: TimingConfig = TIMING, only=None) -> dict:
    """{(backend, dtype): [(roofline s, {stage: median s}, {stage: launches}, item blocks)]} for
    every candidate here (or those in `only`); roofline times at achieved fraction 1."""
    from dataclasses import replace
    from ..errors import one_line
    from ..kernels.auto import candidate_names
    from ..kernels.base import ModelInputs, get_backend
    from ..scenarios.grid import make_workload
    device = torch.device(device)
    bare = replace(profile, achieved={}, fixed_costs={})
    points = points or calibration_points
    series: dict = {}
    launches: dict = {}
    dropped: set = set()            # (backend, dtype) skipped for the rest of the series
    for dtype in dtypes:
        count = 0
        for point in points(dtype):
            w = make_workload(point, device)
            inputs = ModelInputs(w)
            count += 1
            for name in candidate_names():
                backend = get_backend(name)
                if (only is not None and name not in only) or (name, dtype) in dropped \
                        or backend.workload_unavailable_reason(w):      # model fit aside
                    continue
                pending = backend.build_pending_reason(w)
                if pending:                 # a JIT build inside the step would take it past its time
                    dropped.add((name, dtype))
                    log(f"  fixed costs: {name} {dtype} skipped: {pending}")
                    continue
                start = time.perf_counter()
                try:
                    plan = backend.plan(w)
                    roof, _ = backend.roofline(w, inputs, bare)
                    samples = time_plan(plan, timing, device)
                except Exception as exc:    # one backend that fails here leaves the others' costs measured
                    log(f"  fixed costs: {name} {dtype} N {w.n_tokens} skipped: {one_line(exc)}")
                    continue
                took = time.perf_counter() - start
                if took > CANDIDATE_SECONDS:
                    dropped.add((name, dtype))
                    log(f"  fixed costs: {name} {dtype} skipped after N {w.n_tokens}: planning and timing took "
                        f"{took:.0f} s, over {CANDIDATE_SECONDS:.0f} s a workload (a build or a stall in it)")
                    del plan
                    continue
                medians = {s: statistics.median(v.seconds) for s, v in samples.items() if s != "plan"}
                if (name, dtype) not in launches:        # the profiler is slow to start: once per backend
                    launches[(name, dtype)] = {s: count_launches(fn) for s, fn in plan.stages.items()}
                series.setdefault((name, dtype), []).append(
                    (roof, medians, launches[(name, dtype)], backend.item_blocks(w, inputs)))
                del plan
            del w
            torch.cuda.empty_cache()
        log(f"  fixed costs: {dtype} timed on {count} workloads")
    return series


def pick_dependent(name: str) -> bool:
    """True for a backend that declares no stages of its own (`auto`): its units run the stages of
    whichever candidate it picked, so no one fixed cost belongs to it."""
    from ..kernels.base import get_backend
    try:
        return not get_backend(name).stage_names
    except KeyError:            # not registered here (a series from elsewhere): fit what it holds
        return False


def fit_series(series: dict) -> dict:
    """The profile's "stages" table from measure_series: per backend, stage and dtype, the stage's
    intercept scaled so a backend's stages sum to its module's intercept. A stage is fitted on the rows
    that ran it (a hybrid unit may run fewer stages than another) and skipped where those rows hold
    fewer than two roofline times; a backend whose stages depend on its pick is skipped."""
    stages = {}
    for (name, dtype), rows in series.items():
        if len({r[0] for r in rows}) < 2 or pick_dependent(name):
            continue
        xs = [r[0] for r in rows]
        module = max(0.0, theil_sen(xs, [r[1][MODULE] for r in rows])[0])
        names = list(dict.fromkeys(s for r in rows for s in r[1] if s != MODULE))
        raw = {}
        for s in names:
            have = [r for r in rows if s in r[1]]
            if len({r[0] for r in have}) >= 2:
                raw[s] = fixed_costs_entry([r[0] for r in have], [r[1][s] for r in have],
                                           max(r[2].get(s, 0) for r in have))
        total = sum(e["s"] for e in raw.values())
        for s, e in raw.items():
            share = e["s"] / total if total > 0 else 1.0 / len(raw)
            stages[f"{name}/{s}/{dtype}"] = {**e, "stage_intercept_s": e["s"], "s": module * share,
                                             "module_intercept_s": module}
    return stages


def fit_decode_achieved(series: dict) -> dict:
    """{"backend/dtype": 1 / the module's Theil-Sen slope against its roofline time} over the decode
    batches (at least two roofline times), where within (0, MAX_ACHIEVED]."""
    from ..roofline.devices import MAX_ACHIEVED
    out = {}
    for (name, dtype), rows in series.items():
        if len({r[0] for r in rows}) < 2 or pick_dependent(name):
            continue
        slope = theil_sen([r[0] for r in rows], [r[1][MODULE] for r in rows])[1]
        if slope > 0 and 1.0 / slope <= MAX_ACHIEVED:
            out[f"{name}/{dtype}"] = 1.0 / slope
    return out


def fit_items(series: dict, stages: dict) -> dict:
    """{"backend/dtype": {"s", "block_s", "points"}}: the Theil-Sen fit of module time less the backend's
    fixed cost (from `stages`) against its item blocks, for backends with items at two or more sizes."""
    out = {}
    for (name, dtype), rows in series.items():
        have = [r for r in rows if r[3] is not None]
        if len({r[3] for r in have}) < 2:
            continue
        fixed = sum(e["s"] for k, e in stages.items() if k.startswith(f"{name}/") and k.endswith(f"/{dtype}"))
        a, b = theil_sen([r[3] for r in have], [r[1][MODULE] - fixed for r in have])
        out[f"{name}/{dtype}"] = {"s": max(0.0, a), "block_s": max(0.0, b), "points": len(have)}
    return out


def calibrate_fixed_costs(profile: DeviceProfile, log=print) -> dict:
    """The fixed_costs table for `profile`'s GPU (this one): launch cost, per-stage costs, decode
    fractions and item times."""
    from ..errors import require_cuda
    require_cuda("fixed-cost calibration")
    t0 = time.perf_counter()
    launch, points = launch_seconds(torch.device("cuda"))
    log(f"  kernel launch in a CUDA graph: {launch * 1e6:.2f} us")
    series = measure_series(profile, log=log)
    stages = fit_series(series)
    with_items = {name for (name, _), rows in series.items() if any(r[3] is not None for r in rows)}
    items = fit_items(measure_series(profile, log=log, points=item_points, only=with_items), stages) \
        if with_items else {}
    return {"launch_s": launch, "launch_points": [list(p) for p in points], "stages": stages,
            "decode_achieved": fit_decode_achieved(series), "items": items,
            "method": f"stages: Theil-Sen intercept of stage time against roofline time on decode batches of "
                      f"{list(FIXED_REQUESTS)} one-token requests, contexts {FIXED_CONTEXT[0]}-{FIXED_CONTEXT[1]}, "
                      f"stage intercepts scaled to sum to the module's; decode_achieved: 1 / the module's slope "
                      f"there; items: module time less fixed cost against a tile's blocks on {len(ITEM_POINTS)} "
                      f"one-request workloads",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": time.perf_counter() - t0}
