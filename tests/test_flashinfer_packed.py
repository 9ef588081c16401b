"""flashinfer-packed on CPU: the requests and masks each route hands FlashInfer, read back with
FlashInfer's own semantics (page lists, last_page_len, bottom-right causal, little-endian packed mask
rows of qo_len x kv_len bits at byte offsets) into the dense visibility they imply, which must equal
the contract's; and the same semantics executed in float64 against the reference. The kernels run on
the GPU only (`msa-bench check --backend flashinfer-packed` with each --generator and --requests)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from msa_bench.harness.measure.check import edge_case_workload
from msa_bench.kernels.base import BackendUnavailable, get_backend
from msa_bench.kernels.flashinfer_packed import (MASK_CAUSAL, MASK_CUSTOM, MASK_NONE, FlashInferPacked,
                                                 packed_plan)
from msa_bench.scenarios.prefill_cases import PrefillCase, prefill_workload
from msa_bench.scenarios.reference import reference_attention, relative_error
from msa_bench.scenarios.selection import synthetic_workload
from msa_bench.scenarios.workload import AttnShape

SMALL = AttnShape(hq=8, hkv=2, head_dim=16, block=16, topk=4)
WIDE = AttnShape(hq=32, hkv=2, head_dim=16, block=16, topk=4)     # G 16 as in the study shape


def request_masks(w, pp, hr):
    """Per request: (rows, kv indices, dense [qo_len, kv_len] bool mask) as FlashInfer reads them."""
    b = w.shape.block
    for r in range(hr.num_requests):
        if pp.route == "paged":
            r0, r1 = int(hr.qo_indptr[r]), int(hr.qo_indptr[r + 1])
            last = int(hr.last_page_len[r])
        else:    # BSR: rows r * R .. (r + 1) * R (the last block row ends at M), every block whole
            r0, r1 = r * pp.tile, min((r + 1) * pp.tile, w.n_tokens)
            last = b
        pages = hr.kv_indices[hr.kv_indptr[r]:hr.kv_indptr[r + 1]].long()
        kv_len = (len(pages) - 1) * b + last
        rows = r1 - r0
        if hr.mask_mode == MASK_NONE:
            mask = torch.ones(rows, kv_len, dtype=torch.bool)
        elif hr.mask_mode == MASK_CAUSAL:
            mask = torch.arange(kv_len).view(1, -1) <= torch.arange(rows).view(-1, 1) + kv_len - rows
        else:
            seg = hr.packed_mask[int(hr.mask_indptr[r]):int(hr.mask_indptr[r + 1])]
            assert seg.numel() * 8 == rows * kv_len, "each request's mask is whole bytes of qo_len x kv_len bits"
            mask = ((seg.view(-1, 1).int() >> torch.arange(8)) & 1).bool().view(rows, kv_len)
        yield r0, r1, pages, kv_len, mask


def route_visibility(w, pp) -> torch.Tensor:
    """How many times each (token, KV head, page, key) is visible to the route's requests."""
    s = w.shape
    seen = torch.zeros(w.n_tokens, s.hkv, w.num_pages, s.block, dtype=torch.int32)
    for hr in pp.heads:
        for r0, r1, pages, kv_len, mask in request_masks(w, pp, hr):
            assert bool((pages % s.hkv == hr.head).all()), "a request reads another head's pages"
            j = torch.arange(kv_len)
            page, key = pages[j // s.block] // s.hkv, j % s.block
            for i, t in enumerate(range(r0, r1)):
                seen[t, hr.head, page[mask[i]], key[mask[i]]] += 1
    return seen


def contract_visibility(w) -> torch.Tensor:
    """workload.py: key t of selected page p is visible to query q iff block(p) * block + t <= q_limit[q]."""
    s = w.shape
    seen = torch.zeros(w.n_tokens, s.hkv, w.num_pages, s.block, dtype=torch.int32)
    pos = w.page_block.long().view(-1, 1) * s.block + torch.arange(s.block)
    for h in range(s.hkv):
        for q in range(w.n_tokens):
            for p in w.pages[h, q].tolist():
                if p >= 0:
                    seen[q, h, p] = (pos[p] <= int(w.q_limit[q])).int()
    return seen


def emulate(w, pp) -> torch.Tensor:
    """FlashInfer's semantics in float64: each request's G heads x rows over its keys, masked softmax."""
    s = w.shape
    q, k, v = w.dequantized(torch.float64)
    keys = k.reshape(w.num_pages * s.hkv, s.block, s.head_dim)
    vals = v.reshape(w.num_pages * s.hkv, s.block, s.head_dim)
    out = torch.full((w.n_tokens, s.hq, s.head_dim), float("nan"), dtype=torch.float64)
    for hr in pp.heads:
        heads = slice(hr.head * s.group, (hr.head + 1) * s.group)
        for r0, r1, pages, kv_len, mask in request_masks(w, pp, hr):
            kk = keys[pages].reshape(-1, s.head_dim)[:kv_len]
            vv = vals[pages].reshape(-1, s.head_dim)[:kv_len]
            sc = torch.einsum("tgd,kd->tgk", q[r0:r1, heads], kk) * w.sm_scale
            p = torch.softmax(sc.masked_fill(~mask.unsqueeze(1), float("-inf")), -1).nan_to_num(0.0)
            out[r0:r1, heads] = torch.einsum("tgk,kd->tgd", p, vv)
    return out


def edge(seed, causal, dtype="bf16", empty=0):
    """Three (causal) or two requests; `empty` tokens with no block only where the contract allows them
    (not causal: a causal token keeps its local block)."""
    empty = 0 if causal else empty
    kv = [70, 37, 48] if causal else [70, 37]
    tokens = [30, 37, 17] if causal else [23, 9]
    return edge_case_workload(SMALL, dtype, kv, tokens, causal, hot=0.4, pad=0.3, empty=empty, seed=seed)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.booleans(), st.sampled_from(["paged", "bsr"]), st.sampled_from([8, 16]))
