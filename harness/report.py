"""Plots and a Markdown summary of a run folder, held against the roofline.

Every figure and table comes from a function here, so the CLI (`msa-bench report`) and the notebook
(notebooks/report.py) show the same things. Reuse on the x axis is the measured nsb/N of each point.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ..roofline.devices import DeviceProfile  # noqa: E402
from ..roofline.model import crossover, crossover_at  # noqa: E402
from .prediction import device_for_run, launch_labels, model_shape, plan_config, predict_point  # noqa: E402
from .results import STATUS_OK, Run, load_run  # noqa: E402

STAGE_ORDER = ("index_map", "schedule", "attention", "combine")
GROUP_FIELDS = ("generator", "tokens", "context", "skew", "causal")
MAX_GROUP_VALUES = 6           # a field with more distinct values varies along x, not per figure
KV_OUTER, Q_OUTER = "kv-outer", "q-outer"
SHAPE_DEFAULTS = {"hq": 64, "hkv": 4, "head_dim": 128, "block": 128, "topk": 16}


# ---- tables -------------------------------------------------------------------------------------

def unit_table(run: Run) -> pd.DataFrame:
    """One row per unit: status columns, nsb/N (`x`), and wide `<stage>.<statistic>` columns."""
    st = run.status.copy()
    if st.empty:
        return st
    if "wl_nsb_per_n" in st:
        st["x"] = st["wl_nsb_per_n"]
    elif {"wl_nsb", "wl_n_tokens"} <= set(st):
        st["x"] = st["wl_nsb"] / st["wl_n_tokens"]
    else:
        st["x"] = st.get("reuse", np.nan)
    if run.stats.empty:
        return st
    wide = run.stats.pivot_table(index=["point_key", "backend"], columns=["stage", "statistic"],
                                 values="value", aggfunc="first")
    wide.columns = [f"{a}.{b}" for a, b in wide.columns]
    return st.merge(wide.reset_index(), on=["point_key", "backend"], how="left")


def ok_units(run: Run) -> pd.DataFrame:
    t = unit_table(run)
    return t[t["status"] == STATUS_OK] if not t.empty else t


def _shape(row) -> dict:
    out = {}
    for k, default in SHAPE_DEFAULTS.items():
        value = next((row[c] for c in (k, f"wl_{k}") if c in row and pd.notna(row[c])), default)
        out[k] = int(value)
    return out


def _row_model_shape(row):
    """The model's shape for a unit row: its attention shape, dtype and launch configuration."""
    return model_shape(**_shape(row), dtype=row["dtype"], config=plan_config(row.get("plan_info")))


def _predict_row(row, schedule: str, device: DeviceProfile):
    shape = _row_model_shape(row)
    return predict_point(schedule, shape, row.get("wl_n_tokens", np.nan),
                         row.get("wl_nsb", np.nan), device, flops=row.get("wl_useful_flops"),
                         selected_per_query=row.get("wl_selected_blocks_per_query"))


def group_fields(table: pd.DataFrame) -> list[str]:
    return [f for f in GROUP_FIELDS if f in table and 1 < table[f].nunique(dropna=False) <= MAX_GROUP_VALUES]


def _groups(table: pd.DataFrame):
    fields = group_fields(table)
    if not fields:
        yield {}, table
        return
    for values, g in table.groupby(fields, dropna=False, sort=True):
        values = values if isinstance(values, tuple) else (values,)
        yield dict(zip(fields, values)), g


def _group_label(group: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in group.items()) or "all points"


def _slug(group: dict, extra: str = "") -> str:
    text = "_".join(f"{k}{v}" for k, v in group.items()) or "all"
    text = f"{extra}_{text}" if extra else text
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


def status_table(run: Run) -> pd.DataFrame:
    st = run.status
    if st.empty:
        return pd.DataFrame(columns=["backend", "status", "units"])
    return st.groupby(["backend", "status"]).size().rename("units").reset_index()


