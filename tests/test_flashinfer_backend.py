"""The FlashInfer Q-outer fold, checked on CPU: index arrays, and the fold's semantics executed by a
small torch paged-attention loop compared with the float64 reference. The kernels run on the GPU only."""
from __future__ import annotations

import math

import pytest
import torch

from msa_bench.scenarios.reference import reference_attention, relative_error
from msa_bench.scenarios.workload import AttnShape, build_workload
from msa_bench.kernels.base import BackendUnavailable, get_backend
from msa_bench.kernels.flashinfer_q_outer import FoldError, fold_requests, folded_views

SMALL = AttnShape(hq=8, hkv=2, head_dim=16, block=8, topk=4)


def causal_workload(n: int, shape=SMALL, seed=0, dtype="fp32"):
    """One request, query q at position q: its local block last, up to topk-1 random history blocks."""
    gen = torch.Generator().manual_seed(seed)
    nb = math.ceil(n / shape.block)
    page_table = torch.randperm(nb + 3, generator=gen)[:nb].view(1, nb).to(torch.int32)
    sel = torch.full((shape.hkv, n, shape.topk), -1, dtype=torch.int32)
    for h in range(shape.hkv):
        for q in range(n):
            local = q // shape.block
            hist = torch.randperm(local, generator=gen)[: shape.topk - 1] if local else torch.empty(0, dtype=torch.long)
            row = torch.cat([hist, torch.tensor([local])])
            sel[h, q, : len(row)] = row.to(torch.int32)
    return build_workload(shape, dtype, sel, page_table, torch.zeros(n, dtype=torch.int32),
                          torch.arange(n, dtype=torch.int32), nb + 3, causal=True, seed=seed)


def pool_workload(n: int, kv_len: int, shape=SMALL, seed=0, dtype="fp32"):
    """Non-causal: every query sees the whole pool of kv_len keys (last block partial when kv_len is
    not a multiple of the block); each picks min(topk, blocks) distinct random blocks, -1 padded."""
    gen = torch.Generator().manual_seed(seed)
    nb = math.ceil(kv_len / shape.block)
    page_table = torch.randperm(nb, generator=gen).view(1, nb).to(torch.int32)
    k = min(shape.topk, nb)
    sel = torch.full((shape.hkv, n, shape.topk), -1, dtype=torch.int32)
    sel[..., :k] = torch.rand(shape.hkv, n, nb, generator=gen).argsort(-1)[..., :k].to(torch.int32)
    return build_workload(shape, dtype, sel, page_table, torch.zeros(n, dtype=torch.int32),
                          torch.full((n,), kv_len - 1, dtype=torch.int32), nb, causal=False, seed=seed)


def run_fold_in_torch(w, fold_name: str, f=None) -> torch.Tensor:
    """FlashInfer's paged semantics, literally: request r attends (non-causally, one KV head) to
    pages kv_indices[kv_indptr[r]:kv_indptr[r+1]] of the [pages * Hkv, 1, block, D] cache, all full
    but the last, which holds last_page_len keys; its query rows are qo_indptr[r]:qo_indptr[r+1]."""
    if f is None:
        f = fold_requests(w.pages, w.q_limit, w.page_block, w.shape.block, w.shape.group, fold_name)
    q, k, v = folded_views(w, fold_name)
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    q = q * w.q_scale
    out = torch.zeros_like(q)
    for r in range(f.num_requests):
        idx = f.kv_indices[f.kv_indptr[r]:f.kv_indptr[r + 1]].long()
        keys = k[idx, 0].reshape(-1, w.shape.head_dim) * w.k_scale
        vals = v[idx, 0].reshape(-1, w.shape.head_dim) * w.v_scale
        kv_len = (len(idx) - 1) * w.shape.block + int(f.last_page_len[r])
        keys, vals = keys[:kv_len], vals[:kv_len]
        rows = slice(int(f.qo_indptr[r]), int(f.qo_indptr[r + 1]))
        qr = q[rows].reshape(-1, w.shape.head_dim)
        p = torch.softmax(qr @ keys.T * w.sm_scale, dim=-1)
        out[rows] = (p @ vals).view(out[rows].shape)
    return out.reshape(w.n_tokens, w.shape.hq, w.shape.head_dim)


# ---- index construction ----------------------------------------------------------------------

def test_fold_orders_requests_token_major_and_offsets_pages_by_head():
    w = pool_workload(n=3, kv_len=4 * SMALL.block)       # 4 full blocks, all picked
    f = fold_requests(w.pages, w.q_limit, w.page_block, SMALL.block, SMALL.group)
    hkv = SMALL.hkv
    assert f.num_requests == 3 * hkv
    assert f.qo_indptr.tolist() == list(range(3 * hkv + 1))
    assert f.kv_indptr.tolist() == [4 * r for r in range(3 * hkv + 1)]
    assert f.last_page_len.tolist() == [SMALL.block] * (3 * hkv)
    for q in range(3):
        for h in range(hkv):
            r = q * hkv + h
            got = f.kv_indices[4 * r: 4 * r + 4].tolist()
            assert got == [int(p) * hkv + h for p in w.pages[h, q]]


