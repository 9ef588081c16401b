import json
import math

import pytest

from msa_bench.roofline.devices import PRESETS, load_device, preset, profile_for_gpu
from msa_bench.roofline.model import (ModelShape, crossover, crossover_at, crossover_numeric, predict, traffic,
                                      useful_flops)
from msa_bench.roofline.shape import AttnShape, ShapeError

SMALL = ModelShape(hq=4, hkv=2, head_dim=8, block=4, topk=2, dtype="bf16")


def test_the_model_shape_is_the_attention_shape_with_model_terms():
    assert ModelShape.of(AttnShape(hq=4, hkv=2, head_dim=8, block=4, topk=2), dtype="bf16") == SMALL
    assert ModelShape.of(SMALL, dtype="fp8").q_live_heads == 1 and SMALL.group == 2
    with pytest.raises(ShapeError, match="multiple of hkv"):
        ModelShape(hq=6, hkv=4)


def test_byte_terms_hand_computed_small_shape():
    # N = 3 tokens, nsb = 4: edges = 3 x 2 x 2 = 12, one K+V block = 2 x 4 x 8 x 2 B = 128 B
    hbm, l2 = traffic("q-outer", SMALL, 3, 4)
    assert hbm == {"q_read": 192, "kv_read": 512, "out_write": 192, "index": 12 * 4 + 3 * 2 * 3 * 4}
    assert l2["kv_read"] == 12 * 128
    hbm, l2 = traffic("kv-outer", SMALL, 3, 4)
    assert hbm["partial_write"] == hbm["partial_read"] == 12 * 2 * 8 * 2
    assert hbm["stats_write"] == hbm["stats_read"] == 12 * 2 * 2 * 4
    assert hbm["kv_read"] == 512 and hbm["q_read"] == 192 and hbm["index"] == 12 * 4 * 5
    assert l2["q_read"] == 12 * 2 * 8 * 2 and l2["kv_read"] == 512
    hbm_s, _ = traffic("msa-scatter", SMALL, 3, 4)
    assert hbm_s["stats_write"] == 12 * 2 * 1 * 4
    assert useful_flops(SMALL, 3) == 4 * 4 * 8 * 2 * 4 * 3


def test_grouped_order_reloads_kv_once_per_query_range_hit():
    """q_ranges S: a block's K/V is read once per range its f queries hit, S (1 - (1 - 1/S)^f) of them
    for queries spread uniformly (N 3, nsb 4: f = 12 / 4 = 3; S 2 -> 2 (1 - 1/8) = 1.75 ranges)."""
    from dataclasses import replace
    hbm, l2 = traffic("kv-outer", replace(SMALL, q_ranges=2), 3, 4)
    assert hbm["kv_range_reread"] == pytest.approx(512 * 0.75) and l2["kv_range_reread"] == hbm["kv_range_reread"]
    many, _ = traffic("kv-outer", replace(SMALL, q_ranges=4), 4096, 4)
    assert many["kv_range_reread"] == pytest.approx(512 * 3)      # every range hit: 3 extra reads per block
    assert "kv_range_reread" not in traffic("kv-outer", SMALL, 3, 4)[0]


@pytest.mark.parametrize("schedule", ["q-outer", "kv-outer", "msa-scatter"])
def test_monotonic_in_nsb(schedule):
    dev = PRESETS["h200"]
    shape = ModelShape()
    last = None
    for nsb in [0, 64, 512, 4096, 32768, 262144]:
        p = predict(schedule, shape, 16384, nsb, dev)
        if last is not None:
            assert p.hbm_bytes >= last.hbm_bytes and p.l2_bytes >= last.l2_bytes and p.time_s >= last.time_s
        last = p