def throughput_table(run: Run) -> pd.DataFrame:
    t = ok_units(run)
    if t.empty:
        return t
    cols = {"backend": "backend", "dtype": "dtype", **{f: f for f in group_fields(t)}, "x": "nsb/N",
            "wl_n_tokens": "N", "module.median_s": "module_s", "module.cv": "cv", "module.tflops": "TFLOP/s",
            "attention.tflops": "attention TFLOP/s", "module.converged": "CV converged", "throttled": "throttled"}
    out = t[[c for c in cols if c in t]].rename(columns=cols)
    if "CV converged" in out:
        out["CV converged"] = out["CV converged"].fillna(0).astype(bool)
    if "plan_info" in t:                          # the tile order and CuTe generation each unit ran
        labels = pd.DataFrame([launch_labels(p) if isinstance(p, (str, dict)) else {} for p in t["plan_info"]],
                              index=t.index)
        for col in ("kernel", "tile order"):
            if col in labels and labels[col].notna().any():
                out.insert(2, col, labels[col].fillna(""))
    order = [c for c in ("dtype", "backend", *group_fields(t), "nsb/N") if c in out]
    return out.sort_values(order).reset_index(drop=True)


def stage_table(run: Run) -> pd.DataFrame:
    """Median latency per stage (seconds), one row per unit."""
    t = ok_units(run)
    if t.empty:
        return t
    groups = group_fields(t)
    cols = ["backend", "dtype", *groups, "x"] + [f"{s}.median_s" for s in (*STAGE_ORDER, "module", "plan")
                                                 if f"{s}.median_s" in t]
    return (t[cols].rename(columns={"x": "nsb/N"}).sort_values(["dtype", "backend", *groups, "nsb/N"])
            .reset_index(drop=True))


# ---- the roofline next to the measurements ------------------------------------------------------

def model_time(row, schedule: str, device: DeviceProfile) -> float:
    pred = _predict_row(row, schedule, device)
    return pred.time_s if pred else float("nan")


def bytes_table(run: Run, device: DeviceProfile | None) -> pd.DataFrame:
    """Measured (ncu) HBM and L2 bytes of the module next to the roofline's, per unit with counters."""
    t = ok_units(run)
    if t.empty or "module.hbm_bytes" not in t:
        return pd.DataFrame()
    t = t[t["module.hbm_bytes"].notna()]
    rows = []
    for _, r in t.iterrows():
        # l2 measured: every access at an L2 slice (lts__t_bytes); l2 from SMs: only what the SMs asked
        # for (srcunit_tex), which is what the model counts; the rest is mostly partition crossing.
        row = {"backend": r["backend"], "dtype": r["dtype"], "nsb/N": r["x"],
               "hbm measured": r["module.hbm_bytes"], "l2 measured": r.get("module.l2_bytes", np.nan),
               "l2 from SMs": r.get("module.l2_sm_bytes", np.nan),
               "l2 cross-partition": r.get("module.l2_fabric_bytes", np.nan)}
        if device is not None and r["schedule"] != "none":
            pred = _predict_row(r, r["schedule"], device)
            if pred:
                row.update({"hbm model": pred.hbm_bytes, "l2 model": pred.l2_bytes,
                            "hbm measured/model": row["hbm measured"] / pred.hbm_bytes,
                            "l2 measured/model": row["l2 measured"] / pred.l2_bytes,
                            "l2 from SMs/model": row["l2 from SMs"] / pred.l2_bytes})
        rows.append(row)
    return pd.DataFrame(rows)


@dataclass
class Crossover:
    group: str
    dtype: str
    kv_backend: str
    q_backend: str
    measured: float | None          # nsb/N where the two meet (log-interpolated), None if they never do
    measured_note: str
    predicted: float | None         # capacity-aware, at the group's N (what the curves show)
    predicted_capacity_free: float | None


