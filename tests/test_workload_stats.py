"""A workload's statistics are computed in one place (scenarios/stats.ModelStats): the row workload_stats
writes holds ModelStats' values, and those equal a plain per-entry count on the serving generators'
workloads (decode batches, chunked-prefill steps, drifting prefill)."""
import math
from collections import Counter

import pytest

from msa_bench.roofline.model import DECODE_TOKENS
from msa_bench.roofline.shape import AttnShape
from msa_bench.scenarios.serving import serving_workload
from msa_bench.scenarios.stats import ModelStats, workload_stats

SHAPE = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)
WORKLOADS = {
    "drift": dict(generator="drift", tokens=48, context=1024, drift=0.2, seed=1),
    "mixed": dict(generator="mixed", tokens=32, context=512, context_min=256, requests=6, chunks=1, drift=0.1),
    "decode": dict(generator="decode", tokens=None, context=1024, requests=8),
}


def workload(name):
    return serving_workload(SHAPE, "fp16", device="cpu", with_tensors=False, **WORKLOADS[name])


def by_hand(w) -> dict:
    """The statistics restated entry by entry, without the tensor code they are computed with."""
    s, n = w.shape, w.n_tokens
    pages, sel = w.pages.tolist(), w.selection.tolist()
    limit, request = w.q_limit.tolist(), w.q_request.tolist()
    entries = [(h, q, k) for h in range(s.hkv) for q in range(n) for k in range(s.topk) if sel[h][q][k] >= 0]
    fanin = Counter((h, pages[h][q][k]) for h, q, k in entries)
    per_request = Counter(request)
    decode = {q for q in range(n) if per_request[request[q]] <= DECODE_TOKENS}
    visible = sum(min(max(limit[q] - sel[h][q][k] * s.block + 1, 0), s.block) for h, q, k in entries)
    return {"n_tokens": n, "requests": len(w.page_table), "nsb": len(fanin),
            "nsb_shared": sum(c > 1 for c in fanin.values()), "nsb_per_n": len(fanin) / n,
            "fanin_max": max(fanin.values()), "fanin_mean": sum(fanin.values()) / len(fanin),
            "selected_blocks_per_query": len(entries) / (n * s.hkv),
            "decode_share": len(decode) / n,
            "decode_kv_share": len({(h, pages[h][q][k]) for h, q, k in entries if q in decode}) / len(fanin),
            "selected_tokens": visible, "useful_flops": 4 * s.group * s.head_dim * visible,
            "visible_keys": sum(lim + 1 for lim in limit)}


@pytest.mark.parametrize("name", WORKLOADS)
def test_statistics_equal_a_count_by_hand(name):
    w = workload(name)
    stats, model = workload_stats(w), ModelStats(w)
    for key, value in by_hand(w).items():
        assert stats[key] == pytest.approx(value) and model[key] == pytest.approx(value), (name, key)


@pytest.mark.parametrize("name", WORKLOADS)
def test_a_row_holds_what_the_model_computes_live(name):
    w = workload(name)
    stats, model = workload_stats(w, "h200"), ModelStats(w)
    numeric = {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    known = {k: v for k, v in numeric.items() if model.get(k) is not None}
    # every number a row holds but its generator's aims, its neighbour Jaccard and the schedule-wise
    # roofline (predicted_times) is one ModelStats computes, the same value
    assert set(numeric) - set(known) <= {"target_reuse", "drift", "neighbour_jaccard", "target_neighbour_jaccard",
                                         "target_union_ratio", "crossover_nsb_per_n", "packed_crossover_union_ratio"
                                         } | {k for k in numeric if k.startswith("pred_")}, name
    for key, value in known.items():
        assert model[key] == value or (math.isnan(value) and math.isnan(model[key])), (name, key)
