"""Each run's figures along the axis its points vary, and a measured crossover only across points that
differ in reuse alone. Synthetic unit tables stand in for each generator (made-up timings: these tests
check which axis and which points, never a number); the committed H200 runs for the real ones."""
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")

from msa_bench.harness.report import axes, plots, tables  # noqa: E402
from msa_bench.harness.store.results import Run, load_run  # noqa: E402
from msa_bench.roofline.devices import load_device  # noqa: E402

H200 = Path(__file__).resolve().parents[1] / "results" / "h200"
BASE = {"generator": "synthetic", "tokens": 8192, "context": 1 << 20, "reuse": 1.0, "skew": 0.0, "causal": False,
        "case_id": None, "share": None, "share_group": None, "hq": 64, "hkv": 4, "head_dim": 128, "block": 128,
        "topk": 16, "weight": 1.0, "wl_requests": 1.0, "wl_union_ratio_p8": 8.0}


def synthetic_run(points: list[dict], backends=(("kv-outer-cute", "kv-outer"), ("flashinfer", "q-outer")),
                  dtypes=("bf16", "fp8"), latency=None) -> Run:
    """A Run of made-up units: one per point, backend and dtype; `latency(point, backend)` in seconds."""
    status, stats = [], []
    for i, p in enumerate(points):
        for dtype in dtypes:
            for backend, schedule in backends:
                row = {**BASE, **p, "dtype": dtype, "backend": backend, "schedule": schedule, "status": "ok"}
                row["point_key"] = f"p{i}/{dtype}/seed0"
                row.setdefault("wl_n_tokens", float(row["tokens"]))
                row.setdefault("wl_context_tokens", float(row["context"]))
                row.setdefault("wl_nsb_per_n", float(row["reuse"] or 0.25))
                row.setdefault("wl_nsb", row["wl_nsb_per_n"] * row["wl_n_tokens"])
                row.setdefault("wl_useful_flops", 1e12)
                row.setdefault("wl_selected_blocks_per_query", 16.0)
                status.append(row)
                s = latency(row, backend) if latency else 1e-3 * (1 + i)
                for stage, value in (("module", s), ("attention", 0.7 * s), ("combine", 0.3 * s)):
                    stats.append({"point_key": row["point_key"], "backend": backend, "stage": stage,
                                  "statistic": "median_s", "value": value})
                stats.append({"point_key": row["point_key"], "backend": backend, "stage": "module",
                              "statistic": "tflops", "value": row["wl_useful_flops"] / s / 1e12})
                stats.append({"point_key": row["point_key"], "backend": backend, "stage": "module",
                              "statistic": "model_hbm_bytes", "value": 1e9 * row["wl_requests"] / 64})
    return Run(Path("synthetic"), {"scenario": "synthetic", "timer": "cuda-graph"}, pd.DataFrame(status),
               pd.DataFrame(stats), pd.DataFrame())


def axis_of(run: Run) -> axes.FigureAxis:
    return axes.figure_axis(tables.ok_units(run))


# ---- the axis helper, per generator -------------------------------------------------------------

def test_real_prefill_cases_are_categorical_heaviest_first():
    cases = [{"generator": "real-prefill", "reuse": None, "case_id": f"prefill_{i}", "tokens": n, "context": c,
              "weight": w} for i, (n, c, w) in enumerate([(171, 55339, 1325), (16384, 47744, 2477), (338, 74578, 1418)])]
    run = synthetic_run(cases)
    t = tables.ok_units(run)
    axis = axes.figure_axis(t)
    assert axis.kind == axes.CASE and axis.categorical and axes.group_fields(t, axis) == []
    order = axes.point_order(t, axis)
    first = t.assign(pid=axes.point_id(t)).groupby("pid")["weight"].first()
    assert list(first[order]) == [2477, 1418, 1325]


