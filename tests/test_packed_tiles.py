"""The tile-packing planner against a plain Python oracle: tiles, unions, token bits and hit counts;
the fixed-size variant's padding, overflow count and freedom from device-to-host synchronisation."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from msa_bench.kernels.packed_tiles import max_tiles_bound, pack_tiles, plan_tiles, visible_selection
from msa_bench.scenarios.prefill_cases import PrefillCase, prefill_workload
from msa_bench.scenarios.tiling import tile_keys
from msa_bench.scenarios.workload import AttnShape


def oracle(ids: torch.Tensor, key: torch.Tensor, tile: int):
    """Tiles [(start, length)] and per (head, tile) {id: set of tile tokens that chose it}."""
    hkv, n, _ = ids.shape
    seg = key.tolist()
    tiles, i = [], 0
    while i < n:
        j = i
        while j < n and seg[j] == seg[i]:
            j += 1
        tiles += [(s, min(tile, j - s)) for s in range(i, j, tile)]
        i = j
    chosen = []
    for h in range(hkv):
        per_tile = []
        for start, length in tiles:
            picks: dict[int, set[int]] = {}
            for lane in range(length):
                for x in ids[h, start + lane].tolist():
                    if x >= 0:
                        picks.setdefault(x, set()).add(lane)
            per_tile.append(picks)
        chosen.append(per_tile)
    return tiles, chosen


@st.composite
def selections(draw):
    hkv = draw(st.integers(1, 3))
    k = draw(st.integers(1, 5))
    lens = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    n = sum(lens)
    causal = draw(st.booleans())
    tile = draw(st.sampled_from([1, 8, 16]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 12, (hkv, n, k), generator=gen)
    ids[torch.rand(hkv, n, k, generator=gen) < draw(st.sampled_from([0.0, 0.3, 0.9]))] = -1
    q_request = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    # causal: positions after a random prefix, so tiles are windows of P positions
    q_limit = torch.cat([torch.arange(ln) + int(torch.randint(0, 50, (1,), generator=gen)) for ln in lens])
    return ids, tile_keys(q_request, q_limit, tile, causal), tile


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(selections())
def test_pack_matches_oracle(case):
    ids, key, tile = case
    pack = pack_tiles(ids, key, tile)
    tiles, chosen = oracle(ids, key, tile)
    assert list(zip(pack.start.tolist(), pack.length.tolist())) == tiles
    assert int(pack.tile_count) == len(tiles)
    for h, per_tile in enumerate(chosen):
        for t, picks in enumerate(per_tile):
            keys = sorted(picks)
            c = int(pack.count[h, t])
            assert c == len(keys)
            assert pack.union[h, t, :c].tolist() == keys                   # ascending, distinct
            assert bool((pack.union[h, t, c:] == -1).all())
            assert pack.bits[h, t, :c].tolist() == [sum(1 << i for i in picks[x]) for x in keys]
            assert pack.hits[h, t, :c].tolist() == [len(picks[x]) for x in keys]
            assert bool((pack.bits[h, t, c:] == 0).all()) and bool((pack.hits[h, t, c:] == 0).all())
    # every token maps back to its tile and lane
    for t, (start, length) in enumerate(tiles):
        assert pack.token_tile[start:start + length].tolist() == [t] * length
        assert pack.token_slot[start:start + length].tolist() == list(range(length))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(selections(), st.integers(0, 6))
def test_fixed_size_plan_pads_and_counts(case, extra):
    ids, key, tile = case
    exact = pack_tiles(ids, key, tile)
    t = exact.num_tiles
    fixed = plan_tiles(ids, key, tile, t + extra)
    assert fixed.union.shape == (ids.shape[0], t + extra, tile * ids.shape[2])
    assert int(fixed.tile_count) == t
    assert torch.equal(fixed.start[:t], exact.start) and torch.equal(fixed.length[:t], exact.length)
    assert bool((fixed.length[t:] == 0).all()) and bool((fixed.count[:, t:] == 0).all())
    assert bool((fixed.union[:, t:] == -1).all())
    cap = exact.union.shape[-1]
    assert torch.equal(fixed.union[:, :t, :cap], exact.union) and torch.equal(fixed.bits[:, :t, :cap], exact.bits)
    if t > 1:    # too few tiles: the count says so and compact() refuses
        short = plan_tiles(ids, key, tile, t - 1)
        assert int(short.tile_count) == t
        with pytest.raises(ValueError, match="max_tiles"):
            short.compact()


def test_bound_holds_for_any_runs():
    for n, tile, runs in [(1, 8, 1), (17, 8, 3), (128, 16, 1), (5, 1, 5), (33, 16, 33)]:
        key = torch.repeat_interleave(torch.arange(runs), torch.tensor([n // runs + (i < n % runs) for i in range(runs)]))
        pack = pack_tiles(torch.zeros(1, n, 1, dtype=torch.long), key, tile)
        assert pack.num_tiles <= max_tiles_bound(n, tile, runs)


def test_plan_tiles_makes_no_data_dependent_step():
    """Meta tensors hold no data: .item(), nonzero() or a data-sized boolean index would raise. So a plan
    that completes on them has fixed output sizes and never reads a value back to the host."""
    ids = torch.empty(4, 300, 16, dtype=torch.int32, device="meta")
    q_request = torch.empty(300, dtype=torch.int32, device="meta")
    q_limit = torch.empty(300, dtype=torch.int32, device="meta")
    for tile in (1, 8, 16):
        pack = plan_tiles(ids, tile_keys(q_request, q_limit, tile, causal=True), tile, 50)
        assert pack.union.shape == (4, 50, tile * 16) and pack.union.device.type == "meta"
        assert pack.bits.dtype == torch.int32 and pack.tile_count.shape == ()
    with pytest.raises((NotImplementedError, RuntimeError)):
        int(pack.tile_count)             # the same check fails where a value is read back


def test_bits_widen_and_vanish_with_the_tile():
    ids = torch.arange(40).view(1, 40, 1)
    seg = torch.zeros(40, dtype=torch.long)
    assert pack_tiles(ids, seg, 40).bits.dtype == torch.int64
    assert pack_tiles(ids, seg, 40).bits[0, 0, 39].item() == 1 << 39
    assert pack_tiles(ids, seg, 64).bits is None
    assert pack_tiles(ids, seg, 64).hits[0, 0].tolist() == [1] * 40


def test_repeated_ids_count_once():
    ids = torch.tensor([[[3, 3, -1], [3, 5, 5]]])
    pack = pack_tiles(ids, torch.zeros(2, dtype=torch.long), 8)
    assert pack.union[0, 0, :2].tolist() == [3, 5]
    assert pack.bits[0, 0, :2].tolist() == [0b11, 0b10] and pack.hits[0, 0, :2].tolist() == [2, 1]


def test_real_prefill_query_blocks_share_their_blocks():
    """The real-prefill rule: the query tiles hold one block set (union ratio 1), also after unaligned prefixes."""
    shape = AttnShape(hq=8, hkv=2, head_dim=16, block=16, topk=4)
    w = prefill_workload(PrefillCase("t", (50, 21), (70, 16)), shape, "bf16", with_tensors=False)
    for tile in (1, 8, 16):
        pack = pack_tiles(visible_selection(w), tile_keys(w.q_request, w.q_limit, tile, w.causal), tile)
        assert int(pack.executed_entries()) == int(pack.selected_entries())
        assert int(pack.selected_entries()) == int((w.selection >= 0).sum())
