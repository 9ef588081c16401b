"""The figures of a run, each along the axis its points vary (harness/report/axes.py): throughput against reuse
with the rooflines and the KV-outer/Q-outer crossovers; against co-selection with the three schedules'
rooflines; per real-prefill case with its call weight; HBM bandwidth against batch size; against context
or query tokens; stacked stage latency as small multiples; ncu bytes against the model. Each function
returns (file name, figure) pairs; `save_png` writes them small."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ...roofline.devices import DeviceProfile  # noqa: E402
from ..measure.timing import GPU_TIMERS  # noqa: E402
from ...roofline.model import ALL_SCHEDULES, ModelShape, packed_crossover_by_dtype  # noqa: E402
from ...roofline.schedules import Schedule  # noqa: E402
from ...roofline.shape import AttnShape  # noqa: E402

from .axes import (AXES, CASE, CONTEXT, POINTS, REQUESTS, REUSE, TOKENS, UNION, UNION_AXIS,  # noqa: E402
                   FigureAxis, figure_axis, given_fields, group_fields, group_label, groups, point_id, point_order,
                   ratio_label,
                   short, short_number, slug, varying_fields)
from ..store.rows import predict_point  # noqa: E402
from ..store.results import Run  # noqa: E402
from .tables import (PICK_SCHEDULES, STAGE_ORDER, _predict_row, attention_shape, bytes_table,  # noqa: E402
                     crossovers, model_time, ok_units, prefill_aggregate, row_model_shape)

SCHEDULE_COLORS = {Schedule.KV_OUTER: "tab:blue", Schedule.Q_OUTER: "tab:orange", Schedule.Q_PACKED: "tab:green",
                   Schedule.MSA_SCATTER: "tab:purple", Schedule.HYBRID: "dimgrey"}
MEASURED_STYLES = [("tab:red", "o"), ("tab:brown", "s"), ("black", "^"), ("tab:pink", "D"), ("tab:olive", "v"),
                   ("tab:cyan", "P"), ("darkgoldenrod", "X"), ("navy", "<"), ("lime", ">"), ("magenta", "*"),
                   ("teal", "h")]      # backends: apart from the schedules' colours, one per backend in every panel
UNION_TICKS = (1, 1.5, 2, 3, 4, 6, 8, 16)
SAVE_DPI = 100
MAX_WIDTH_PX = 1600            # a report figure reads at normal size: no wider than this
MAX_PANELS_WIDE = 4
MIN_SLOT_PX = 24               # a stage bar's share of a panel: room for its four-character label

# ---- figures ------------------------------------------------------------------------------------

def _title(run: Run, what: str) -> str:
    timer = run.timer
    tag = "CPU TIMINGS, NOT GPU" if timer not in GPU_TIMERS else run.device_name
    return f"{what} — {run.meta.get('scenario')} on {tag}"


def axis_figures(run: Run, device: DeviceProfile | None) -> list[tuple[str, plt.Figure]]:
    """The run's throughput figures, along the axis its points vary (harness/report/axes.py)."""
    kind = figure_axis(ok_units(run)).kind
    if kind == REUSE:
        return throughput_figures(run, device)
    if kind == UNION_AXIS:
        return co_selection_figures(run, device)
    if kind == REQUESTS:
        return bandwidth_figures(run, device)
    if kind in (CASE, POINTS):
        return point_figures(run, device)
    return line_figures(run, device)


def report_figures(run: Run, device: DeviceProfile | None) -> list[tuple[str, plt.Figure]]:
    """Every figure of a run's report: its throughput along its axis, stage latency, bytes against the model."""
    return axis_figures(run, device) + stage_figures(run) + bytes_figure(run, device)


def _style(table) -> dict:
    return {b: MEASURED_STYLES[i % len(MEASURED_STYLES)] for i, b in enumerate(sorted(table["backend"].unique()))}


