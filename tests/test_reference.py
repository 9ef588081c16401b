"""The float64 oracle (scenarios/reference.py) against a naive dense masked attention, and the split
(per-block partials) against the whole, on small shapes: causal, non-causal, -1 padding, multi-request."""
import math

import pytest
import torch

from msa_bench.scenarios.prefill_cases import PrefillCase, prefill_workload
from msa_bench.scenarios.reference import combine_partials, reference_attention, reference_partials, relative_error
from msa_bench.scenarios.selection import assemble, scattered_page_table, synthetic_workload
from msa_bench.scenarios.workload import AttnShape

SHAPE = AttnShape(hq=4, hkv=2, head_dim=16, block=8, topk=3)


def padded_workload(dtype="fp32"):
    """Non-causal, one request of 70 tokens (last block partial), rows with 3, 2, 1 and 0 valid blocks."""
    gen = torch.Generator().manual_seed(7)
    table, num_pages = scattered_page_table([70], SHAPE.block, gen)
    sel = torch.tensor([[[0, 4, 8], [3, 8, -1], [6, -1, -1], [-1, -1, -1]],
                        [[8, 1, 2], [5, -1, -1], [0, 7, -1], [2, 3, 4]]], dtype=torch.int32)
    q_limit = torch.full((4,), 69, dtype=torch.int32)
    return assemble(SHAPE, dtype, sel, table, torch.zeros(4, dtype=torch.int32), q_limit, num_pages,
                    causal=False, seed=11)


def dense_masked_attention(w):
    """A naive check of the oracle: expand the selection into a dense key mask over each query's whole
    request and run ordinary masked softmax attention, in float64. Only for small shapes."""
    s = w.shape
    q, k, v = w.dequantized(torch.float64)
    max_blocks = w.page_table.shape[1]
    out = torch.zeros(w.n_tokens, s.hq, s.head_dim, dtype=torch.float64, device=w.device)
    for r in range(w.n_tokens):
        req = int(w.q_request[r])
        table = w.page_table[req].long()
        for h in range(s.hkv):
            chosen = torch.zeros(max_blocks, dtype=torch.bool, device=w.device)
            sel = w.selection[h, r].long()
            chosen[sel[sel >= 0]] = True
            blocks = [b for b in range(max_blocks) if table[b] >= 0]
            keys = torch.cat([k[table[b], h] for b in blocks])             # [T, D] positions 0..T-1
            vals = torch.cat([v[table[b], h] for b in blocks])
            key_block = torch.tensor(blocks, device=w.device).repeat_interleave(s.block)
            key_pos = key_block * s.block + torch.arange(s.block, device=w.device).repeat(len(blocks))
            mask = chosen[key_block] & (key_pos <= int(w.q_limit[r]))
            qh = q[r, h * s.group:(h + 1) * s.group]
            sc = (qh @ keys.T) * w.sm_scale
            sc = sc.masked_fill(~mask, float("-inf"))
            if mask.any():
                out[r, h * s.group:(h + 1) * s.group] = torch.softmax(sc, dim=-1) @ vals
    return out


def dense_lse(w):
    """LSE of the scaled scores over the selected visible keys, by brute force."""
    s = w.shape
    q, k, _ = w.dequantized(torch.float64)
    out = torch.full((w.n_tokens, s.hq), float("-inf"), dtype=torch.float64)
    for n in range(w.n_tokens):
        table = w.page_table[int(w.q_request[n])]
        for h in range(s.hkv):
            scores = []
            for b in w.selection[h, n].tolist():
                if b < 0:
                    continue
                visible = min(s.block, int(w.q_limit[n]) - b * s.block + 1)
                keys = k[table[b], h][:max(0, visible)]
                scores.append(q[n, h * s.group:(h + 1) * s.group] @ keys.T * w.sm_scale)
            if scores:
                out[n, h * s.group:(h + 1) * s.group] = torch.logsumexp(torch.cat(scores, dim=1), dim=1)
    return out


