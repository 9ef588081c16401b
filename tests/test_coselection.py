"""Co-selection: the union_ratio statistic on hand-made selections, the generator's share axis (share and
reuse both hit, or one line names the feasible ranges), the q-packed terms of the model on a case
computed by hand, the `roofline` winner table and its JSON, and the quantization each backend states."""
import json
import math
import re
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from msa_bench.errors import UserError
from msa_bench.roofline.devices import PRESETS, load_device
from msa_bench.roofline.model import (ModelShape, packed_crossover, predict, traffic, union_ratio_floor,
                                      useful_flops)
from msa_bench.scenarios.coselection import (coselected_selection, coselected_workload, implied_union_ratio,
                                             plan_coselection)
from msa_bench.scenarios.grid import Point, load_scenario, make_workload, parse_scenario
from msa_bench.scenarios.selection import check_selection
from msa_bench.scenarios.stats import union_ratio, workload_stats
from msa_bench.scenarios.workload import AttnShape, WorkloadError

# ---- the statistic -------------------------------------------------------------------------------


def sel_of(rows):
    """[Hkv = 1, N, topk] from per-token lists (-1 padding)."""
    return torch.tensor([rows], dtype=torch.int32)


def test_union_ratio_by_hand():
    # P = 2: tile {t0, t1} selects {0, 1, 2} (3 blocks x 2 tokens), tile {t2} selects {5} (1 x 1);
    # the tokens select 2 + 2 + 1 valid blocks: (6 + 1) / 5
    sel = sel_of([[0, 1], [1, 2], [5, -1]])
    assert union_ratio(sel, torch.zeros(3), 2) == pytest.approx(7 / 5)
    assert union_ratio(sel, torch.zeros(3), 1) == 1.0                        # a token alone: always 1
    # every token of a tile selects alike: 1; every token its own blocks: P
    assert union_ratio(sel_of([[3, 4]] * 8), torch.zeros(8), 8) == 1.0
    assert union_ratio(sel_of([[2 * t, 2 * t + 1] for t in range(8)]), torch.zeros(8), 8) == 8.0
    assert union_ratio(sel_of([[-1, -1]] * 3), torch.zeros(3), 8) is None


def test_union_ratio_tiles_stay_within_a_request_and_a_kv_head():
    # a tile holds consecutive tokens of one request: interleaved requests leave every token alone; the
    # same block id in two requests (or two KV heads) is not shared
    sel = sel_of([[7], [7], [7], [9]])
    assert union_ratio(sel, torch.tensor([0, 1, 0, 1]), 2) == 1.0
    assert union_ratio(sel, torch.tensor([0, 0, 1, 1]), 2) == pytest.approx((2 * 1 + 2 * 2) / 4)
    assert union_ratio(sel, torch.tensor([0, 1, 1, 2]), 2) == 1.0
    two_heads = torch.tensor([[[1], [1]], [[1], [2]]], dtype=torch.int32)        # [Hkv 2, N 2, topk 1]
    assert union_ratio(two_heads, torch.zeros(2), 2) == pytest.approx((2 * 1 + 2 * 2) / 4)


def test_causal_union_ratio_tiles_are_windows_of_positions():
    # positions 6..9 at P = 4: tiles {6, 7} and {8, 9}, not {6..9}
    sel = sel_of([[1], [2], [3], [3]])
    q_limit = torch.arange(6, 10)
    assert union_ratio(sel, torch.zeros(4), 4, q_limit=q_limit, causal=True) == pytest.approx((2 * 2 + 2 * 1) / 4)
    assert union_ratio(sel, torch.zeros(4), 4, padded=True, q_limit=q_limit, causal=True) == pytest.approx(
        (4 * 2 + 4 * 1) / 4)
    assert union_ratio(sel, torch.zeros(4), 4) == pytest.approx(4 * 3 / 4)