def _legend_below(fig, axes, ncol: int = 4) -> float:
    """One legend under the panels, each entry once; returns the figure fraction it takes."""
    legend = {}
    for ax in np.ravel(axes):
        for h, n in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(n, h)
    rows = -(-len(legend) // ncol)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    return min(0.45, (0.2 * rows + 0.15) / fig.get_figheight())


def _model_tflops(g, device: DeviceProfile, column: str):
    """Per schedule, the roofline's TFLOP/s at each measured point: useful FLOPs over the model's time."""
    out = {}
    for sched, gs in g[g["schedule"].isin(ALL_SCHEDULES)].groupby("schedule"):
        times = np.array([model_time(r, sched, device) for _, r in gs.iterrows()])
        ok = np.isfinite(times) & (times > 0)
        if ok.any():
            v = pd.Series(gs["wl_useful_flops"].to_numpy(float)[ok] / times[ok] / 1e12, index=gs[column].to_numpy()[ok])
            out[sched] = v.groupby(level=0).max().sort_index()
    return out


def throughput_figures(run: Run, device: DeviceProfile | None) -> list[tuple[str, plt.Figure]]:
    """TFLOP/s vs nsb/N per backend, one panel per dtype, one figure per group of points that differ in
    reuse only; the KV-outer, Q-outer and MSA-scatter rooflines as curves, q-packed's at each point (its
    cost follows the union_ratio the selection has there), and the predicted (dotted) and measured
    (dash-dot) crossovers of KV-outer against Q-outer."""
    t = ok_units(run)
    figs = []
    if t.empty or "module.tflops" not in t:
        return figs
    axis = AXES[REUSE]
    cross = {(c.group, c.dtype): c for c in crossovers(run, device)}
    style = _style(t)
    for group, g in groups(t, axis):
        dtypes = sorted(g["dtype"].unique())
        fig, axes = plt.subplots(1, len(dtypes), figsize=(6.4 * len(dtypes), 6.2), squeeze=False)
        for ax, dtype in zip(axes[0], dtypes):
            gd = g[g["dtype"] == dtype]
            for backend, gb in gd.groupby("backend"):
                color, marker = style[backend]
                m = gb.groupby("x")["module.tflops"].median()
                ax.plot(m.index, m.values, "-", color=color, marker=marker, ms=4, label=f"{backend} (measured)")
            if device is not None and gd["x"].notna().any():
                _reuse_rooflines(ax, gd, device)
            c = cross.get((group_label(group), dtype))
            if c and c.predicted:
                ax.axvline(c.predicted, color="grey", ls=":", lw=1.5, label="predicted crossover, KV-outer vs Q-outer")
            if c and c.measured:
                ax.axvline(c.measured, color="black", ls="-.", lw=1.2, label="measured crossover, KV-outer vs Q-outer")
            _log_axes(ax)
            ax.set_xlabel(axis.label)
            ax.set_ylabel("useful TFLOP/s (module)")
            ax.set_title(", ".join([dtype, *([group_label(group)] if group else [])])
                         + (f"\n{_crossover_lines(c)}" if c else ""), fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
        bottom = _legend_below(fig, axes, ncol=3)
        fig.suptitle(_title(run, "Throughput vs reuse"), fontsize=10)
        fig.tight_layout(rect=(0, bottom, 1, 1))
        figs.append((f"throughput_{slug(group)}.png", fig))
    return figs


_plain = FuncFormatter(lambda v, _: short_number(v))     # 1, 8, 64, 128K: no 2^n


def _crossover_lines(c) -> str:
    """Who stands for each schedule, then the crossover measured and predicted with their gap."""
    who = f"KV-outer: fastest of {c.kv_backend}; Q-outer: {c.q_backend}"
    if c.measured is None:
        faster = c.measured_note.split(" over ")[0]
        measured = f"none measured ({faster} from {ratio_label(c.reuse_range[0])} to {ratio_label(c.reuse_range[1])})"
    else:
        measured = f"measured {c.measured:.3g}"
    predicted = "" if c.predicted is None else f", predicted {c.predicted:.3g}"
    gap = f" (gap {c.gap:+.0%})" if c.gap is not None else ""
    return f"{who}\ncrossover {measured}{predicted}{gap}"


def _log_axes(ax) -> None:
    """Log nsb/N (ticks 1/32 .. 64) and log TFLOP/s, both labelled as plain numbers."""
    from matplotlib.ticker import LogLocator, NullFormatter
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: ratio_label(v)))
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _reuse_rooflines(ax, gd, device: DeviceProfile) -> None:
    kv_rows = gd[gd["schedule"] == Schedule.KV_OUTER]
    shape = row_model_shape((kv_rows if len(kv_rows) else gd).iloc[0])
    n = float(gd["wl_n_tokens"].median())
    lo, hi = np.nanmin(gd["x"]) / 1.3, np.nanmax(gd["x"]) * 1.3
    xs = np.geomspace(max(lo, 1e-4), max(hi, lo * 2), 60)
    # the question is KV-outer against Q-outer (and the packed tile); MSA scatter's roofline is KV-outer's
    for sched in sorted(s for s in gd["schedule"].unique() if s in (Schedule.KV_OUTER, Schedule.Q_OUTER)):
        ys = [(lambda p: p.flops / p.time_s / 1e12)(predict_point(sched, shape, n, r * n, device)) for r in xs]
        ax.plot(xs, ys, "--", color=SCHEDULE_COLORS.get(sched, "grey"), alpha=0.8, label=f"{sched} roofline ({device.name})")
    packed = _model_tflops(gd[gd["schedule"] == Schedule.Q_PACKED], device, "x").get(Schedule.Q_PACKED)
    if packed is not None:
        ax.plot(packed.index, packed.values, "--", color=SCHEDULE_COLORS[Schedule.Q_PACKED], alpha=0.8,
                label=f"{Schedule.Q_PACKED} roofline ({device.name}, at each point's union_ratio)")