def test_co_selection_and_drift_plot_against_union_ratio():
    shares = [{"reuse": 0.25, "share": s, "wl_union_ratio_p8": 8 - 7 * s} for s in (0.0, 0.5, 1.0)]
    assert axis_of(synthetic_run(shares)).kind == axes.UNION_AXIS
    drift = [{"reuse": 0.25, "drift": p, "wl_union_ratio_p8": 1 + 7 * p} for p in (0.0, 0.1, 0.5)]
    assert axis_of(synthetic_run(drift)).kind == axes.UNION_AXIS
    # a field the helper does not know: the statistic that moved most with it
    unknown = [{"reuse": 0.25, "mystery": p, "wl_union_ratio_p8": 1 + 7 * p} for p in (0.0, 0.5)]
    assert axis_of(synthetic_run(unknown)).kind == axes.UNION_AXIS
    unknown = [{"reuse": 0.25, "mystery": p, "wl_nsb_per_n": 0.25 * 4 ** p, "wl_union_ratio_p8": 7 + p}
               for p in (0.0, 1.0, 2.0)]                   # reuse x16, union x1.3: along reuse
    assert axis_of(synthetic_run(unknown)).kind == axes.REUSE


def test_decode_plots_gbps_against_batch_size_under_the_hbm_roofline():
    batch = [{"requests": b, "tokens": b, "wl_requests": float(b), "wl_n_tokens": float(b)} for b in (1, 8, 64)]
    run = synthetic_run(batch)
    assert axis_of(run).kind == axes.REQUESTS
    dev = load_device("h200")
    figs = plots.axis_figures(run, dev)
    assert [n for n, _ in figs] == ["bandwidth_all.png"]
    ax = figs[0][1].axes[0]
    assert "GB/s" in ax.get_ylabel() and "batch size" in ax.get_xlabel()
    roof = [ln for ln in ax.get_lines() if ln.get_label().startswith("HBM roofline")]
    assert len(roof) == 1 and roof[0].get_ydata()[0] == pytest.approx(dev.hbm_bytes_per_s / 1e9)
    measured = next(ln for ln in ax.get_lines() if ln.get_label().startswith("flashinfer"))
    assert list(measured.get_xdata()) == [1, 8, 64]
    # model HBM bytes over the measured module time
    assert measured.get_ydata()[0] == pytest.approx(1e9 / 64 / 1e-3 / 1e9)
    for _, fig in figs:
        matplotlib.pyplot.close(fig)
    # speculative decode at one batch size: N = requests x query tokens is no axis of its own
    multi = batch + [{"requests": 64, "tokens": 64 * q, "query_tokens": q, "wl_requests": 64.0,
                      "wl_n_tokens": 64.0 * q} for q in (2, 4)]
    t = tables.ok_units(synthetic_run(multi))
    assert axes.figure_axis(t).kind == axes.REQUESTS and "tokens" not in axes.group_fields(t)


def test_sparsity_plots_against_context_and_a_grid_splits_by_the_rest():
    contexts = [{"context": c} for c in (1 << 17, 1 << 18, 1 << 19, 1 << 20)]
    run = synthetic_run(contexts)
    assert axis_of(run).kind == axes.CONTEXT
    names = [n for n, fig in plots.axis_figures(run, load_device("h200"))]
    assert names == ["throughput_context_all.png"]
    # long-context: 4 contexts x 2 reuses -> along context, one line set per reuse
    grid = [{"context": c, "reuse": r} for c in (1 << 17, 1 << 18, 1 << 19, 1 << 20) for r in (0.25, 1.0)]
    t = tables.ok_units(synthetic_run(grid))
    assert axes.figure_axis(t).kind == axes.CONTEXT and axes.group_fields(t) == ["reuse"]
    # decode batches over more contexts than batch sizes (the sparsity scenario): along context
    sweep = [{"context": c, "requests": b, "tokens": b, "wl_requests": float(b), "wl_n_tokens": float(b)}
             for c in (1 << 11, 1 << 13, 1 << 15, 1 << 17) for b in (1, 16, 256)]
    t = tables.ok_units(synthetic_run(sweep))
    assert axes.figure_axis(t).kind == axes.CONTEXT and axes.group_fields(t) == ["requests"]


def test_reuse_grids_and_the_fallbacks():
    sweep = [{"tokens": n, "context": c, "reuse": r} for n, c in ((2048, 1 << 22), (512, 1 << 20))
             for r in (8.0, 16.0, 32.0, 64.0)]
    t = tables.ok_units(synthetic_run(sweep))
    assert axes.figure_axis(t).kind == axes.REUSE and axes.group_fields(t) == ["tokens", "context"]
    causal = [{"causal": c, "generator": "indexer", "reuse": None} for c in (True, False)]
    assert axis_of(synthetic_run(causal)).kind == axes.POINTS
    assert axis_of(synthetic_run([{}])).kind == axes.POINTS


