"""A trace's statistics per call, their distributions per layer and over the trace, and where each call
sits on the model's map: the schedule the roofline predicts fastest, and the nearest synthetic workload.

Every statistic is the one the generators' workloads report (stats.workload_stats, serving.neighbour_jaccard);
nothing is computed a second way here.

Nearest synthetic point: over a small grid of the generators that model co-selection (drift at p in
DRIFTS, co-selected synthetic at SHARES and the call's own nsb/N to one digit), made at the call's
context rounded up to a power of two and min(N, MAP_TOKENS) tokens, the one closest in (union_ratio at 8, nsb/N, neighbour Jaccard),
by distance^2 = ln(u / u')^2 + ln(r / r')^2 + (2 (J - J'))^2 (Jaccard left out where the call has none:
a call of one token a request).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .serving import neighbour_jaccard
from .stats import SCHEDULES, nearest_rank, workload_stats
from .trace import CallEntry, TraceInfo
from .trace_workload import call_workload
from .workload import WorkloadError

STATS = {"nsb_per_n": "nsb/N", "union_ratio_p8": "union_ratio P=8", "union_ratio_p16": "union_ratio P=16",
         "neighbour_jaccard": "neighbour Jaccard", "fanin_mean": "fan-in (mean)"}
QUANTILES = (0.1, 0.5, 0.9)
DRIFTS = (0.01, 0.03, 0.07, 0.15, 0.3)
SHARES = (0.0, 0.5, 0.75, 1.0)
MAP_TOKENS = 1024


@dataclass
class CallStats:
    entry: CallEntry
    stats: dict                  # workload_stats with neighbour_jaccard
    schedule: str | None         # the roofline's fastest schedule (with a device profile)
    nearest: tuple[str, float] | None = None     # (synthetic point, distance)


def predicted_schedule(st: dict) -> str | None:
    times = {s: st[f"pred_{s}_s"] for s in SCHEDULES if st.get(f"pred_{s}_s") is not None}
    return min(times, key=times.get) if times else None


def call_stats(info: TraceInfo, entry: CallEntry, dtype: str, profile=None) -> CallStats:
    w = call_workload(info, entry.call, dtype, with_tensors=False)
    st = workload_stats(w, profile)
    st["neighbour_jaccard"] = neighbour_jaccard(w.selection, w.q_request)
    return CallStats(entry, st, predicted_schedule(st) if profile is not None else None)


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (as stats' fan-in quantiles)."""
    return nearest_rank(sorted(values), q)


def distributions(calls: list[CallStats]) -> list[tuple[str, str, int, list[float] | None]]:
    """(statistic label, "all" or layer, calls with a value, [p10, p50, p90] or None) per statistic, over
    the whole trace and then per layer."""
    layers = sorted({c.entry.layer for c in calls})
    out = []
    for key, label in STATS.items():
        for layer in ["all", *layers]:
            values = [c.stats[key] for c in calls if (layer == "all" or c.entry.layer == layer)
                      and c.stats.get(key) is not None]
            out.append((label, str(layer), len(values), [quantile(values, q) for q in QUANTILES] if values else None))
    return out


# ---- the nearest synthetic point -------------------------------------------------------------------

def _map_point(shape, dtype, tokens: int, context: int, reuse: float, drift=None, share=None) -> dict | None:
    from .coselection import coselected_workload
    from .serving import serving_workload
    try:
        if drift is not None:
            w = serving_workload(shape, dtype, "drift", tokens, context, drift=drift, with_tensors=False)
        else:
            w = coselected_workload(shape, dtype, tokens, context, reuse, share, 8, 0.0, True, 0, "cpu", False)
    except WorkloadError:
        return None
    st = workload_stats(w)
    return {"u": st["union_ratio_p8"], "r": st["nsb_per_n"], "j": neighbour_jaccard(w.selection, w.q_request)}


def synthetic_map(shape, dtype: str, tokens: int, context: int, reuse: float, cache: dict | None = None) -> dict:
    """label ("drift p P", or "share S": co-selected synthetic) -> the statistics of each synthetic grid point
    that can be built at this size (drift's points do not depend on the reuse: `cache` keeps them across
    calls)."""
    tokens = min(tokens, MAP_TOKENS, context)
    cache = {} if cache is None else cache
    for p in DRIFTS:
        key = ("drift", p, tokens, context)
        if key not in cache:
            cache[key] = _map_point(shape, dtype, tokens, context, reuse, drift=p)
    for s in SHARES:
        key = ("share", s, tokens, context, reuse)
        if key not in cache:
            cache[key] = _map_point(shape, dtype, tokens, context, reuse, share=s)
    points = {f"drift p {p:g}": cache[("drift", p, tokens, context)] for p in DRIFTS}
    points |= {f"share {s:g}": cache[("share", s, tokens, context, reuse)] for s in SHARES}
    return {k: v for k, v in points.items() if v is not None and v["u"] is not None}