def _measured_panel(ax, gd, style, axis, value: str, ylabel: str, dtype: str, group) -> None:
    """One dtype's panel along a log2 axis: each backend's median `value` per axis point, joined."""
    for backend, gb in gd.groupby("backend"):
        color, marker = style[backend]
        m = gb.groupby(axis.column)[value].median()
        ax.plot(m.index, m.values, "-", color=color, marker=marker, ms=4, label=f"{backend} (measured)")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(_plain)
    ax.set_xlabel(axis.label)
    ax.set_ylabel(ylabel)
    ax.set_title(", ".join([dtype, *([group_label(group)] if group else [])]), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)


def line_figures(run: Run, device: DeviceProfile | None) -> list[tuple[str, plt.Figure]]:
    """TFLOP/s against a numeric axis other than reuse or co-selection (context, query tokens), one panel
    per dtype, one figure per group; each schedule's roofline at the measured points."""
    t = ok_units(run)
    axis = figure_axis(t)
    if t.empty or "module.tflops" not in t or axis.column not in t:
        return []

    def rooflines(ax, gd):
        if device is not None:
            for sched, v in _model_tflops(gd, device, axis.column).items():
                ax.plot(v.index, v.values, "--", color=SCHEDULE_COLORS.get(sched, "grey"), alpha=0.8,
                        label=f"{sched} roofline ({device.name})")
    return _measured_figures(run, t, axis, "module.tflops", "useful TFLOP/s (module)",
                             f"Throughput vs {axis.kind}", f"throughput_{axis.kind}", 5.6, rooflines)


def bandwidth_figures(run: Run, device: DeviceProfile | None) -> list[tuple[str, plt.Figure]]:
    """Decode-like runs (one query token per request): HBM GB/s against batch size, the roofline model's
    HBM bytes of each unit over its measured module time, under the device's HBM bandwidth."""
    t = ok_units(run)
    axis = AXES[REQUESTS]
    if t.empty or "module.median_s" not in t or axis.column not in t:
        return []
    if "module.model_hbm_bytes" in t:
        hbm = t["module.model_hbm_bytes"].astype(float)
    else:
        hbm = pd.Series(np.nan, index=t.index)
    if device is not None:           # units written before the sweep stored model bytes: the model, here
        for i, r in t[hbm.isna() & t["schedule"].isin(ALL_SCHEDULES)].iterrows():
            pred = _predict_row(r, r["schedule"], device)
            hbm[i] = pred.hbm_bytes if pred else np.nan
    t = t.assign(gbps=hbm / t["module.median_s"].astype(float) / 1e9)
    t = t[t["gbps"].notna()]
    if t.empty:
        return []

    def hbm_line(ax, gd):
        if device is not None:
            ax.axhline(device.hbm_bytes_per_s / 1e9, color="black", ls="--", lw=1,
                       label=f"HBM roofline ({device.name}, {device.hbm_bytes_per_s / 1e12:.2f} TB/s)")
    return _measured_figures(run, t, axis, "gbps", "GB/s (model HBM bytes / measured module time)",
                             "HBM bandwidth vs batch size", "bandwidth", 5.2, hbm_line)


