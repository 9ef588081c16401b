# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # msa-bench: one run against the roofline
#
# This notebook reads a run folder written by `msa-bench sweep` (or `msa-bench merge`) and shows the
# same tables and plots as `msa-bench report`, through the same functions (`msa_bench.harness.report.summary`).
# Run it as a script: `python notebooks/report.py RUN_DIR`, or set `MSA_BENCH_RUN`; without either it
# opens the small committed CPU fixture `results/fixtures/smoke-run`.

# %%
import os
import sys
import tempfile
from pathlib import Path

import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

from msa_bench.harness.report import axes

from msa_bench.harness.report import plots

from msa_bench.harness.report import summary as report

from msa_bench.harness.report import tables
from msa_bench.harness.store.rows import device_for_run
from msa_bench.harness.store.results import load_run
from msa_bench.harness.measure.timing import GPU_TIMERS

REPO = Path(__file__).resolve().parents[1] if "__file__" in globals() else Path.cwd()
args = [a for a in sys.argv[1:] if not a.startswith("-")] if "ipykernel" not in sys.modules else []
RUN_DIR = Path(args[0] if args else os.environ.get("MSA_BENCH_RUN", REPO / "results" / "fixtures" / "smoke-run"))
# figures go outside the run folder (it may be the committed fixture): MSA_BENCH_FIGURES or a temp dir
FIG_DIR = Path(os.environ.get("MSA_BENCH_FIGURES", Path(tempfile.gettempdir()) / "msa-bench-notebook" / RUN_DIR.name))

run = load_run(RUN_DIR)
device = device_for_run(run.meta)
print(f"run {RUN_DIR}: scenario {run.meta.get('scenario')}, measured on {run.device_name}, timer {run.timer}")
print(f"roofline device: {device.name if device else 'none (no profile matches; model curves omitted)'}")
if run.timer not in GPU_TIMERS:
    print("!! CPU RUN: host timings of the CPU pipeline, NOT GPU timings; read no performance from them.")


def show(figures):
    """Save each figure next to the run and show it when a notebook front end is attached."""
    FIG_DIR.mkdir(parents=True, exist_ok=True)
    for name, fig in figures:
        plots.save_png(fig, FIG_DIR / name)
        print(f"figure: {FIG_DIR / name}")
        if "ipykernel" in sys.modules:
            plt.show()
        plt.close(fig)


# %% [markdown]
# ## Which units ran
# Every (point, backend) is one unit. A backend whose output disagrees with the float64 reference is
# recorded as `failed` and its timings discarded; one that cannot run here (no GPU, package missing,
# dtype) as `unavailable`.

# %%
print(report.markdown_table(tables.status_table(run)))

# %% [markdown]
# ## Throughput along what the run varies
# `harness/report/axes.py` reads which point field the run varies and plots along it: reuse nsb/N with the
# rooflines and the KV-outer/Q-outer crossovers (measured only across points that differ in reuse and
# nothing else), co-selection union_ratio with the three schedules' rooflines, real-prefill cases by
# call weight with the call-weighted aggregate, batch size in GB/s under the HBM roofline, context or
# query tokens; points that differ in several things side by side, never joined by lines.

# %%
axis = axes.figure_axis(tables.ok_units(run))
print(f"axis: {axis.kind} ({axis.label}); groups: {axes.group_fields(tables.ok_units(run), axis) or 'none'}")
print(report.markdown_table(tables.throughput_table(run, device)))
for c in tables.crossovers(run, device):
    print(f"{c.group} {c.dtype}: KV-outer ({c.kv_backend}) vs Q-outer ({c.q_backend}): measured {c.measured} "
          f"({c.measured_note}), predicted {c.predicted}")
show(plots.axis_figures(run, device))

# %% [markdown]
# ## Accuracy and how close each backend gets to its roofline
# What each backend quantizes next to its measured error against the float64 reference; and the
# fraction of its roofline time each module reaches (the figures a device profile's `achieved` holds).

# %%
print(report.markdown_table(tables.accuracy_table(run)))
print(report.markdown_table(tables.achieved_table(run)))

# %% [markdown]
# ## Where the time goes
# Each stage timed alone (its inputs prepared by the preceding stages, L2 flushed), stacked, with the
# whole-module graph as a black tick: the gap between the stack and the tick is launch overlap. One
# panel per backend, the bars in the order of the run's axis, the same order in every dtype.

# %%
print(report.markdown_table(tables.stage_table(run)))
show(plots.stage_figures(run))

# %% [markdown]
# ## Bytes moved: Nsight Compute against the model
# Only for runs with `--counters`: DRAM and L2 bytes per module next to the roofline's HBM and L2 terms.

# %%
bytes_table = tables.bytes_table(run, device)
print(report.markdown_table(bytes_table) if not bytes_table.empty else "no counters in this run")
show(plots.bytes_figure(run, device))

# %% [markdown]
# ## Real prefill cases
# For a `real-prefill` run: the call-weighted mean latency and aggregate useful TFLOP/s per backend, and
# per case whether the roofline picked the schedule that was measured faster.

# %%
if tables.is_prefill_run(run):
    print(report.markdown_table(tables.prefill_aggregate(run)))
    picks, summary = tables.roofline_picks(run, device)
    print(summary or "roofline picks need a device profile and two schedules per case")
else:
    print("not a real-prefill run")