def test_route_masks_give_exactly_the_contract_visibility(seed, causal, route, tile):
    """Multi-request, -1 padding, hot blocks, tokens with no block; causal and not: every visible key
    once, nothing else (tokens of a tile that did not select a block see none of it)."""
    w = edge(seed, causal, empty=2)
    pp = packed_plan(w, route, tile)
    assert torch.equal(route_visibility(w, pp), contract_visibility(w))


@pytest.mark.parametrize("route", ["paged", "bsr"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_route_semantics_match_the_reference(route, causal, dtype):
    w = edge(3, causal, dtype, empty=1)
    ref, _ = reference_attention(w)
    for tile in (8, 16):
        assert relative_error(emulate(w, packed_plan(w, route, tile)), ref) < 1e-12


def test_real_prefill_needs_no_custom_mask_on_the_paged_route():
    """Every token of a query block selects the same blocks: tiles cut at query blocks have union ratio 1
    and FlashInfer's own causal rule (last page partial) is exact, also for unaligned prefixes and
    several requests; the BSR route's whole blocks need the per-token mask for the same workload."""
    w = prefill_workload(PrefillCase("t", (40, 23, 16), (37, 0, 64)), SMALL, "bf16")
    paged = packed_plan(w, "paged", 8)
    assert [h.mask_mode for h in paged.heads] == [MASK_CAUSAL] * SMALL.hkv
    assert paged.union_ratio == 1.0 and all(h.packed_mask is None for h in paged.heads)
    bsr = packed_plan(w, "bsr", 8)
    assert [h.mask_mode for h in bsr.heads] == [MASK_CUSTOM] * SMALL.hkv
    for pp in (paged, bsr):
        assert torch.equal(route_visibility(w, pp), contract_visibility(w))
    assert "need a per-token mask" in bsr.mask_summary()


def test_noncausal_uniform_tiles_need_no_mask():
    """Every token picks every block of a 3-block pool whose last block is partial: mask 'none', the
    last page trimmed by last_page_len."""
    n, kv_len = 20, 40
    sel = torch.tensor([0, 1, 2, -1], dtype=torch.int32).view(1, 1, 4).expand(SMALL.hkv, n, 4).contiguous()
    from msa_bench.scenarios.workload import build_workload
    w = build_workload(SMALL, "bf16", sel, torch.tensor([[2, 0, 1]], dtype=torch.int32),
                       torch.zeros(n, dtype=torch.int32), torch.full((n,), kv_len - 1, dtype=torch.int32), 3, False)
    pp = packed_plan(w, "paged", 8)
    assert [h.mask_mode for h in pp.heads] == [MASK_NONE] * SMALL.hkv
    assert pp.heads[0].last_page_len.tolist() == [kv_len - 2 * SMALL.block] * 3
    assert relative_error(emulate(w, pp), reference_attention(w)[0]) < 1e-12


def test_tile_choice_is_the_least_fa2_work_and_recorded():
    """G 16: 8 tokens fill FA2's 128-row tile, 16 take two, so P 8 never does more work; G 4 x 16 tokens
    is still one 128-row tile, so P 16 wins where its union is under twice P 8's."""
    w16 = synthetic_workload(WIDE, "bf16", 64, 256, 0.5, seed=1)
    pp = packed_plan(w16, "paged")
    assert pp.tile == 8 and pp.tile_work[8] <= pp.tile_work[16]
    w4 = prefill_workload(PrefillCase("t", (64,), (48,)), SMALL, "bf16")
    pp4 = packed_plan(w4, "paged")
    assert pp4.tile == 16 and pp4.tile_work[16] < pp4.tile_work[8]
    assert packed_plan(w4, "paged", 8).tile == 8


def test_union_ratio_counts_the_blocks_a_tile_computes():
    w = synthetic_workload(SMALL, "bf16", 64, 512, 1.0, seed=2)
    pp = packed_plan(w, "paged", 8)
    assert pp.selected_entries == int((w.selection >= 0).sum())
    assert pp.executed_entries == sum(int(l) * int(c) for l, c in zip(pp.pack.length.repeat(SMALL.hkv),
                                                                        pp.pack.count.reshape(-1)))
    assert pp.union_ratio > 1.5


def test_options_and_cpu_reason():
    assert (get_backend("flashinfer-packed").route, get_backend("flashinfer-packed").tile) == ("paged", None)
    b = get_backend("flashinfer-packed@bsr+p16")
    assert (b.route, b.tile, b.name) == ("bsr", 16, "flashinfer-packed@bsr+p16")
    assert get_backend("flashinfer-packed@p8@bsr").route == "bsr"
    with pytest.raises(KeyError, match=r"paged\|bsr"):
        get_backend("flashinfer-packed@p12")
    reasons = {get_backend("flashinfer-packed").unavailable_reason(dt, "cpu") for dt in ("bf16", "fp8", "fp16")}
    assert reasons == {"flashinfer-packed needs a CUDA GPU (FlashInfer kernels); the workload is on cpu"}
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        FlashInferPacked().plan(edge(0, True))