def _measured_figures(run: Run, t: pd.DataFrame, axis: FigureAxis, column: str, ylabel: str, title: str,
                      prefix: str, height: float, overlay) -> list[tuple[str, plt.Figure]]:
    """One figure per group of `axis`, one panel per dtype: each backend's `column` against the axis,
    then `overlay(ax, the panel's rows)` (rooflines); named PREFIX_GROUP.png."""
    style, figs = _style(t), []
    for group, g in groups(t, axis):
        dtypes = sorted(g["dtype"].unique())
        fig, axes = plt.subplots(1, len(dtypes), figsize=(6.4 * len(dtypes), height), squeeze=False)
        for ax, dtype in zip(axes[0], dtypes):
            gd = g[g["dtype"] == dtype]
            _measured_panel(ax, gd, style, axis, column, ylabel, dtype, group)
            overlay(ax, gd)
        bottom = _legend_below(fig, axes, ncol=3)
        fig.suptitle(_title(run, title), fontsize=10)
        fig.tight_layout(rect=(0, bottom, 1, 1))
        figs.append((f"{prefix}_{slug(group)}.png", fig))
    return figs


def _point_labels(t, axis: FigureAxis, order: list[str]) -> list[str]:
    """One short tick label per point id: the axis value, and under the first point of each group the
    group's fields (nothing repeated bar after bar)."""
    first = t.assign(_pid=point_id(t)).groupby("_pid").first()
    fields_ = group_fields(t, axis)
    out, previous = [], None
    for pid in order:
        r = first.loc[pid]
        if axis.kind == CASE:
            lines = [short_number(r["wl_n_tokens"]), short_number(r["wl_context_tokens"])]
        elif axis.kind == POINTS:           # what differs, then what the workloads measured
            lines = [short(f, r[f]) for f in varying_fields(t)] + [f"nsb/N {r['x']:.2g}"]
            lines += [f"u {r[UNION]:.3g}"] if UNION in r and pd.notna(r[UNION]) else []
        elif axis.kind == REQUESTS:
            lines = [f"{r[axis.column]:g}"]
        elif axis.kind in (CONTEXT, TOKENS):
            lines = [short_number(r[axis.column])]
        elif axis.kind == REUSE:
            lines = [ratio_label(r[axis.column])]
        else:
            lines = [f"{r[axis.column]:.3g}"]
        group = [short(f, v) for f, v in given_fields({f: r[f] for f in fields_}).items()]
        out.append("\n".join(lines + (group if group != previous else [])))
        previous = group
    return out


def _group_starts(t, axis: FigureAxis, order: list[str]) -> list[int]:
    """Positions in `order` where a new group begins (after the first)."""
    fields_ = group_fields(t, axis)
    if not fields_:
        return []
    first = t.assign(_pid=point_id(t)).groupby("_pid").first()
    keys = [tuple(repr(first.loc[p, f]) for f in fields_) for p in order]
    return [i for i in range(1, len(keys)) if keys[i] != keys[i - 1]]


