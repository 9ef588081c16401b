"""Report and notebook on the committed CPU fixture run; crossover interpolation; call-weighted aggregate
on a real-prefill run measured here (reference backend, the two smallest representative cases)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from msa_bench.harness.report import summary as report

from msa_bench.harness.report import tables
from msa_bench.harness.store.results import load_run
from msa_bench.harness.store.seal import seal_unit
from msa_bench.roofline.devices import load_device
from msa_bench.roofline.model import ModelShape, predict

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "results" / "fixtures" / "smoke-run"


def test_a_cpu_summary_describes_only_its_columns_and_names_no_missing_driver(tmp_path, cli):
    code, _, err = cli("report", FIXTURE, "--out", tmp_path)
    assert code == 0, err
    summary = (tmp_path / "summary.md").read_text()
    throughput = summary.split("## Throughput")[1].split("\n## ")[0]
    header = next(ln for ln in throughput.splitlines() if ln.startswith("| backend"))
    assert "GB/s" not in header and "GB/s" not in throughput and "HBM frac" not in throughput
    assert "| tile order |" in header and "1:0 is key order" in throughput     # the column this run has, explained
    assert "driver None" not in summary and "CUDA none, no GPU driver" in summary


def test_column_notes_follow_the_columns_a_table_has():
    import pandas as pd
    with_rates = pd.DataFrame(columns=["backend", "GB/s", "HBM frac", "max rel err"])
    notes = report.column_notes(with_rates)
    assert notes.startswith("GB/s: the model's HBM bytes") and "HBM frac: " in notes and "tile order" not in notes
    assert report.column_notes(pd.DataFrame(columns=["backend", "dtype"])) == ""


def test_report_writes_plots_and_summary(tmp_path, cli):
    code, out, err = cli("report", FIXTURE, "--out", tmp_path)
    assert code == 0, err
    summary = (tmp_path / "summary.md").read_text()
    assert "NOT GPU timings" in summary and "## Throughput" in summary and "## Per-stage" in summary
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert any(n.startswith("throughput_") for n in pngs) and any(n.startswith("stages_") for n in pngs)
    for name in pngs:
        assert f"![{name}]({name})" in summary
        assert (tmp_path / name).stat().st_size > 5000
    run = load_run(FIXTURE)
    ok = run.status[run.status["status"] == "ok"]
    for backend in ok["backend"].unique():
        assert f"| {backend} |" in summary


def test_report_without_figures_writes_the_tables_alone(tmp_path, cli):
    out = tmp_path / "rep"
    code, _, err = cli("report", str(FIXTURE), "--out", str(out), "--no-figures")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["summary.md"]
    text = (out / "summary.md").read_text()
    assert "## Figures" not in text and ".png" not in text and "|" in text


def test_report_with_a_gpu_model_over_cpu_measurements(tmp_path, cli):
    code, _, err = cli("report", FIXTURE, "--out", tmp_path, "--device", "h200")
    assert code == 0, err
    assert "roofline device: h200" in (tmp_path / "summary.md").read_text()
    code, _, err = cli("report", FIXTURE, "--out", tmp_path, "--device", "no-such-gpu")
    assert code == 2 and "unknown device" in err


def test_measured_crossover_interpolates_on_log_reuse():
    x = np.array([1.0, 4.0, 16.0])
    kv = np.array([1.0, 3.0, 9.0])        # KV-outer latency
    q = np.array([2.0, 1.5, 2.0])         # Q-outer latency
    value, how = tables.measured_crossover(x, kv, q)
    # d = log(kv/q): log(0.5) at 1, log(2) at 4 -> halfway on the log axis between 1 and 4
    assert how == "interpolated" and value == pytest.approx(2.0)
    assert tables.measured_crossover(x, q / 4, q)[0] is None
    assert "KV-outer faster" in tables.measured_crossover(x, q / 4, q)[1]
    assert "Q-outer faster" in tables.measured_crossover(x, q * 4, q)[1]


def test_model_time_is_the_roofline_prediction_for_the_point():
    run = load_run(FIXTURE)
    dev = load_device("h200")
    row = tables.ok_units(run).query("schedule == 'kv-outer'").iloc[0]
    shape = ModelShape(hq=int(row["hq"]), hkv=int(row["hkv"]), head_dim=int(row["head_dim"]), block=int(row["block"]),
                       topk=int(row["topk"]), dtype=row["dtype"])
    want = predict("kv-outer", shape, row["wl_n_tokens"], row["wl_nsb"], dev,
                   selected_per_query=row["wl_selected_blocks_per_query"], flops=row["wl_useful_flops"]).time_s
    assert tables.model_time(row, "kv-outer", dev) == pytest.approx(want)


def test_roofline_picks_compare_kv_outer_with_q_outer(tmp_path):
    """The CPU fixture has no Q-outer (FlashInfer needs a GPU), so it has no picks. On a copy whose
    msa-scatter units are relabelled as Q-outer (a label change for this logic test only), every point
    with both is a case, and `agree` says whether the model's faster schedule was measured faster."""
    import shutil
    dev = load_device("h200")
    table, summary = tables.roofline_picks(load_run(FIXTURE), dev)
    assert table.empty and summary == {}
    run_dir = tmp_path / "relabelled"
    shutil.copytree(FIXTURE, run_dir)
    for unit in (run_dir / "units").glob("msa-scatter-*"):
        status = json.loads((unit / "status.json").read_text())
        status["schedule"] = "q-outer"
        (unit / "status.json").write_text(json.dumps(status))
        seal_unit(unit)
    run = load_run(run_dir)
    table, summary = tables.roofline_picks(run, dev)
    t = tables.ok_units(run)
    both = t.groupby("point_key")["schedule"].nunique()
    assert summary["cases"] == int((both == 2).sum()) > 0
    for case in table.itertuples():
        g = t[t["point_key"] == case.case]
        model = {s: tables.model_time(g[g["schedule"] == s].iloc[0], s, dev) for s in ("kv-outer", "q-outer")}
        measured = g.loc[g["module.median_s"].idxmin(), "schedule"]
        assert case.predicted == min(model, key=model.get)
        assert case.agree == (case.predicted == measured)
    assert summary["agree_weight_share"] == pytest.approx(summary["agree_cases"] / summary["cases"])  # weights 1