def measured_crossover(x: np.ndarray, kv_s: np.ndarray, q_s: np.ndarray) -> tuple[float | None, str]:
    """Where KV-outer stops being faster, on the log nsb/N axis. Inputs: nsb/N and module latencies."""
    order = np.argsort(x)
    x, d = x[order], np.log(kv_s[order]) - np.log(q_s[order])     # d < 0: KV-outer faster
    if len(x) == 0:
        return None, "no common points"
    for i in range(len(x) - 1):
        if d[i] == 0:
            return float(x[i]), "measured tie"
        if d[i] * d[i + 1] < 0:
            lx0, lx1 = math.log(x[i]), math.log(x[i + 1])
            return float(math.exp(lx0 + (lx1 - lx0) * d[i] / (d[i] - d[i + 1]))), "interpolated"
    if d[-1] == 0:
        return float(x[-1]), "measured tie"
    if (d < 0).all():
        return None, f"KV-outer faster over the whole measured range (nsb/N {x[0]:.3g} to {x[-1]:.3g})"
    return None, f"Q-outer faster over the whole measured range (nsb/N {x[0]:.3g} to {x[-1]:.3g})"


def _finite_or_none(v: float) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


def crossovers(run: Run, device: DeviceProfile | None) -> list[Crossover]:
    t = ok_units(run)
    out = []
    if t.empty or "module.median_s" not in t:
        return out
    for group, g in _groups(t):
        for dtype, gd in g.groupby("dtype"):
            kv = sorted(gd.loc[gd["schedule"] == KV_OUTER, "backend"].unique())
            qo = sorted(gd.loc[gd["schedule"] == Q_OUTER, "backend"].unique())
            for kb in kv:
                for qb in qo:
                    a = gd[gd["backend"] == kb].groupby("x")["module.median_s"].median()
                    b = gd[gd["backend"] == qb].groupby("x")["module.median_s"].median()
                    common = a.index.intersection(b.index)
                    value, note = measured_crossover(common.to_numpy(float), a[common].to_numpy(float),
                                                     b[common].to_numpy(float))
                    pred = free = None
                    if device is not None:
                        row = gd[gd["backend"] == kb].iloc[0]
                        shape = _row_model_shape(row)
                        free = _finite_or_none(crossover(shape, device))
                        pred = _finite_or_none(crossover_at(shape, device, float(gd["wl_n_tokens"].median())))
                    out.append(Crossover(_group_label(group), dtype, kb, qb, value, note, pred, free))
    return out


def is_prefill_run(run: Run) -> bool:
    st = run.status
    return (not st.empty and "case_id" in st and st["case_id"].notna().any()
            and (st["case_id"].astype(str) != "").any() and "weight" in st)


def prefill_aggregate(run: Run) -> pd.DataFrame:
    """Call-weighted mean latency and aggregate useful TFLOP/s per backend (SOURCE-README formulas),
    over the cases every backend of that dtype finished, so backends are compared on the same cases."""
    t = ok_units(run)
    if t.empty or "module.median_s" not in t:
        return pd.DataFrame()
    rows = []
    for dtype, gd in t.groupby("dtype"):
        backends = sorted(gd["backend"].unique())
        cases = set.intersection(*(set(gd.loc[gd["backend"] == b, "case_id"]) for b in backends))
        for b in backends:
            g = gd[(gd["backend"] == b) & gd["case_id"].isin(cases)]
            w, lat = g["weight"].astype(float), g["module.median_s"].astype(float)
            flops = g.get("wl_useful_flops", pd.Series(0.0, index=g.index)).astype(float)
            rows.append({"dtype": dtype, "backend": b, "cases": len(g), "call weight": w.sum(),
                         "weighted mean latency_s": (w * lat).sum() / w.sum() if w.sum() else float("nan"),
                         "aggregate TFLOP/s": ((w * flops).sum() / (w * lat).sum() / 1e12 if (w * lat).sum()
                                               else float("nan"))})
    return pd.DataFrame(rows)