def point_figures(run: Run, device: DeviceProfile | None) -> list[tuple[str, plt.Figure]]:
    """Points that differ in more than one thing (real-prefill cases, or a few points): each point's
    module TFLOP/s per backend, side by side, nothing joined across points; one panel per dtype. Cases
    come heaviest call weight first, with their weights below and the call-weighted aggregate at the
    right."""
    t = ok_units(run)
    if t.empty or "module.tflops" not in t:
        return []
    axis = figure_axis(t)
    order = point_order(t, axis)
    labels = _point_labels(t, axis, order)
    t = t.assign(_pid=point_id(t))
    pos = {pid: i for i, pid in enumerate(order)}
    cases = axis.kind == CASE and "weight" in t
    agg = prefill_aggregate(run) if cases else pd.DataFrame()
    dtypes = sorted(t["dtype"].unique())
    style, backends = _style(t), sorted(t["backend"].unique())
    ratios = [3] * len(dtypes) + ([1] if cases else [])
    width = min(MAX_WIDTH_PX / SAVE_DPI, max(8.0, 3.0 + 0.62 * (len(order) + (1.5 if cases else 0))))
    fig, axes = plt.subplots(len(ratios), 1, figsize=(width, 1.1 * sum(ratios) + 1.6), sharex=True,
                             gridspec_kw={"height_ratios": ratios}, squeeze=False)
    axes = axes[:, 0]
    agg_x = len(order) + 0.6
    for ax, dtype in zip(axes, dtypes):
        gd = t[t["dtype"] == dtype]
        for i, backend in enumerate(backends):
            gb = gd[gd["backend"] == backend]
            if gb.empty:
                continue
            m = gb.groupby("_pid")["module.tflops"].median()
            dx = (i - (len(backends) - 1) / 2) * 0.06
            color, marker = style[backend]
            ax.plot([pos[p] + dx for p in m.index], m.values, ls="none", marker=marker, color=color, ms=5,
                    label=backend)
            a = agg[(agg["dtype"] == dtype) & (agg["backend"] == backend)] if not agg.empty else agg
            if len(a):
                ax.plot([agg_x + dx], a["aggregate TFLOP/s"], ls="none", marker=marker, color=color, ms=7)
        if cases:
            ax.axvline(len(order) - 0.2, color="grey", lw=0.8)
        ax.set_ylabel(f"{dtype}: useful TFLOP/s")
        ax.grid(True, axis="y", alpha=0.3)
    ticks, names = list(range(len(order))), labels
    if cases:
        w = t.groupby("_pid")["weight"].first().reindex(order).astype(float)
        axes[-1].bar(range(len(order)), w.to_numpy() / w.sum() * 100, color="grey")
        axes[-1].set_ylabel("call weight %")
        ticks, names = ticks + [agg_x], names + ["call-\nweighted"]
    axes[-1].set_xticks(ticks, names, fontsize=7)
    axes[-1].set_xlabel(axis.label if cases else "point: what differs, then the measured nsb/N and "
                        "union_ratio u at P = 8", fontsize=8)
    axes[-1].set_xlim(-0.6, (agg_x if cases else len(order) - 1) + 0.6)
    bottom = _legend_below(fig, axes[:1], ncol=5)
    what = "Real-prefill cases" if cases else "Throughput per point"
    fig.suptitle(_title(run, what), fontsize=10)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return [(f"{'cases' if cases else 'points'}.png", fig)]

def _bands(ax, xs, schedules, y0: float, y1: float) -> None:
    """Colour the strip y0..y1 (axes fraction) by the schedule that wins at each x (split at midpoints)."""
    edges = np.concatenate([[xs[0]], np.sqrt(xs[1:] * xs[:-1]), [xs[-1]]]) if len(xs) > 1 else [xs[0] / 1.05,
                                                                                               xs[0] * 1.05]
    for lo, hi, s in zip(edges[:-1], edges[1:], schedules):
        ax.axvspan(lo, hi, ymin=y0, ymax=y1, color=SCHEDULE_COLORS.get(s, "grey"), alpha=0.6, lw=0)


def co_selection_figures(run: Run, device: DeviceProfile | None, tile: int = 8) -> list[tuple[str, plt.Figure]]:
    """Module TFLOP/s against co-selection (union_ratio at P = 8) per backend, one panel per dtype, one
    figure per group and target reuse where union_ratio varies; with the KV-outer, Q-outer and q-packed
    rooflines at the group's reuse and N, the union_ratio below which q-packed beats KV-outer, and two
    strips of where each schedule wins: predicted (bottom) and measured (top, the fastest backend's)."""
    t = ok_units(run)
    if t.empty or "module.tflops" not in t or UNION not in t:
        return []
    t = t[t[UNION].notna()]
    figs = []
    for group, g in groups(t, AXES[UNION_AXIS]):
        by_reuse = g.groupby(g["reuse"].fillna(-1.0) if "reuse" in g else np.zeros(len(g)))
        for reuse, gr in by_reuse:
            if gr[UNION].round(3).nunique() < 2:
                continue
            dtypes = sorted(gr["dtype"].unique())
            style = {b: MEASURED_STYLES[i % len(MEASURED_STYLES)] for i, b in enumerate(sorted(gr["backend"].unique()))}
            fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 6.4), squeeze=False)
            for ax, dtype in zip(axes[0], dtypes):
                gd = gr[gr["dtype"] == dtype]
                for backend, gb in gd.groupby("backend"):
                    color, marker = style[backend]
                    m = gb.groupby(UNION)["module.tflops"].median()
                    ax.plot(m.index, m.values, "-", marker=marker, color=color,
                            label=f"{backend} ({gb['schedule'].iloc[0]}, measured)")
                timed = gd[gd["schedule"] != "none"]
                strips = []
                if len(timed):
                    best = timed.loc[timed.groupby(UNION)["module.tflops"].idxmax()].sort_values(UNION)
                    _bands(ax, best[UNION].to_numpy(float), list(best["schedule"]), 0.95, 1.0)
                    strips = list(best["schedule"])
                if device is not None:
                    strips += _co_selection_rooflines(ax, gd, device, tile)
                for s in dict.fromkeys(strips):
                    ax.plot([], [], "s", color=SCHEDULE_COLORS.get(s, "grey"), alpha=0.6, label=f"strip: {s} fastest")
                ax.set_xscale("log", base=2)
                ax.set_xticks([u for u in UNION_TICKS if u <= tile], [f"{u:g}" for u in UNION_TICKS if u <= tile])
                ax.set_xlabel(f"co-selection: union_ratio at P = {tile} tokens (measured; 1 = a tile selects alike)")
                ax.set_ylabel("useful TFLOP/s (module)")
                ax.set_title(", ".join([dtype, f"nsb/N {gd['x'].median():.3g}", *([group_label(group)] if group else [])])
                             + "; strips: fastest "
                             "schedule measured (top), predicted (bottom)", fontsize=8)
                ax.grid(True, which="both", alpha=0.3)
            legend = {}
            for ax in axes[0]:                       # one legend below the panels, each entry once
                for h, n in zip(*ax.get_legend_handles_labels()):
                    legend.setdefault(n.replace(f", {dtypes[0]}", ""), h)
            fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=3, fontsize=7, frameon=False)
            fig.suptitle(_title(run, "Throughput vs co-selection"), fontsize=10)
            fig.tight_layout(rect=(0, 0.24, 1, 1))
            figs.append((f"coselection_{slug(group, f'reuse{reuse:g}')}.png", fig))
    return figs