@pytest.mark.parametrize("device", list(PRESETS))
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_closed_form_crossover_equals_numeric(device, dtype):
    shape = ModelShape(dtype=dtype)
    dev = PRESETS[device]
    closed, numeric = crossover(shape, dev), crossover_numeric(shape, dev)
    assert math.isfinite(closed) and closed > 0
    assert closed == pytest.approx(numeric, rel=1e-9)
    # just below the crossover KV-outer wins, just above it loses (capacity-free model)
    n = 16384
    below = predict("kv-outer", shape, n, 0.99 * closed * n, dev, l2_capacity=False).time_s
    assert below < predict("q-outer", shape, n, 0.99 * closed * n, dev, l2_capacity=False).time_s
    above = predict("kv-outer", shape, n, 1.01 * closed * n, dev, l2_capacity=False).time_s
    assert above > predict("q-outer", shape, n, 1.01 * closed * n, dev, l2_capacity=False).time_s


def test_b200_fp8_crossover_matches_the_study():
    r = crossover(ModelShape(dtype="fp8", partial_dtype="bf16"), load_device("b200"))
    assert 2.65 <= r <= 3.05


def test_binding_resources_follow_the_study():
    dev, shape = PRESETS["b200"], ModelShape(dtype="fp8")
    assert predict("q-outer", shape, 16384, 1024, dev, l2_capacity=False).binding == "l2"
    assert predict("kv-outer", shape, 16384, 1024, dev, l2_capacity=False).binding == "hbm"


def test_l2_capacity_adds_hbm_rereads_only_past_l2():
    dev, shape = PRESETS["h200"], ModelShape()
    small = predict("q-outer", shape, 2048, 64, dev)        # 64 blocks x 64 KiB = 4 MiB: fits
    assert "kv_l2_miss_reread" not in small.hbm_terms
    big = predict("q-outer", shape, 16384, 4096, dev)       # 256 MiB working set
    assert big.hbm_terms["kv_l2_miss_reread"] > 0 and big.binding == "hbm"
    assert crossover_at(shape, dev, 16384) >= crossover(shape, dev)


def test_only_blocks_read_more_than_once_and_one_heads_blocks_make_the_reread_working_set():
    """q-packed's misses: the re-reads compete for one KV head's shared blocks (the tile list is head-major);
    blocks one token selects (a mixed step's decode tokens) are read once and take no part."""
    from msa_bench.roofline.model import decode_work_share
    dev, shape = PRESETS["h200"], ModelShape()
    n, nsb = 16384, 16384 * 0.25                       # 4096 blocks x 64 KiB = 256 MiB, 64 MiB a head
    p = predict("q-packed", shape, n, nsb, dev, union_ratio=2.0)
    kv_tiles = n * 4 * 16 * 2.0 / 8 * 65536
    assert p.hbm_terms["kv_l2_miss_reread"] == pytest.approx((kv_tiles - nsb * 65536) * (1 - 30 / 64))
    few = predict("q-packed", shape, n, nsb, dev, union_ratio=2.0, shared_nsb=1024)   # 16 MiB a head: fits
    assert "kv_l2_miss_reread" not in few.hbm_terms
    assert few.hbm_terms["kv_read"] == p.hbm_terms["kv_read"]               # read once all the same
    q = predict("q-outer", shape, n, nsb, dev, shared_nsb=256)
    assert "kv_l2_miss_reread" not in q.hbm_terms
    # the decode share of a step's work: of the HBM bytes where HBM binds (K/V blocks by kv_share, per-token
    # terms by the token share, re-reads none), of the tokens elsewhere
    k = predict("kv-outer", shape, n, nsb, dev)
    t = k.hbm_terms
    assert k.binding == "hbm" and "kv_range_reread" not in t
    share = (t["kv_read"] * 0.9 + (sum(t.values()) - t["kv_read"]) * 0.1) / sum(t.values())
    assert decode_work_share(k, 0.1, 0.9) == pytest.approx(share) and decode_work_share(k, 0.1, None) == 0.1
    # re-reads are none of a decode token's work
    assert p.binding == "hbm" or decode_work_share(p, 0.1, 0.9) == 0.1
    mma = predict("q-packed", shape, n, 64, dev, union_ratio=1.0)
    assert mma.binding == "mma" and decode_work_share(mma, 0.1, 0.9) == 0.1


