"""Stage 3, attention: the persistent KV-stationary Triton kernel shared by kv-outer and msa-scatter.

Each of num_ctas programs walks its slice [begin, end) of the tile sequence segment by segment: a
segment is a run of tiles of one key (KV head, page); its K/V block is loaded once, then each tile
gathers its TILE_Q queries x G heads of Q (rows slot * G + g, one query's G heads are contiguous in
Q [N, Hq, D]), computes S = Q K^T, masks keys past each query's limit (only when the tile needs it),
takes one softmax step (one block: no running rescale) and O = P V.

Scores are kept in log2 units (log2(e) folded into the scale, exp2); m is stored in natural-log
units. fp8 e4m3: the q/k scales fold into the score scale and v_scale into the output; the V block
is read d-major ([D, block], a transposed copy of the cache made at plan time) so P V's second
operand is K-major, as Hopper's fp8 wgmma requires. P is cast to fp8 scaled by 2^P_SHIFT (free: it
shifts the exp2 argument) so its small values stay out of e4m3's subnormal range, where rounding
would be coarse; the shift is undone in l and in the output scale.

STORE_MODE 0 (kv-outer): raw O tile, contiguous in tile order, plus m, l per row.
STORE_MODE 1 (msa-scatter): O / l scattered to o_slot[slot, query, head, :] with lse_slot.
"""
from __future__ import annotations

import math

import torch

from .. import triton_common  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton is imported)
import triton
import triton.language as tl

STORE_TILES = 0
STORE_SCATTER = 1
LN2 = math.log(2.0)