def _co_selection_rooflines(ax, gd, device: DeviceProfile, tile: int) -> list[str]:
    """The three rooflines over union_ratio 1..P and the predicted-winner strip; returns the winners. The
    model's shape for the panel's dtype (its default KV-outer), as `msa-bench roofline` has it, so the
    crossover drawn is the one the CLI and the README quote."""
    row = gd.iloc[0]
    dtype, attention = str(row["dtype"]), AttnShape(**attention_shape(row))
    shape = ModelShape.of(attention, dtype=dtype)
    n, r = float(gd["wl_n_tokens"].median()), float(gd["x"].median())
    us = np.geomspace(1.0, float(tile), 80)
    preds = {s: [predict_point(s, shape, n, r * n, device, union_ratio=u, tile=tile) for u in us]
             for s in PICK_SCHEDULES}
    for s, ps in preds.items():
        ax.plot(us, [p.flops / p.time_s / 1e12 for p in ps], "--", color=SCHEDULE_COLORS[s], alpha=0.8,
                label=f"{s} roofline ({device.name}, nsb/N {r:.3g})")
    winners = [min(PICK_SCHEDULES, key=lambda s: preds[s][i].time_s) for i in range(len(us))]
    _bands(ax, us, winners, 0.0, 0.05)
    cross = packed_crossover_by_dtype(device, n, r, tile, dtypes=(dtype,), shape=attention)[dtype]
    if cross is not None and np.isfinite(cross):
        ax.axvline(cross, color="grey", ls=":", label=f"predicted ({dtype}): q-packed beats kv-outer below {cross:.3g}")
    return winners