@pytest.mark.parametrize("scenario, kind", [("real-prefill", axes.CASE), ("co-selection", axes.UNION_AXIS),
                                            ("baseline", axes.REUSE),
                                            ("indexer", axes.POINTS), ("drift", axes.UNION_AXIS)])
def test_committed_runs_get_their_axis(scenario, kind):
    assert axis_of(load_run(H200 / scenario)).kind == kind


# ---- the measured crossover ---------------------------------------------------------------------

def _crossing(row, backend):
    """The fastest KV-outer backend slower than Q-outer above nsb/N 16 (made up)."""
    r = row["wl_nsb_per_n"]
    scale = {"kv-outer-cute": r / 16, "kv-outer": r / 8}.get(backend, 1.0)
    return 1e-3 * scale * (1 + row["context"] / 2 ** 30)


def test_no_measured_crossover_where_points_differ_in_more_than_reuse():
    # every reuse at its own context: the points differ in reuse and context, never in reuse alone
    mixed = [{"reuse": r, "context": c} for r, c in ((4.0, 1 << 20), (16.0, 1 << 21), (64.0, 1 << 22))]
    run = synthetic_run(mixed, latency=_crossing)
    assert tables.crossovers(run, None) == []
    # real prefill: cases differ in everything, no reuse field varies
    prefill = load_run(H200 / "real-prefill")
    assert tables.crossovers(prefill, load_device("h200")) == []
    for name, fig in plots.axis_figures(prefill, load_device("h200")):
        assert not any("crossover" in ln.get_label() for ax in fig.axes for ln in ax.get_lines()), name
        matplotlib.pyplot.close(fig)


def test_crossover_per_group_of_points_that_differ_in_reuse_alone():
    grid = [{"reuse": r, "context": c} for r in (4.0, 8.0, 32.0, 64.0) for c in (1 << 20, 1 << 22)]
    run = synthetic_run(grid, latency=_crossing,
                        backends=(("kv-outer-cute", "kv-outer"), ("kv-outer", "kv-outer"), ("flashinfer", "q-outer"),
                                  ("auto", "kv-outer")))
    cr = tables.crossovers(run, None)
    assert sorted((c.group, c.dtype) for c in cr) == sorted((f"context {g}", d) for g in ("1M", "4M")
                                                            for d in ("bf16", "fp8"))
    for c in cr:                       # auto picks per point: never the KV-outer side
        assert c.kv_backend == "kv-outer, kv-outer-cute" and c.q_backend == "flashinfer"
        assert c.measured == pytest.approx(16.0)


# ---- stage plots --------------------------------------------------------------------------------

@pytest.mark.parametrize("scenario", ["real-prefill", "co-selection", "drift"])
def test_stage_plots_are_small_multiples_in_the_axis_order(scenario):
    run = load_run(H200 / scenario)
    figs = plots.stage_figures(run)
    assert [n for n, _ in figs] == ["stages_bf16.png", "stages_fp8.png"]
    ticks = []
    for name, fig in figs:
        width, height = fig.get_size_inches() * plots.SAVE_DPI
        assert width <= plots.MAX_WIDTH_PX and height <= plots.MAX_WIDTH_PX, name
        panels = [ax for ax in fig.axes if ax.get_visible()]
        lefts = sorted({round(ax.get_position().x0, 3) for ax in panels})
        assert len(lefts) <= plots.MAX_PANELS_WIDE, name
        ticks.append([t.get_text() for t in panels[0].get_xticklabels()])
        matplotlib.pyplot.close(fig)
    assert ticks[0] == ticks[1]                        # both dtypes: the same points in the same order
    t = tables.ok_units(run)
    axis = axes.figure_axis(t)
    if axis.kind == axes.UNION_AXIS:                   # ordered by u, labelled with it
        assert [float(x) for x in ticks[0]] == sorted(float(x) for x in ticks[0])
    if axis.kind == axes.CASE:                         # heaviest first: c17ccf, N 16384 over 47K
        assert ticks[0][0] == "16K\n47K"
