"""The paged dense path's layout and bit mask (kernels/dense_paged.py), on the CPU: the bits FlashInfer
would read, unpacked, against the visibility the float64 reference uses."""
import pytest
import torch

from msa_bench.kernels.dense_paged import WORD_TYPES, mask_builder, paged_layout, paged_sizes, word_bits
from msa_bench.scenarios.serving import serving_workload
from msa_bench.scenarios.workload import AttnShape

TINY = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)
WIDE = AttnShape(hq=8, hkv=2, head_dim=32, block=128, topk=4)


def _expected(w, tok: int, head: int, keys: int) -> torch.Tensor:
    """Key k of a row: its block selected by (token, head) and k within the token's limit."""
    want = torch.zeros(keys, dtype=torch.bool)
    limit = int(w.q_limit[tok])
    for blk in w.selection[head, tok].tolist():
        if blk >= 0:
            want[blk * w.shape.block:(blk + 1) * w.shape.block] = True
    want[limit + 1:] = False
    return want


def _unpack(words: torch.Tensor) -> torch.Tensor:
    b = words.view(torch.uint8)
    return ((b.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1).bool()


CASES = [
    ("decode, contexts of different length", TINY, dict(kind="decode", tokens=None, context=600, context_min=100,
                                                       requests=5, query_tokens=2, drift=0.2)),
    ("mixed step", TINY, dict(kind="mixed", tokens=40, context=500, context_min=90, requests=6, chunks=2, drift=0.1)),
    ("causal chunk, 128-key blocks", WIDE, dict(kind="drift", tokens=300, context=2048, drift=0.1)),
]


@pytest.mark.parametrize("name,shape,kw", CASES, ids=[c[0] for c in CASES])
def test_packed_mask_bits_are_the_selected_visible_keys(name, shape, kw):
    kind = kw.pop("kind")
    w = serving_workload(shape, "bf16", kind, kw.pop("tokens"), **kw)
    lay = paged_layout(w)
    b = shape.block
    bits = word_bits(b)
    words = torch.full((lay.mask_bits * b // bits,), 7, dtype=WORD_TYPES[bits])
    empty = torch.ones(lay.row_tok.numel(), dtype=torch.bool)
    mask_builder(w, lay, words, empty)()
    got = _unpack(words)
    assert got.numel() == lay.mask_bits * b
    start = 0
    for row, (tok, head, blocks) in enumerate(zip(lay.row_tok.tolist(), lay.row_head.tolist(), lay.row_blocks.tolist())):
        keys = blocks * b
        want = _expected(w, tok, head, keys)
        assert torch.equal(got[start:start + keys], want), (name, row)
        assert bool(empty[row]) == (not bool(want.any()))
        start += keys
    # FlashInfer's request (r, h): r's tokens in order, its pages the context's, KV head h
    table = w.page_table.long()
    for i in range(lay.num_requests):
        lo, hi = int(lay.kv_indptr[i]), int(lay.kv_indptr[i + 1])
        tok = lay.row_tok[int(lay.qo_indptr[i])]
        head = int(lay.row_head[int(lay.qo_indptr[i])])
        r = int(w.q_request[tok])
        assert torch.equal(lay.kv_indices[lo:hi].long(), table[r, :hi - lo] * shape.hkv + head)
        assert hi - lo == int(w.q_limit[w.q_request == r].max()) // b + 1


def test_paged_sizes_count_no_gather_and_a_bit_mask():
    w = serving_workload(WIDE, "bf16", "decode", None, context=4096, requests=3, with_tensors=False)
    sz = paged_sizes(w)
    assert sz["kv_bytes"] == 0
    assert sz["dense_keys"] == 3 * 4096
    assert word_bits(128) == 64 and word_bits(16) == 16 and word_bits(12) is None


# ---- on the GPU: FlashInfer's kernel with this mask -------------------------------------------------

FULL = AttnShape()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_paged_dense_matches_the_reference_and_replays_bitwise(dtype, graph_replay_equals_eager):
    from msa_bench.harness.measure.check import check_backend
    from msa_bench.kernels.base import get_backend
    from msa_bench.kernels.flashinfer_common import import_flashinfer
    import_flashinfer()                                   # no FlashInfer on a GPU host is a failure here
    cases = [serving_workload(FULL, dtype, "decode", None, context=32768, context_min=8192, requests=16,
                              query_tokens=2, drift=0.05, device="cuda"),
             serving_workload(FULL, dtype, "drift", 512, context=8192, drift=0.07, device="cuda"),
             serving_workload(FULL, dtype, "mixed", 1024, context=16384, context_min=4096, requests=32, chunks=1,
                              drift=0.05, device="cuda")]
    for w in cases:
        err, tol, details = check_backend("dense-masked@flashinfer", w)
        assert details["info"]["paged"] and err <= tol, (w.meta, err)
        graph_replay_equals_eager(get_backend("dense-masked@flashinfer").plan(w))


def test_a_mask_past_flashinfers_int32_offsets_is_refused(monkeypatch):
    from msa_bench.kernels import dense_paged
    from msa_bench.kernels.base import BackendUnavailable
    monkeypatch.setattr(dense_paged, "import_flashinfer", lambda: None)
    monkeypatch.setattr(dense_paged, "MAX_MASK_BITS", 1000)
    w = serving_workload(WIDE, "bf16", "decode", None, context=4096, requests=3)
    with pytest.raises(BackendUnavailable, match="int32 bit offsets"):
        dense_paged.build_paged_stages(w)


def test_a_last_page_with_keys_that_are_not_finite_is_refused():
    from msa_bench.kernels.dense_paged import _tail_reason, contexts
    w = serving_workload(TINY, "bf16", "decode", None, context=600, context_min=100, requests=5)
    ctx = contexts(w)
    assert _tail_reason(w, ctx) is None
    i = next(i for i in range(len(ctx.tokens)) if int(ctx.limits[i]) % TINY.block + 1 < TINY.block)
    r = int(ctx.requests[i])
    page = int(w.page_table[r, int(ctx.blocks[i]) - 1])
    w.v_cache[page, 0, int(ctx.limits[i]) % TINY.block + 1] = float("nan")   # past its context: read, masked
    assert "not finite" in _tail_reason(w, ctx)
    w.page_table[r, 0] = -1
    assert "no page" in _tail_reason(w, ctx)
