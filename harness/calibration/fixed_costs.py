"""Measure what the model adds to a module's roofline time (`msa-bench calibrate`).

Launch: a CUDA graph of k one-element kernels, k = 1 .. 64; the cost of one launch is the Theil-Sen slope
of replay time against k.
Fixed costs: every `auto` candidate that runs here is planned and timed (harness/measure/timing.py: CUDA graphs,
cold L2) on the latency point (LATENCY_POINT: one token over its top-k blocks, the least work a module
runs); a module's fixed cost is its time there, less its one item's walk for a backend with items, and its
stages share it as their own times there (each stage timed alone, one graph each). The fixed cost measured
as the intercept of a line through large batches instead was 1.8x a one-request module's whole time (KV-
outer: 144 us against 80), which put every small decode batch 20-80 % over its measured time.
Decode fractions: on decode batches of FIXED_REQUESTS one-token requests (several packed tiles or KV-outer
pairs per SM), the median of roofline time / (module time less its fixed cost) is the fraction of its
roofline the backend reaches on decode work ("decode_achieved"). Kernel launches per stage are counted
with the PyTorch profiler on one eager run. On each workload the first candidate timed times a dropped
plan first (timing.warm_plan, as a sweep's first unit does). Before, a candidate measured alone
(`--backend`) was first on every workload, and its decode fractions read 7-11 % under those of the
whole calibration, the size of the order effect (docs/perf-log.md, 2026-12-04).
Items: a backend with work items (a packed tile: `roofline.predict.item_blocks`) is also timed on one request whose
few tiles cannot fill the GPU (ITEM_POINTS: about 50 and 120 blocks a tile); the Theil-Sen line of module
time against the blocks a tile walks (the latency point's 16 included) gives its fixed cost (the
intercept) and one block's walk on one SM (block_s). A stage those workloads run and the latency point
does not (q-packed-cute's schedule: a one-token plan reads its pages itself) costs, on top, its own time on
the least work that ran it.
Host: every candidate is also timed eagerly on the latency point (timing.py's eager timer: the stages launched
from Python, as an engine without graphs runs them); its host cost per stage launch is the median host time
inside its stages' calls over the stages it ran, and its per-step planning (`plan_step`) the median of
that; `auto@eager` adds them (roofline/model.module_time).
A candidate whose first plan would JIT-build a kernel (Backend.build_pending_reason), or whose plan and
timing on one workload take over CANDIDATE_SECONDS, is skipped with its reason printed, so the step stays
within its time; that dtype's entries then stay the profile's, named (merge_fixed_costs), never dropped.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from .ceilings import theil_sen
from ...roofline.devices import DeviceProfile
from ...roofline.names import base_name
from ..measure.timing import MODULE, PLAN_STEP, TimingConfig, time_plan, warm_plan
from ...roofline.model import EAGER

FIXED_REQUESTS = (264, 528, 792, 1056)      # 2 to 8 one-token requests per SM: 8 to 32 packed tiles per SM
FIXED_CONTEXT = (8192, 16384)                # each request's context, uniform in this range
# one token over the top-k blocks (a context of 16 x 128 keys): what a module costs at no work to speak of
LATENCY_POINT = ("decode", {"requests": 1, "context": 2048})
ITEM_POINTS = (("decode", {"requests": 1, "context": 16384}),       # (generator, options): 4 tiles of 16 blocks
               ("drift", {"tokens": 8, "context": 131072, "drift": 0.3}),   # one 8-token tile: ~50 blocks
               ("drift", {"tokens": 8, "context": 131072, "drift": 1.0}))   # ~115 blocks
LAUNCH_COUNTS = (1, 2, 4, 8, 16, 32, 64)
TIMING = TimingConfig(warmup=3, reps=20, max_reps=40)
EAGER_TIMING = replace(TIMING, timer=EAGER)
HOST_LAUNCH = "host_launch_s"       # an eager row's median host time per stage launch (measure_series)
HOST_STAGES = "host_stage_launch_s"  # and each stage's own: {stage: median host seconds in its call}
HOST_PROBE = "host_probe_s"         # and the host launch probe's median there (how fast the host was)
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
    from ...scenarios.grid import point_from_options
    from ...scenarios.workload import AttnShape
    for n in requests:
        yield point_from_options("decode", shape or AttnShape(), dtype, requests=n, context_min=context[0],
                                 context=context[1])


def latency_points(dtype: str, shape=None):
    """The latency point (LATENCY_POINT): the least work a module runs."""
    return item_points(dtype, shape, (LATENCY_POINT,))


def item_points(dtype: str, shape=None, points=ITEM_POINTS):
    """The item series: one request's few tiles (ITEM_POINTS)."""
    from ...scenarios.grid import point_from_options
    from ...scenarios.workload import AttnShape
    for generator, options in points:
        yield point_from_options(generator, shape or AttnShape(), dtype, **options)