def test_profile_roundtrip_and_errors(tmp_path):
    path = tmp_path / "p.json"
    PRESETS["h200"].to_json(path)
    assert load_device(str(path)) == PRESETS["h200"]
    assert profile_for_gpu("NVIDIA H200") == preset("h200")      # with the committed calibration, where one is
    from msa_bench.errors import UserError
    with pytest.raises(UserError, match="unknown device"):
        load_device("tpu")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_device(str(bad))
    data = json.loads(path.read_text())
    data["hbm_bytes_per_s"] = -1
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError, match="positive"):
        load_device(str(bad))


def test_l2_capacity_rule_hand_computed():
    dev, shape = PRESETS["h200"], ModelShape()
    # Q-outer: working set = 4096 selected blocks x 64 KiB = 256 MiB; effective capacity = half of 60 MiB
    p = predict("q-outer", shape, 16384, 4096, dev)
    rereads = 16384 * 4 * 16 * 65536 - 4096 * 65536
    assert p.hbm_terms["kv_l2_miss_reread"] == pytest.approx(rereads * (1 - 30 / 256))
    # KV-outer: one KV head's Q (64 MiB) competes with the partial-O writes for the same half L2
    k = predict("kv-outer", shape, 16384, 4096, dev)
    q_gather = 16384 * 4 * 16 * 16 * 128 * 2
    partials = q_gather                       # bf16 partials and bf16 Q rows have the same size
    share = q_gather / (q_gather + partials)
    q_bytes = 16384 * 64 * 128 * 2
    miss = 1 - 30 * 2**20 * share / (q_bytes / 4)
    assert k.hbm_terms["q_l2_miss_reread"] == pytest.approx((q_gather - q_bytes) * miss)


def test_grouped_tile_order_shrinks_the_live_queries_only_when_ctas_walk_together():
    """q_ranges divides the Q working set of the L2-capacity term when the CTAs walk the grouped order
    together (a persistent order dealt in chunks or in phases, or chunked launches); contiguous persistent slices keep every
    head's queries live whatever q_ranges says."""
    from msa_bench.kernels.kv_outer.config import launch_terms
    from msa_bench.roofline.devices import load_device
    from msa_bench.roofline.model import ModelShape, traffic
    dev = load_device("h200")

    def q_miss(config):
        shape = ModelShape(hq=64, hkv=4, head_dim=128, block=128, topk=16, dtype="bf16", **launch_terms(4, "bf16", config))
        hbm, _ = traffic("kv-outer", shape, 16384, 4096, device=dev)
        return hbm.get("q_l2_miss_reread", 0.0)

    slices = q_miss({"attn_chunk": 0, "order_chunk": 0, "q_ranges": 4})
    dealt_1 = q_miss({"attn_chunk": 0, "order_chunk": 8, "q_ranges": 1})
    dealt_4 = q_miss({"attn_chunk": 0, "order_chunk": 8, "q_ranges": 4})
    chunked_4 = q_miss({"attn_chunk": 64, "q_ranges": 4})
    phased_1 = q_miss({"attn_chunk": 0, "order_chunk": 0, "order_phases": True, "q_ranges": 1})
    phased_4 = q_miss({"attn_chunk": 0, "order_chunk": 0, "order_phases": True, "q_ranges": 4})
    assert slices > dealt_1 > dealt_4 >= 0.0
    assert chunked_4 == dealt_4 and phased_4 == dealt_4 and phased_1 == dealt_1


def test_packed_crossover_is_one_number_per_dtype_everywhere(cli):
    """README, `msa-bench roofline` (either --dtype) and `msa-bench workload` quote the q-packed / KV-outer
    crossover from one function, with the dtype named."""
    import re
    from pathlib import Path
    from msa_bench.roofline.devices import load_device
    from msa_bench.roofline.model import packed_crossover_by_dtype
    u = packed_crossover_by_dtype(load_device("h200"), 16384, 0.25)
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert f"union_ratio of {u['bf16']:.2f} bf16 / {u['fp8']:.2f} fp8 at nsb/N 0.25, N 16384 on the H200" in readme
    for dtype in ("fp8", "bf16"):
        code, out, _ = cli("roofline", "--device", "h200", "--dtype", dtype)
        text = " ".join(out.split())
        assert code == 0 and f"below union_ratio (P = 8): bf16 {u['bf16']:.2f}, fp8 {u['fp8']:.2f}" in text
        assert re.search(rf"0\.25 .* {u[dtype]:.2f}", text)          # the table's QP < u column, this dtype
    code, out, _ = cli("workload", "--device", "h200", "--dtype", "fp8")
    assert code == 0 and f"{u['fp8']:.3g}" in out and "reuse (fp8)" in " ".join(out.replace("│", " ").split())