def test_fold_rows_variant_steps_query_rows_by_group():
    w = pool_workload(n=2, kv_len=2 * SMALL.block)
    f = fold_requests(w.pages, w.q_limit, w.page_block, SMALL.block, SMALL.group, fold="rows")
    assert f.qo_indptr.tolist() == [SMALL.group * r for r in range(2 * SMALL.hkv + 1)]
    assert (f.qo_heads, f.rows_per_request) == (1, SMALL.group)


def test_fold_causal_partial_local_block_last_and_padding_dropped():
    w = causal_workload(n=20)                               # block 8: query 19 sits at offset 3 of block 2
    f = fold_requests(w.pages, w.q_limit, w.page_block, SMALL.block, SMALL.group)
    for q in (0, 5, 8, 19):
        for h in range(SMALL.hkv):
            r = q * SMALL.hkv + h
            n_valid = int((w.pages[h, q] >= 0).sum())
            assert int(f.kv_indptr[r + 1] - f.kv_indptr[r]) == n_valid          # -1 padding left out
            last_page = int(f.kv_indices[f.kv_indptr[r + 1] - 1]) // SMALL.hkv
            local = q // SMALL.block
            assert int(w.page_block[last_page]) == local                        # local block last
            assert int(f.last_page_len[r]) == q - local * SMALL.block + 1       # its partial length
    assert f.dropped_blocks == 0
    assert int(f.kv_indptr[-1]) == int((w.pages >= 0).sum())


def test_fold_moves_the_partial_block_last_and_drops_invisible_blocks():
    shape = AttnShape(hq=2, hkv=1, head_dim=4, block=4, topk=3)
    pages = torch.tensor([[[2, 0, 1]]], dtype=torch.int32)       # page p holds block p
    page_block = torch.tensor([0, 1, 2], dtype=torch.int32)
    q_limit = torch.tensor([5], dtype=torch.int32)              # sees 0..5: block 0 full, block 1 has 2 keys, block 2 none
    f = fold_requests(pages, q_limit, page_block, shape.block, shape.group)
    assert f.kv_indices.tolist() == [0, 1]
    assert f.last_page_len.tolist() == [2]
    assert f.dropped_blocks == 1


def test_fold_rejects_two_partial_blocks():
    pages = torch.tensor([[[0, 1]]], dtype=torch.int32)
    page_block = torch.tensor([0, 0], dtype=torch.int32)        # two pages claiming block 0 at limit 2
    with pytest.raises(FoldError, match="partially visible"):
        fold_requests(pages, torch.tensor([2]), page_block, 4, 1)


# ---- semantics against the float64 oracle ------------------------------------------------------

@pytest.mark.parametrize("fold", ["heads", "rows"])
@pytest.mark.parametrize("make", [
    lambda: causal_workload(n=21, seed=1),                         # partial local block, -1 padding early
    lambda: pool_workload(n=6, kv_len=5 * 8 + 3, seed=2),          # partial block anywhere in the list
    lambda: pool_workload(n=4, kv_len=2 * 8 + 1, seed=3),          # 3 blocks < topk: -1 padding
], ids=["causal", "pool-partial", "pool-padded"])
def test_fold_semantics_match_reference(make, fold):
    w = make()
    got = run_fold_in_torch(w, fold)
    ref, _ = reference_attention(w)
    assert relative_error(got, ref) < 1e-12


def test_fold_semantics_fp8_scales():
    w = causal_workload(n=12, seed=4, dtype="fp8")
    got = run_fold_in_torch(w, "heads")
    ref, _ = reference_attention(w)
    assert relative_error(got, ref) < 1e-12


def test_wrong_fold_is_caught_by_the_oracle():
    """The check can fail: attending to every valid page in full (ignoring last_page_len) is wrong."""
    w = causal_workload(n=21, seed=1)
    f = fold_requests(w.pages, w.q_limit, w.page_block, SMALL.block, SMALL.group)
    f.last_page_len.fill_(SMALL.block)
    got = run_fold_in_torch(w, "heads", f)
    ref, _ = reference_attention(w)
    assert relative_error(got, ref) > 1e-3


# ---- availability ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["flashinfer", "flashinfer-fa3"])
def test_backend_registered_and_unavailable_without_gpu(name):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    b = get_backend(name)
    w = causal_workload(n=4, dtype="bf16")
    reason = b.unavailable_reason("bf16", "cpu")
    assert reason and "\n" not in reason and ("GPU" in reason or "flashinfer" in reason)
    with pytest.raises(BackendUnavailable):
        b.plan(w)
    # what the machine lacks is the reason, the same for every dtype: a sweep says it once
    assert b.unavailable_reason("fp32", "cpu") == reason and "no GPU" in reason


@pytest.mark.cuda
def test_flashinfer_matches_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    b = get_backend("flashinfer")
    if b.unavailable_reason("bf16", "cuda"):
        pytest.skip(b.unavailable_reason("bf16", "cuda"))
    shape = AttnShape()
    w = pool_workload(n=64, kv_len=20 * 128 + 5, shape=shape, dtype="bf16").to("cuda")
    out = b.plan(w).run()
    ref, _ = reference_attention(w)
    assert relative_error(out, ref) < 1e-2