def measure_series(profile: DeviceProfile, dtypes=("bf16", "fp8"), log=print, device="cuda", points=None,
                   timing: TimingConfig = TIMING, only=None, skipped: dict | None = None, names=None) -> dict:
    """{(backend, dtype): [(roofline s, {stage: median s}, {stage: launches}, item blocks)]} for
    every candidate here (or those in `only`); roofline times at achieved fraction 1. Each candidate
    skipped on a workload is also put in `skipped` ({"backend/dtype": why}, the first reason kept)."""
    from ...errors import one_line
    from ...kernels.base import get_backend
    from ...roofline.predict import item_blocks, predict_module, unmodelled_reason
    from ...scenarios.stats import ModelStats
    from ...scenarios.grid import make_workload
    device = torch.device(device)
    bare = replace(profile, achieved={}, fixed_costs={})
    points = points or calibration_points
    series: dict = {}
    launches: dict = {}
    dropped: set = set()            # (backend, dtype) skipped for the rest of the series
    skipped = {} if skipped is None else skipped

    def skip(name, dtype, why):
        log(f"  fixed costs: {name} {dtype} skipped{why}")
        skipped.setdefault(f"{name}/{dtype}", why.removeprefix(": ").strip())
    for dtype in dtypes:
        count = 0
        for point in points(dtype):
            w = make_workload(point, device)
            stats = ModelStats(w)
            count += 1
            first = True            # the first candidate timed on the workload times a dropped plan first
            for name in names or calibrated_names():
                backend = get_backend(name)
                # a workload the backend cannot run, or the model does not predict it on (a per-token-mask
                # tile where its tokens select apart), is not one of its points: its other points stand
                if (only is not None and name not in only) or (name, dtype) in dropped \
                        or backend.workload_unavailable_reason(w) or unmodelled_reason(backend.facts, stats):
                    continue
                pending = backend.build_pending_reason(w)
                if pending:                 # a JIT build inside the step would take it past its time
                    dropped.add((name, dtype))
                    skip(name, dtype, f": {pending}")
                    continue
                start = time.perf_counter()
                try:
                    plan = warm_plan(backend, w, timing, device) if first else backend.plan(w)
                    first = False
                    # at fraction 1 with no fixed costs and no item floor: the roofline alone
                    roof = predict_module(backend.facts, stats, plan.info["model"], bare, dtype).seconds
                    samples = time_plan(plan, timing, device)
                except Exception as exc:    # one backend that fails here leaves the others' costs measured
                    skip(name, dtype, f" at N {w.n_tokens}: {one_line(exc)}")
                    continue
                took = time.perf_counter() - start
                if took > CANDIDATE_SECONDS:
                    dropped.add((name, dtype))
                    skip(name, dtype, f" after N {w.n_tokens}: planning and timing took {took:.0f} s, over "
                         f"{CANDIDATE_SECONDS:.0f} s a workload (a build or a stall in it)")
                    del plan
                    continue
                medians = {s: statistics.median(v.seconds) for s, v in samples.items() if s != "plan"}
                if samples[MODULE].launch_s is not None:      # eager: host time per stage launch, and each one's
                    medians.update(host_medians(samples, tuple(plan.stages), plan.module is not None))
                if (name, dtype) not in launches:        # the profiler is slow to start: once per backend
                    launches[(name, dtype)] = {s: count_launches(fn) for s, fn in plan.stages.items()}
                series.setdefault((name, dtype), []).append(
                    (roof, medians, launches[(name, dtype)], item_blocks(backend.facts, stats)))
                del plan
            del w
            torch.cuda.empty_cache()
        log(f"  fixed costs: {dtype} timed on {count} workloads")
    return series


