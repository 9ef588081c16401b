"""`msa-bench report`: the figures and a Markdown summary of a run folder, held against the roofline.

The tables (harness/report/tables.py) and figures (harness/report/plots.py) are the same functions the notebook
(notebooks/report.py) uses.
"""
from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import numpy as np
import pandas as pd

from ...kernels.kv_outer.config import TILE_ORDER_NOTATION
from ...roofline.devices import DeviceProfile
from .plots import plt, report_figures, save_png
from .dense_crossover import crossover_figures, crossover_table
from .trace_table import trace_winners
from .timers import eager_markdown, pair_runs
from ..measure.timing import GPU_TIMERS
from ..store.rows import device_for_run
from ..store.results import STATUS_OK, Run, load_run
from .tables import (accuracy_table, unit_bound, achieved_table, auto_summary, auto_vs_fastest, bytes_table, crossovers,
                     fidelity_table, is_prefill_run, prefill_aggregate, roofline_picks, stage_table, status_table,
                     throughput_table, ok_units)


# ---- Markdown -----------------------------------------------------------------------------------

def _fmt(v) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        if not math.isfinite(v):
            return "–"
        a = abs(v)
        if v == int(v) and a < 1e7:       # counts (N, context) read whole: 16384, not 1.638e+04
            return str(int(v))
        if 1e4 <= a < 1e6:                # five or six digits read whole too: 12382, not 1.238e+04
            return f"{v:.0f}"
        return f"{v:.3e}" if a and (a < 1e-3 or a >= 1e6) else f"{v:.4g}"
    return "–" if v is None else str(v)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:+.0%}"