def roofline_picks(run: Run, device: DeviceProfile | None) -> tuple[pd.DataFrame, dict]:
    """Per case: KV-outer or Q-outer, which the roofline predicts faster vs which was measured faster.

    The decision the model exists for is the schedule (KV-outer against Q-outer); the MSA-style scatter
    differs from KV-outer only by a store path whose cost is latency, not bytes, so it is left out here.
    Returns (per-case table, {"cases", "agree_cases", "agree_weight_share"})."""
    t = ok_units(run)
    if device is None or t.empty or "module.median_s" not in t:
        return pd.DataFrame(), {}
    t = t[t["schedule"].isin(["kv-outer", "q-outer"])]
    rows = []
    for (key, dtype), g in t.groupby(["point_key", "dtype"]):
        if g["schedule"].nunique() < 2:
            continue
        predicted = {s: model_time(g[g["schedule"] == s].iloc[0], s, device) for s in g["schedule"].unique()}
        fastest = g.loc[g["module.median_s"].idxmin()]
        pick = min(predicted, key=predicted.get)
        case_id = g["case_id"].iloc[0] if "case_id" in g else None
        rows.append({"case": case_id if isinstance(case_id, str) and case_id else key, "dtype": dtype,
                     "weight": float(g["weight"].iloc[0]) if "weight" in g and pd.notna(g["weight"].iloc[0]) else 1.0,
                     "nsb/N": g["x"].iloc[0], "predicted": pick, "measured fastest": fastest["backend"],
                     "agree": pick == fastest["schedule"]})
    table = pd.DataFrame(rows)
    if table.empty:
        return table, {}
    total_w = table["weight"].sum()
    summary = {"cases": len(table), "agree_cases": int(table["agree"].sum()),
               "agree_weight_share": (float(table.loc[table["agree"], "weight"].sum() / total_w) if total_w
                                      else float("nan"))}
    return table, summary


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
    for group, g in _groups(t):
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
                shape = _row_model_shape(row)
                n = float(gd["wl_n_tokens"].median())
                lo, hi = np.nanmin(gd["x"]) / 1.5, np.nanmax(gd["x"]) * 1.5
                xs = np.geomspace(max(lo, 1e-4), max(hi, lo * 2), 60)
                for sched in sorted(s for s in gd["schedule"].unique() if s != "none"):
                    ys = []
                    for r in xs:
                        p = predict_point(sched, shape, n, r * n, device)
                        ys.append(p.flops / p.time_s / 1e12)
                    ax.plot(xs, ys, "--", alpha=0.7, label=f"{sched} roofline ({device.name})")
                c = cross.get((_group_label(group), dtype))
                if c and c.predicted:
                    ax.axvline(c.predicted, color="grey", ls=":", label=f"predicted crossover {c.predicted:.3g}")
            c = cross.get((_group_label(group), dtype))
            if c and c.measured:
                ax.axvline(c.measured, color="black", ls="-.", label=f"measured crossover {c.measured:.3g}")
            ax.set_xscale("log")
            ax.set_xlabel("reuse nsb/N (measured)")
            ax.set_ylabel("useful TFLOP/s (module)")
            ax.set_title(f"{dtype}, {_group_label(group)}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(_title(run, "Throughput vs reuse"), fontsize=10)
        fig.tight_layout()
        figs.append((f"throughput_{_slug(group)}.png", fig))
    return figs


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
            labels = [f"{r['x']:.3g}" + "".join(f" {f}={r[f]}" for f in fields) for _, r in gb.iterrows()]
            ax.set_xticks(pos, labels, rotation=60, ha="right", fontsize=6)
            ax.set_xlabel("nsb/N (and what else varies)")
            ax.set_ylabel("median latency (µs)")
            ax.set_title(backend, fontsize=9)
            ax.legend(fontsize=7)
        fig.suptitle(_title(run, f"Per-stage latency, {dtype}"), fontsize=10)
        fig.tight_layout()
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


# ---- Markdown -----------------------------------------------------------------------------------

def _fmt(v) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        if not math.isfinite(v):
            return "–"
        a = abs(v)
        return f"{v:.3e}" if a and (a < 1e-3 or a >= 1e6) else f"{v:.4g}"
    return "–" if v is None else str(v)


def markdown_table(df: pd.DataFrame, max_rows: int = 200) -> str:
    if df is None or df.empty:
        return "_(none)_\n"
    df = df.head(max_rows)
    lines = ["| " + " | ".join(str(c) for c in df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def summary_markdown(run: Run, device: DeviceProfile | None, figures: list[str]) -> str:
    prov = run.meta.get("provenance") or {}
    out = [f"# msa-bench report: {run.path.name}", ""]
    if run.timer == "cpu":
        out += ["> **CPU RUN — these are host timings of the CPU pipeline, NOT GPU timings.** "
                "They show that the pipeline works; do not read performance from them.", ""]
    out += [f"- scenario: `{run.meta.get('scenario')}` ({run.meta.get('scenario_description', '')})",
            f"- measured on: {run.device_name}; timer: {run.timer}",
            f"- torch {prov.get('torch')}, triton {prov.get('triton')}, flashinfer {prov.get('flashinfer')}, "
            f"CUDA {prov.get('cuda')}, driver {prov.get('driver')}",
            f"- source: commit {prov.get('git_commit')} (dirty: {prov.get('git_dirty')}); started {prov.get('time_utc')} "
            f"on {prov.get('hostname')}",
            f"- run complete: {run.meta.get('complete')}",
            f"- roofline device: {device.name if device else 'none (no profile matches this device; model omitted)'}",
            ""]
    for note in run.meta.get("notes") or []:
        out.append(f"- note: {note}")
    out += ["", "## Units", "", markdown_table(status_table(run))]
    bad = run.status[run.status["status"] != STATUS_OK] if not run.status.empty else run.status
    if not bad.empty:
        why = bad.groupby(["backend", "status", "reason"]).size().rename("units").reset_index()
        out += ["Not timed (a failed check is never timed):", "", markdown_table(why)]
    if "throttled" in run.status and run.status["throttled"].fillna(False).astype(bool).any():
        n = int(run.status["throttled"].fillna(False).astype(bool).sum())
        out += [f"**{n} unit(s) were measured while the GPU reported a thermal/power slowdown** "
                "(column `throttled`).", ""]
    out += ["## Throughput", "", markdown_table(throughput_table(run))]
    cr = crossovers(run, device)
    if cr:
        out += ["## Crossover (nsb/N where KV-outer and Q-outer meet)", "",
                markdown_table(pd.DataFrame([{"group": c.group, "dtype": c.dtype, "KV-outer": c.kv_backend,
                                              "Q-outer": c.q_backend, "measured": c.measured,
                                              "how": c.measured_note, "predicted (L2 capacity, this N)": c.predicted,
                                              "predicted (capacity-free)": c.predicted_capacity_free}
                                             for c in cr]))]
    out += ["## Per-stage median latency (s)", "", markdown_table(stage_table(run))]
    bt = bytes_table(run, device)
    if not bt.empty:
        out += ["## Bytes moved: ncu vs roofline", "", markdown_table(bt)]
    if is_prefill_run(run):
        out += ["## Real prefill: call-weighted aggregate", "", markdown_table(prefill_aggregate(run))]
        picks, summ = roofline_picks(run, device)
        if summ:
            out += [f"The roofline picked the measured-faster schedule (KV-outer vs Q-outer) in {summ['agree_cases']} of "
                    f"{summ['cases']} cases ({summ['agree_weight_share']:.1%} of the call weight).", "",
                    markdown_table(picks)]
        else:
            out += ["Roofline picks: no device profile or fewer than two schedules per case.", ""]
    out += ["## Figures", ""] + [f"![{f}]({f})" for f in figures] + [""]
    return "\n".join(out)


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


def write_report(run_dir: str | Path, out_dir: str | Path | None = None,
                 device: DeviceProfile | None = None) -> Path:
    """Write the PNGs and summary.md into `out_dir` (default RUN/report); returns the summary path."""
    run = load_run(run_dir)
    dev = device_for_run(run.meta, device)
    out = Path(out_dir) if out_dir else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for name, fig in throughput_figures(run, dev) + stage_figures(run) + bytes_figure(run, dev):
        save_png(fig, out / name)
        plt.close(fig)
        names.append(name)
    path = out / "summary.md"
    path.write_text(summary_markdown(run, dev, names))
    return path