def host_medians(samples: dict, stages: tuple, one_call: bool) -> dict:
    """An eager row's host medians: HOST_LAUNCH the module's host time per stage launch, HOST_STAGES each
    stage's own (in its own call; where `one_call` launches the module, shared so that they add up to that
    call), HOST_PROBE the host launch probe's."""
    launch = statistics.median(samples[MODULE].launch_s) / max(len(stages), 1)
    own = {st: statistics.median(samples[st].launch_s) for st in stages if st in samples and samples[st].launch_s}
    if one_call and sum(own.values()) > 0:
        share = launch * len(stages) / sum(own.values())
        own = {st: x * share for st, x in own.items()}
    return {HOST_LAUNCH: launch, HOST_STAGES: own, HOST_PROBE: statistics.median(samples[MODULE].host_probe_s)}


def calibrated_names() -> list[str]:
    """The backends the fixed-cost steps measure: `auto`'s candidates, and the dense baselines the report
    predicts beside them (the dense floor: its crossover's model context), which no pick weighs."""
    from ...kernels import auto
    from ...kernels.base import get_backend, registered_names
    from ...roofline.schedules import DENSE_SCHEDULES
    names = auto.candidate_names()
    return names + [n for n in registered_names()
                    if n not in names and get_backend(n).schedule in DENSE_SCHEDULES]


def host_names() -> list[str]:
    """The backends whose host costs calibrate measures: calibrated_names(), and each one launched from C++
    (NAME@op and NAME@graph, kernels/dispatch; where its library is not built it runs no workload, so it is
    not measured), so `auto@eager` can weigh every launch path."""
    from ...kernels.dispatch import op_variants
    names = calibrated_names()
    return names + op_variants(names)


def host_scope(only):
    """`only` (backend names) with their C++ launch paths, for the host series."""
    from ...kernels.dispatch import op_variants
    return None if only is None else list(only) + op_variants(only)


def pick_dependent(name: str) -> bool:
    """True for a backend that declares no stages of its own (`auto`): its units run the stages of
    whichever candidate it picked, so no one fixed cost belongs to it."""
    from ...kernels.base import get_backend
    try:
        return not get_backend(name).stage_names
    except KeyError:            # not registered here (a series from elsewhere): fit what it holds
        return False


def scales_hbm(name: str) -> bool:
    """Whether a backend's achieved fraction scales its HBM term (Backend.fraction_terms); one that does
    not has no decode fraction: its prefill fraction prices its decode work too."""
    from ...kernels.base import get_backend
    try:
        return "hbm" in get_backend(name).fraction_terms
    except KeyError:
        return True