def markdown_table(df: pd.DataFrame) -> str:
    """Every row: a reader judges each unit's number, so none is left out."""
    if df is None or df.empty:
        return "_(none)_\n"
    lines = ["| " + " | ".join(str(c) for c in df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


# what the throughput table's less obvious columns mean; summary.md says it for the columns a run has
COLUMN_NOTES = {
    "tile order": TILE_ORDER_NOTATION,
    "union_ratio P8": "co-selection of the workload (distinct blocks of an 8-token tile over one token's)",
    "max rel err": "the unit's measured error against the float64 reference",
    "quantization": "what the backend states it quantizes",
    "GB/s": "the model's HBM bytes over the measured module time",
    "HBM frac": "GB/s over the profile's HBM bandwidth (the figures of merit of a memory-bound point)",
}


def column_notes(table: pd.DataFrame) -> str:
    """What the table's columns of COLUMN_NOTES mean, in the table's column order ('' for none)."""
    notes = [f"{c}: {COLUMN_NOTES[c]}" for c in table.columns if c in COLUMN_NOTES]
    return "; ".join(notes) + "." if notes else ""


def incomplete(run: Run) -> str | None:
    """None for a complete run, else how many planned units are missing and how to get them."""
    if run.meta.get("complete"):
        return None            # load_run refused a complete run that lacks planned units
    planned = len(run.meta.get("units_planned") or [])
    head = f"run incomplete: {len(run.missing)} of {planned} planned unit(s) missing"
    if run.meta.get("merged_from"):
        return f"{head} (the folders merged lack them): sweep their shards to the end, then merge again"
    if run.meta.get("packed"):
        # samples_removed says where the raw unit folders are, or that they were not kept
        where = run.meta.get("samples_removed") or "its raw unit folders were packed"
        return (f"{head}; a packed run is not resumed ({where}): with its unit folders back, "
                f"{resume_here(run)}; else sweep the missing points into a new folder")
    return f"{head}; resume with: {resume_here(run)}"


def resume_here(run: Run) -> str:
    """The command that finishes the run in its folder as it is now named: the one its sweep recorded (a run
    made before sweeps recorded it: the command that started it), with --out this folder and --resume."""
    recorded = run.meta.get("resume_command") or (run.meta.get("provenance") or {}).get("command")
    words = shlex.split(recorded or "msa-bench sweep")
    words[0] = "msa-bench" if Path(words[0]).name == "msa-bench" else words[0]
    kept, skip = [], False
    for w in words:
        if not skip and w not in ("--out", "--resume") and not w.startswith("--out="):
            kept.append(w)
        skip = w == "--out"
    return shlex.join(kept + ["--out", str(run.path), "--resume"])


def above_roofline_table(run: Run, device: DeviceProfile | None, l2_capacity: bool = False) -> pd.DataFrame:
    """Every unit measured faster than its bound allows, a model defect: the roofline of compulsory traffic
    (each selected block from HBM once, every re-read from L2, `tables.unit_bound`) at the profile's
    ceilings, every fraction 1, no fixed cost, over the measured module time above 1; HBM frac is that
    roofline's HBM bytes over the measured time, over the HBM ceiling. l2_capacity True: against the
    roofline with the model's L2-capacity misses, where a unit above it shows the miss estimate
    over-counting (a fidelity defect, not a broken bound)."""
    t = ok_units(run)
    if device is None or t.empty or "module.median_s" not in t:
        return pd.DataFrame()
    rows = []
    for _, r in t.iterrows():
        measured = r["module.median_s"]
        if not isinstance(measured, float) or not measured > 0:
            continue
        roof = unit_bound(r, device, l2_capacity)
        if roof is None or not roof.time_s / measured > 1:
            continue
        rows.append({"backend": r["backend"], "dtype": r["dtype"], "point": r["point_key"], "measured s": measured,
                     "roofline s": roof.time_s, "binding": roof.binding, "roofline / measured": roof.time_s / measured,
                     "HBM frac": roof.hbm_bytes / measured / device.hbm_bytes_per_s})
    return pd.DataFrame(rows)


def summary_markdown(run: Run, device: DeviceProfile | None, figures: list[str], profile_line: str | None = None,
                     beside: Run | None = None) -> str:
    prov = run.meta.get("provenance") or {}
    out = [f"# msa-bench report: {run.path.name}", ""]
    if run.timer not in GPU_TIMERS:
        out += ["> **CPU RUN — these are host timings of the CPU pipeline, NOT GPU timings.** "
                "They show that the pipeline works; do not read performance from them.", ""]
    out += [f"- scenario: `{run.meta.get('scenario')}` ({run.meta.get('scenario_description', '')})",
            f"- measured on: {run.device_name}; timer: {run.timer}",
            f"- torch {prov.get('torch')}, triton {prov.get('triton')}, flashinfer {prov.get('flashinfer')}, "
            f"CUDA {prov.get('cuda')}, " + (f"driver {prov['driver']}" if prov.get("driver") else "no GPU driver"),
            f"- source: commit {prov.get('git_commit')} (dirty: {prov.get('git_dirty')}); started {prov.get('time_utc')} "
            f"on {prov.get('hostname')}",
            f"- {incomplete(run) or 'run complete'}",
            f"- roofline device: {device.name if device else 'none (no profile matches this device; model omitted)'}"
            + (f" ({profile_line})" if profile_line and device else ""),
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
    throughput = throughput_table(run, device)
    out += ["## Throughput", "", column_notes(throughput), "", markdown_table(throughput)]
    av = auto_vs_fastest(run)
    if not av.empty:
        s = auto_summary(av)
        out += ["## auto against the fastest backend measured", "",
                f"auto is within 5 % of the fastest at {s['share_within']:.0%} of {s['points']} points; worst "
                f"{s['worst']:.3f}x, median {s['median']:.3f}x.", "", markdown_table(av)]
    winners = trace_winners(run)
    if not winners.empty:
        out += ["## Trace: the fastest backend per layer", "",
                "Each call counted at its weight (the engine calls it stands for); auto / fastest: auto's "
                "weighted time over the per-call fastest backend's.", "", markdown_table(winners)]
    above = above_roofline_table(run, device)
    if device is not None:
        out += ["## Units measured above their roofline (model defects)", "",
                f"A roofline bounds what it models: a unit measured faster than its roofline time (compulsory "
                f"traffic, each selected block from HBM once and every re-read from L2, at the profile's ceilings: "
                f"HBM {device.hbm_bytes_per_s / 1e12:.2f} TB/s, L2 {device.l2_bytes_per_s / 1e12:.2f} TB/s, "
                f"bf16 {device.peak_flops('bf16') / 1e12:.0f} TFLOP/s; every fraction 1, no fixed cost) shows a "
                "defect of the model (bytes or FLOPs over-counted, or a ceiling under the hardware's).", ""]
        out += [f"**{len(above)} unit(s) above their roofline: model defects.**", "", markdown_table(above)] \
            if not above.empty else ["None: every modelled unit is at or under its roofline.", ""]
        misses = above_roofline_table(run, device, l2_capacity=True)
        if not misses.empty:
            out += [f"{len(misses)} unit(s) ran faster than the roofline with the model's L2-capacity misses "
                    "(its predicted HBM re-reads): there the miss estimate over-counts.", "", markdown_table(misses)]
    fid = fidelity_table(run, device)
    if not fid.empty:
        out += ["## Model fidelity: predicted module time (roofline / achieved + fixed costs) against measured", "",
                markdown_table(fid)]
    acc = accuracy_table(run)
    if not acc.empty:
        out += ["## Accuracy: what each backend quantizes, and its error against the float64 reference", "",
                markdown_table(acc)]
    ach = achieved_table(run)
    if not ach.empty:
        out += ["## Achieved fraction of the roofline (model time / measured module time)", "",
                markdown_table(ach)]
    cr = crossovers(run, device)
    if cr:
        out += ["## Crossover (nsb/N where KV-outer and Q-outer meet)", "",
                "Over points that differ in reuse and nothing else. KV-outer: the fastest of its backends at "
                "each nsb/N; measured: log-interpolated between the two measured points around the sign change; "
                "predicted: the roofline with Q-outer's L2 capacity at this N; gap: measured / predicted - 1.", "",
                markdown_table(pd.DataFrame([{"points": c.group, "dtype": c.dtype, "N": c.n_tokens,
                                              "KV-outer": c.kv_backend, "Q-outer": c.q_backend,
                                              "measured": c.measured if c.measured is not None else c.measured_note,
                                              "predicted": c.predicted, "gap": _pct(c.gap),
                                              "predicted (capacity-free)": c.predicted_capacity_free}
                                             for c in cr]))]
    dense = crossover_table(run, device)
    if not dense.empty:
        out += ["## Sparse against dense: the context above which sparse wins", "",
                "One row per dense backend: the selection as a mask (the same output as sparse), or none at "
                "all (the dense floor: what the model costs without sparse attention). ratio: visible context / "
                "selected keys there; model: the same from the module times the model predicts (roofline over "
                "achieved fraction, plus fixed costs: what `auto` weighs); dense / sparse at least context: "
                "the dense module time over the fastest sparse one's there (sparsity ratio 1 at a context of "
                "top-k blocks).", "", markdown_table(dense)]
    graph, eager = pair_runs(run, beside) if beside is not None else (None, run)
    out += eager_markdown(eager, graph, markdown_table)
    out += ["## Per-stage median latency (s)", "", markdown_table(stage_table(run))]
    bt = bytes_table(run, device)
    if not bt.empty:
        out += ["## Bytes moved: ncu vs roofline", "", markdown_table(bt)]
    picks, summ = roofline_picks(run, device)
    if is_prefill_run(run):
        out += ["## Real prefill: call-weighted aggregate", "", markdown_table(prefill_aggregate(run))]
        if summ:
            out += [f"The roofline picked the measured-faster schedule (KV-outer, Q-outer or q-packed) in "
                    f"{summ['agree_cases']} of {summ['cases']} cases ({summ['agree_weight_share']:.1%} of the call "
                    "weight).", "", markdown_table(picks)]
        else:
            out += ["Roofline picks: no device profile or fewer than two schedules per case.", ""]
    elif summ:
        out += ["## Roofline picks: predicted fastest schedule against the measured fastest backend", "",
                f"The roofline picked the measured-faster schedule (KV-outer, Q-outer or q-packed) at "
                f"{summ['agree_cases']} of {summ['cases']} points.", "", markdown_table(picks)]
    out += (["## Figures", ""] + [f"![{f}]({f})" for f in figures] + [""]) if figures else []
    return "\n".join(out)



def _remove_old_figures(out: Path) -> None:
    """The figures an earlier report in `out` named: a figure this run no longer draws must not stay."""
    old = out / "summary.md"
    if old.is_file():
        for name in re.findall(r"!\[[^\]]*\]\(([^)/]+\.png)\)", old.read_text()):
            (out / name).unlink(missing_ok=True)


def write_report(run_dir: str | Path, out_dir: str | Path | None = None,
                 device: DeviceProfile | None = None, warn=None, figures: bool = True,
                 beside: str | Path | None = None) -> Path:
    """Write the PNGs and summary.md into `out_dir` (default RUN/report); returns the summary path.
    `warn(line)` is told what the reader must know first: a run that is not complete. figures=False: the
    tables alone (a committed run where results/ has no room for its plots). `beside`: a run of the other
    timer on the same GPU, whose module times stand beside this run's (harness/report/timers.py)."""
    from ...roofline.devices import run_profile
    run = load_run(run_dir)
    other = load_run(beside) if beside is not None else None
    if other is not None:
        pair_runs(run, other)                    # refused before anything is written
    note = incomplete(run)
    if note and warn:
        warn(note)
    dev = device_for_run(run.meta, device)
    choice = run_profile(run.meta) if device is None else None
    line = (f"{choice.origin}: {choice.path}" + (f", sha256 {choice.sha256[:12]}" if choice.sha256 else "")
            + (f"; {choice.note}" if choice.note else "")) if choice and choice.profile else \
        ("given by --device" if device is not None else None)
    out = Path(out_dir) if out_dir else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    _remove_old_figures(out)
    names = []
    for name, fig in (report_figures(run, dev) + crossover_figures(run, dev)) if figures else ():
        save_png(fig, out / name)
        plt.close(fig)
        names.append(name)
    path = out / "summary.md"
    path.write_text(summary_markdown(run, dev, names, line, other))
    return path