@pytest.fixture(scope="module")
def prefill_run(tmp_path_factory, cli):
    toml = tmp_path_factory.mktemp("scn") / "tiny-prefill.toml"
    # the cases' real lengths and weights, with few small heads so the CPU reference stays quick
    toml.write_text('description = "two small representative prefill cases"\nbackends = ["reference"]\n'
                    '[shape]\nhq = 4\nhkv = 2\nhead_dim = 32\n[timing]\nreps = 2\nwarmup = 0\n'
                    '[grid]\ngenerator = "real-prefill"\ndtypes = "bf16"\n'
                    'cases = ["prefill_4469427d069d9467c4ec", "prefill_092e27340df8621a02f0"]\n')
    out = tmp_path_factory.mktemp("prefill") / "run"
    code, _, err = cli("sweep", "--scenario", toml, "--out", out)
    assert code == 0, err
    return out


def test_call_weighted_aggregate_follows_the_source_formulas(prefill_run, cli, tmp_path):
    run = load_run(prefill_run)
    assert tables.is_prefill_run(run)
    agg = tables.prefill_aggregate(run).set_index("backend").loc["reference"]
    t = tables.ok_units(run)
    w, lat, fl = t["weight"].to_numpy(float), t["module.median_s"].to_numpy(float), t["wl_useful_flops"].to_numpy(float)
    assert sorted(w) == [611.0, 1325.0]               # representative_weight of the two cases
    assert agg["weighted mean latency_s"] == pytest.approx((w * lat).sum() / w.sum())
    assert agg["aggregate TFLOP/s"] == pytest.approx((w * fl).sum() / (w * lat).sum() / 1e12)
    assert agg["cases"] == 2 and agg["call weight"] == pytest.approx(1936.0)
    code, _, err = cli("report", prefill_run, "--out", tmp_path)
    assert code == 0, err
    assert "call-weighted aggregate" in (tmp_path / "summary.md").read_text()