def test_union_ratio_matches_a_loop_and_is_fast():
    gen = torch.Generator().manual_seed(0)
    sel = torch.randint(-1, 40, (3, 61, 5), generator=gen, dtype=torch.int32)
    req = torch.repeat_interleave(torch.tensor([0, 1, 0, 2]), torch.tensor([20, 17, 5, 19]))
    for p in (3, 8):
        num, start = 0, 0
        while start < 61:                   # tiles: up to p consecutive tokens of one request
            end = start + 1
            while end < 61 and end - start < p and req[end] == req[start]:
                end += 1
            for h in range(3):
                b = sel[h, start:end]
                num += (end - start) * b[b >= 0].unique().numel()
            start = end
        assert union_ratio(sel, req, p) == pytest.approx(num / int((sel >= 0).sum()))
    big = torch.randint(0, 1024, (4, 16384, 16), generator=gen, dtype=torch.int32)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        union_ratio(big, torch.zeros(16384, dtype=torch.int32), 8)
        best = min(best, time.perf_counter() - start)
    assert best < 1.0, f"union_ratio took {best:.2f} s"


def test_workload_stats_store_union_ratio_at_8_and_16():
    w = coselected_workload(AttnShape(), "bf16", 1024, 65536, 0.5, 0.5, with_tensors=False)
    st_ = workload_stats(w, "h200")
    assert st_["union_ratio_p8"] == pytest.approx(4.5) == st_["target_union_ratio"]
    assert 4.5 < st_["union_ratio_p16"] <= 16
    assert st_["pred_q-packed_s"] > 0 and st_["packed_crossover_union_ratio"] > 1


# ---- the generator axis --------------------------------------------------------------------------

def distinct_pairs(sel: torch.Tensor) -> int:
    head = torch.arange(sel.shape[0]).view(-1, 1, 1).expand_as(sel)
    valid = sel >= 0
    return torch.unique(head[valid].long() * 10**7 + sel[valid].long()).numel()


@st.composite
def coselection_case(draw):
    hkv = draw(st.sampled_from([1, 2, 4]))
    shape = AttnShape(hq=hkv, hkv=hkv, head_dim=8, block=draw(st.sampled_from([4, 8, 16])),
                      topk=draw(st.integers(2, 8)))
    causal = draw(st.booleans())
    tokens = draw(st.integers(1, 96))
    context = tokens + draw(st.integers(0, 900)) if causal else draw(st.integers(1, 900))
    k = shape.topk - 1 if causal else shape.topk
    n_local = (context - 1) // shape.block - (context - tokens) // shape.block + 1 if causal else 0
    # nsb an integer, so nsb/N is exact: what is asked is what can be hit
    nsb = hkv * n_local + draw(st.integers(1, hkv * (max(k, 1) * 12 + 4)))
    return dict(shape=shape, tokens=tokens, context=context, reuse=nsb / tokens, causal=causal,
                share=draw(st.sampled_from([0.0, 0.25, 0.5, 0.8, 1.0, draw(st.floats(0, 1))])),
                group=draw(st.sampled_from([1, 2, 4, 8, 16])), skew=draw(st.sampled_from([0.0, 1.0])),
                seed=draw(st.integers(0, 2**31)))


