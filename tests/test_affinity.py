"""Pinning the timing process near its GPU (timing.pin): NVML's mask read, the cores chosen, the scenario
key, and on a GPU the pin applied and recorded."""
import os

import pytest
import torch

from msa_bench.errors import UserError
from msa_bench.harness.measure.affinity import chosen_cpus, cpu_list, mask_cpus, pin_process
from msa_bench.harness.measure.timing import TimingConfig


def test_mask_words_are_64_bit_with_cpu_0_lowest():
    assert mask_cpus([0b1011]) == [0, 1, 3]
    assert mask_cpus([0, 1 << 63 | 1]) == [64, 127]
    assert mask_cpus([]) == []


def test_cpu_list_prints_ranges():
    assert cpu_list([8, 0, 1, 2, 3]) == "0-3,8"
    assert cpu_list([5]) == "5"
    assert cpu_list([0, 2, 3]) == "0,2-3"


def test_chosen_cores_are_near_and_allowed():
    near = [0, 1, 2, 3, 4, 5, 6, 7]
    allowed = {4, 5, 6, 7, 8, 9}                       # a cgroup cpuset that straddles the node
    assert chosen_cpus("none", near, allowed) == (None, "")
    assert chosen_cpus("numa", near, allowed) == ([4, 5, 6, 7], "")
    assert chosen_cpus("core", near, allowed) == ([4], "")


def test_no_usable_core_leaves_the_process_and_says_so():
    cpus, why = chosen_cpus("core", [0, 1], {2, 3})
    assert cpus is None and "left unpinned" in why


def test_pin_without_nvml_handle_is_a_note_not_a_failure():
    before = os.sched_getaffinity(0)
    record = pin_process("numa", None)
    assert record["pin"] == "numa" and "no NVML handle" in record["note"]
    assert set(record["cpus"]) == before == os.sched_getaffinity(0)


def test_scenario_timing_takes_a_pin_and_refuses_others():
    assert TimingConfig.from_dict({"pin": "core"}).pin == "core"
    assert TimingConfig.from_dict({}).pin == "none"
    with pytest.raises(UserError, match="timing.pin"):
        TimingConfig.from_dict({"pin": "socket"})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and NVML")
def test_pin_core_on_the_gpu_leaves_one_near_core():
    from msa_bench.harness.measure.affinity import gpu_near_cpus
    from msa_bench.harness.measure.telemetry import open_telemetry
    tel = open_telemetry("cuda")
    if not tel.available:
        pytest.skip(tel.reason)
    before = os.sched_getaffinity(0)
    try:
        record = pin_process("core", tel.nvml_handle)
        near = set(gpu_near_cpus(tel.nvml_handle))
        if "note" not in record:
            assert len(record["cpus"]) == 1 and set(record["cpus"]) <= near & before
    finally:
        os.sched_setaffinity(0, before)
