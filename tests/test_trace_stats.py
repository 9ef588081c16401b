"""Trace statistics (scenarios/trace_stats.py): a trace made from a generator reads back that generator's
closed forms and lands on its own point of the synthetic map; the printed summary fits 80 columns."""
import pytest
import torch

from msa_bench.roofline.devices import load_device
from msa_bench.roofline.shape import AttnShape
from msa_bench.scenarios.serving import serving_workload
from msa_bench.scenarios.stats import workload_stats
from msa_bench.scenarios.trace import index_entry, read_index, write_trace
from msa_bench.scenarios.trace_stats import call_stats, distributions, place, quantile, trace_lines

SHAPE = AttnShape()


def trace_of(path, workloads, layers):
    """Workloads of a generator written as a trace, one call each."""
    calls = []
    for i, (w, layer) in enumerate(zip(workloads, layers)):
        t = {"selection": w.selection, "q_request": w.q_request, "q_position": w.q_limit,
             "context": torch.tensor(w.meta["kv_lens"], dtype=torch.int32)}
        calls.append((index_entry(i, layer, i, 1.0, w.selection, t["context"], SHAPE.block, None), t))
    return read_index(write_trace(path, SHAPE, calls, {"model": "drift generator"}))


@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    ws = [serving_workload(SHAPE, "bf16", "drift", 1024, 32768, drift=0.07, seed=s, with_tensors=False)
          for s in range(2)]
    return ws, trace_of(tmp_path_factory.mktemp("t") / "drift.safetensors", ws, [0, 1])


def test_a_drift_trace_reads_back_its_closed_form_within_5_percent(drift):
    ws, info = drift
    for w, e in zip(ws, info.calls):
        st = call_stats(info, e, "bf16").stats
        assert st["neighbour_jaccard"] == pytest.approx(w.meta["target_neighbour_jaccard"], rel=0.05)
        assert st["union_ratio_p8"] == pytest.approx(w.meta["target_union_ratio"], rel=0.05)
        direct = workload_stats(w)
        for key in ("nsb_per_n", "union_ratio_p8", "union_ratio_p16", "fanin_mean", "useful_flops"):
            assert st[key] == pytest.approx(direct[key]), key


def test_a_drift_trace_lands_on_its_own_synthetic_point_and_schedule(drift):
    _, info = drift
    calls = [call_stats(info, e, "bf16", load_device("h200")) for e in info.calls]
    place(calls, info.shape, "bf16")
    assert [c.nearest[0] for c in calls] == ["drift p 0.07"] * 2
    assert calls[0].nearest[1] == pytest.approx(0, abs=1e-9)         # seed 0: the map's own point
    assert all(c.schedule is not None for c in calls)
    lines = trace_lines(info, calls, "h200", "bf16")
    assert max(map(len, lines)) <= 80
    assert any(line.split()[:2] == ["nsb/N", "all"] for line in lines)
    assert sum(1 for line in lines if line.startswith(" " * 20) and line.split()[0] in ("0", "1")) == 10


def test_quantiles_are_nearest_rank_per_layer_and_over_all():
    class C:
        def __init__(self, layer, value):
            self.entry = type("E", (), {"layer": layer})()
            self.stats = {"nsb_per_n": value}
    calls = [C(0, v) for v in (1, 2, 3, 4)] + [C(1, 10)]
    rows = {(label, layer): (n, q) for label, layer, n, q in distributions(calls) if label == "nsb/N"}
    assert rows[("nsb/N", "all")] == (5, [1, 3, 10]) and rows[("nsb/N", "0")] == (4, [1, 2, 4])
    assert quantile([5.0], 0.1) == 5.0