def fit_series(latency: dict, items: dict | None = None, beyond: dict | None = None) -> dict:
    """The profile's "stages" table: per backend, stage and dtype, the stage's share of the module's fixed
    cost. The module's fixed cost is its time on the latency point (LATENCY_POINT), less the walk of its
    one item where it has items (the intercept `items` holds); the stages share it as their own times there
    (each timed alone, one graph each). A stage the latency point did not run (a hybrid runs one side) takes
    its time on the least-work row that ran it; a backend whose stages depend on its pick is skipped.
    `beyond` (the item series) adds, on top, each stage that no latency row ran at its own time on the
    least-work row of it that did: q-packed-cute's schedule stage, which a one-token plan skips and every
    plan of longer tiles runs."""
    stages = _shared_stages(latency, items)
    for (name, dtype), rows in (beyond or {}).items():
        if not rows or pick_dependent(name):
            continue
        for roof, medians, launches, _ in sorted(rows, key=lambda r: r[0]):
            for s, t in medians.items():
                key = f"{name}/{s}/{dtype}"
                if s != MODULE and key not in stages:
                    stages[key] = {"s": t, "latency_s": t, "launches": int(launches.get(s, 0)), "module_s": medians[MODULE]}
    return stages


def _shared_stages(latency: dict, items: dict | None) -> dict:
    """fit_series over the latency series alone: each stage's share of its module's fixed cost."""
    stages = {}
    for (name, dtype), rows in latency.items():
        if not rows or pick_dependent(name):
            continue
        rows = sorted(rows, key=lambda r: r[0])
        module = (items or {}).get(f"{name}/{dtype}", {}).get("intercept_s", rows[0][1][MODULE])
        names = list(dict.fromkeys(s for r in rows for s in r[1] if s != MODULE))
        own = {s: next((r[1][s], r[2].get(s, 0)) for r in rows if s in r[1]) for s in names}
        total = sum(t for t, _ in own.values())
        for s, (t, launches) in own.items():
            share = t / total if total > 0 else 1.0 / len(own)
            stages[f"{name}/{s}/{dtype}"] = {"s": max(0.0, module) * share, "latency_s": t, "launches": int(launches),
                                             "module_s": max(0.0, module)}
    return stages


def fit_decode_achieved(series: dict, stages: dict) -> dict:
    """{"backend/dtype": the median over the decode batches of roofline time / (module time less the
    fixed costs in `stages` of the stages that batch ran)}, where within (0, MAX_ACHIEVED], for each
    backend whose fraction scales its HBM term (scales_hbm)."""
    from ...roofline.devices import MAX_ACHIEVED
    out = {}
    for (name, dtype), rows in series.items():
        if pick_dependent(name) or not scales_hbm(name):
            continue
        # the fixed costs of the stages each batch ran (a one-token plan skips q-packed-cute's schedule)
        fixed = [sum(stages.get(f"{name}/{s}/{dtype}", {}).get("s", 0.0) for s in r[1] if s != MODULE) for r in rows]
        fractions = [r[0] / (r[1][MODULE] - f) for r, f in zip(rows, fixed) if r[1][MODULE] > f and r[0] > 0]
        if fractions and 0 < statistics.median(fractions) <= MAX_ACHIEVED:
            out[f"{name}/{dtype}"] = statistics.median(fractions)
    return out


def fit_host(series: dict) -> dict:
    """{"backend/dtype": {"s": host seconds per stage launch, "step_s": per-step planning seconds, "module_s":
    the eager module's wall-clock, "stages": {stage: its own launch seconds}, "probe_s": the host launch
    probe's seconds per launch meanwhile, the host's speed these were measured at}} from an eager series
    (measure_series with EAGER_TIMING): each on its least-work row, a stage's on the least-work row that ran
    it (q-packed-cute's schedule is not run by a one-token plan)."""
    out = {}
    for (name, dtype), rows in series.items():
        rows = sorted((r for r in rows if HOST_LAUNCH in r[1]), key=lambda r: r[0])
        if not rows or pick_dependent(name):
            continue
        medians = rows[0][1]
        stages: dict = {}
        for r in rows:
            for stage, s in r[1].get(HOST_STAGES, {}).items():
                stages.setdefault(stage, s)
        out[f"{name}/{dtype}"] = {"s": medians[HOST_LAUNCH], "step_s": medians.get(PLAN_STEP, 0.0),
                                  "module_s": medians[MODULE], **({"stages": stages} if stages else {}),
                                  **({"probe_s": medians[HOST_PROBE]} if HOST_PROBE in medians else {})}
    return out


