"""Stage 4, combine: gather each (query, KV head)'s <= topk raw partials through combine_index and
merge them by log-sum-exp into out [N, Hq, D] and lse [N, Hq] (natural log).

With `merge_into_output`, out and lse already hold a normalized output and its LSE (the packed part of
the hybrid schedule, written there by the packed kernel): each pair that has partials merges them with it
as one more partial (m = lse, l = 1) in place, and a pair with none is left as it is, so the stage's cost
follows the residual partials, not N.

A partial of (query, head, rank) is G consecutive rows of o_part (rows slot * G + g of its tile), so
each gather is one contiguous G x D chunk: wide vector loads. A program handles PAIRS (query, head)
pairs; the rank loop is unrolled so all of a pair's loads can be in flight together.
"""
from __future__ import annotations

import torch

from .. import triton_common  # noqa: F401
from ..dispatch.triton_launch import launch
import triton
import triton.language as tl


@triton.jit
def combine_tiles_kernel(o_part_ptr, m_part_ptr, l_part_ptr, combine_index_ptr, out_ptr, lse_ptr, n_pairs,
                         HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr,
                         TOPK_P2: tl.constexpr, PAIRS: tl.constexpr, EXTRA: tl.constexpr):
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    r = tl.arange(0, TOPK_P2)
    for i in tl.static_range(PAIRS):
        pair = tl.program_id(0) * PAIRS + i          # pair = query * HKV + head
        idx = tl.load(combine_index_ptr + pair * TOPK + r, mask=(r < TOPK) & (r * 0 + pair < n_pairs), other=-1)
        live = pair < n_pairs
        if EXTRA:                                    # pairs without partials keep the packed output as it is
            live = live & (tl.max(idx, 0) >= 0)
        if live:
            rows = idx.to(tl.int64) * G
            m = tl.load(m_part_ptr + rows[:, None] + g[None, :], mask=(idx >= 0)[:, None],
                        other=float("-inf"))                                            # [TOPK_P2, G]
            l = tl.load(l_part_ptr + rows[:, None] + g[None, :], mask=(idx >= 0)[:, None], other=0.0)
            base = pair.to(tl.int64) * G             # out [N, Hq, D] = [N * Hkv * G, D]
            big_m = tl.max(m, 0)
            if EXTRA:
                m_x = tl.load(lse_ptr + base + g)
                big_m = tl.maximum(big_m, m_x)
            big_m = tl.where(big_m == float("-inf"), 0.0, big_m)
            big_l = tl.sum(tl.exp(m - big_m[None, :]) * l, 0)                            # [G]
            acc = tl.zeros([G, D], dtype=tl.float32)
            if EXTRA:
                w_x = tl.exp(m_x - big_m)
                big_l += w_x
                acc += w_x[:, None] * tl.load(out_ptr + (base + g)[:, None] * D + d[None, :]).to(tl.float32)
            if EXTRA:           # few ranks hold a partial (the rest were packed): visit only those
                for k in range(TOPK):
                    idx_k = tl.load(combine_index_ptr + pair * TOPK + k)
                    if idx_k >= 0:
                        row_k = idx_k.to(tl.int64) * G + g
                        m_k = tl.load(m_part_ptr + row_k)
                        o_k = tl.load(o_part_ptr + row_k[:, None] * D + d[None, :])
                        acc += tl.exp(m_k - big_m)[:, None] * o_k.to(tl.float32)
            else:               # unrolled: all of a pair's loads in flight together
                for k in tl.static_range(TOPK):
                    idx_k = tl.load(combine_index_ptr + pair * TOPK + k)
                    row_k = idx_k.to(tl.int64) * G + g
                    ok = (g * 0 + idx_k) >= 0                    # [G]: a tensor mask (interpreter needs one)
                    m_k = tl.load(m_part_ptr + row_k, mask=ok, other=float("-inf"))
                    o_k = tl.load(o_part_ptr + row_k[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
                    acc += tl.exp(m_k - big_m)[:, None] * o_k.to(tl.float32)
            seen = big_l > 0
            safe_l = tl.where(seen, big_l, 1.0)
            out = tl.where(seen[:, None], acc / safe_l[:, None], 0.0)
            lse = tl.where(seen, big_m + tl.log(safe_l), float("-inf"))
            tl.store(out_ptr + (base + g)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty))
            tl.store(lse_ptr + base + g, lse)


class Combine:
    def __init__(self, workload, buffers: dict, out: torch.Tensor, lse: torch.Tensor, pairs: int = 4,
                 num_warps: int = 4, merge_into_output: bool = False):
        s = workload.shape
        self.b, self.out, self.lse = buffers, out, lse
        self.n_pairs = workload.n_tokens * s.hkv
        self.pairs, self.num_warps = pairs, num_warps
        self.consts = dict(HKV=s.hkv, G=s.group, D=s.head_dim, TOPK=s.topk,
                           TOPK_P2=triton.next_power_of_2(s.topk), PAIRS=pairs, EXTRA=merge_into_output)

    def __call__(self) -> None:
        b = self.b
        grid = (triton.cdiv(self.n_pairs, self.pairs),)
        launch(combine_tiles_kernel, grid, b["o_part"], b["m_part"], b["l_part"], b["combine_index"], self.out,
               self.lse, self.n_pairs, num_warps=self.num_warps, **self.consts)
