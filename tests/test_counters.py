"""ncu CSV parsing and per-stage sums, on a hand-written parser fixture (not a measurement)."""
from pathlib import Path

import pytest

from msa_bench.harness.counters import (METRICS, CountersError, ncu_command, parse_ncu_csv, sum_kernels)
from msa_bench.harness.telemetry import is_throttled, point_telemetry, reason_names

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


def test_ncu_command_filters_one_stage_by_nvtx_push_pop_range():
    cmd = ncu_command("/usr/local/cuda/bin/ncu", "attention", '{"tokens": 1}', "kv-outer")
    assert cmd[cmd.index("--nvtx-include") + 1] == "attention/"
    assert "--nvtx" in cmd and cmd[cmd.index("--clock-control") + 1] == "none"
    assert set(cmd[cmd.index("--metrics") + 1].split(",")) == set(METRICS)
    assert cmd[-4:] == ["--point", '{"tokens": 1}', "--backend", "kv-outer"]


def test_throttle_flags():
    assert is_throttled(0x20) and is_throttled(0x4) and not is_throttled(0x1 | 0x10)
    assert reason_names(0x41) == ["gpu_idle", "hw_thermal_slowdown"]
    row = point_telemetry({"clock_event_reasons": 0, "sm_clock_mhz": 1980.0},
                          {"clock_event_reasons": 0x8, "sm_clock_mhz": 1500.0})
    assert row["throttled"] and row["sm_clock_mhz_after"] == 1500.0
    assert point_telemetry({}, {}) == {"telemetry": "unavailable"}


def test_point_round_trips_through_the_child_json():
    import json

    from msa_bench.harness.counters import point_from_dict
    from msa_bench.harness.scenarios import load_scenario
    for p in load_scenario("smoke").points[:3] + load_scenario("real-prefill").points[:1]:
        assert point_from_dict(json.loads(json.dumps(p.as_dict()))) == p


def test_poller_and_point_summary_of_polls():
    import itertools
    import time

    from msa_bench.harness.telemetry import Poller
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
