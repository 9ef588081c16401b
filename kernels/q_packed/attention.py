"""Stage `attention` of q-packed: one Triton program per (KV head, token tile) walks the tile's union blocks.

The tile's P tokens x G heads of Q (rows p * G + g; a token's G heads are contiguous in Q [N, Hq, D])
are loaded once. Per union block: S = Q K^T, keys past each token's limit masked (a token that did not
select the block has limit -1: it sees none of it), an online softmax step (running max and sum,
the accumulator rescaled), O += P V. O / l and the LSE are written once: no partials, no combine.

Scores are in log2 units (log2(e) folded into the scale, exp2). fp8 e4m3, as in the KV-outer stages:
the q/k scales fold into the score scale and v_scale into the output, V is read d-major (a transposed
copy made once in plan()) so P V's second operand is K-major, and P is cast to e4m3 scaled by
2^P_SHIFT so its small values stay out of the subnormal range; the shift cancels in O / l.
"""
from __future__ import annotations

import math

import torch

from .. import triton_common  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton is imported)
import triton
import triton.language as tl

from ..kv_outer.attention import round_to_e4m3

LN2 = math.log(2.0)


@triton.jit
def packed_attention_kernel(q_ptr, k_ptr, v_ptr, tile_tok0_ptr, tile_ntok_ptr, tile_count_ptr, tile_page_ptr,
                            tile_limit_ptr, out_ptr, lse_ptr, qk_scale_log2, out_scale, n_token_tiles,
                            HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                            BLOCK: tl.constexpr, P: tl.constexpr, U: tl.constexpr, V_DMAJOR: tl.constexpr,
                            IEEE: tl.constexpr, P_SHIFT: tl.constexpr, SOFT_ROUND_P: tl.constexpr,
                            NUM_STAGES: tl.constexpr):
    tile = tl.program_id(0)                      # head-major: tile = head * n_token_tiles + token tile
    head = tile // n_token_tiles
    tt = tile % n_token_tiles
    ROWS: tl.constexpr = P * G
    rows = tl.arange(0, ROWS)
    token = rows // G
    g = rows % G
    d = tl.arange(0, D)
    kt = tl.arange(0, BLOCK)
    tok0 = tl.load(tile_tok0_ptr + tt)
    ntok = tl.load(tile_ntok_ptr + tt)
    count = tl.load(tile_count_ptr + tile)
    live = token < ntok
    q_rows = (tok0 + token).to(tl.int64) * (HQ * D) + (head * G + g) * D
    q_tile = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=live[:, None], other=0.0)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for j in tl.range(0, count, num_stages=NUM_STAGES):
        page = tl.load(tile_page_ptr + tile * U + j)
        kv_base = (page.to(tl.int64) * HKV + head) * (BLOCK * D)
        k_blk = tl.load(k_ptr + kv_base + kt[:, None] * D + d[None, :])
        if V_DMAJOR:
            v_blk = tl.trans(tl.load(v_ptr + kv_base + d[:, None] * BLOCK + kt[None, :]))
        else:
            v_blk = tl.load(v_ptr + kv_base + kt[:, None] * D + d[None, :])
        if IEEE:
            s = tl.dot(q_tile, tl.trans(k_blk), input_precision="ieee")
        else:
            s = tl.dot(q_tile, tl.trans(k_blk))
        limit = tl.load(tile_limit_ptr + (tile * U + j).to(tl.int64) * P + token)
        s = tl.where(kt[None, :] <= limit[:, None], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - (m_safe - P_SHIFT)[:, None])                    # = exp(score - m) * 2^P_SHIFT
        l_i = l_i * alpha + tl.sum(p, 1)
        if SOFT_ROUND_P:
            p = round_to_e4m3(p)
        if IEEE:
            pv = tl.dot(p.to(v_blk.dtype), v_blk, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v_blk.dtype), v_blk)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    seen = l_i > 0
    safe_l = tl.where(seen, l_i, 1.0)
    out = tl.where(seen[:, None], acc * (out_scale / safe_l)[:, None], 0.0)
    lse = tl.where(seen, (m_i - P_SHIFT + tl.log2(safe_l)) * 0.6931471805599453, float("-inf"))
    out_rows = (tok0 + token).to(tl.int64) * HQ + head * G + g
    tl.store(out_ptr + out_rows[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(lse_ptr + out_rows, lse, mask=live)


def packed_quantization(w) -> str:
    """What the packed stages quantize, as a plan states it."""
    return ("e4m3 Q/K/V/P on fp8 MMA (V d-major copy made in plan)" if w.dtype == "fp8"
            else f"{w.dtype} Q/K/V and MMA, fp32 softmax")


class PackedAttention:
    """Binds the kernel to a plan's schedule buffers; calling it launches one program per tile."""

    def __init__(self, workload, schedule, out: torch.Tensor, lse: torch.Tensor, num_warps: int = 8,
                 num_stages: int = 2):
        w, s = workload, workload.shape
        self.w, self.sch, self.out, self.lse = w, schedule, out, lse
        self.v_dmajor = w.dtype == "fp8"
        self.v = w.v_cache.transpose(-1, -2).contiguous() if self.v_dmajor else w.v_cache
        self.qk_scale_log2 = w.sm_scale * w.q_scale * w.k_scale / LN2
        self.p_shift = 8 if self.v_dmajor else 0
        self.out_scale = w.v_scale
        self.num_warps, self.num_stages = num_warps, num_stages
        self.consts = dict(HQ=s.hq, HKV=s.hkv, G=s.group, D=s.head_dim, BLOCK=s.block, P=schedule.P,
                           U=schedule.union_cap, V_DMAJOR=self.v_dmajor, IEEE=w.dtype == "fp32",
                           P_SHIFT=self.p_shift, SOFT_ROUND_P=self.v_dmajor and triton_common.interpreting(),
                           NUM_STAGES=num_stages)

    def describe(self) -> dict:
        return dict(tile_tokens=self.sch.P, tile_rows=self.sch.P * self.w.shape.group, grid=self.sch.num_tiles,
                    num_warps=self.num_warps, num_stages=self.num_stages)

    def __call__(self) -> None:
        if self.sch.num_tiles == 0:
            return
        b = self.sch.buffers
        packed_attention_kernel[(self.sch.num_tiles,)](
            self.w.q, self.w.k_cache, self.v, b["tile_tok0"], b["tile_ntok"], b["tile_count"], b["tile_page"],
            b["tile_limit"], self.out, self.lse, self.qk_scale_log2, self.out_scale, self.sch.n_token_tiles,
            num_warps=self.num_warps, num_stages=self.num_stages, **self.consts)
