"""Serving workloads (decode, mixed, drift), their scenario axes, and the dense-masked backend."""
import math

import pytest
import torch

from msa_bench.errors import UserError
from msa_bench.kernels.base import get_backend
from msa_bench.scenarios.grid import load_scenario, make_workload, parse_scenario, serving_point
from msa_bench.scenarios.prefill_cases import PrefillCase, prefill_workload
from msa_bench.scenarios.reference import reference_attention, relative_error
from msa_bench.scenarios.serving import drift_expectations, neighbour_jaccard, serving_workload
from msa_bench.scenarios.stats import workload_stats, workload_union_ratio
from msa_bench.scenarios.workload import AttnShape

FULL = AttnShape()
TINY = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)
SERVING_SCENARIOS = ("decode", "mixed", "drift", "sparsity")


# ---- drift: the closed form --------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.01, 0.07, 0.3])
def test_drift_jaccard_and_union_ratio_match_the_closed_form(p):
    w = serving_workload(FULL, "bf16", "drift", tokens=4096, context=65536, drift=p, seed=3, with_tensors=False)
    want = drift_expectations(FULL, [65536], [4096], p)
    got_j = neighbour_jaccard(w.selection, w.q_request)
    got_u = workload_union_ratio(w, 8)
    assert got_j == pytest.approx(want["neighbour_jaccard"], rel=0.05)
    assert got_u == pytest.approx(want["union_ratio"], rel=0.05)
    # the large-k form the issue states: (1 - p) / (1 + p), near the exact mean
    assert want["neighbour_jaccard"] == pytest.approx((1 - p) / (1 + p), abs=0.04)


def test_drift_zero_keeps_every_block_and_one_replaces_all():
    still = serving_workload(FULL, "bf16", "drift", tokens=256, context=32768, drift=0.0, with_tensors=False)
    assert workload_union_ratio(still, 8) == 1.0
    moved = serving_workload(FULL, "bf16", "drift", tokens=256, context=32768, drift=1.0, with_tensors=False)
    a, b = moved.selection[:, 1:, :-1], moved.selection[:, :-1, :-1]
    assert not (a.unsqueeze(-1) == b.unsqueeze(-2)).any()


def test_drift_in_a_context_with_no_fresh_blocks_to_spare_keeps_the_block():
    """The sparsity scenario's smallest prefill point (N 2048 at the end of 4K): the first token sees only
    k + 1 history blocks, so after one replacement no block its predecessor lacked is left. The block
    stays (this drew forever before); every token still holds k distinct history blocks."""
    import signal
    def stop(*_):
        raise TimeoutError("drift generation did not finish")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(60)
    try:
        w = serving_workload(FULL, "bf16", "drift", tokens=2048, context=4096, drift=0.05, with_tensors=False)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    hist = w.selection[:, :, :-1]
    assert (hist >= 0).all()
    assert (hist.sort(-1).values.diff(dim=-1) != 0).all()


def test_stats_report_the_drift_and_its_closed_form():
    w = serving_workload(FULL, "bf16", "drift", tokens=1024, context=32768, drift=0.15, with_tensors=False)
    st = workload_stats(w)
    assert st["drift"] == 0.15
    assert st["neighbour_jaccard"] == pytest.approx(st["target_neighbour_jaccard"], rel=0.05)
    assert st["union_ratio_p8"] == pytest.approx(st["target_union_ratio"], rel=0.05)


# ---- decode and mixed layouts ------------------------------------------------------------------