def stage_figures(run: Run, max_points: int = 16) -> list[tuple[str, plt.Figure]]:
    """Stacked per-stage median latency: one figure per dtype, small multiples (one panel per backend, at
    most MAX_PANELS_WIDE across), each panel's bars in the order of the run's axis, the same order for
    every dtype; a dtype's figure has a slot for each point that ran in it, none for a point that ran only
    in another dtype."""
    t = ok_units(run)
    figs = []
    if t.empty:
        return figs
    axis = figure_axis(t)
    order = point_order(t, axis)
    if len(order) > max_points:
        order = [order[i] for i in np.linspace(0, len(order) - 1, max_points).round().astype(int)]
    t = t.assign(_pid=point_id(t))
    t = t[t["_pid"].isin(order)]
    stages = [s for s in STAGE_ORDER if f"{s}.median_s" in t]
    colors = {s: f"C{STAGE_ORDER.index(s)}" for s in stages}        # a stage keeps its colour in every report
    backends = sorted(t["backend"].unique())
    # each bar's slot wide enough for a four-character label: fewer panels across when there are many bars
    fit = int((MAX_WIDTH_PX - 40) // (MIN_SLOT_PX * len(order) + 90))
    cols = max(1, min(MAX_PANELS_WIDE, len(backends), fit))
    rows = -(-len(backends) // cols)
    panel_w = (MAX_WIDTH_PX - 40) / SAVE_DPI / cols
    fields_ = group_fields(t, axis)
    xlabel = {CASE: "case: N query tokens over T context, heaviest call weight first",
              POINTS: "point: what differs, then the measured nsb/N and union_ratio u at P = 8"}.get(axis.kind,
                                                                                                    axis.label)
    height = 3.0 * rows + 1.0
    for dtype, gd in t.groupby("dtype"):
        ran = set(gd["_pid"])
        here = [p for p in order if p in ran]
        labels, starts = _point_labels(t, axis, here), _group_starts(t, axis, here)
        pos = {pid: i for i, pid in enumerate(here)}
        fig, axes = plt.subplots(rows, cols, figsize=(panel_w * cols, height), squeeze=False)
        for ax, backend in zip(axes.flat, backends):
            gb = gd[gd["backend"] == backend].groupby("_pid").first()
            x = np.array([pos[p] for p in gb.index])
            bottom = np.zeros(len(gb))
            for stage in stages:
                v = gb[f"{stage}.median_s"].fillna(0).to_numpy() * 1e6
                ax.bar(x, v, bottom=bottom, color=colors[stage], label=stage)
                bottom += v
            top = bottom.max() if len(bottom) else 0.0
            if "module.median_s" in gb:
                module = gb["module.median_s"].to_numpy() * 1e6
                ax.plot(x, module, "k_", markersize=8, mew=1.5, label="module (one graph)")
                top = max(top, np.nanmax(module) if len(module) else 0.0)
            for i in starts:
                ax.axvline(i - 0.5, color="grey", lw=0.8)
            ax.set_xticks(range(len(here)), labels, fontsize=6)       # one value per line: no rotated labels
            ax.set_xlim(-0.6, len(here) - 0.4)
            if top > 0:
                ax.set_ylim(0, top * 1.08)           # the tallest bar and its module tick inside the frame
            ax.tick_params(axis="y", labelsize=7)
            ax.set_title(backend, fontsize=8)
        for ax in axes[:, 0]:
            ax.set_ylabel("median latency (µs)", fontsize=7)
        for ax in axes.flat[len(backends):]:
            ax.set_visible(False)
        handles, names = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.5 / height),
                   ncol=len(names), fontsize=7, frameon=False)       # above the panels, never over a bar
        note = xlabel + (f"; groups ({', '.join(fields_)}) named under their first bar" if fields_ else "")
        fig.suptitle(_title(run, f"Per-stage latency, {dtype}") + f"\nx: {note}", fontsize=9, y=1 - 0.06 / height)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.75 / height))
        figs.append((f"stages_{dtype}.png", fig))
    return figs

def bytes_figure(run: Run, device: DeviceProfile | None) -> list[tuple[str, plt.Figure]]:
    bt = bytes_table(run, device)
    if bt.empty or "hbm model" not in bt:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
    for ax, level in zip(axes, ("hbm", "l2")):
        for backend, g in bt.groupby("backend"):
            dots = ax.scatter(g[f"{level} model"], g[f"{level} measured"], label=backend)
            if level == "l2" and g["l2 from SMs"].notna().any():
                ax.scatter(g["l2 model"], g["l2 from SMs"], marker="x", color=dots.get_facecolor()[0],
                           label=f"{backend}, from SMs only")
        lim = [bt[[f"{level} model", f"{level} measured"]].min().min() * 0.8,
               bt[[f"{level} model", f"{level} measured"]].max().max() * 1.25]
        ax.plot(lim, lim, "k--", lw=1, label="measured = model")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"{level.upper()} bytes, roofline model")
        ax.set_ylabel(f"{level.upper()} bytes, ncu measured")
        ax.legend(fontsize=7)
    fig.suptitle(_title(run, "Bytes moved: measured vs model"), fontsize=10)
    fig.tight_layout()
    return [("bytes.png", fig)]



def save_png(fig, path: Path, dpi: int = SAVE_DPI) -> None:
    """The figure as a 256-colour palette PNG: plots of a few flat colours lose nothing visible and
    take about a third of matplotlib's RGBA bytes (results travel with the repository)."""
    import io

    from PIL import Image
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    shrink_png(Image.open(buf), path)


def shrink_png(image, path: Path) -> None:
    from PIL import Image
    image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, "PNG", optimize=True)
