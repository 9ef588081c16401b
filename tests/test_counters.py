"""ncu CSV parsing and per-stage sums, on a hand-written parser fixture (not a measurement)."""
from pathlib import Path

import pytest

from msa_bench.harness.measure.counters import (ALL_METRICS, MARKER, METRICS, RANGE, CountersError, ncu_command, parse_ncu_csv,
                                        split_by_markers, sum_kernels)
from msa_bench.harness.measure.telemetry import is_throttled, point_telemetry, reason_names

FIXTURE = Path(__file__).parent / "data" / "ncu_details_parser_fixture.csv"


def test_parse_fixture_units_separators_and_na():
    kernels = parse_ncu_csv(FIXTURE.read_text())
    assert [k["id"] for k in kernels] == ["0", "1"]
    k0, k1 = kernels
    assert k0["dram_read_bytes"] == 1_000_000
    assert k0["dram_write_bytes"] == 250_000          # Kbyte is 1000 bytes in ncu's SI units
    assert k0["l2_bytes"] == 3_000_000
    assert k0["kernel_time_s"] == pytest.approx(12.5e-6)
    assert k0["tensor_inst_gmma"] == 4096
    assert "l2_bytes" not in k1                       # n/a is absent, not zero
    assert k1["kernel_time_s"] == pytest.approx(2.5e-6)


def test_sum_kernels_per_stage():
    totals = sum_kernels(parse_ncu_csv(FIXTURE.read_text()))
    assert totals["dram_read_bytes"] == 1_000_500
    assert totals["dram_write_bytes"] == 251_500
    assert totals["hbm_bytes"] == 1_252_000
    assert totals["l2_bytes"] == 3_000_000
    assert totals["tensor_inst_gmma"] == 5120
    assert totals["tensor_inst_hmma"] == 8
    assert totals["kernel_time_s"] == pytest.approx(15e-6)
    assert totals["n_kernels"] == 2


def test_no_csv_means_no_kernels_and_missing_columns_is_an_error():
    assert parse_ncu_csv("==PROF== No kernels were profiled.\n") == []
    with pytest.raises(CountersError):
        parse_ncu_csv('"ID","Kernel Name"\n"0","k"\n')


def test_ncu_command_profiles_only_the_counter_ranges_of_one_child():
    cmd = ncu_command("/usr/local/cuda/bin/ncu", "/tmp/spec.json", "/tmp/m.json")
    assert cmd[cmd.index("--nvtx-include") + 1] == f"{RANGE}/"
    assert "--nvtx" in cmd and cmd[cmd.index("--clock-control") + 1] == "none"
    assert set(cmd[cmd.index("--metrics") + 1].split(",")) == set(ALL_METRICS)
    assert cmd[-4:] == ["--spec", "/tmp/spec.json", "--manifest", "/tmp/m.json"]
    plain = ncu_command("ncu", "s", "m", optional=False)
    assert set(plain[plain.index("--metrics") + 1].split(",")) == set(METRICS)


def _k(i, name, grid=1, **values):
    return {"id": str(i), "kernel": name, "grid_blocks": grid, **values}


def test_markers_split_the_launch_order_into_stages():
    entries = [["kv-outer", "index_map"], ["kv-outer", "attention"], ["flashinfer", "attention"]]
    kernels = [_k(0, MARKER, 1), _k(1, "sort", dram_read_bytes=10), _k(2, "scan", dram_read_bytes=5),
               _k(3, MARKER, 2), _k(4, MARKER, 3), _k(5, "BatchPrefill", dram_read_bytes=7)]
    split = split_by_markers(kernels, entries)
    assert [k["kernel"] for k in split[("kv-outer", "index_map")]] == ["sort", "scan"]
    assert split[("kv-outer", "attention")] == []              # a stage may launch nothing
    assert sum_kernels(split[("flashinfer", "attention")])["dram_read_bytes"] == 7


@pytest.mark.parametrize("kernels, why", [
    ([_k(0, "sort")], "before the first stage marker"),
    ([_k(0, MARKER, 1)], "1 of 2 stage markers"),
    ([_k(0, MARKER, 1), _k(1, MARKER, 5)], "grid 5"),
    ([_k(0, MARKER, 1), _k(1, MARKER, 2), _k(2, MARKER, 3)], "more stage markers"),
])
def test_markers_that_do_not_add_up_are_refused(kernels, why):
    with pytest.raises(CountersError, match=why):
        split_by_markers(kernels, [["a", "x"], ["a", "y"]])


