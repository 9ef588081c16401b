"""The report's figures stay readable: flat tick labels that do not overlap, the stage legend off the
bars, and every PNG of a report present, within its size limits and not blank."""
import re
from pathlib import Path

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from msa_bench.harness.report.plots import MAX_WIDTH_PX, stage_figures  # noqa: E402
from msa_bench.harness.report.summary import write_report  # noqa: E402
from msa_bench.harness.store.results import load_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1] / "results"
MAX_PNG_BYTES = 120_000
COMMITTED_REPORTS = sorted(p for p in (ROOT / "h200").glob("*/report") if p.is_dir())


def test_a_dtype_stage_figure_has_a_slot_only_for_the_points_that_ran_in_that_dtype():
    from msa_bench.harness.report.axes import point_id
    run = load_run(ROOT / "fixtures" / "smoke-run")       # CPU: some groups ran only in fp16, others only in fp32
    ok = run.status[run.status["status"] == "ok"]
    ran = {d: set(point_id(g)) for d, g in ok.groupby("dtype")}
    assert ran["fp16"] != ran["fp32"]
    for name, fig in stage_figures(run):
        dtype = name.removeprefix("stages_").removesuffix(".png")
        for ax in (a for a in fig.axes if a.get_visible()):
            assert len(ax.get_xticks()) == len(ran[dtype]), name
            bars = [p for p in ax.patches if p.get_height() > 0]
            assert {round(b.get_x() + b.get_width() / 2) for b in bars} == set(range(len(ran[dtype]))), name
        matplotlib.pyplot.close(fig)


@pytest.mark.parametrize("run", [ROOT / "fixtures" / "smoke-run", ROOT / "h200" / "co-selection",
                                 ROOT / "h200" / "real-prefill", ROOT / "h200" / "drift"],
                         ids=lambda p: p.name)
def test_stage_figures_keep_labels_flat_and_the_legend_off_the_bars(run):
    for name, fig in stage_figures(load_run(run)):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert fig.legends, name
        legend = fig.legends[0].get_window_extent(renderer)
        for ax in (a for a in fig.axes if a.get_visible()):
            assert ax.get_legend() is None, name
            assert all(t.get_rotation() == 0 for t in ax.get_xticklabels()), name
            assert not legend.overlaps(ax.get_window_extent(renderer)), name
            labels = ax.xaxis.get_ticklabels()
            boxes = [t.get_window_extent(renderer) for t in labels]
            assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:])), name
            # the labels take a small part of the figure, not half of it
            assert max(b.height for b in boxes) < 0.2 * fig.bbox.height, name
        matplotlib.pyplot.close(fig)


def check_report_images(folder: Path) -> list[str]:
    """Every figure summary.md names exists and it names every PNG there; each PNG opens, is at most
    MAX_WIDTH_PX across and tall, at most MAX_PNG_BYTES, and not blank (ink on a few % of it, several
    colours). Returns the PNG names."""
    from PIL import Image
    named = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", (folder / "summary.md").read_text())
    present = sorted(p.name for p in folder.glob("*.png"))
    assert sorted(named) == present, folder
    for name in present:
        path = folder / name
        assert path.stat().st_size <= MAX_PNG_BYTES, (path, path.stat().st_size)
        with Image.open(path) as image:
            width, height = image.size
            assert width <= MAX_WIDTH_PX and height <= MAX_WIDTH_PX, (path, image.size)
            pixels = np.asarray(image.convert("L"))
        ink = (pixels < 200).mean()
        assert ink > 0.02, (path, ink)                          # not a white page
        assert len(np.unique(pixels)) >= 8, path                # not one flat colour
    return present


def test_a_fresh_report_has_its_images(tmp_path):
    names = check_report_images(write_report(ROOT / "fixtures" / "smoke-run", tmp_path).parent)
    assert any(n.startswith("throughput_") for n in names) and any(n.startswith("stages_") for n in names)


@pytest.mark.parametrize("folder", COMMITTED_REPORTS, ids=lambda p: p.parent.name)
def test_committed_report_images(folder):
    check_report_images(folder)
