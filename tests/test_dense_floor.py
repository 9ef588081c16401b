"""dense-floor, the whole visible context with no selection: its FlashInfer requests, the float64 check
over that context, the model's dense floor (its bytes and FLOPs in closed form), the report's two
crossovers; on a GPU, the backend against the reference in both dtypes and replayed from a CUDA graph."""
from pathlib import Path

import pandas as pd
import pytest
import torch

from msa_bench.harness.measure.check import compare_output, poison  # sets TRITON_INTERPRET first
from msa_bench.kernels.base import Plan, backend_class, get_backend
from msa_bench.kernels.dense_floor import LayoutError, dense_layout
from msa_bench.roofline.devices import load_device
from msa_bench.roofline.model import ModelShape
from msa_bench.roofline.predict import MODELLED, predict_module, schedule_roofline
from msa_bench.roofline.schedules import Schedule
from msa_bench.scenarios.grid import make_workload, serving_point
from msa_bench.scenarios.reference import reference_attention, relative_error
from msa_bench.scenarios.serving import serving_workload
from msa_bench.scenarios.stats import workload_stats
from msa_bench.scenarios.workload import AttnShape, full_context

TINY = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)
FULL = AttnShape()


def _dense_by_hand(w, rows):
    """Each row's attention over every key its request holds up to its limit, in float64."""
    q, k, v = w.dequantized()
    s = w.shape
    out = []
    for r in rows:
        req, lim = int(w.q_request[r]), int(w.q_limit[r])
        pages = w.page_table[req, :lim // s.block + 1].long()
        keys = [c[pages].permute(1, 0, 2, 3).reshape(s.hkv, -1, s.head_dim)[:, :lim + 1] for c in (k, v)]
        scores = torch.einsum("hgd,hkd->hgk", q[r].view(s.hkv, s.group, s.head_dim), keys[0]) * w.sm_scale
        out.append(torch.einsum("hgk,hkd->hgd", scores.softmax(-1), keys[1]).reshape(s.hq, s.head_dim))
    return torch.stack(out)


def test_it_declares_a_dense_schedule_it_is_never_weighed_and_needs_a_gpu():
    cls = backend_class("dense-floor")
    assert cls.schedule == Schedule.DENSE and Schedule.DENSE in MODELLED
    assert cls.dense and cls.full_context and not cls.candidate and cls.stage_names == ("attention",)
    assert get_backend("dense-floor@fa2").kernel == "fa2" and get_backend("dense-floor").kernel is None
    with pytest.raises(KeyError):
        get_backend("dense-floor@simt")          # the decode kernels that lost are gone (docs/perf-log.md)
    if not torch.cuda.is_available():
        reason = get_backend("dense-floor").unavailable_reason("bf16", "cpu")
        assert "needs a CUDA GPU" in reason and "\n" not in reason


def test_decode_is_one_flashinfer_request_per_token_over_its_context():
    w = serving_workload(TINY, "bf16", "decode", None, context=600, context_min=100, requests=5)
    lay = dense_layout(w)
    assert lay.decode and lay.num_requests == w.n_tokens
    for i in range(w.n_tokens):
        r, lim = int(w.q_request[i]), int(w.q_limit[i])
        lo, hi = int(lay.kv_indptr[i]), int(lay.kv_indptr[i + 1])
        assert torch.equal(lay.kv_indices[lo:hi].long(), w.page_table[r, :lim // 16 + 1].long())
        assert int(lay.last_page_len[i]) == lim % 16 + 1 and int(lay.kv_lens[i]) == lim + 1


def test_a_mixed_step_is_one_causal_request_per_request_and_disorder_is_refused():
    w = serving_workload(TINY, "bf16", "mixed", 40, context=500, context_min=90, requests=6, chunks=2, drift=0.1)
    lay = dense_layout(w)
    assert not lay.decode and lay.num_requests == 8
    assert lay.qo_indptr.tolist() == [0, 40, 80, 81, 82, 83, 84, 85, 86]
    assert lay.kv_lens[:2].tolist() == [500, 500] and int(lay.kv_indptr[-1]) == int(((lay.kv_lens + 15) // 16).sum())
    w.q_limit[3], w.q_limit[4] = w.q_limit[4].clone(), w.q_limit[3].clone()
    with pytest.raises(LayoutError, match="last positions"):
        dense_layout(w)
    w.q_request[0], w.q_request[45] = w.q_request[45].clone(), w.q_request[0].clone()
    with pytest.raises(LayoutError, match="request order"):
        dense_layout(w)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_check_of_a_full_context_plan_takes_the_reference_over_every_visible_block(dtype):
    w = serving_workload(TINY, dtype, "mixed", 24, context=400, context_min=120, requests=4, chunks=1, drift=0.1)
    rows = torch.tensor([0, 11, 23, 24, 27])
    ref, lse = reference_attention(full_context(w, rows))
    assert relative_error(ref, _dense_by_hand(w, rows)) < 1e-12 and torch.isfinite(lse).all()
    dense = reference_attention(full_context(w))[0].to(torch.bfloat16)
    plan = Plan(backend="x", stages={"attention": lambda: None}, output=dense.clone())
    assert compare_output(plan, w)[0] > 0.1                       # the selection's reference: another attention
    plan.full_context = True
    err, tol, _ = compare_output(plan, w)
    assert err <= tol
    poison(plan)
    assert compare_output(plan, w, rows)[0] == float("inf")


def test_at_sparsity_ratio_one_the_full_context_is_the_selection():
    # a context of top-k blocks: every query selects every block it may see
    w = serving_workload(TINY, "bf16", "decode", None, context=4 * 16, requests=3)
    assert relative_error(reference_attention(w)[0], reference_attention(full_context(w))[0]) < 1e-12


def test_the_model_reads_each_context_once_and_counts_causal_flops_exactly():
    w = serving_workload(TINY, "bf16", "drift", 40, context=300, drift=0.1, with_tensors=False)
    st = workload_stats(w)
    p = schedule_roofline(Schedule.DENSE, st, {}, load_device("h200"), "bf16")
    shape = ModelShape.of(TINY, dtype="bf16")
    blocks = 300 // 16 + 1                                        # one request: blocks 0 .. its last token's
    qo = 40 * TINY.hq * TINY.head_dim * 2
    assert p.schedule == Schedule.DENSE
    assert p.hbm_terms == {"q_read": qo, "kv_read": blocks * TINY.hkv * shape.kv_block_bytes, "out_write": qo}
    assert p.l2_terms == p.hbm_terms
    visible = sum(range(260 + 1, 300 + 1))                        # tokens at 260 .. 299 see 261 .. 300 keys
    assert st["visible_keys"] == visible and st["dense_keys"] == 40 * blocks * 16
    assert p.flops == p.executed_flops == 4 * TINY.hq * TINY.head_dim * visible
    fp8 = schedule_roofline(Schedule.DENSE, st, {}, load_device("h200"), "fp8")
    assert fp8.hbm_terms["kv_read"] == p.hbm_terms["kv_read"] / 2
    got = predict_module(backend_class("dense-floor")().facts, st, {}, load_device("h200"), "bf16")
    assert got is not None and got.seconds >= p.time_s


def _fake_run(ms: dict, contexts):
    """A run of 16-request decode points at `contexts`, each backend's module medians (ms) as given."""
    from msa_bench.harness.store.results import Run
    schedules = {"kv-outer-cute": "kv-outer", "dense-masked": "dense-masked", "dense-floor": "dense"}
    status, stats = [], []
    for i, ctx in enumerate(contexts):
        p = serving_point("decode", FULL, "bf16", 0, tokens=None, context=ctx, requests=16)
        wl = {f"wl_{k}": v for k, v in workload_stats(make_workload(p, with_tensors=False)).items()}
        for backend, times in ms.items():
            status.append({"point_key": p.key(), "backend": backend, "schedule": schedules[backend], "status": "ok",
                           **p.as_dict(), **wl, "plan_info": "{}"})
            stats.append({"point_key": p.key(), "backend": backend, "stage": "module", "statistic": "median_s",
                          "value": times[i] / 1e3})
    return Run(Path("fake"), {"timer": "cuda"}, pd.DataFrame(status), pd.DataFrame(stats), pd.DataFrame())


def test_the_report_states_both_crossovers():
    from msa_bench.harness.report.dense_crossover import crossover_figures, crossover_table
    ctx = [2048, 8192, 32768]
    run = _fake_run({"kv-outer-cute": [2.0, 2.0, 2.0], "dense-masked": [3.0, 12.0, 48.0],
                     "dense-floor": [1.0, 4.0, 16.0]}, ctx)
    table = crossover_table(run, load_device("h200"))
    assert table["dense"].tolist() == ["dense-masked", "dense-floor"]
    masked, floor = (table.set_index("dense").loc[n] for n in ("dense-masked", "dense-floor"))
    assert pd.isna(masked["measured context"]) and "sparse faster" in masked["how"]
    assert floor["measured context"] == pytest.approx(4096) and floor["measured ratio"] == pytest.approx(2.0)
    assert floor["dense / sparse at least context"] == pytest.approx(0.5)
    assert masked["dense / sparse at least context"] == pytest.approx(1.5)
    assert pd.isna(floor["model context"]) or 2048 <= floor["model context"] <= 32768
    assert [name for name, _ in crossover_figures(run, None)] == ["dense_crossover_bf16.png"]


# ---- on the GPU: FlashInfer's kernels -----------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("option", ["", "@fa2"])
def test_dense_floor_matches_the_reference_and_replays_bitwise(dtype, option, graph_replay_equals_eager):
    from msa_bench.harness.measure.check import check_backend, sample_rows
    from msa_bench.kernels.flashinfer_common import import_flashinfer
    import_flashinfer()                                   # no FlashInfer on a GPU host is a failure here
    cases = [serving_workload(FULL, dtype, "decode", None, context=2048, requests=256, device="cuda"),
             serving_workload(FULL, dtype, "decode", None, context=32768, context_min=8192, requests=16,
                              query_tokens=2, drift=0.05, device="cuda"),
             serving_workload(FULL, dtype, "drift", 512, context=8192, drift=0.07, device="cuda"),
             serving_workload(FULL, dtype, "mixed", 1024, context=16384, context_min=4096, requests=32, chunks=1,
                              drift=0.05, device="cuda")]
    name = f"dense-floor{option}"
    for w in cases:
        err, tol, details = check_backend(name, w, rows=sample_rows(w.n_tokens))
        assert err <= tol, (w.meta["generator"], details["out_rel_err"], details.get("lse_rel_err"), details["info"])
        graph_replay_equals_eager(get_backend(name).plan(w))