def test_l2_sources_are_sector_counts_and_absent_when_not_collected():
    with_sources = sum_kernels([_k(0, "k", l2_sm_sectors=100, l2_fabric_sectors=10, l2_bytes=5000)])
    assert with_sources["l2_sm_bytes"] == 3200 and with_sources["l2_fabric_bytes"] == 320
    assert "l2_sm_bytes" not in sum_kernels([_k(0, "k", l2_bytes=5000)])


def test_parse_reads_the_grid_and_sorts_by_id():
    kernels = parse_ncu_csv(FIXTURE.read_text())
    assert [k["grid_blocks"] for k in kernels] == [132, 132]


def test_throttle_flags():
    assert is_throttled(0x20) and is_throttled(0x4) and not is_throttled(0x1 | 0x10)
    assert reason_names(0x41) == ["gpu_idle", "hw_thermal_slowdown"]
    row = point_telemetry({"clock_event_reasons": 0, "sm_clock_mhz": 1980.0},
                          {"clock_event_reasons": 0x8, "sm_clock_mhz": 1500.0})
    assert row["throttled"] and row["sm_clock_mhz_after"] == 1500.0
    assert point_telemetry({}, {}) == {"telemetry": "unavailable"}


def test_point_round_trips_through_the_child_json():
    import json

    from msa_bench.harness.measure.counters import point_from_dict
    from msa_bench.scenarios.grid import load_scenario
    for p in load_scenario("smoke").points[:3] + load_scenario("real-prefill").points[:1]:
        assert point_from_dict(json.loads(json.dumps(p.as_dict()))) == p


def test_poller_and_point_summary_of_polls():
    import itertools
    import time

    from msa_bench.harness.measure.telemetry import Poller
    clock = itertools.cycle([1980.0, 1980.0, 1755.0])
    mask = itertools.cycle([0x0, 0x4, 0x0])

    def read():
        return {"sm_clock_mhz": next(clock), "mem_clock_mhz": 3201.0, "power_w": 500.0, "temperature_c": 55.0,
                "clock_event_reasons": next(mask)}
    poller = Poller(read, interval_s=0.001).start()
    time.sleep(0.05)
    polls = poller.stop()
    assert len(polls) >= 3
    row = point_telemetry(read(), read(), polls)
    assert row["polls"] == len(polls) and row["sm_clock_min_mhz"] == 1755.0
    assert 0 < row["slowdown_poll_share"] < 1 and row["throttled"] and "sw_power_cap" in row["clock_event_names"]


FAKE_NCU = r'''#!/usr/bin/env python3
# A stand-in for ncu (no GPU here): writes the manifest a child would and prints ncu-style CSV rows
# with made-up values, so the glue from spec to per-unit totals can be checked.
import json, sys
a = sys.argv
spec = json.load(open(a[a.index("--spec") + 1]))
entries, errors, rows, kid = [], [[1, "flashinfer", "RuntimeError: boom"]], [], 0
def kernel(name, grid, read):
    global kid
    for metric, unit, value in (("dram__bytes_read.sum", "byte", read), ("lts__t_bytes.sum", "Kbyte", "1"),
                                ("lts__t_sectors_srcunit_tex.sum", "sector", "10")):
        rows.append(f'"{kid}","1","python","h","{name}","1","7","(1, 1, 1)","({grid}, 1, 1)","0","9.0","s","{metric}","{unit}","{value}"')
    kid += 1
for i, item in enumerate(spec):
    for b in item["backends"]:
        if [i, b, "RuntimeError: boom"] in errors:
            continue
        for stage in ("attention", "combine"):
            entries.append([i, b, stage])
            kernel("msa_counters_marker", len(entries), 0)
            kernel("work", 1, 100 * (i + 1))
json.dump({"entries": entries, "errors": errors}, open(a[a.index("--manifest") + 1], "w"))
print("==PROF== Disconnected")
print('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
print("\n".join(rows))
'''


def test_collect_maps_the_child_manifest_back_to_units(tmp_path):
    import json
    import stat

    from msa_bench.harness.measure.counters import collect
    from msa_bench.scenarios.grid import load_scenario
    ncu = tmp_path / "ncu"
    ncu.write_text(FAKE_NCU)
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    p0, p1 = load_scenario("smoke").points[:2]
    got = collect(str(ncu), [(json.loads(json.dumps(p0.as_dict())), ["kv-outer"]),
                             (p1.as_dict(), ["kv-outer", "flashinfer"])])
    assert got[(0, "kv-outer")]["attention"]["dram_read_bytes"] == 100
    assert got[(1, "kv-outer")]["module"]["dram_read_bytes"] == 400        # 2 stages x 200
    assert got[(1, "kv-outer")]["module"]["l2_sm_bytes"] == 2 * 10 * 32
    assert got[(1, "flashinfer")] == {"error": "RuntimeError: boom"}