def test_q_outer_rereads_inside_its_window_hit_the_l2():
    """Tokens that select alike re-read their blocks within the window: only the window's union can miss."""
    from msa_bench.roofline.model import Q_OUTER_WINDOW, traffic
    shape, dev = ModelShape(), PRESETS["h200"]
    n, nsb = 16384, 16384 * 0.25
    none, _ = traffic("q-outer", shape, n, nsb, device=dev)
    alike, _ = traffic("q-outer", shape, n, nsb, device=dev, union_ratio=1.0, tile_tokens=Q_OUTER_WINDOW)
    apart, _ = traffic("q-outer", shape, n, nsb, device=dev, union_ratio=Q_OUTER_WINDOW, tile_tokens=Q_OUTER_WINDOW)
    assert apart["kv_l2_miss_reread"] == pytest.approx(none["kv_l2_miss_reread"])
    assert alike["kv_l2_miss_reread"] < none["kv_l2_miss_reread"] / 10


def test_a_wide_packed_plan_is_predicted_at_the_8_token_traffic_and_its_critical_walk():
    """A q-packed plan of a tile size the workload statistics do not hold (q-packed-cute's 12-token tiles)
    is predicted with the 8-token tiles' traffic and the MMAs of its critical walk, as its plan records
    them; an 8-token plan without a recorded walk runs its MMAs at the statistics' ratio at its MMA tokens.
    A schema-1 row's plan_info gives the same record (harness/store/migrate.py)."""
    from msa_bench.harness.store.migrate import record_of
    from msa_bench.roofline.predict import schedule_roofline
    dev = load_device("h200")
    n = 16384
    stats = {"n_tokens": n, "nsb": n / 8, "useful_flops": 1.0e12, "selected_blocks_per_query": 16.0,
             "nsb_shared": n / 8, "union_ratio_p8": 1.0, "executed_union_ratio_p8": 1.0,
             "executed_union_ratio_p4": 1.1, "union_ratio_p16": 1.0, "executed_union_ratio_p16": 1.0}

    def pred(info):
        return schedule_roofline("q-packed", stats, record_of(info, {"backend": "q-packed-cute", "dtype": "fp8"}),
                                 dev, "fp8")

    eight = pred({"schedule": "q-packed", "tile_tokens": 8, "mma_tokens": 4})
    assert eight.executed_flops == pytest.approx(1.1e12)
    for tile in (8, 12):
        crit = pred({"schedule": "q-packed", "tile_tokens": tile, "mma_tokens": 4, "executed_union_ratio": 1.2,
                     "critical_union_ratio": 1.3})
        assert crit.executed_flops == pytest.approx(1.3e12) and crit.l2_bytes == pytest.approx(eight.l2_bytes)


def test_a_fraction_scales_only_the_terms_its_backend_names():
    """scaled_time: every term over the fraction is the roofline over it; a term left out (FlashInfer's HBM
    stream) runs at the device's rate, so where it binds the time is its bytes alone, not bytes / fraction."""
    from msa_bench.kernels.base import get_backend
    from msa_bench.roofline.model import fraction_roofline, scaled_time
    dev = PRESETS["h200"]
    unique = predict("q-outer", ModelShape(dtype="fp8"), 2048, 2048 * 64, dev)     # no block read twice
    assert unique.binding == "hbm" and unique.hbm_s > unique.l2_s
    assert scaled_time(unique, 0.34) == pytest.approx(unique.time_s / 0.34)
    terms = get_backend("flashinfer").fraction_terms
    assert "hbm" not in terms and fraction_roofline(unique, terms) == unique.l2_s
    assert scaled_time(unique, 0.34, terms) == pytest.approx(max(unique.hbm_s, unique.l2_s / 0.34))
    assert scaled_time(unique, 0.9, terms) == unique.hbm_s