def test_notebook_runs_as_a_script(tmp_path):
    env = {**os.environ, "MPLBACKEND": "Agg", "MSA_BENCH_FIGURES": str(tmp_path)}
    env.pop("MSA_BENCH_RUN", None)
    proc = subprocess.run([sys.executable, str(REPO / "notebooks" / "report.py")], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU RUN" in proc.stdout and "smoke" in proc.stdout
    figures = list(tmp_path.glob("*.png"))
    assert any(f.name.startswith("throughput_") for f in figures)
    assert any(f.name.startswith("stages_") for f in figures)


def test_bytes_table_puts_the_model_next_to_counters(tmp_path, cli):
    """CPU runs have no counters: plant counter rows (made-up values, labelled so) on a copy of the
    fixture and check the model's bytes for the same schedule land beside them."""
    import shutil

    import pandas as pd
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    unit = next(u for u in sorted((run_dir / "units").iterdir())
                if u.name.startswith("kv-outer-") and (u / "stats.parquet").is_file())
    stats = pd.read_parquet(unit / "stats.parquet")
    planted = stats[stats["stage"] == "module"].iloc[[0, 0]].copy()
    planted["statistic"] = ["hbm_bytes", "l2_bytes"]
    planted["value"] = [1.0e6, 3.0e6]
    pd.concat([stats, planted]).to_parquet(unit / "stats.parquet", index=False)
    seal_unit(unit)
    dev = load_device("h200")
    table = tables.bytes_table(load_run(run_dir), dev)
    assert len(table) == 1
    row = table.iloc[0]
    units = tables.ok_units(load_run(run_dir))
    pred = tables._predict_row(units[units["unit"] == unit.name].iloc[0], "kv-outer", dev)
    assert row["hbm model"] == pytest.approx(pred.hbm_bytes) and row["l2 model"] == pytest.approx(pred.l2_bytes)
    assert row["hbm measured/model"] == pytest.approx(1.0e6 / pred.hbm_bytes)
    code, _, err = cli("report", run_dir, "--out", tmp_path / "rep", "--device", "h200")
    assert code == 0, err
    assert (tmp_path / "rep" / "bytes.png").is_file()
    assert "## Bytes moved" in (tmp_path / "rep" / "summary.md").read_text()


def test_launch_labels_read_the_kernel_under_either_key():
    """A CuTe unit's plan_info names its kernel as cute_kernel (runs before 2026-12-01: cute_variant)."""
    from msa_bench.harness.store.rows import launch_labels
    cfg = {"q_ranges": 2, "order_chunk": 0, "order_phases": True}
    assert launch_labels({"config": cfg, "cute_kernel": "v28"}) == {"tile order": "2:p", "kernel": "v28"}
    assert launch_labels({"config": cfg, "cute_variant": "v23"})["kernel"] == "v23"
    assert "kernel" not in launch_labels({"config": cfg})


def test_throughput_table_names_each_units_tile_order_and_kernel():
    """The committed H200 default run: the CuTe units name their dtype's default kernel (bf16 v23, fp8
    v28) and the order the workload chose (2 query ranges in phases for bf16 at nsb/N 1/16 and 1/4, key
    order elsewhere); the Triton units their key order, with no kernel."""
    t = tables.throughput_table(load_run(REPO / "results" / "h200" / "baseline"))
    cute = t[t["backend"] == "kv-outer-cute"]
    assert dict(zip(cute["dtype"], cute["kernel"])) == {"bf16": "v23", "fp8": "v28"}
    grouped = cute[cute["tile order"] == "2:p"]
    assert set(grouped["dtype"]) == {"bf16"} and sorted(grouped["nsb/N"]) == [0.0625, 0.25]
    assert set(cute["tile order"]) == {"1:0", "2:p"}
    triton = t[t["backend"] == "kv-outer"]
    assert set(triton["tile order"]) == {"1:0"} and set(triton["kernel"]) == {""}


def test_counts_print_whole_in_reports_and_committed_summaries():
    """N and other counts read as 16384, not 1.638e+04: in new reports and in the committed ones."""
    import re
    from msa_bench.harness.report.summary import _fmt
    assert _fmt(16384.0) == "16384" and _fmt(1048576.0) == "1048576" and _fmt(0.0025) == "0.0025"
    assert _fmt(12345.5) == "12346" and _fmt(999999.4) == "999999" and _fmt(2.5e9) == "2.500e+09"
    for summary in sorted((REPO / "results").glob("**/report/summary.md")):
        whole = re.findall(r"\|\s*(\d\.\d+e\+0[3-6])\s*(?=\|)", summary.read_text())
        assert not [v for v in whole if float(v) == int(float(v)) and float(v) < 1e7], (summary, whole[:3])
