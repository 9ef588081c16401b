"""The per-stage figure stays readable: horizontal tick labels and a legend outside the panels."""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from msa_bench.harness.plots import stage_figures  # noqa: E402
from msa_bench.harness.results import load_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1] / "results"


def test_stage_figures_keep_labels_flat_and_the_legend_off_the_bars():
    for run in (ROOT / "fixtures" / "smoke-run", ROOT / "h200" / "co-selection"):
        for name, fig in stage_figures(load_run(run)):
            fig.canvas.draw()
            renderer = fig.canvas.get_renderer()
            assert fig.legends, name
            legend = fig.legends[0].get_window_extent(renderer)
            for ax in fig.axes:
                assert ax.get_legend() is None, name
                assert all(t.get_rotation() == 0 for t in ax.get_xticklabels()), name
                assert not legend.overlaps(ax.get_window_extent(renderer)), name
                labels = ax.xaxis.get_ticklabels()
                boxes = [t.get_window_extent(renderer) for t in labels]
                assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:])), name
                # the labels take a small part of the figure, not half of it
                assert max(b.height for b in boxes) < 0.2 * fig.bbox.height, name