def _measure(c, reuse, share):
    sel, q_limit = coselected_selection(c["shape"], c["tokens"], c["context"], reuse, share, c["group"], c["skew"],
                                        c["causal"], c["seed"])
    check_selection(sel, q_limit, c["shape"].block, c["causal"])
    return distinct_pairs(sel) / c["tokens"], union_ratio(sel, torch.zeros(c["tokens"]), c["group"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(coselection_case())
def test_share_and_reuse_hit_or_the_error_names_the_feasible_ranges(c):
    args = (c["shape"], c["tokens"], c["context"])
    try:
        reuse, union = _measure(c, c["reuse"], c["share"])
    except WorkloadError as exc:
        msg = str(exc)
        assert "\n" not in msg and isinstance(exc, UserError)
        at_share = re.search(r"feasible reuse at share \S+ is (\S+) to (\S+);", msg)
        at_reuse = re.search(r"feasible share at reuse \S+ is (\S+) to (\S+)$", msg)
        assert at_share or at_reuse or "no reuse" in msg or "no share" in msg, msg
        if at_share:                                      # (ranges printed to 4 significant digits)
            lo, hi = float(at_share[1]), float(at_share[2])
            assert not lo * 1.001 < c["reuse"] < hi * 0.999
            # the named range is real: its upper end can be generated at this share
            nsb_hi = round(hi * c["tokens"])
            if abs(nsb_hi - hi * c["tokens"]) < 1e-6:
                got, _ = _measure(c, nsb_hi / c["tokens"], c["share"])
                assert got == pytest.approx(nsb_hi / c["tokens"])
        if at_reuse:
            lo, hi = float(at_reuse[1]), float(at_reuse[2])
            assert not lo * 1.001 < c["share"] < hi * 0.999
            _measure(c, c["reuse"], hi)                  # the named share range is feasible at this reuse
        return
    want_union = implied_union_ratio(*args, c["share"], c["group"], c["causal"])
    assert abs(reuse - c["reuse"]) <= 0.05 * c["reuse"]
    assert abs(union - want_union) <= 0.05 * want_union
    assert plan_coselection(*args, c["reuse"], c["share"], c["group"], c["causal"])["nsb"] == round(reuse * c["tokens"])


def test_study_scale_hits_both_targets_exactly():
    shape = AttnShape()
    for share, want in [(0.0, 8.0), (0.5, 4.5), (1.0, 1.0)]:
        sel, _ = coselected_selection(shape, 16384, 131072, 0.25, share)
        assert distinct_pairs(sel) == 4096
        assert union_ratio(sel, torch.zeros(16384), 8) == want == implied_union_ratio(shape, 16384, 131072, share)


@pytest.mark.parametrize("kwargs, message", [
    (dict(reuse=2.0, share=0.0), "feasible reuse at share 0 is 0.03125 to 0.25"),
    (dict(reuse=8.0, share=0.5, tokens=16), "feasible share at reuse 8 is 0.875 to 1"),
    (dict(reuse=0.25, share=1.5), "between 0 and 1"),
    (dict(reuse=0.25, share=0.5, group=0), "positive integer"),
])
def test_infeasible_share_is_one_line(kwargs, message):
    kw = dict(tokens=16384, context=131072, group=8) | kwargs
    with pytest.raises(WorkloadError) as exc:
        plan_coselection(AttnShape(), kw["tokens"], kw["context"], kw["reuse"], kw["share"], kw["group"])
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_point_key_names_share_only_when_set():
    plain = Point("synthetic", 8192, 1048576, 0.25, 0.0, False, "bf16", 0, None, 1.0, AttnShape())
    assert "share" not in plain.key() and plain.as_dict()["share"] is None
    shared = Point("synthetic", 8192, 1048576, 0.25, 0.0, False, "bf16", 0, None, 1.0, AttnShape(), 0.5, 8)
    assert shared.key() == ("synthetic/N8192/T1048576/reuse0.25/skew0/share0.5-G8/noncausal/bf16/seed0/"
                            "hq64-hkv4-d128-b128-top16")
    w = make_workload(shared, with_tensors=False)
    assert w.meta["share"] == 0.5 and workload_stats(w)["union_ratio_p8"] == pytest.approx(4.5)


GRID = """
description = "a co-selection grid"
backends = ["kv-outer"]
[shape]
hq = 4
hkv = 2
head_dim = 16
block = 8
topk = 4
[grid]
generator = "synthetic"
tokens = 32
context = 512
reuse = 2.0
"""


def test_scenario_share_axis():
    import tomllib
    s = parse_scenario(tomllib.loads(GRID + "share = [0.0, 1.0]\nshare_group = [2, 4]\n"), "t.toml", "t")
    assert sorted((p.share, p.share_group) for p in s.points) == [(0.0, 2), (0.0, 4), (1.0, 2), (1.0, 4)]
    s = parse_scenario(tomllib.loads(GRID + "share = 0.5\n"), "t.toml", "t")
    assert [p.share_group for p in s.points] == [8]
    plain = parse_scenario(tomllib.loads(GRID), "t.toml", "t")
    assert plain.points[0].share is None and "share" not in plain.points[0].key()
    for extra, why in [("share_group = 4\n", "needs share"), ("share = 2.0\n", "between 0 and 1"),
                       ("share = 0.0\nshare_group = 64\n", "grid.share")]:
        with pytest.raises(UserError, match=why):
            parse_scenario(tomllib.loads(GRID + extra), "t.toml", "t")


def test_shipped_co_selection_scenario():
    s = load_scenario("co-selection")
    assert {p.dtype for p in s.points} == {"bf16", "fp8"} and s.shape == AttnShape(64, 4, 128, 128, 16)
    assert {(p.tokens, p.context, p.reuse, p.share_group) for p in s.points} == {(16384, 131072, 0.25, 8)}
    assert 5 <= len({p.share for p in s.points}) <= 7 and {0.0, 1.0} <= {p.share for p in s.points}
    assert {"kv-outer", "kv-outer-cute", "flashinfer", "msa-scatter"} <= set(s.backends)


def test_workload_cli_share(cli, one_error_line):
    code, out, err = cli("workload", "--json", "--tokens", "2048", "--context", "65536", "--reuse", "0.5",
                         "--share", "0.75", "--share-group", "4")
    assert code == 0, err
    data = json.loads(out)
    # groups of 4 sharing 12 of 16: (12 + 4 x 4) / 16 at P = 4; at P = 8 two groups meet
    assert data["target_union_ratio"] == pytest.approx(1.75) and data["nsb_per_n"] == pytest.approx(0.5)
    assert 1.75 < data["union_ratio_p8"] <= 3.5
    code, out, err = cli("workload", "--tokens", "2048", "--context", "65536", "--share", "1")
    assert code == 0 and "union_ratio" in out and "q-packed" in out, err
    code, _, err = cli("workload", "--tokens", "2048", "--context", "65536", "--reuse", "8", "--share", "0")
    assert code == 2 and "feasible reuse at share 0" in one_error_line(err)
    code, _, err = cli("workload", "--generator", "indexer", "--share", "0.5")
    assert code == 2 and "--share does not apply to --generator indexer" in one_error_line(err)


# ---- the model -----------------------------------------------------------------------------------

SMALL = ModelShape(hq=4, hkv=2, head_dim=8, block=4, topk=2, dtype="bf16")


def test_q_packed_terms_by_hand():
    # N = 4, nsb = 4, P = 2, union_ratio 1.5: triples = 4 x 2 x 2 = 16, one K+V block = 2 x 4 x 8 x 2 B
    # = 128 B; union blocks over (tile, KV head) = 16 x 1.5 / 2 = 12; tiles x KV heads = 2 x 2 = 4
    hbm, l2 = traffic("q-packed", SMALL, 4, 4, union_ratio=1.5, tile_tokens=2)
    index = 12 * 4 + 4 * 4 + 12 * 2 / 8                 # block ids, tile pointers, a token mask bit each
    assert hbm == {"q_read": 4 * 4 * 8 * 2, "kv_read": 4 * 128, "out_write": 4 * 4 * 8 * 2, "index": index}
    assert l2 == {**hbm, "kv_read": 12 * 128}
    dev = PRESETS["h200"]
    p = predict("q-packed", SMALL, 4, 4, dev, union_ratio=1.5, tile_tokens=2)
    useful = 4 * 4 * 8 * 2 * 4 * 4
    assert p.flops == useful == useful_flops(SMALL, 4) and p.executed_flops == 1.5 * useful
    assert p.mma_s == pytest.approx(1.5 * useful / dev.peak_flops("bf16"))
    assert p.time_s == max(p.hbm_s, p.l2_s, p.mma_s)
    assert p.l2_s == pytest.approx((256 + 512 + 256 + index + 12 * 128 - 512) / dev.l2_bytes_per_s)


def test_q_packed_at_the_extremes():
    dev, shape, n = PRESETS["h200"], ModelShape(), 16384
    # union_ratio P: every token its own blocks, the L2 bytes of Q-outer's K/V
    assert traffic("q-packed", shape, n, 4096, union_ratio=8)[1]["kv_read"] == traffic("q-outer", shape, n, 4096)[1]["kv_read"]
    # no partials and no combine at any union_ratio; time grows with union_ratio
    hbm, _ = traffic("q-packed", shape, n, 4096, union_ratio=2)
    assert not {"partial_write", "partial_read", "stats_write", "stats_read"} & set(hbm)
    times = [predict("q-packed", shape, n, 4096, dev, union_ratio=u).time_s for u in (1, 2, 4, 8)]
    assert times == sorted(times)
    assert union_ratio_floor(shape, 16.0) == 2.0 and union_ratio_floor(shape, 0.25) == 1.0


def test_packed_crossover_is_where_the_times_meet():
    dev, shape, n = PRESETS["h200"], ModelShape(dtype="fp8"), 16384
    u = packed_crossover(shape, dev, n, 0.25)
    assert 1 < u < 8
    kv = predict("kv-outer", shape, n, 0.25 * n, dev).time_s
    assert predict("q-packed", shape, n, 0.25 * n, dev, union_ratio=u * 0.999).time_s < kv
    assert predict("q-packed", shape, n, 0.25 * n, dev, union_ratio=u * 1.001).time_s >= kv


def test_roofline_json_and_table_show_the_co_selection_winner(cli):
    code, out, err = cli("roofline", "--json", "--device", "h200", "--dtype", "bf16")
    assert code == 0, err
    co = json.loads(out)["co_selection"]
    assert co["tile_tokens"] == 8 and co["schedules"] == ["kv-outer", "q-outer", "q-packed"]
    dev, shape = load_device("h200"), ModelShape(dtype="bf16")   # --device h200: its calibrated profile
    for row in co["rows"]:
        r = row["nsb_per_n"]
        for cell in row["cells"]:
            assert cell["feasible"] == (union_ratio_floor(shape, r) <= cell["union_ratio"] <= 8)
            if cell["feasible"]:
                times = {s: predict(s, shape, 16384, r * 16384, dev, union_ratio=cell["union_ratio"]).time_s
                         for s in co["schedules"]}
                assert cell["winner"] == min(times, key=times.get)
                assert cell["tflops"] == pytest.approx(useful_flops(shape, 16384) / times[cell["winner"]] / 1e12)
        cross = packed_crossover(shape, dev, 16384, r)
        assert row["q_packed_beats_kv_outer_below_union_ratio"] == (cross if cross and math.isfinite(cross)
                                                                     else None)
    assert co["rows"][0]["cells"][0]["winner"] == "q-packed"              # all alike: no partials, no re-reads
    assert co["rows"][0]["cells"][-1]["winner"] == "kv-outer"             # union_ratio 8: Q-outer's re-reads
    code, out, err = cli("roofline", "--device", "h200", env={"COLUMNS": "80"})
    assert code == 0, err
    table = out[out.index("Predicted winner"):]
    assert "QP" in table and "KV" in table and "QP < u" in table
    assert max(len(line) for line in table.splitlines()) <= 80


# ---- quantization statements ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype, stated", [("fp16", "none (fp16 Q/K/V/P)"), ("fp8", "e4m3 Q/K/V/P on fp8 MMA")])
def test_kv_outer_states_what_it_quantizes(dtype, stated):
    from msa_bench.kernels.base import get_backend
    from msa_bench.scenarios.selection import synthetic_workload
    w = synthetic_workload(AttnShape(hq=4, hkv=2, head_dim=16, block=16, topk=2), dtype, 8, 128, 0.5)
    for name in ("kv-outer", "msa-scatter", "reference"):
        backend = get_backend(name)
        if backend.unavailable_reason(dtype, w.device):
            continue
        info = backend.plan(w).info
        assert info["quantization"] == (stated if name != "reference" else
                                        "none (float32 compute on the stored values)")


# ---- the report ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def co_run(tmp_path_factory, cli):
    """A tiny co-selection sweep measured here on the CPU (reference and the Triton KV-outer in the
    interpreter): three shares at one reuse."""
    toml = tmp_path_factory.mktemp("scn") / "tiny-co.toml"
    toml.write_text('description = "tiny co-selection"\nbackends = ["kv-outer", "reference"]\n'
                    '[shape]\nhq = 4\nhkv = 2\nhead_dim = 32\nblock = 16\ntopk = 4\n[timing]\nreps = 2\nwarmup = 0\n'
                    '[grid]\ngenerator = "synthetic"\ntokens = 64\ncontext = 1024\nreuse = 1.0\n'
                    'share = [0.0, 0.5, 1.0]\ndtypes = "fp16"\n')
    out = tmp_path_factory.mktemp("co") / "run"
    code, _, err = cli("sweep", "--scenario", toml, "--out", out)
    assert code == 0, err
    return out


def test_report_plots_throughput_against_co_selection(co_run, cli, tmp_path):
    from msa_bench.harness.report import tables
    from msa_bench.harness.store.results import load_run
    run = load_run(co_run)
    t = tables.throughput_table(run)
    # groups of 8 sharing s = 0, 2, 4 of 4 blocks: (s + 8 (4 - s)) / 4
    assert sorted(t["union_ratio P8"].unique()) == [1.0, 4.5, 8.0]
    cols = list(t.columns)
    assert cols.index("max rel err") == cols.index("TFLOP/s") + 1 and cols[cols.index("max rel err") + 1] == "quantization"
    assert set(t.loc[t["backend"] == "kv-outer", "quantization"]) == {"none (fp16 Q/K/V/P)"}
    assert (t["max rel err"] >= 0).all()
    acc = tables.accuracy_table(run).set_index("backend")
    assert acc.loc["kv-outer", "checked units"] == 3 and acc.loc["kv-outer", "max rel err (worst)"] < 1e-2
    code, _, err = cli("report", co_run, "--out", tmp_path, "--device", "h200")
    assert code == 0, err
    summary = (tmp_path / "summary.md").read_text()
    assert "union_ratio P8" in summary and "## Accuracy" in summary and "none (fp16 Q/K/V/P)" in summary
    figs = sorted(p.name for p in tmp_path.glob("coselection_*.png"))
    assert figs and all(f"![{f}]({f})" in summary for f in figs)


def test_roofline_picks_take_q_packed_at_its_union_ratio(co_run, tmp_path):
    """The CPU run has no q-packed backend (FlashInfer needs a GPU): on a copy whose reference units are
    relabelled q-packed (a label change for this logic test only), each point's pick is the schedule whose
    roofline at the point's measured union_ratio is fastest."""
    import shutil

    from msa_bench.harness.report import tables
    from msa_bench.harness.store.results import load_run
    from msa_bench.harness.store.seal import seal_unit
    run_dir = tmp_path / "relabelled"
    shutil.copytree(co_run, run_dir)
    for unit in (run_dir / "units").glob("reference-*"):
        status = json.loads((unit / "status.json").read_text())
        status["schedule"] = "q-packed"
        (unit / "status.json").write_text(json.dumps(status))
        seal_unit(unit)
    dev = PRESETS["h200"]
    table, summary = tables.roofline_picks(load_run(run_dir), dev)
    assert summary["cases"] == 3 and set(table["union_ratio P8"]) == {1.0, 4.5, 8.0}
    t = tables.ok_units(load_run(run_dir))
    for case in table.itertuples():
        g = t[t["point_key"] == case.case]
        model = {s: tables.model_time(g[g["schedule"] == s].iloc[0], s, dev) for s in ("kv-outer", "q-packed")}
        row = g[g["schedule"] == "q-packed"].iloc[0]
        shape = tables.row_model_shape(row)
        want = predict("q-packed", shape, row["wl_n_tokens"], row["wl_nsb"], dev, flops=row["wl_useful_flops"],
                       selected_per_query=row["wl_selected_blocks_per_query"], union_ratio=row["wl_union_ratio_p8"])
        assert model["q-packed"] == pytest.approx(want.time_s)
        assert case.predicted == min(model, key=model.get)
    from msa_bench.harness.report.summary import write_report
    summary_md = write_report(run_dir, tmp_path / "rep", dev).read_text()     # q-packed curves in every figure
    assert "## Roofline picks" in summary_md and "| q-packed |" in summary_md
    # a run that varies co-selection is drawn along u (harness/report/axes.py), not along reuse
    assert list((tmp_path / "rep").glob("coselection_*.png")) and not list((tmp_path / "rep").glob("throughput_*.png"))
