"""benchmarks/cute_ncu.py's CPU side: profile names and the reading of an ncu raw page."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cute_ncu  # noqa: E402


def test_file_tag_names_order_and_alias():
    assert cute_ncu.file_tag("v18") == "v18"
    assert cute_ncu.file_tag("v9@4:8") == "v9_o4-8"
    assert cute_ncu.file_tag("v18ko-exp~256") == "v18ko-exp_a256"


def test_raw_page_summary_reads_clock_and_pipes():
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
              "gpc__cycles_elapsed.avg.per_second", "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
              "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
              "l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_elapsed",
              "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"]
    units = ["", "", "ms", "Gbyte", "Gbyte", "hz", "%", "%", "%", "%"]
    row = ["0", "kernel_cutlass_x", "3.21", "4.31", "4.40", "1,340,736,269.90", "30.5", "20.1", "41.2", "47.7"]
    text = "==PROF== noise\n" + "\n".join(",".join(f'"{c}"' for c in r) for r in (header, units, row))
    (kernel,) = cute_ncu.parse_raw(text)
    rec = cute_ncu.summarize(kernel)
    assert abs(rec["time_s"] - 3.21e-3) < 1e-9 and abs(rec["dram_read_bytes"] - 4.31e9) < 1
    assert abs(rec["sm_clock_mhz"] - 1340.74) < 0.01
    assert (rec["issue_active_pct"], rec["xu_pipe_pct"], rec["lsu_pipe_pct"], rec["tensor_active_pct"]) == \
        (30.5, 20.1, 41.2, 47.7)
    assert "SM clock 1340.7" in cute_ncu.line({"impl": "v18", "dtype": "bf16", **rec})
