"""benchmarks/ncu_regions.py on small hand-made ncu source tables (no GPU, no ncu)."""
from __future__ import annotations

import csv
import gzip
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import ncu_regions  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
BASE = 0x7F0000001000


def table(path: Path, body: list[tuple[str, int, int, int, int]], gz: bool = False) -> Path:
    """body rows: (SASS text, samples, executed, wait samples, barrier samples); addresses 16 apart."""
    rows = [["Kernel Name", "kernel_x", ""], HEADER]
    for k, (text, samples, executed, wait, barrier) in enumerate(body):
        rows.append([hex(BASE + 16 * k), f"      {text}", str(samples), str(samples), str(executed),
                     str(wait), str(barrier), "0"])
    opener = gzip.open if gz else open
    with opener(path, "wt", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


LOOP = [("LDC R1, c[0x0][0x28]", 1, 1, 0, 0),                       # 0: prologue
        ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR15], R11", 2, 10, 2, 0),   # 1: loop start (top)
        ("HGMMA.64x128x16.F32.BF16 R88, gdesc[UR20], RZ, !UPT", 10, 10, 4, 0),
        ("HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR20].tnspB, RZ, !UPT", 6, 10, 0, 0),
        ("WARPGROUP.DEPBAR.LE gsb0, 0x1", 8, 10, 0, 8),
        ("MUFU.EX2 R88, R88", 30, 10, 20, 0),
        ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 1, 10, 0, 1),
        ("STSM.16.M88.4 [R9], R20", 12, 10, 0, 6),
        ("UTMACMDFLUSH", 0, 10, 0, 0),
        ("F2FP.BF16.F32.PACK_AB R155, R151, R150", 5, 10, 5, 0),
        (f"@P0 BRA {hex(BASE + 16)}", 5, 10, 0, 0),
        ("EXIT", 0, 1, 0, 0)]


def test_regions_split_the_consumer_loop_at_its_phase_changes(tmp_path):
    path = table(tmp_path / "source.csv.gz", LOOP, gz=True)
    header, rows = ncu_regions.read_table(path)
    loop = ncu_regions.consumer_loop(ncu_regions.instructions(header, rows))
    assert [i["text"].split()[0] for i in (loop[0], loop[-1])] == ["SYNCS.PHASECHK.TRANS64.TRYWAIT", "BRA"]
    parts = dict(ncu_regions.regions(loop))
    assert list(parts) == ["top", "issue", "softmax", "store_o", "after_store"]
    assert [len(parts[k]) for k in parts] == [1, 2, 2, 3, 2]
    assert sum(i["samples"] for i in parts["softmax"]) == 38
    text = ncu_regions.summary(path)
    assert "softmax" in text and "47.5% of samples" in text            # 38 of 80
    assert "barrier 21%" in text                                          # 8 of the softmax region's 38


SERIAL = [("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR15], R11", 4, 10, 4, 0),     # 0: loop start (top)
          ("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT", 2, 10, 0, 0),
          ("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0", 1, 10, 0, 0),
          ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 6, 10, 0, 6),                      # wait S
          ("FMNMX R9, R26, R27, !PT", 3, 10, 3, 0),
          ("MUFU.EX2 R27, R27", 20, 10, 15, 0),
          ("F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R54, R55, R54, RZ", 2, 10, 1, 0),
          ("QGMMA.64x128x32.F32.E4M3.E4M3 R88, R54, gdesc[UR12], R88", 1, 10, 0, 0),
          ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 7, 10, 0, 7),                      # wait P V
          ("F2FP.BF16.F32.PACK_AB R15, R63, R62", 3, 10, 3, 0),
          ("UTMACMDFLUSH", 0, 10, 0, 0),
          ("UIADD3 UR13, UR13, 0x3, URZ", 1, 10, 1, 0),
          (f"@P0 BRA {hex(BASE)}", 0, 10, 0, 0)]


def test_a_consumer_that_is_not_pipelined_is_cut_at_its_own_waits(tmp_path):
    """v23 / v28: no wait for all but one wgmma group, so S, its wait, the softmax (through P's
    conversion), P V, its wait and the store are regions of their own."""
    path = table(tmp_path / "serial.csv", SERIAL)
    header, rows = ncu_regions.read_table(path)
    parts = dict(ncu_regions.regions(ncu_regions.consumer_loop(ncu_regions.instructions(header, rows))))
    assert list(parts) == ["top", "S issue", "wait S", "softmax", "P V issue", "wait P V", "store_o", "after_store"]
    assert [len(parts[k]) for k in parts] == [1, 2, 1, 3, 1, 1, 2, 2]
    assert sum(i["samples"] for i in parts["softmax"]) == 25
    assert re.search(r"wait P V\s+14\.0% of samples", ncu_regions.summary(path))      # 7 of 50


def test_table_without_wgmma_is_a_one_line_error(tmp_path):
    path = table(tmp_path / "plain.csv", [("LDC R1, c[0x0][0x28]", 1, 1, 0, 0), (f"BRA {hex(BASE)}", 1, 1, 0, 0)])
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ncu_regions.py"), str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no loop with warpgroup MMA" in proc.stderr