@pytest.mark.parametrize("make", [
    lambda: synthetic_workload(SHAPE, "fp32", 24, 160, 0.5, seed=1),
    lambda: synthetic_workload(SHAPE, "fp16", 24, 160, 0.5, skew=1.0, causal=True, seed=2),
    lambda: synthetic_workload(SHAPE, "fp8", 20, 100, 0.6, causal=True, seed=3),
    lambda: padded_workload(),
    lambda: prefill_workload(PrefillCase("t", query_lens=(9, 14), prefix_lens=(0, 24)), SHAPE, "fp32", seed=4),
], ids=["noncausal", "causal-skew-fp16", "causal-fp8", "padding", "multi-request"])
def test_reference_matches_dense_masked_attention(make):
    w = make()
    out, lse = reference_attention(w)
    dense = dense_masked_attention(w)
    assert out.dtype == torch.float64 and out.shape == (w.n_tokens, w.shape.hq, w.shape.head_dim)
    assert relative_error(out, dense) < 1e-12
    want = dense_lse(w)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(lse))
    assert torch.allclose(lse[finite], want[finite], rtol=0, atol=1e-10)


def test_padding_rows():
    w = padded_workload()
    out, lse = reference_attention(w)
    # row 3 of KV head 0 selects nothing: zero output, -inf LSE, for that head's query heads only
    g = w.shape.group
    assert bool((out[3, :g] == 0).all()) and bool(torch.isinf(lse[3, :g]).all())
    assert bool(torch.isfinite(lse[3, g:]).all()) and out[3, g:].abs().sum() > 0
    o, m, l = reference_partials(w, rows=[1, 2])
    assert bool((l[0, 0, 2] == 0).all()) and bool(torch.isinf(m[0, 0, 2]).all()) and bool((o[0, 0, 2] == 0).all())


def test_causal_local_block_only_sees_up_to_the_query():
    # a query at the first token of its block sees exactly one key there: its partial is that key's value
    w = synthetic_workload(SHAPE, "fp32", 16, 64, 0.75, causal=True, seed=9)
    n = next(i for i in range(w.n_tokens) if int(w.q_limit[i]) % SHAPE.block == 0)
    o, m, l = reference_partials(w, rows=[n])
    rank = int((w.selection[0, n] >= 0).sum()) - 1            # local block, last valid entry
    page = int(w.pages[0, n, rank])
    _, _, v = w.dequantized(torch.float64)
    assert torch.allclose(l[0, 0, rank], torch.ones(SHAPE.group, dtype=torch.float64))
    assert torch.allclose(o[0, 0, rank], v[page, 0, 0].expand(SHAPE.group, -1))


def test_combine_of_partials_is_order_free_and_matches_blockwise_softmax():
    w = synthetic_workload(SHAPE, "fp32", 12, 120, 0.75, causal=True, seed=5)
    o, m, l = reference_partials(w, chunk=5)
    out, lse = combine_partials(o, m, l)
    ref_out, ref_lse = reference_attention(w)
    assert torch.allclose(out, ref_out, atol=1e-13) and torch.allclose(lse, ref_lse, atol=1e-13)
    perm = torch.randperm(SHAPE.topk, generator=torch.Generator().manual_seed(0))
    p_out, p_lse = combine_partials(o[:, :, perm], m[:, :, perm], l[:, :, perm])
    assert torch.allclose(p_out, out, atol=1e-13) and torch.allclose(p_lse, lse, atol=1e-13)
    # each partial alone is a softmax over its block: o / l equals attention restricted to that block
    q, k, v = w.dequantized(torch.float64)
    n, h, r = 3, 1, 0
    page = int(w.pages[h, n, r])
    visible = min(SHAPE.block, int(w.q_limit[n]) - int(w.selection[h, n, r]) * SHAPE.block + 1)
    qg = q[n, h * SHAPE.group:(h + 1) * SHAPE.group]
    p = torch.softmax(qg @ k[page, h, :visible].T * w.sm_scale, dim=-1)
    assert torch.allclose(o[n, h, r] / l[n, h, r].unsqueeze(-1), p @ v[page, h, :visible], atol=1e-13)
    assert torch.allclose(m[n, h, r], (qg @ k[page, h, :visible].T * w.sm_scale).amax(-1), atol=1e-13)


def test_rows_subset_and_relative_error():
    w = synthetic_workload(SHAPE, "fp32", 10, 80, 0.8, seed=6)
    full, _ = reference_attention(w)
    part, _ = reference_attention(w, rows=[7, 2])
    assert torch.equal(part, full[[7, 2]])
    assert relative_error(full, full) == 0.0
    bad = full.clone()
    bad[0, 0, 0] = float("nan")
    assert math.isinf(relative_error(bad, full))
    assert relative_error(full * 1.01, full) == pytest.approx(0.01, rel=1e-6)