def distance(call: dict, point: dict) -> float:
    d = math.log(call["union_ratio_p8"] / point["u"]) ** 2 + math.log(call["nsb_per_n"] / point["r"]) ** 2
    if call.get("neighbour_jaccard") is not None and point["j"] is not None:
        d += (2 * (call["neighbour_jaccard"] - point["j"])) ** 2
    return math.sqrt(d)


def place(calls: list[CallStats], shape, dtype: str) -> None:
    """Set each call's nearest synthetic point (the co-selected points at the call's reuse, to one digit)."""
    cache: dict = {}
    for c in calls:
        st = c.stats
        if st.get("union_ratio_p8") is None or not st.get("nsb_per_n"):
            continue
        context = 1 << (st["context_tokens"] - 1).bit_length()      # a few maps for a trace of many contexts
        grid = synthetic_map(shape, dtype, st["n_tokens"], context, float(f"{st['nsb_per_n']:.1g}"), cache)
        if grid:
            best = min(grid, key=lambda k: distance(st, grid[k]))
            c.nearest = (best, distance(st, grid[best]))


# ---- what `msa-bench workload --trace` prints: JSON, or text in 80 columns -------------------------

def trace_json(info: TraceInfo, calls: list[CallStats], device: str | None, dtype: str) -> dict:
    from dataclasses import asdict
    return {"trace": info.path, "shape": asdict(info.shape), "provenance": info.provenance, "device": device,
            "dtype": dtype,
            "distributions": [{"statistic": label, "layer": layer, "calls": n,
                               **({f"p{round(q * 100)}": v for q, v in zip(QUANTILES, qs)} if qs else {})}
                              for label, layer, n, qs in distributions(calls)],
            "calls": [{**asdict(c.entry), "stats": c.stats, "schedule": c.schedule,
                       "nearest": c.nearest and {"point": c.nearest[0], "distance": c.nearest[1]}} for c in calls]}


def _num(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def trace_lines(info: TraceInfo, calls: list[CallStats], device: str | None, dtype: str, width: int = 80) -> list[str]:
    import textwrap
    s = info.shape
    layers = sorted({c.entry.layer for c in calls})
    lines = [f"trace {info.path}"] + textwrap.wrap(
        f"{len(calls)} of its {len(info.calls)} calls, layers {', '.join(map(str, layers))}; shape Hq {s.hq}, "
        f"Hkv {s.hkv}, D {s.head_dim}, block {s.block} tokens, top-{s.topk}", width, initial_indent="  ",
        subsequent_indent="    ")
    for key, value in info.provenance.items():
        text = value if isinstance(value, str) else ", ".join(f"{k} {v}" for k, v in value.items()) \
            if isinstance(value, dict) else str(value)
        lines += textwrap.wrap(f"{key}: {text}", width, initial_indent="  ", subsequent_indent="    ")
    lines += ["", "distributions over calls (nearest rank)",
              f"{'statistic':<20}{'layer':>6}{'calls':>7}{'p10':>10}{'p50':>10}{'p90':>10}"]
    last = None
    for label, layer, n, q in distributions(calls):
        lines.append(f"{label if label != last else '':<20}{layer:>6}{n:>7}"
                     + ("".join(f"{_num(v, '.4g'):>10}" for v in q) if q else f"{'-':>10}" * 3))
        last = label
    if device is not None:
        lines += [""] + textwrap.wrap(f"each call on the model's map ({device}, {dtype}): the schedule the roofline "
                                      "predicts fastest, and the nearest synthetic point (distance: "
                                      "docs/trace-format.md)", width, break_on_hyphens=False)
        lines += [f"{'call':>5}{'layer':>6}{'step':>5}{'N':>7}{'nsb/N':>7}{'u P=8':>6}{'Jacc.':>6}  "
                  f"{'schedule':<13}nearest synthetic"]
        for c in calls:
            st, e = c.stats, c.entry
            near = f"{c.nearest[0]} ({c.nearest[1]:.2f})" if c.nearest else "-"
            lines.append(f"{e.call:>5}{e.layer:>6}{_num(e.step, 'd'):>5}{e.tokens:>7}{_num(st['nsb_per_n'], '.3g'):>7}"
                         f"{_num(st['union_ratio_p8'], '.2f'):>6}{_num(st['neighbour_jaccard'], '.2f'):>6}  "
                         f"{c.schedule or '-':<13}{near}")
        total = sum(c.entry.weight for c in calls)
        picks: dict[str, list] = {}
        for c in calls:
            picks.setdefault(c.schedule or "-", []).append(c.entry.weight)
        lines += textwrap.wrap("predicted schedules, share of the engine calls the trace stands for: " + ", ".join(
            f"{k} {sum(v) / total:.0%} ({len(v)} calls)" for k, v in sorted(picks.items(), key=lambda kv: -sum(kv[1]))),
            width, subsequent_indent="  ")
    return lines