def _check_layout(w, kv_lens, q_counts):
    b = w.shape.block
    table = w.page_table
    assert table.shape[0] == len(kv_lens)
    for r, (kv, n) in enumerate(zip(kv_lens, q_counts)):
        pages = table[r][table[r] >= 0]
        assert pages.numel() == math.ceil(kv / b)                         # every block of the request paged
        tok = torch.nonzero(w.q_request == r).view(-1)
        assert tok.numel() == n
        assert w.q_limit[tok].tolist() == list(range(kv - n, kv))           # its last n tokens, causal
        assert (w.selection[:, tok, -1] == w.q_limit[tok] // b).all()       # local block last
        assert (w.selection[:, tok, :-1] < (kv - n) // b).all()             # history before the first query
    used = table[table >= 0]
    assert used.unique().numel() == used.numel() == w.num_pages             # no page shared, none left over


def test_decode_layout_and_page_tables():
    w = serving_workload(FULL, "bf16", "decode", None, context=32768, context_min=8192, requests=12,
                         query_tokens=3, seed=1, with_tensors=False)
    kv = w.meta["kv_lens"]
    assert all(8192 <= c <= 32768 for c in kv) and len(set(kv)) > 1
    assert w.n_tokens == 36
    _check_layout(w, kv, [3] * 12)


def test_mixed_layout_puts_the_chunks_first():
    w = serving_workload(FULL, "bf16", "mixed", tokens=512, context=16384, context_min=4096, requests=20,
                         chunks=2, drift=0.05, with_tensors=False)
    kv, counts = w.meta["kv_lens"], w.meta["query_counts"]
    assert kv[:2] == [16384, 16384] and counts == [512, 512] + [1] * 20
    _check_layout(w, kv, counts)


def test_a_mixed_steps_decode_shares_and_reread_working_set():
    """The decode tokens' blocks are their requests' own, read once: most of the step's distinct blocks,
    few of its tokens, and none of the blocks more than one token selects (model.traffic's working set)."""
    from msa_bench.scenarios.stats import decode_tokens, selected_pairs
    w = serving_workload(FULL, "bf16", "mixed", tokens=512, context=16384, context_min=4096, requests=64,
                         chunks=1, drift=0.05, with_tensors=False)
    st = workload_stats(w)
    assert int(decode_tokens(w).sum()) == 64 and st["decode_share"] == pytest.approx(64 / 576)
    decode_pairs = 64 * FULL.hkv * FULL.topk                  # distinct: every request has its own pages
    assert st["decode_kv_share"] == pytest.approx(decode_pairs / st["nsb"])
    assert st["decode_kv_share"] > 0.5 > st["decode_share"]
    assert st["nsb_shared"] == int((selected_pairs(w)[1] > 1).sum()) <= st["nsb"] - decode_pairs
    batch = workload_stats(serving_workload(FULL, "bf16", "decode", None, context=8192, requests=4, with_tensors=False))
    assert batch["decode_kv_share"] == 1.0 and batch["nsb_shared"] == 0


def test_fixed_context_and_the_sparsity_ratio():
    for context, ratio in ((2048, 1.0), (131072, 64.0)):
        w = serving_workload(FULL, "bf16", "decode", None, context=context, requests=4, with_tensors=False)
        assert w.meta["kv_lens"] == [context] * 4
        assert workload_stats(w)["sparsity_ratio"] == pytest.approx(ratio)


def test_the_grid_builds_what_the_point_says():
    p = serving_point("decode", FULL, "fp8", 2, tokens=None, context=32768, context_min=8192, requests=64,
                      query_tokens=2, drift=0.05)
    assert p.key() == "decode/R64x2/T8192-32768/drift0.05/fp8/seed2/hq64-hkv4-d128-b128-top16"
    w = make_workload(p, with_tensors=False)
    assert w.n_tokens == p.tokens == 128 and w.meta["point"] == p.key()


# ---- scenario files and the axes' validation -----------------------------------------------------

@pytest.mark.parametrize("name", SERVING_SCENARIOS)
def test_serving_scenarios_load(name):
    s = load_scenario(name)
    assert s.points and ("dense-masked" in s.backends or name == "drift")
    for b in s.backends:
        get_backend(b)


def test_scenarios_command_lists_them(cli):
    code, out, _ = cli("scenarios")
    assert code == 0
    for name in SERVING_SCENARIOS:
        assert name in out


def _grid(**grid):
    return {"description": "x", "backends": ["reference"], "grid": grid}


@pytest.mark.parametrize("grid, key", [
    (dict(generator="decode", requests=4, context=32768, query_tokens=5), "query_tokens"),
    (dict(generator="decode", requests=0, context=32768), "requests"),
    (dict(generator="decode", requests=4, context=8192, context_min=16384), "context_min"),
    (dict(generator="decode", requests=4, context=32768, context_min=1024), "context_min"),
    (dict(generator="decode", requests=4, context=32768, drift=1.5), "drift"),
    (dict(generator="drift", tokens=4096, context=131072), "drift"),
    (dict(generator="drift", tokens=4096, context=4096, drift=0.1), "context"),
    (dict(generator="mixed", tokens=1024, context=32768, requests=4, chunks=0), "chunks"),
    (dict(generator="decode", requests=4, context=32768, causal=True), "causal"),
    (dict(generator="synthetic", tokens=64, context=4096, reuse=1.0, drift=0.1), "drift"),
])
def test_an_infeasible_axis_is_one_line_naming_it(grid, key):
    with pytest.raises(UserError) as exc:
        parse_scenario(_grid(**grid), "bad.toml", "bad")
    msg = str(exc.value)
    assert "\n" not in msg and f".{key}" in msg


def test_a_bad_serving_scenario_exits_2(cli, one_error_line, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('description = "x"\nbackends = ["reference"]\n[grid]\ngenerator = "decode"\n'
                    'requests = 4\ncontext = 32768\nquery_tokens = 9\n')
    code, _, err = cli("sweep", "--scenario", path, "--out", tmp_path / "run")
    assert code == 2
    assert "query_tokens" in one_error_line(err)


# ---- dense-masked on the CPU: every generator ------------------------------------------------------

def _tiny_workloads():
    from msa_bench.harness.measure.check import edge_case_workload
    from msa_bench.scenarios.coselection import coselected_workload
    from msa_bench.scenarios.indexer import indexer_workload
    from msa_bench.scenarios.selection import synthetic_workload
    s = TINY
    yield "decode", serving_workload(s, "bf16", "decode", None, context=600, context_min=100, requests=5,
                                     query_tokens=2, drift=0.2)
    yield "decode-fp8", serving_workload(s, "fp8", "decode", None, context=400, requests=3)
    yield "mixed", serving_workload(s, "bf16", "mixed", tokens=40, context=500, context_min=90, requests=6,
                                    chunks=2, drift=0.1)
    yield "drift", serving_workload(s, "fp8", "drift", tokens=64, context=512, drift=0.1)
    yield "synthetic", synthetic_workload(s, "bf16", 48, 1024, 0.5)
    yield "synthetic-causal", synthetic_workload(s, "fp8", 48, 1024, 0.5, causal=True)
    yield "co-selection", coselected_workload(s, "bf16", 48, 1024, 1.0, 0.5)
    yield "indexer", indexer_workload(s, "bf16", 48, 1024, True)
    yield "real-prefill", prefill_workload(PrefillCase("tiny", (5, 30), (70, 200)), s, "bf16")
    yield "edge-cases", edge_case_workload(s, "bf16", [300, 150, 40], [20, 9, 3], False, hot=0.2, pad=0.3, empty=2)


@pytest.mark.parametrize("option", ["dense-masked", "dense-masked@math-fold"])
def test_dense_masked_matches_the_reference_on_every_generator(option):
    for name, w in _tiny_workloads():
        plan = get_backend(option).plan(w)
        plan.output.fill_(float("nan"))
        plan.run()
        ref, _ = reference_attention(w)
        assert relative_error(plan.output, ref) <= 1e-2, name
        assert "quantization" in plan.info and plan.info["schedule"] == "dense-masked"


def test_dense_masked_buckets_requests_of_like_context():
    from msa_bench.kernels.dense_masked import PAD_RATIO, dense_buckets
    w = serving_workload(FULL, "bf16", "decode", None, context=131072, context_min=8192, requests=64,
                         with_tensors=False)
    buckets = dense_buckets(w)
    assert sum(b.batch for b in buckets) == 64 and 1 < len(buckets) < 64
    for b in buckets:
        need = (w.q_limit[b.tokens[:, -1]] // FULL.block + 1)
        assert int(need.max()) == b.blocks and b.blocks <= int(need.min()) * PAD_RATIO


def test_dense_masked_unavailable_names_the_size(monkeypatch):
    from msa_bench.kernels import dense_masked
    w = serving_workload(TINY, "bf16", "decode", None, context=600, requests=3)
    monkeypatch.setattr(dense_masked, "free_memory_bytes", lambda device: 1 << 10)
    reason = get_backend("dense-masked").workload_unavailable_reason(w)
    assert reason and "GiB" in reason and "mask" in reason


def test_dense_masked_options():
    assert get_backend("dense-masked@efficient-expand").kernel == "efficient"
    with pytest.raises(KeyError):
        get_backend("dense-masked@flash")


# ---- the model's dense term ----------------------------------------------------------------------

def test_dense_model_counts_the_whole_context():
    from msa_bench.roofline.devices import load_device
    from msa_bench.roofline.model import ModelShape, predict, predict_dense
    dev = load_device("h200")
    shape = ModelShape(dtype="bf16")
    n, ctx_blocks = 256, 256                                   # 256 decode requests at 32K
    keys = n * ctx_blocks * shape.block
    paged = predict_dense(shape, n, n * ctx_blocks, keys, dev, gathered=False)
    assert paged.hbm_terms["kv_read"] == n * ctx_blocks * shape.hkv * shape.kv_block_bytes
    assert paged.executed_flops == 4 * shape.hq * shape.head_dim * keys
    gathered = predict_dense(shape, n, n * ctx_blocks, keys, dev)
    assert gathered.hbm_bytes > 2 * paged.hbm_bytes
    sparse = predict("kv-outer", shape, n, n * shape.hkv * shape.topk, dev)
    assert paged.time_s > 10 * sparse.time_s                  # sparsity ratio 16: dense reads 16x the K/V


def test_prediction_glue_reads_dense_stats():
    from msa_bench.harness.store.rows import schedule_of
    from msa_bench.roofline.devices import load_device
    from msa_bench.roofline.model import ModelShape
    from msa_bench.roofline.predict import schedule_roofline
    w = serving_workload(FULL, "bf16", "decode", None, context=16384, requests=8, with_tensors=False)
    st = workload_stats(w)
    assert schedule_of("dense-masked") == "dense-masked"
    pred = schedule_roofline("dense-masked", st, {}, load_device("h200"), "bf16")
    assert pred is not None and pred.hbm_terms["kv_read"] == 8 * 128 * 4 * ModelShape().kv_block_bytes


# ---- every backend on decode and mixed, on the GPU -------------------------------------------------

GPU_BACKENDS = ["kv-outer-cute", "q-packed-cute", "hybrid", "auto", "flashinfer", "flashinfer-packed", "msa-scatter",
                "kv-outer", "dense-masked"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_every_backend_on_decode_and_mixed(backend, dtype):
    from msa_bench.harness.measure.check import check_backend
    from msa_bench.kernels.base import BackendUnavailable
    points = [serving_point("decode", FULL, dtype, 0, tokens=None, context=32768, context_min=8192, requests=64),
              serving_point("decode", FULL, dtype, 0, tokens=None, context=32768, context_min=8192, requests=16,
                            query_tokens=4, drift=0.05),
              serving_point("mixed", FULL, dtype, 0, tokens=2048, context=32768, context_min=8192, requests=128,
                            chunks=1, drift=0.05)]
    for p in points:
        w = make_workload(p, "cuda")
        try:
            err, tol, _ = check_backend(backend, w)
        except BackendUnavailable as exc:
            pytest.skip(str(exc))
        assert err <= tol, (p.key(), err)


# ---- the report: sparse against dense-masked --------------------------------------------------------

def _fake_run(dense_ms, sparse_ms, contexts, dense_info="{}"):
    """A run of decode points at `contexts` with kv-outer-cute and dense-masked module medians (ms)."""
    from pathlib import Path

    import pandas as pd

    from msa_bench.harness.store.results import Run
    status, stats = [], []
    for ctx, d, sp in zip(contexts, dense_ms, sparse_ms):
        p = serving_point("decode", FULL, "bf16", 0, tokens=None, context=ctx, requests=16)
        wl = {f"wl_{k}": v for k, v in workload_stats(make_workload(p, with_tensors=False)).items()}
        for backend, schedule, ms, info in (("kv-outer-cute", "kv-outer", sp, "{}"),
                                            ("dense-masked", "dense-masked", d, dense_info)):
            status.append({"point_key": p.key(), "backend": backend, "schedule": schedule, "status": "ok",
                           **p.as_dict(), **wl, "plan_info": info})
            stats.append({"point_key": p.key(), "backend": backend, "stage": "module", "statistic": "median_s",
                          "value": ms / 1e3})
    return Run(Path("fake"), {"timer": "cuda"}, pd.DataFrame(status), pd.DataFrame(stats), pd.DataFrame())


def test_the_crossover_is_where_sparse_starts_to_win():
    from msa_bench.harness.report.dense_crossover import crossover_table
    from msa_bench.roofline.devices import load_device
    dense_ms, sparse_ms, ctx = [1.0, 4.0, 16.0], [2.0, 2.0, 2.0], [2048, 8192, 32768]
    run = _fake_run(dense_ms, sparse_ms, ctx, dense_info='{"model": {"paged": true}}')
    row = crossover_table(run, load_device("h200")).iloc[0]
    assert row["regime"] == "decode 16 x 1" and row["fastest sparse (largest context)"] == "kv-outer-cute"
    assert row["measured context"] == pytest.approx(4096)          # log-interpolated: 1 ms x 2 = 2 ms
    assert row["measured ratio"] == pytest.approx(2.0)
    paged = row["model context"]                                   # the model of the path that ran
    assert paged is not None and 2048 <= paged <= 32768            # 16 requests: the model crosses in range
    gathered = crossover_table(_fake_run(dense_ms, sparse_ms, ctx), load_device("h200")).iloc[0]["model context"]
    assert gathered is None or gathered < paged                    # the gather only makes dense slower
    never = crossover_table(_fake_run([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [2048, 8192, 32768]), None).iloc[0]
    assert never["measured context"] is None and "dense-masked faster" in never["how"]


def test_the_crossover_figure_is_drawn():
    from msa_bench.harness.report.dense_crossover import crossover_figures
    figs = crossover_figures(_fake_run([1.0, 4.0, 16.0], [2.0, 2.0, 2.0], [2048, 8192, 32768]), None)
    assert [name for name, _ in figs] == ["dense_crossover_bf16.png"]
    # the measured crossover (a whole number of tokens) is drawn as a vertical line at 4096
    labels = [line.get_label() for ax in figs[0][1].axes for line in ax.get_lines()]
    assert any(label.startswith("measured crossover") and label.endswith(" 4.0K") for label in labels), labels


# ---- the commands --------------------------------------------------------------------------------

def test_workload_command_prints_the_drift_against_its_closed_form(cli):
    code, out, _ = cli("workload", "--generator", "drift", "--drift", "0.07", "--tokens", "2048", "--context",
                       "32768", "--json")
    assert code == 0
    import json
    st = json.loads(out)
    assert st["generator"] == "drift" and st["union_ratio_p8"] == pytest.approx(st["target_union_ratio"], rel=0.05)


@pytest.mark.parametrize("args, option", [
    (["--generator", "decode"], "--requests"),
    (["--generator", "decode", "--requests", "4", "--causal"], "--causal"),
    (["--generator", "synthetic", "--drift", "0.1"], "--drift"),
    (["--generator", "mixed", "--requests", "4", "--chunks", "0"], "--chunks"),
    (["--generator", "decode", "--requests", "4", "--query-tokens", "8"], "--query-tokens"),
])
def test_workload_command_refuses_bad_serving_options(cli, one_error_line, args, option):
    code, _, err = cli("workload", *args)
    assert code == 2
    assert option in one_error_line(err)


def test_check_command_runs_dense_masked_on_a_mixed_step(cli):
    code, out, _ = cli("check", "--backend", "dense-masked", "--generator", "mixed", "--requests", "5", "--tokens",
                       "24", "--drift", "0.1", "--dtype", "bf16")
    assert code == 0, out
    assert "mixed/C1x24/R5x1" in out and out.strip().splitlines()[-1].endswith("PASS")