def host_points(dtype: str, shape=None):
    """The eager series: the latency point, and one request's 8-token tile, whose plan runs the stages a
    one-token plan skips (ITEM_POINTS' second)."""
    yield from latency_points(dtype, shape)
    yield from item_points(dtype, shape, ITEM_POINTS[1:2])


def fit_items(series: dict) -> dict:
    """{"backend/dtype": {"s": 0, "block_s", "intercept_s", "points"}}: the Theil-Sen fit of module time against
    the blocks its item walks, for backends with items at two or more sizes (the latency point's and
    ITEM_POINTS'); the intercept is the module's fixed cost (fit_series), the slope one block's walk."""
    out = {}
    for (name, dtype), rows in series.items():
        have = [r for r in rows if r[3] is not None]
        if len({r[3] for r in have}) < 2:
            continue
        a, b = theil_sen([r[3] for r in have], [r[1][MODULE] for r in have])
        out[f"{name}/{dtype}"] = {"s": 0.0, "block_s": max(0.0, b), "intercept_s": max(0.0, a), "points": len(have)}
    return out


def calibrate_fixed_costs(profile: DeviceProfile, log=print, only=None, dtypes=("bf16", "fp8")) -> dict:
    """The fixed_costs table for `profile`'s GPU (this one): launch cost, per-stage costs, decode
    fractions and item times of every candidate, or with `only` (backend names) of those, every other
    backend's entries kept from `profile`. A candidate skipped on a dtype keeps that dtype's entries from
    `profile`, named in the method and the log (merge_fixed_costs)."""
    from ...errors import require_cuda
    require_cuda("fixed-cost calibration")
    t0 = time.perf_counter()
    launch, points = launch_seconds(torch.device("cuda"))
    log(f"  kernel launch in a CUDA graph: {launch * 1e6:.2f} us")
    skipped: dict = {}
    latency = measure_series(profile, dtypes, log=log, points=latency_points, only=only, skipped=skipped)
    with_items = {name for (name, _), rows in latency.items() if any(r[3] is not None for r in rows)}
    item_series = measure_series(profile, dtypes, log=log, points=item_points, only=with_items,
                                 skipped=skipped) if with_items else {}
    items = fit_items({k: latency.get(k, []) + item_series.get(k, []) for k in set(latency) | set(item_series)})
    stages = fit_series(latency, items, item_series)
    batches = measure_series(profile, dtypes, log=log, only=only, skipped=skipped)
    host = fit_host(measure_series(profile, dtypes, log=log, points=host_points, only=host_scope(only),
                                   skipped=skipped, timing=EAGER_TIMING, names=host_names()))
    generator, options = LATENCY_POINT
    fresh = {"launch_s": launch, "launch_points": [list(p) for p in points], "stages": stages,
            "decode_achieved": fit_decode_achieved(batches, stages), "items": items, "host": host,
            "method": f"stages: the module's time on the latency point ({generator} {options}), less its one "
                      f"item's walk where it has items, shared by the stages as their own times there; "
                      f"decode_achieved: the median of roofline time / (module time less that) on decode batches "
                      f"of {list(FIXED_REQUESTS)} one-token requests, contexts {FIXED_CONTEXT[0]}-{FIXED_CONTEXT[1]}; "
                      f"items: Theil-Sen of module time against a tile's blocks on the latency point and "
                      f"{len(ITEM_POINTS)} one-request workloads; host: the eager timer's host time per stage "
                      f"launch and per-step planning on the latency point, each stage's own on the least work "
                      f"that ran it (the latency point, or one request's 8-token tile)",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": time.perf_counter() - t0}
    out = merge_fixed_costs(profile.fixed_costs or {}, fresh, only, skipped,
                            candidates=[c for c in host_names() if not pick_dependent(c)])
    for unit, e in out.get("unmeasured", {}).items():
        log(f"  fixed costs: {unit} {unmeasured_line(e)}")
    return out


PER_BACKEND = ("stages", "decode_achieved", "items", "host")     # fixed_costs tables keyed "backend/..."


def unit_of(key: str) -> str:
    """The "backend/dtype" a fixed_costs key belongs to ("backend/stage/dtype" or "backend/dtype")."""
    parts = key.split("/")
    return f"{parts[0]}/{parts[-1]}"


def unmeasured_line(entry: dict) -> str:
    """What a profile's "unmeasured" entry says: where its entries come from and why."""
    where = f"kept from {entry['kept_from']}" if entry.get("kept_from") else "missing"
    return f"{where} ({entry.get('why', 'not measured here')})"


def merge_fixed_costs(old: dict, fresh: dict, only=None, skipped: dict | None = None, candidates=None) -> dict:
    """The fixed costs a calibration writes: `fresh`'s entries for each backend and dtype it measured (a
    stage at the latency point, skipped on no workload), in place of `old`'s (an entry `fresh` lacks is
    dropped, not kept stale), and the launch cost re-measured. With `only` (backend names) every other
    backend's entries are `old`'s; without, `old`'s backends are replaced whole. A backend and dtype in
    scope that `fresh` did not measure (skipped, as `skipped` says why, or absent where `old` had it and it
    is still in `candidates`) keeps all of `old`'s entries, named under "unmeasured" and in the method,
    never dropped in silence. A calibration that measured nothing in scope is a UserError: nothing is written."""
    from ...errors import UserError
    skipped = skipped or {}
    mine = (lambda key: True) if only is None else (lambda key: base_name(key.split("/")[0]) in set(only))  # noqa: E731
    live = set(candidates) if candidates is not None else None
    # a C++ launch path (NAME@op) has host costs alone: its stages are NAME's
    measured = {unit_of(k) for table in ("stages", "host") for k in (fresh.get(table) or {})} - set(skipped)
    if not any(mine(u) for u in measured):
        scope = "any candidate" if only is None else ", ".join(sorted(only))
        raise UserError(f"fixed costs of {scope} were not measured (the log above says why); the profile is unchanged")
    had = {unit_of(k) for table in PER_BACKEND for k in (old.get(table) or {}) if mine(k)}
    wanted = {u for u in had if live is None or u.split("/")[0] in live} | {u for u in skipped if mine(u)}
    kept_units = sorted(wanted - measured)
    noted = old.get("unmeasured") or {}          # an entry kept before keeps the date it was measured on
    since = lambda u: (noted.get(u) or {}).get("kept_from") or old.get("date", "an earlier calibration")  # noqa: E731
    kept = {u: {"kept_from": since(u) if u in had else None, "why": skipped.get(u, "not measured here")}
            for u in kept_units}
    out = {**old, "launch_s": fresh["launch_s"], "launch_points": fresh["launch_points"],
           "date": fresh["date"], "seconds": fresh["seconds"]}
    for table in PER_BACKEND:
        out[table] = {**{k: v for k, v in (old.get(table) or {}).items() if not mine(k) or unit_of(k) in kept},
                      **{k: v for k, v in (fresh.get(table) or {}).items() if mine(k) and unit_of(k) in measured}}
    said = "; ".join(f"{u} {unmeasured_line(e)}" for u, e in kept.items())
    if only is None:
        out["method"] = fresh["method"] + (f"; {said}" if said else "")
    else:
        out["method"] = (f"{old.get('method', '')}; {', '.join(sorted(only))} re-measured {fresh['date']} "
                         f"({fresh['seconds']:.0f} s)" + (f"; {said}" if said else "")).lstrip("; ")
    kept = {**{u: e for u, e in noted.items() if not mine(u)}, **kept}
    out.pop("unmeasured", None)
    if kept:
        out["unmeasured"] = kept
    return out
