"""The figures of a run: throughput against reuse with the roofline, throughput against co-selection with
the three schedules' rooflines, stacked stage latency, ncu bytes against the model. Each function returns
(file name, figure) pairs; `save_png` writes them small."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..roofline.devices import DeviceProfile  # noqa: E402
from ..roofline.model import ALL_SCHEDULES  # noqa: E402
from ..roofline.model import PACKED, ModelShape, packed_crossover_by_dtype  # noqa: E402
from .prediction import predict_point  # noqa: E402
from .results import Run  # noqa: E402
from .tables import (KV_OUTER, PICK_SCHEDULES, STAGE_ORDER, UNION, attention_shape, group_label, groups,  # noqa: E402
                     row_model_shape, slug, bytes_table, crossovers, group_fields, ok_units)

SCHEDULE_COLORS = {"kv-outer": "tab:blue", "q-outer": "tab:orange", PACKED: "tab:green", "msa-scatter": "tab:purple",
                   "hybrid": "dimgrey"}
MEASURED_STYLES = [("tab:red", "o"), ("tab:brown", "s"), ("black", "^"), ("tab:pink", "D"), ("tab:olive", "v"),
                   ("tab:cyan", "P"), ("darkgoldenrod", "X"), ("navy", "<"), ("lime", ">"), ("magenta", "*"),
                   ("teal", "h")]      # backends: apart from the schedules' colours, one per backend in every panel
UNION_TICKS = (1, 1.5, 2, 3, 4, 6, 8, 16)

# ---- figures ------------------------------------------------------------------------------------

def _title(run: Run, what: str) -> str:
    timer = run.timer
    tag = "CPU TIMINGS, NOT GPU" if timer == "cpu" else run.device_name
    return f"{what} — {run.meta.get('scenario')} on {tag}"


def throughput_figures(run: Run, device: DeviceProfile | None) -> list[tuple[str, plt.Figure]]:
    """TFLOP/s vs nsb/N per backend, one panel per dtype, one figure per group, with roofline curves
    per schedule and the predicted crossover (vertical line) and measured crossover (marker)."""
    t = ok_units(run)
    figs = []
    if t.empty or "module.tflops" not in t:
        return figs
    cross = {(c.group, c.dtype): c for c in crossovers(run, device)}
    for group, g in groups(t):
        dtypes = sorted(g["dtype"].unique())
        fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.6), squeeze=False)
        for ax, dtype in zip(axes[0], dtypes):
            gd = g[g["dtype"] == dtype]
            for backend, gb in gd.groupby("backend"):
                gb = gb.groupby("x")["module.tflops"].median()
                ax.plot(gb.index, gb.values, "o-", label=f"{backend} (measured)")
            if device is not None and gd["x"].notna().any():
                kv_rows = gd[gd["schedule"] == KV_OUTER]
                row = (kv_rows if len(kv_rows) else gd).iloc[0]
                shape = row_model_shape(row)
                n = float(gd["wl_n_tokens"].median())
                lo, hi = np.nanmin(gd["x"]) / 1.5, np.nanmax(gd["x"]) * 1.5
                xs = np.geomspace(max(lo, 1e-4), max(hi, lo * 2), 60)
                for sched in sorted(s for s in gd["schedule"].unique() if s in ALL_SCHEDULES):
                    # q-packed's roofline needs a co-selection: the group's median union_ratio at P 8
                    union = float(gd[UNION].median()) if UNION in gd and gd[UNION].notna().any() else None
                    if sched == PACKED and union is None:
                        continue
                    ys = []
                    for r in xs:
                        p = predict_point(sched, shape, n, r * n, device, union_ratio=union)
                        ys.append(p.flops / p.time_s / 1e12)
                    at = f", union_ratio {union:.3g}" if sched == PACKED else ""
                    ax.plot(xs, ys, "--", alpha=0.7, label=f"{sched} roofline ({device.name}{at})")
                c = cross.get((group_label(group), dtype))
                if c and c.predicted:
                    ax.axvline(c.predicted, color="grey", ls=":", label=f"predicted crossover {c.predicted:.3g}")
            c = cross.get((group_label(group), dtype))
            if c and c.measured:
                ax.axvline(c.measured, color="black", ls="-.", label=f"measured crossover {c.measured:.3g}")
            ax.set_xscale("log")
            ax.set_xlabel("reuse nsb/N (measured)")
            ax.set_ylabel("useful TFLOP/s (module)")
            ax.set_title(f"{dtype}, {group_label(group)}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(_title(run, "Throughput vs reuse"), fontsize=10)
        fig.tight_layout()
        figs.append((f"throughput_{slug(group)}.png", fig))
    return figs


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
    for group, g in groups(t):
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
                ax.set_title(f"{dtype}, nsb/N {gd['x'].median():.3g}, {group_label(group)}; strips: fastest "
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
    dtype, attention = str(row["dtype"]), attention_shape(row)
    shape = ModelShape(dtype=dtype, **attention)
    n, r = float(gd["wl_n_tokens"].median()), float(gd["x"].median())
    us = np.geomspace(1.0, float(tile), 80)
    preds = {s: [predict_point(s, shape, n, r * n, device, union_ratio=u, tile=tile) for u in us]
             for s in PICK_SCHEDULES}
    for s, ps in preds.items():
        ax.plot(us, [p.flops / p.time_s / 1e12 for p in ps], "--", color=SCHEDULE_COLORS[s], alpha=0.8,
                label=f"{s} roofline ({device.name}, nsb/N {r:.3g})")
    winners = [min(PICK_SCHEDULES, key=lambda s: preds[s][i].time_s) for i in range(len(us))]
    _bands(ax, us, winners, 0.0, 0.05)
    cross = packed_crossover_by_dtype(device, n, r, tile, dtypes=(dtype,), **attention)[dtype]
    if cross is not None and np.isfinite(cross):
        ax.axvline(cross, color="grey", ls=":", label=f"predicted ({dtype}): q-packed beats kv-outer below {cross:.3g}")
    return winners


def _short(field: str, value) -> str:
    """A grouping value as a short tick line: N16, T128K, T1M, z1, causal / not causal, or the value."""
    if field == "causal":
        return "causal" if value else "not causal"
    prefix = {"tokens": "N", "context": "T", "skew": "z"}.get(field)
    if prefix is None or not isinstance(value, (int, float, np.number)):
        return str(value)
    v = float(value)
    for size, unit in ((1 << 20, "M"), (1 << 10, "K")):
        if v >= size and v % size == 0:
            return f"{prefix}{int(v) // size}{unit}"
    return f"{prefix}{v:g}"


def stage_figures(run: Run, max_points: int = 16) -> list[tuple[str, plt.Figure]]:
    """Stacked per-stage median latency per backend (one panel per backend, one figure per dtype)."""
    t = ok_units(run)
    figs = []
    if t.empty:
        return figs
    stages = [s for s in STAGE_ORDER if f"{s}.median_s" in t]
    for dtype, gd in t.groupby("dtype"):
        backends = sorted(gd["backend"].unique())
        fig, axes = plt.subplots(1, len(backends), figsize=(5.5 * len(backends), 5.2), squeeze=False)
        for ax, backend in zip(axes[0], backends):
            gb = gd[gd["backend"] == backend].sort_values("x")
            if len(gb) > max_points:
                gb = gb.iloc[np.linspace(0, len(gb) - 1, max_points).round().astype(int)]
            pos = np.arange(len(gb))
            bottom = np.zeros(len(gb))
            for stage in stages:
                v = gb[f"{stage}.median_s"].fillna(0).to_numpy() * 1e6
                ax.bar(pos, v, bottom=bottom, label=stage)
                bottom += v
            if "module.median_s" in gb:
                ax.plot(pos, gb["module.median_s"].to_numpy() * 1e6, "k_", markersize=14, mew=2,
                        label="module (one graph)")
            fields = group_fields(gd)
            labels = ["\n".join([f"{r['x']:.3g}"] + [_short(f, r[f]) for f in fields]) for _, r in gb.iterrows()]
            ax.set_xticks(pos, labels, fontsize=6)          # one value per line: no rotated labels
            ax.set_xlabel("nsb/N" + (f"; below it {', '.join(fields)}" if fields else ""), fontsize=8)
            ax.set_ylabel("median latency (µs)")
            ax.set_title(backend, fontsize=9)
        handles, names = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0.95), ncol=len(names), fontsize=7,
                   frameon=False)                           # above the panels, never over a bar
        fig.suptitle(_title(run, f"Per-stage latency, {dtype}"), fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 0.92))
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



def save_png(fig, path: Path, dpi: int = 110) -> None:
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