@triton.jit
def round_to_e4m3(x):
    """Round non-negative fp32 to the nearest e4m3 value (ties to even), kept as fp32. Only for the CPU
    interpreter, whose fp32 -> fp8 cast mis-rounds values just below a power of two (0.49 -> 0.25)."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = tl.floor(x * 512.0 + 0.5) * (1.0 / 512.0)      # below 2^-6 the e4m3 step is 2^-9
    return tl.where(x < 0.015625, subnormal, normal)


@triton.jit
def attend_tiles(t_begin, t_end,
                 q_ptr, k_ptr, v_ptr, csr_query_ptr, edge_slot_ptr,
                 tile_key_ptr, tile_edge_ptr, tile_count_ptr, run_end_ptr,
                 page_block_ptr, q_limit_ptr, o_ptr, m_ptr, l_ptr,
                 qk_scale_log2, out_scale, num_pages, n_tokens,
                 HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                 BLOCK: tl.constexpr, TILE_Q: tl.constexpr, V_DMAJOR: tl.constexpr, IEEE: tl.constexpr,
                 STORE_MODE: tl.constexpr, NUM_STAGES: tl.constexpr, P_SHIFT: tl.constexpr,
                 SOFT_ROUND_P: tl.constexpr):
    """Positions [t_begin, t_end) of the tile sequence, run by run (one K/V load per run of a key)."""
    ROWS: tl.constexpr = TILE_Q * G
    rows = tl.arange(0, ROWS)
    slot = rows // G
    g = rows % G
    d = tl.arange(0, D)
    kt = tl.arange(0, BLOCK)

    t = t_begin
    while t < t_end:
        key = tl.load(tile_key_ptr + t)
        head = key // num_pages
        page = key % num_pages
        seg_end = tl.minimum(t_end, tl.load(run_end_ptr + t))
        kv_base = (page.to(tl.int64) * HKV + head) * (BLOCK * D)
        k_blk = tl.load(k_ptr + kv_base + kt[:, None] * D + d[None, :])                 # [BLOCK, D]
        if V_DMAJOR:
            v_blk = tl.trans(tl.load(v_ptr + kv_base + d[:, None] * BLOCK + kt[None, :]))  # [BLOCK, D]
        else:
            v_blk = tl.load(v_ptr + kv_base + kt[:, None] * D + d[None, :])
        block_first = tl.load(page_block_ptr + page) * BLOCK
        key_pos = block_first + kt

        for tt in tl.range(t, seg_end, num_stages=NUM_STAGES):
            first_edge = tl.load(tile_edge_ptr + tt)
            count = tl.load(tile_count_ptr + tt)
            live = slot < count
            query = tl.load(csr_query_ptr + first_edge + slot, mask=live, other=0)
            q_rows = query.to(tl.int64) * (HQ * D) + (head * G + g) * D
            q_tile = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=live[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q_tile, tl.trans(k_blk), input_precision="ieee")
            else:
                s = tl.dot(q_tile, tl.trans(k_blk))
            s = s * qk_scale_log2
            limit = tl.load(q_limit_ptr + query, mask=live, other=-1)
            # Only tiles that hold a query seeing part of this block pay for the mask.
            if tl.min(tl.where(live, limit, block_first + BLOCK), 0) < block_first + BLOCK - 1:
                s = tl.where(key_pos[None, :] <= limit[:, None], s, float("-inf"))
            m = tl.max(s, 1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            p = tl.exp2(s - (m_safe - P_SHIFT)[:, None])      # = exp(score - m) * 2^P_SHIFT
            l = tl.sum(p, 1) * (1.0 / (1 << P_SHIFT))
            if SOFT_ROUND_P:
                p = round_to_e4m3(p)
            if IEEE:
                o = tl.dot(p.to(v_blk.dtype), v_blk, input_precision="ieee")
            else:
                o = tl.dot(p.to(v_blk.dtype), v_blk)
            if STORE_MODE == 0:
                out_rows = rows.to(tl.int64) + tt * ROWS   # row index < 2^31; bytes need int64
                # padding slots are never read by the combine: storing them cost up to 7/8 of the
                # partial writes at high reuse (one query per block), measured with ncu on the H200
                tl.store(o_ptr + out_rows[:, None] * D + d[None, :], (o * out_scale).to(o_ptr.dtype.element_ty),
                         mask=live[:, None])
                tl.store(m_ptr + out_rows, m * 0.6931471805599453, mask=live)
                tl.store(l_ptr + out_rows, l, mask=live)
            else:
                rank = tl.load(edge_slot_ptr + first_edge + slot, mask=live, other=0)
                dest = (rank.to(tl.int64) * n_tokens + query) * HQ + head * G + g
                seen = l > 0
                inv_l = tl.where(seen, 1.0 / tl.where(seen, l, 1.0), 0.0)
                o_norm = o * (inv_l * out_scale)[:, None]
                lse = tl.where(seen, m * 0.6931471805599453 + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
                tl.store(o_ptr + dest[:, None] * D + d[None, :], o_norm.to(o_ptr.dtype.element_ty),
                         mask=live[:, None])
                tl.store(m_ptr + dest, lse, mask=live)
        t = seg_end


@triton.jit
def kv_stationary_attention_kernel(
        q_ptr, k_ptr, v_ptr, csr_query_ptr, edge_slot_ptr,
        tile_key_ptr, tile_edge_ptr, tile_count_ptr, run_end_ptr, tile_ptr_ptr, cta_range_ptr,
        page_block_ptr, q_limit_ptr,
        o_ptr, m_ptr, l_ptr,
        qk_scale_log2, out_scale, num_pages, n_tokens,
        HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
        TILE_Q: tl.constexpr, V_DMAJOR: tl.constexpr, IEEE: tl.constexpr, STORE_MODE: tl.constexpr,
        NUM_STAGES: tl.constexpr, P_SHIFT: tl.constexpr, SOFT_ROUND_P: tl.constexpr,
        CHUNK: tl.constexpr = 0):
    """CHUNK 0: program pid walks the scheduler's slice cta_range[pid] (persistent, v1).
    CHUNK > 0: the tile sequence is cut into chunks of CHUNK tiles; program pid takes chunks pid,
    pid + num_programs, ... (one each when the grid covers every chunk). Chunks run roughly in tile
    order, so the CTAs resident at any moment work on neighbouring keys of one KV head: the Q rows
    they gather (one head's slice of Q) are shared through L2 instead of streaming all heads."""
    pid = tl.program_id(0)
    if CHUNK == 0:
        begin = tl.load(cta_range_ptr + 2 * pid)
        end = tl.load(cta_range_ptr + 2 * pid + 1)
        attend_tiles(begin, end, q_ptr, k_ptr, v_ptr, csr_query_ptr, edge_slot_ptr,
                     tile_key_ptr, tile_edge_ptr, tile_count_ptr, run_end_ptr,
                     page_block_ptr, q_limit_ptr, o_ptr, m_ptr, l_ptr,
                     qk_scale_log2, out_scale, num_pages, n_tokens,
                     HQ, HKV, G, D, BLOCK, TILE_Q, V_DMAJOR, IEEE, STORE_MODE, NUM_STAGES, P_SHIFT,
                     SOFT_ROUND_P)
    else:
        total = tl.load(tile_ptr_ptr + HKV * num_pages)
        n_chunks = tl.cdiv(total, CHUNK)
        for c in range(pid, n_chunks, tl.num_programs(0)):
            begin = c * CHUNK
            end = tl.minimum(begin + CHUNK, total)
            attend_tiles(begin, end, q_ptr, k_ptr, v_ptr, csr_query_ptr, edge_slot_ptr,
                         tile_key_ptr, tile_edge_ptr, tile_count_ptr, run_end_ptr,
                         page_block_ptr, q_limit_ptr, o_ptr, m_ptr, l_ptr,
                         qk_scale_log2, out_scale, num_pages, n_tokens,
                         HQ, HKV, G, D, BLOCK, TILE_Q, V_DMAJOR, IEEE, STORE_MODE, NUM_STAGES, P_SHIFT,
                         SOFT_ROUND_P)


MIN_CHUNK = 8
PROGRAMS_PER_CTA = 2


def fill_chunk(chunk: int, tile_slots: int, num_ctas: int) -> int:
    """The chunk size for one program per chunk: the configured one, halved (down to MIN_CHUNK) while
    the tile slots would give fewer than PROGRAMS_PER_CTA programs per persistent-CTA slot. Short
    prefill chunks (N of a few hundred) otherwise leave most SMs idle: 64-tile chunks made 40-90
    programs for 132 SMs there (H200, real-prefill, bf16 65-127 TFLOP/s). Powers of two keep the
    number of compiled variants small (CHUNK is a compile-time constant)."""
    while chunk > MIN_CHUNK and -(-tile_slots // chunk) < PROGRAMS_PER_CTA * num_ctas:
        chunk //= 2
    return chunk


class Attention:
    """Binds the kernel to a plan's buffers; calling it launches one grid.

    chunk 0: persistent grid of num_ctas programs over the scheduler's cta_range (v1).
    chunk > 0: work items of `chunk` tiles in tile order, one program per possible chunk (programs
    past the real tile count exit at once).
    chunk defaults to config.default_config(dtype)'s when left None.
    """

    def __init__(self, workload, buffers: dict, tile_q: int, num_ctas: int, num_warps: int = 8,
                 num_stages: int = 2, store_mode: int = STORE_TILES, chunk: int | None = None):
        from .config import default_config
        w = workload
        s = w.shape
        self.w, self.b = w, buffers
        self.chunk = default_config(w.dtype).attn_chunk if chunk is None else chunk
        self.v_dmajor = w.dtype == "fp8"
        # fp8: V d-major ([pages, Hkv, D, block]) is the cache layout this path expects; made once here.
        self.v = w.v_cache.transpose(-1, -2).contiguous() if self.v_dmajor else w.v_cache
        self.qk_scale_log2 = w.sm_scale * w.q_scale * w.k_scale / LN2
        self.p_shift = 8 if w.dtype == "fp8" else 0
        self.out_scale = w.v_scale / 2.0 ** self.p_shift
        self.tile_q, self.num_ctas = tile_q, num_ctas
        self.num_warps, self.num_stages, self.store_mode = num_warps, num_stages, store_mode
        if self.chunk > 0:
            self.chunk = fill_chunk(self.chunk, buffers["tile_key"].numel(), num_ctas)
            self.grid = -(-buffers["tile_key"].numel() // self.chunk)
        else:
            self.grid = num_ctas
        self.consts = dict(HQ=s.hq, HKV=s.hkv, G=s.group, D=s.head_dim, BLOCK=s.block, TILE_Q=tile_q,
                           V_DMAJOR=self.v_dmajor, IEEE=w.dtype == "fp32", STORE_MODE=store_mode,
                           NUM_STAGES=num_stages, P_SHIFT=self.p_shift,
                           SOFT_ROUND_P=self.v_dmajor and triton_common.interpreting(), CHUNK=self.chunk)
        self.launch_opts = dict(num_warps=num_warps, num_stages=num_stages)

    def describe(self) -> dict:
        return dict(tile_q=self.tile_q, num_warps=self.num_warps, num_stages=self.num_stages,
                    chunk=self.chunk, grid=self.grid)

    def __call__(self) -> None:
        b, w = self.b, self.w
        if self.store_mode == STORE_TILES:
            outs = (b["o_part"], b["m_part"], b["l_part"])
        else:
            outs = (b["o_slot"], b["lse_slot"], b["lse_slot"])
        edge_slot = b.get("edge_slot", b["csr_query"])
        kv_stationary_attention_kernel[(self.grid,)](
            w.q, w.k_cache, self.v, b["csr_query"], edge_slot,
            b["tile_key"], b["tile_edge"], b["tile_count"], b["tile_run_end"], b["tile_ptr"], b["cta_range"],
            w.page_block, w.q_limit, *outs,
            self.qk_scale_log2, self.out_scale, w.num_pages, w.n_tokens,
            **self.launch_opts, **self.consts)
