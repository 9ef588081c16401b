"""Token-packed Q-outer attention stage for Hopper (sm_90a): q-packed's attention in CuTe DSL.

Same contract as the Triton stage (kernels/q_packed/attention.py; buffers in kernels/q_packed/__init__.py):
a tile is P = 8 consecutive tokens of one request x the G = 16 query heads of one KV head (128 rows,
row p * G + g); it walks the union of its tokens' selected blocks with an online softmax and writes
out [N, Hq, D] bf16 and lse [N, Hq] fp32 (natural log) once. No partials, no combine.

How (FA3's warp-specialized layout, reusing the KV-outer stage's pieces):
* Persistent CTAs, one per SM: CTA c takes tiles c, c + grid, ... of the head-major tile list (tile =
  head * Tt + token tile), so the CTAs resident at once walk neighbouring token tiles of one head and
  share its K/V blocks through L2.
* 384 threads. Warpgroup 0 is the producer (setmaxnreg down to PRODUCER_REGS): warp 0 loads each union
  block's K and V by TMA (slab page * Hkv + head of the [pages * Hkv * block, D] view; fp8 V d-major) into
  a ring of kv_stages, and writes the block's eight per-token key limits (tile_limit) next to the stage;
  kv_full expects P arrivals (lane 0's carries the TMA bytes) and kv_empty the eight consumer warps.
  Warps 1 and 2 gather the tile's Q rows by cp.async into a ring of Q_STAGES (the next tile's Q lands
  while this tile's blocks stream: the gather does not wait behind warp 0's K/V stage waits, as it would
  if one warp did both) and write the tile's (count, ntok, tok0, lo_end, hi_start) next to the stage; q_full
  expects their 64 arrivals plus that one; q_empty the eight consumer warps, after the tile's last S.
  Warp 3 has nothing to do.
* direct (a launch scalar: every tile one token, decode): no schedule stage ran; warp 0 takes a tile's
  blocks from its token's row of the selected pages ([Hkv, N, topk], valid entries first, distinct),
  lane j holding entry j's page and key limit (min(q_limit - block * BLOCK, BLOCK - 1); the next tile's
  are read while this one's blocks stream) and handing them out by shuffle, and warp 1 counts them (a
  ballot) for the tile's metadata: all of them the first half's.
* Warpgroups 1 and 2 are the consumers, 64 rows = 4 tokens each. In a m64 wgmma accumulator warp w of a
  warpgroup owns rows 16 w .. 16 w + 15: one token's 16 heads, so each consumer warp w (0..7 across both
  warpgroups) is tile token w and needs one key limit per union block (-1: the token did not select it).
* Per union block j: S = Q K^T; keys past the warp's limit masked; the online softmax step in log2 units
  (running row max m and a thread-partial row sum l in registers; alpha = exp2((m_old - m_new) scale_log2)
  rescales O and l; rows that have seen no key keep m = -inf and take alpha = 1, P = 0); P to registers
  (bf16: the accumulator's k16 slices; fp8: e4m3 regrouped without shuffles, V's keys permuted to match,
  manifest.fp8_v_key_order; times 2^P_SHIFT); O += P V.
* Each consumer warpgroup walks only the union blocks its four tokens selected: the schedule orders a
  tile's union as first-half-only, both, second-half-only (kernels/q_packed/schedule.py), so warpgroup 0
  runs slots [0, lo_end) and warpgroup 1 [hi_start, count), and each releases the other stages as they
  fill (taking their pingpong turns). Where neighbours drift this cuts the MMAs to the union of 4 tokens
  instead of 8; a decode tile of one token leaves warpgroup 1 nothing to do.
* After the tile's last block: O * out_scale / l -> bf16 -> stmatrix into the warp's staging slot -> one TMA
  store of its (G, D) rows to out row block (tok0 + w) * Hkv + head (tokens past tile_ntok not stored);
  lse = (m scale_log2 + log2 l - P_SHIFT) ln 2, -inf where l = 0, by the lane holding each row.

Options (constructor flags, off by default; FA3's two ways of running the softmax under the MMAs):
* pingpong: the two consumer warpgroups take turns issuing their MMAs, ordered by two named barriers, so
  one's softmax runs while the other's MMAs do.
* s_ahead: block j + 1's S is issued together with block j's P V, so the softmax of j + 1 runs while P V
  of j is on the tensor cores (one more S accumulator's worth of registers live).
With both, a turn issues S(j + 1) and P V(j), as FA3 does for head dim 128.
* pairs (decode, direct only, neither of the above): tile t holds tokens 2t and 2t + 1, in token slots 0
  and P / 2, so each consumer warpgroup computes one of them. Lanes 0-15 of warp 0 hold the first token's
  entries, 16-31 the second's; the blocks go out a0 b0 a1 b1 ... then the longer token's rest, and each
  warpgroup passes the other's block after its own (_pair_pass). A one-token tile runs one softmax chain per
  block on one warpgroup while the other idles; a pair runs two at once. Without pingpong (its turns would
  order the pairs one warpgroup after the other) and s_ahead (two held stages per warpgroup: all four of
  fp8's pairs ring, none left to read ahead).

* mma_sum: P's row sums by wgmma instead of the softmax's adds: each P V group also multiplies P by an
  8-column tile of ones (one k block, 256 bytes before sQ, read for every k step), and each block's sums
  are added to l in fp32 after the group completes (l stays whole rows: no quad shuffles at the end).
  The fp8 12-token tile's default (manifest.WIDE_MMA_SUM; docs/perf-log.md, 2026-12-04).

* 12-token tiles (tile_tokens 12; neither flag): three consumer warpgroups of 64 rows (512 threads,
  registers 128 x 32 + 384 x 160), warpgroup c holding tokens 4c .. 4c + 3 and walking its third's range
  of the union (the schedule orders it by thirds: [0, e0), [s1, e1), [s2, count); a token's unselected
  blocks in that range are masked by its -1 limit). fp8: four K/V stages, Q 2 x 24 KiB + K, V 4 x 16 KiB each +
  O staging 12 x 4 KiB = 224 KiB. bf16: Q 2 x 48 KiB + K, V 2 x 32 KiB each = 224 KiB, and each warp stages
  its token's O in its own rows of the tile's Q stage (o_in_q: no S reads them after the tile's last block;
  the warps release the Q stage once their O stores have read it). Three softmax chains per SM
  sub-partition instead of two: at u 1 the attention stage is 7-10 % faster (docs/perf-log.md, 2026-12-03
  and 2026-12-04); where tokens drift its union grows.

Shared memory (one CTA per SM): bf16 Q 2 x 32 KiB + K, V 2 x 32 KiB each + O staging 8 x 4 KiB = 224 KiB;
fp8 Q 2 x 16 KiB + K, V 5 x 16 KiB each + 32 KiB = 224 KiB (pingpong, pairs: 4 stages, 192 KiB).
Registers: 128 x 56 (producer) + 256 x 224 (consumers) = 64512 of the 65536 at 384 threads; the DSL 4.8.1
build's consumers use at most 186 (bf16) / 171 (fp8) registers, 197 / 182 with s_ahead, none spilled.

Import this module only with CUTE_DSL_ARCH set (build.py does) when no GPU is present.
"""
from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils as cutlass_utils
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .barriers import advance, release, wait
from .layouts import DSL_DTYPES, LOG2E, acc_to_frg_a, gmem_tile, rows_cols_view, staged_smem_layout
from .manifest import P_SHIFT
from .mma import _fresh, fp8_p_regs
from .producer import gather_q, q_row_copy
from .softmax import _row, mask_keys, pairwise

# the KV-outer stage's fp8 P regrouping (a method that uses no state of its class)

# (producer, consumer) registers by consumer warpgroups: 128 x 56 + 256 x 224 = 384 x 168 and
# 128 x 32 + 384 x 160 = 512 x 128, each launch's allocation
REGS = {2: (56, 224), 3: (32, 160)}
Q_STAGES = 2                 # the tile's Q and the next tile's
# per Q stage: the tile's count, ntok, tok0, lo_end, hi_start; three warpgroups: count, ntok, tok0, e0, s1, e1, s2
META = {2: 5, 3: 7}
KV_STAGES = {"bf16": 2, "fp8": 5}      # as many K/V stages as shared memory holds next to Q and O staging
# 12-token tiles: fp8 Q 2 x 24 KiB + O staging 12 x 4 KiB; bf16 Q 2 x 48 KiB, O staged in the tile's own Q rows
THREE_WG_KV_STAGES = {"bf16": 2, "fp8": 4}
# pingpong and decode pairs keep four (H200, 2026-12-02; outputs bitwise equal): with pingpong a fifth was
# within 0.7 % on 12 prefill, drift and decode points (the turns order the warpgroups), and every fp8 pairs
# point of the decode scenario ran 0.5-3.3 % slower with it
TURNS_KV_STAGES = 4
SUM_N = 8                    # mma_sum: the narrowest wgmma N; every column of P x ones is the row sum
ONES_BYTES = SUM_N * 32       # one k block of B: 8 x 32 fp8 or 8 x 16 bf16
ONES_WORD = {"bf16": 0x3F803F80, "fp8": 0x38383838}      # 1.0 in every element of a 32-bit word
PINGPONG_BARRIER = 1         # named barriers 1 and 2: consumer warpgroup c waits on 1 + c for its turn
LN2 = math.log(2.0)


def _online_softmax_step(s_rc: cute.Tensor, m_run: cute.Tensor, l_run: cute.Tensor, alpha: cute.Tensor,
                         scale_log2: Float32, p_bias, sum_p: bool = True):
    """One online softmax step over a thread's rows of S (masked, raw scores), in place: the row max over
    the quad that holds each row, m_new = max(m_run, that), alpha = 2^((m_run - m_new) scale_log2) (1 while
    the row has seen no key), P = 2^(S scale_log2 - m_new scale_log2 + p_bias) (0 for masked keys), and
    l_run = l_run alpha + this thread's sum of P (the quad's partial sums share m, so they are reduced once,
    at the end; not with sum_p False, where an MMA sums P). Plain Python, traced inline: the rows' trees and
    shuffles interleave."""
    n_r = cute.size(s_rc, mode=[0])
    maxes = [pairwise(_row(s_rc, r), cute.arch.fmax) for r in range(n_r)]
    for offset in (1, 2):
        other = [cute.arch.shuffle_sync_bfly(m, offset=offset) for m in maxes]
        maxes = [cute.arch.fmax(m, o) for m, o in zip(maxes, other)]
    shifts = []
    for r in range(n_r):
        m_new = cute.arch.fmax(m_run[r], maxes[r])
        seen = m_new != -Float32.inf
        alpha[r] = Float32(cutlass.select_(seen, cute.arch.exp2((m_run[r] - m_new) * scale_log2), Float32(1.0)))
        shifts.append(Float32(cutlass.select_(seen, m_new * scale_log2 - p_bias, Float32(-p_bias))))
        m_run[r] = m_new
    for r in range(n_r):
        for c in range(cute.size(s_rc, mode=[1])):
            s_rc[r, c] = cute.arch.exp2(s_rc[r, c] * scale_log2 - shifts[r])
    if sum_p:
        for r in range(n_r):
            l_run[r] = l_run[r] * alpha[r] + pairwise(_row(s_rc, r), lambda a, b: a + b)


def _scale_rows(acc: cute.Tensor, factor: cute.Tensor) -> None:
    """Multiply each of a thread's accumulator rows by its factor. Plain Python, traced inline."""
    rc = rows_cols_view(acc)
    for r in range(cute.size(rc, mode=[0])):
        for c in range(cute.size(rc, mode=[1])):
            rc[r, c] = rc[r, c] * factor[r]


class QPackedSm90:
    """One compiled configuration of the token-packed attention stage (module docstring): data dtype, the
    tile (P tokens x G heads = 128 rows), D, block, and the schedule options."""

    wg_threads = 128
    kernel_version = "qp2-ws-online-halves"

    def __init__(self, dtype: str, tile_tokens: int = 8, group: int = 16, head_dim: int = 128, block: int = 128,
                 pingpong: bool = False, s_ahead: bool = False, pairs: bool = False, residual: bool = False,
                 kv_stages: int | None = None, mma_sum: bool = False):
        if dtype not in DSL_DTYPES:
            raise ValueError(f"the q-packed CuTe stage supports {', '.join(DSL_DTYPES)}, not {dtype}")
        if tile_tokens not in (8, 12) or (group, head_dim, block) != (16, 128, 128):
            raise ValueError(f"the q-packed CuTe stage is written for P 8 or 12, G 16, D 128, block 128 (one token "
                             f"per consumer warp), got P {tile_tokens}, G {group}, D {head_dim}, block {block}")
        # a consumer warpgroup per 4 tokens (64 rows): the union's halves for two, its thirds for three
        self.consumer_wgs = tile_tokens // 4
        if self.consumer_wgs == 3 and (pingpong or pairs):
            raise ValueError("QPackedSm90: 12-token tiles (three consumer warpgroups) run without pingpong (two "
                             "warpgroups' turns) or pairs")
        # bf16's 12-token Q stage (48 KiB) leaves no room for O staging beside two K/V stages: each warp stages
        # its token's O in its own Q rows, which no S reads after the tile's last block
        self.o_in_q = self.consumer_wgs == 3 and dtype == "bf16"
        self.num_threads = self.wg_threads * (1 + self.consumer_wgs)
        self.num_consumer_warps = 4 * self.consumer_wgs
        self.producer_regs, self.consumer_regs = REGS[self.consumer_wgs]
        self.dtype_name = dtype
        self.dtype = DSL_DTYPES[dtype]
        self.v_d_major = dtype == "fp8"
        self.tile_tokens, self.group, self.head_dim, self.block = tile_tokens, group, head_dim, block
        self.rows = tile_tokens * group
        self.p_shift = P_SHIFT[dtype]
        if pairs and (pingpong or s_ahead):
            # pingpong's turns would order the pairs' blocks one warpgroup after the other again, and s_ahead
            # holds two stages per warpgroup, all four of fp8's pairs ring
            raise ValueError("QPackedSm90: pairs runs without pingpong and s_ahead")
        self.pingpong, self.s_ahead, self.pairs = pingpong, s_ahead, pairs
        if residual and pairs:
            raise ValueError("QPackedSm90: residual merges the hybrid's KV-outer partials into prefill tiles; "
                             "pairs runs decode tokens")
        self.residual = residual
        self.mma_sum = mma_sum
        self.q_stages = Q_STAGES
        turns = pingpong or pairs
        self.kv_stages = kv_stages or (min(KV_STAGES[dtype], TURNS_KV_STAGES) if turns else
                                       THREE_WG_KV_STAGES[dtype] if self.consumer_wgs == 3 else KV_STAGES[dtype])
        self.kv_tx_bytes = 2 * block * head_dim * self.dtype.width // 8     # K box + V box
        self.q_threads = 2 * 32                                             # producer warps 1 and 2
        self.kernel_version = (self.kernel_version + ("-pingpong" if pingpong else "") + ("-s-ahead" if s_ahead else "")
                               + ("-pairs" if pairs else "") + ("-3wg" if self.consumer_wgs == 3 else "")
                               + ("-residual" if residual else "") + ("-mma-sum" if mma_sum else ""))

    def __repr__(self) -> str:
        # the DSL names the compiled functions (and ncu shows the kernel) after str(self)
        return (f"QPackedSm90_{self.dtype_name}" + ("_pingpong" if self.pingpong else "")
                + ("_sahead" if self.s_ahead else "") + ("_pairs" if self.pairs else "")
                + ("_3wg" if self.consumer_wgs == 3 else "") + ("_res" if self.residual else "")
                + ("_msum" if self.mma_sum else ""))

    # ---- host side (traced once at compile time) --------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mTileTok0: cute.Tensor,
                 mTileNtok: cute.Tensor, mTileCount: cute.Tensor, mTilePage: cute.Tensor, mTileLimit: cute.Tensor,
                 mTileSplit: cute.Tensor, mPages: cute.Tensor, mSel: cute.Tensor, mQLimit: cute.Tensor,
                 mO: cute.Tensor, mLse: cute.Tensor, mResIdx: cute.Tensor, mResO: cute.Tensor, mResM: cute.Tensor,
                 mResL: cute.Tensor, hkv: Int32, n_token_tiles: Int32, union_cap: Int32,
                 num_ctas: Int32, n_tokens: Int32, topk: Int32, direct: Int32, scale: Float32, out_scale: Float32,
                 stream: cuda.CUstream):
        dt = self.dtype
        D, BLK, ROWS = self.head_dim, self.block, self.rows
        kmaj, mnmaj = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        wgs = (self.consumer_wgs, 1, 1)
        qk_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj, Float32, wgs, (64, BLK))
        pv_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj if const_expr(self.v_d_major) else mnmaj,
                                             Float32, wgs, (64, D), a_source=warpgroup.OperandSource.RMEM)
        # mma_sum: l = P x ones (SUM_N columns, one k block of ones read for every k block of P)
        sum_mma = (sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj, Float32, wgs, (64, SUM_N),
                                               a_source=warpgroup.OperandSource.RMEM)
                   if const_expr(self.mma_sum) else None)
        sQ_layout = staged_smem_layout(dt, ROWS, D, self.q_stages)
        sK_layout = staged_smem_layout(dt, BLK, D, self.kv_stages)
        v_tile = (D, BLK) if const_expr(self.v_d_major) else (BLK, D)
        sV_layout = staged_smem_layout(dt, v_tile[0], v_tile[1], self.kv_stages)
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, gK_tma = cpasync.make_tiled_tma_atom(tma_op, mK, cute.slice_(sK_layout, (None, None, 0)), (BLK, D))
        tma_v, gV_tma = cpasync.make_tiled_tma_atom(tma_op, mV, cute.slice_(sV_layout, (None, None, 0)), v_tile)
        # O staging: one (G, D) slot per consumer warp (= tile token), stored by TMA slot by slot; o_in_q: slot
        # (w, stage) is Q rows w G .. w G + G - 1 of that Q stage
        if const_expr(self.o_in_q):
            sO_layout = cute.composition(sQ_layout, cute.make_layout(
                (self.group, D, (self.tile_tokens, self.q_stages)), stride=(1, ROWS, (self.group, ROWS * D))))
        else:
            sO_layout = staged_smem_layout(cutlass.BFloat16, self.group, D, self.num_consumer_warps)
        tma_o, gO_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO,
                                                    cute.slice_(sO_layout, (None, None, 0)), (self.group, D))
        storage = self._storage_struct(sQ_layout, sK_layout, sV_layout, sO_layout)
        res_args = (mResIdx, mResO, mResM, mResL, topk) if const_expr(self.residual) else None
        self.kernel(qk_mma, pv_mma, sum_mma, tma_k, gK_tma, tma_v, gV_tma, tma_o, gO_tma, mQ, mTileTok0, mTileNtok,
                    mTileCount, mTilePage, mTileLimit, mTileSplit, (mPages, mSel, mQLimit, n_tokens, topk, direct),
                    mLse, res_args, hkv, n_token_tiles, union_cap, scale * LOG2E, out_scale, sQ_layout, sK_layout,
                    sV_layout, sO_layout).launch(
            grid=(num_ctas, 1, 1), block=(self.num_threads, 1, 1), smem=storage.size_in_bytes(),
            min_blocks_per_mp=1, preferred_smem_carveout=100, stream=stream)

    def _storage_struct(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        """The CTA's shared memory: the four barrier rings, the Q stages' tile metadata (count, ntok, tok0),
        the K/V stages' per-token key limits, and the Q, K, V and O staging buffers (1024-byte aligned for
        the 128-byte swizzle)."""
        dt, mem, align = self.dtype, cute.struct.MemRange, cute.struct.Align
        # field types as objects, not annotations (this module's `from __future__ import annotations`)
        fields = {"q_full": mem[cutlass.Int64, self.q_stages], "q_empty": mem[cutlass.Int64, self.q_stages],
                  "kv_full": mem[cutlass.Int64, self.kv_stages], "kv_empty": mem[cutlass.Int64, self.kv_stages],
                  "sMeta": mem[Int32, META[self.consumer_wgs] * self.q_stages],
                  "sLim": mem[Int32, self.tile_tokens * self.kv_stages],
                  # mma_sum's ones: one k block of B (256 bytes, unswizzled), in the room before sQ's alignment
                  **({"sOnes": align[mem[Int32, ONES_BYTES // 4], 128]} if self.mma_sum else {}),
                  "sQ": align[mem[dt, cute.cosize(sQ_layout)], 1024],
                  "sK": align[mem[dt, cute.cosize(sK_layout)], 1024],
                  "sV": align[mem[dt, cute.cosize(sV_layout)], 1024]}
        if not self.o_in_q:
            fields["sO"] = align[mem[cutlass.BFloat16, cute.cosize(sO_layout)], 1024]
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        return self.shared_storage

    # ---- device side --------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, sum_mma, tma_k: cute.CopyAtom, gK_tma: cute.Tensor,
               tma_v: cute.CopyAtom, gV_tma: cute.Tensor, tma_o: cute.CopyAtom, gO_tma: cute.Tensor,
               mQ: cute.Tensor, mTileTok0: cute.Tensor, mTileNtok: cute.Tensor, mTileCount: cute.Tensor,
               mTilePage: cute.Tensor, mTileLimit: cute.Tensor, mTileSplit: cute.Tensor, direct_args,
               mLse: cute.Tensor, res_args, hkv: Int32,
               n_token_tiles: Int32, union_cap: Int32, scale_log2: Float32, out_scale: Float32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sO_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group = cute.arch.make_warp_uniform(tidx // self.wg_threads)

        storage = cutlass_utils.SmemAllocator().allocate(self.shared_storage)
        q_full, q_empty = storage.q_full.data_ptr(), storage.q_empty.data_ptr()
        kv_full, kv_empty = storage.kv_full.data_ptr(), storage.kv_empty.data_ptr()
        sMeta = storage.sMeta.get_tensor(cute.make_layout((META[self.consumer_wgs], self.q_stages)))
        sLim = storage.sLim.get_tensor(cute.make_layout((self.tile_tokens, self.kv_stages)))
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)          # (ROWS, D, QS)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)          # (BLK, D, KS)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)          # (BLK, D or D, BLK, KS)
        if const_expr(self.o_in_q):
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)      # (G, D, (P, QS))
        else:
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)      # (G, D, 8)

        sOnes = None
        if const_expr(self.mma_sum):
            words = cute.make_tensor(cute.recast_ptr(storage.sOnes.data_ptr(), dtype=Int32),
                                     cute.make_layout(ONES_BYTES // 4))
            if tidx < ONES_BYTES // 4:
                words[tidx] = Int32(ONES_WORD[self.dtype_name])
            cute.arch.fence_view_async_shared()          # wgmma reads the ones through the async proxy
            ones_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_INTER, self.dtype)
            ones_k = ONES_BYTES // SUM_N * 8 // self.dtype.width          # one k block: 32 fp8 or 16 bf16
            ones_layout = cute.tile_to_shape(ones_atom, (SUM_N, ones_k), order=(0, 1))
            sOnes = cute.make_tensor(cute.recast_ptr(storage.sOnes.data_ptr(), dtype=self.dtype), ones_layout.outer)
        if warp_idx == 0:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(self.q_stages):
                    cute.arch.mbarrier_init(q_full + s, self.q_threads + 1)
                    cute.arch.mbarrier_init(q_empty + s, self.num_consumer_warps)
                for s in cutlass.range_constexpr(self.kv_stages):
                    cute.arch.mbarrier_init(kv_full + s, self.tile_tokens)
                    cute.arch.mbarrier_init(kv_empty + s, self.num_consumer_warps)
            for atom in (tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        num_tiles = hkv * n_token_tiles
        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load_kv(tma_k, gK_tma, tma_v, gV_tma, mTileTok0, mTileCount, mTilePage, mTileLimit, direct_args,
                             sK, sV, sLim, kv_full, kv_empty, hkv, n_token_tiles, num_tiles, union_cap)
            elif warp_idx <= 2:
                self.gather_q(mQ, mTileTok0, mTileNtok, mTileCount, mTileSplit, direct_args, sQ, sMeta, q_full,
                              q_empty, hkv, n_token_tiles, num_tiles, tidx - 32)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consumer(qk_mma, pv_mma, sum_mma, sOnes, tma_o, gO_tma, sQ, sK, sV, sO, sMeta, sLim, mLse, res_args,
                          (q_full, q_empty, kv_full, kv_empty), hkv, n_token_tiles, num_tiles, scale_log2,
                          out_scale, tidx - self.wg_threads)

    # ---- producer warps ---------------------------------------------------------------------------
    @cute.jit
    def load_kv(self, tma_k: cute.CopyAtom, gK_tma: cute.Tensor, tma_v: cute.CopyAtom, gV_tma: cute.Tensor,
                mTileTok0: cute.Tensor, mTileCount: cute.Tensor, mTilePage: cute.Tensor, mTileLimit: cute.Tensor,
                direct_args, sK: cute.Tensor, sV: cute.Tensor, sLim: cute.Tensor, kv_full: cute.Pointer,
                kv_empty: cute.Pointer, hkv: Int32, n_token_tiles: Int32, num_tiles: Int32, union_cap: Int32):
        """Producer warp 0: every union block of the CTA's tiles in order, K and V by TMA into the next
        stage, its P key limits (lane p: tile token p) beside it. The next block's page and limits are
        read before the wait for a free stage. direct (every tile one token, no schedule stage): a tile's
        blocks are its token's selected pages in selection order, lane j holding entry j's page and key
        limit (the selection's contract: valid entries first, distinct ids)."""
        mPages, mSel, mQLimit, n_tokens, topk, direct = direct_args
        D, BLK, P = self.head_dim, self.block, self.tile_tokens
        v_tile = (D, BLK) if const_expr(self.v_d_major) else (BLK, D)
        gK = cute.local_tile(gK_tma, (BLK, D), (None, 0))                 # (BLK, D, slabs)
        gV = cute.local_tile(gV_tma, v_tile, (None, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        copies = (tma_k, tKgK, tKsK, tma_v, tVgV, tVsV)
        lane = cute.arch.lane_idx()
        my_lane = cutlass.min(lane, P - 1)          # lanes past P read token P - 1's limit and drop it
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        kv_idx = Int32(0)
        kv_phase = Int32(1)           # empty barriers: the first wait on each stage passes at once
        direct_entries = (mTileTok0, mPages, mSel, mQLimit, num_tiles, n_token_tiles, n_tokens, topk, lane)
        pg_n = Int32(-1)
        lm_n = Int32(-1)
        if direct != 0:               # the first tile's entries; each next tile's are read during this one's
            pg_n, lm_n = self._direct_entries(direct_entries, cta)
        for tile in cutlass.range(cta, num_tiles, grid, unroll=1):
            head = tile // n_token_tiles
            if const_expr(self.pairs):
                pg = pg_n
                lm = lm_n
                pg_n, lm_n = self._direct_entries(direct_entries, tile + grid)
                n_a, n_b = self._pair_counts(pg)
                both = cutlass.min(n_a, n_b)
                for i in cutlass.range(n_a + n_b, unroll=1):
                    # a0 b0 a1 b1 ... then the longer token's rest (lanes 0-15 hold token a's, 16-31 b's)
                    src = Int32(cutlass.select_(i < 2 * both, (i % 2) * 16 + i // 2,
                                                cutlass.select_(n_a > n_b, i - both, 16 + i - both)))
                    page = cute.arch.shuffle_sync(pg, src)
                    lim = cute.arch.shuffle_sync(lm, src)
                    slot = Int32(cutlass.select_(src >= 16, P // 2, 0))
                    kv_idx, kv_phase = self._fill_stage(copies, sLim, kv_full, kv_empty, kv_idx, kv_phase,
                                                        page * hkv + head,
                                                        Int32(cutlass.select_(lane == slot, lim, Int32(-1))), lane)
            elif direct != 0:
                pg = pg_n
                lm = lm_n
                pg_n, lm_n = self._direct_entries(direct_entries, tile + grid)
                count = cute.arch.popc(cute.arch.vote_ballot_sync(pg >= 0))
                for j in cutlass.range(count, unroll=1):
                    page = cute.arch.shuffle_sync(pg, j)
                    lim = cute.arch.shuffle_sync(lm, j)
                    kv_idx, kv_phase = self._fill_stage(copies, sLim, kv_full, kv_empty, kv_idx, kv_phase,
                                                        page * hkv + head,
                                                        Int32(cutlass.select_(lane == 0, lim, Int32(-1))), lane)
            else:
                count = mTileCount[tile]
                base = tile * union_cap
                page_n = Int32(0)
                lim_n = Int32(-1)
                if count > 0:
                    page_n = mTilePage[base]
                    lim_n = mTileLimit[base * P + my_lane]
                for j in cutlass.range(count, unroll=1):
                    page = page_n
                    lim = lim_n
                    nxt = base + cutlass.min(j + 1, count - 1)
                    page_n = mTilePage[nxt]
                    lim_n = mTileLimit[nxt * P + my_lane]
                    kv_idx, kv_phase = self._fill_stage(copies, sLim, kv_full, kv_empty, kv_idx, kv_phase,
                                                        page * hkv + head, lim, lane)

    @cute.jit
    def _direct_entries(self, direct_entries, tile: Int32):
        """direct: this lane's (page, key limit) of entry `lane` of `tile`'s token; page -1 past its valid
        entries and past the last tile."""
        mTileTok0, mPages, mSel, mQLimit, num_tiles, n_token_tiles, n_tokens, topk, lane = direct_entries
        t = cutlass.min(tile, num_tiles - 1)
        head = t // n_token_tiles
        e = lane
        ok = (tile < num_tiles) & (lane < topk)
        if const_expr(self.pairs):
            # lanes 0-15: the pair's first token (2 tt), 16-31 its second (topk <= 16)
            e = lane % 16
            tok = 2 * (t - head * n_token_tiles) + lane // 16
            ok = (tile < num_tiles) & (e < topk) & (tok < n_tokens)
            tok = cutlass.min(tok, n_tokens - 1)
        else:
            tok = mTileTok0[t - head * n_token_tiles]
        entry = (head * n_tokens + tok) * topk + cutlass.min(e, topk - 1)
        pg = Int32(cutlass.select_(ok, mPages[entry], Int32(-1)))
        lm = cutlass.min(mQLimit[tok] - mSel[entry] * self.block, self.block - 1)
        return pg, lm

    @cute.jit
    def _pair_counts(self, pg: Int32):
        """pairs: the valid entries of the pair's first token (lanes 0-15) and of its second (16-31)."""
        valid = cute.arch.vote_ballot_sync(pg >= 0)
        return cute.arch.popc(valid & 0xFFFF), cute.arch.popc((valid >> 16) & 0xFFFF)

    @cute.jit
    def _fill_stage(self, copies, sLim: cute.Tensor, kv_full: cute.Pointer, kv_empty: cute.Pointer, kv_idx: Int32,
                    kv_phase: Int32, slab: Int32, lim: Int32, lane: Int32):
        """Producer warp 0: wait for the next K/V stage to be free, write the block's key limits (lane p: tile
        token p) and load K and V of `slab` into it. Returns the ring's next (stage, phase)."""
        tma_k, tKgK, tKsK, tma_v, tVgV, tVsV = copies
        P = self.tile_tokens
        wait(kv_empty + kv_idx, kv_phase)
        if lane < P:
            sLim[lane, kv_idx] = lim
            # P arrivals, each after its lane's limit store; lane 0's also expects the TMA bytes
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(kv_full + kv_idx, self.kv_tx_bytes)
            else:
                cute.arch.mbarrier_arrive(kv_full + kv_idx)
        cute.copy(tma_k, tKgK[None, slab], tKsK[None, kv_idx], tma_bar_ptr=kv_full + kv_idx)
        cute.copy(tma_v, tVgV[None, slab], tVsV[None, kv_idx], tma_bar_ptr=kv_full + kv_idx)
        return advance(kv_idx, kv_phase, self.kv_stages)

    @cute.jit
    def gather_q(self, mQ: cute.Tensor, mTileTok0: cute.Tensor, mTileNtok: cute.Tensor, mTileCount: cute.Tensor,
                 mTileSplit: cute.Tensor, direct_args, sQ: cute.Tensor, sMeta: cute.Tensor, q_full: cute.Pointer,
                 q_empty: cute.Pointer, hkv: Int32, n_token_tiles: Int32, num_tiles: Int32, qtid: Int32):
        """Producer warps 1 and 2 (qtid 0..63): each tile's 128 Q rows into the next Q stage by cp.async,
        row p * G + g from q[tok0 + p, head * G + g] (tokens past ntok repeat the last one: finite rows,
        never stored), and the tile's (count, ntok, tok0, lo_end, hi_start) beside the stage (direct: count
        is the token's valid entries, counted by warp 1 as load_kv does, all of them the first half's)."""
        mPages, _, _, n_tokens, topk, direct = direct_args
        dt, G, D = self.dtype, self.group, self.head_dim
        g2s, thr_q, tQcQ = q_row_copy(dt, D, self.q_threads, qtid, self.rows)
        rows_per_pass = self.q_threads // (D // (128 // dt.width))        # divides G: a pass is in one token
        slot_tokens = self.tile_tokens // 2 if const_expr(self.pairs) else 1   # pairs: slots 0-3 token 0, 4-7 1
        hq = hkv * G
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        q_idx = Int32(0)
        q_phase = Int32(1)
        for tile in cutlass.range(cta, num_tiles, grid, unroll=1):
            head = tile // n_token_tiles
            tt = tile - head * n_token_tiles
            count = Int32(0)
            lo_end = Int32(0)
            hi_start = Int32(0)
            if const_expr(self.consumer_wgs == 3):
                hi_end = Int32(0)
                lo_third = Int32(0)
            if const_expr(self.pairs):
                tok0 = 2 * tt
                ntok = cutlass.min(n_tokens - tok0, 2)
            else:
                tok0 = mTileTok0[tt]
                ntok = mTileNtok[tt]
            if const_expr(self.pairs):
                if qtid < 32:
                    # the same entries as load_kv's (lanes 0-15 token tok0, 16-31 tok0 + 1); meta 3 and 4 are
                    # the two tokens' counts
                    lane = qtid
                    e = lane % 16
                    tok = tok0 + lane // 16
                    entry = (head * n_tokens + cutlass.min(tok, n_tokens - 1)) * topk + cutlass.min(e, topk - 1)
                    pg = Int32(cutlass.select_((e < topk) & (tok < n_tokens), mPages[entry], Int32(-1)))
                    lo_end, hi_start = self._pair_counts(pg)
                    count = lo_end + hi_start
            elif direct != 0:
                if qtid < 32:
                    lane = qtid
                    entry = (head * n_tokens + tok0) * topk + cutlass.min(lane, topk - 1)
                    pg = Int32(cutlass.select_(lane < topk, mPages[entry], Int32(-1)))
                    count = cute.arch.popc(cute.arch.vote_ballot_sync(pg >= 0))
                    lo_end = count
                    hi_start = count
                    if const_expr(self.consumer_wgs == 3):
                        hi_end = count
                        lo_third = count
            else:
                if qtid == 0:
                    count = mTileCount[tile]
                    if const_expr(self.consumer_wgs == 3):       # the thirds' (e0, s1, e1, s2)
                        lo_end = mTileSplit[4 * tile]
                        hi_start = mTileSplit[4 * tile + 1]
                        hi_end = mTileSplit[4 * tile + 2]
                        lo_third = mTileSplit[4 * tile + 3]
                    else:
                        lo_end = mTileSplit[2 * tile]
                        hi_start = mTileSplit[2 * tile + 1]
            last = cutlass.max(ntok - 1, 0)
            wait(q_empty + q_idx, q_phase)
            gather_q(g2s, thr_q, tQcQ, sQ[None, None, q_idx], mQ, hq, head, G, D,
                     lambda m, row: tok0 + cutlass.min(m * rows_per_pass // G // slot_tokens, last))
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_mbarrier_arrive_noinc(q_full + q_idx)      # when this thread's copies land
            if qtid == 0:
                sMeta[0, q_idx] = count
                sMeta[1, q_idx] = ntok
                sMeta[2, q_idx] = tok0
                sMeta[3, q_idx] = lo_end
                sMeta[4, q_idx] = hi_start
                if const_expr(self.consumer_wgs == 3):
                    sMeta[5, q_idx] = hi_end
                    sMeta[6, q_idx] = lo_third
                cute.arch.mbarrier_arrive(q_full + q_idx)
            q_idx, q_phase = advance(q_idx, q_phase, self.q_stages)
        cute.arch.cp_async_wait_group(0)

    # ---- consumer warpgroups ----------------------------------------------------------------------
    @cute.jit
    def consumer(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, sum_mma, sOnes, tma_o: cute.CopyAtom,
                 gO_tma: cute.Tensor,
                 sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sO: cute.Tensor, sMeta: cute.Tensor,
                 sLim: cute.Tensor, mLse: cute.Tensor, res_args, bars, hkv: Int32, n_token_tiles: Int32,
                 num_tiles: Int32, scale_log2: Float32, out_scale: Float32, ctid: Int32):
        """Consumer thread ctid (0..255; warp ctid // 32 is tile token w): the CTA's tiles in order, each
        one's union blocks with the online softmax, then O and LSE of the warp's token."""
        q_full, q_empty, kv_full, kv_empty = bars
        G, D, BLK, ROWS = self.group, self.head_dim, self.block, self.rows
        lane = cute.arch.lane_idx()
        warp = ctid // 32                                  # tile token of this warp's 16 rows
        cwg = ctid // self.wg_threads
        if const_expr(self.v_d_major):
            sVt = sV                                                             # (D, BLK, KS)
        else:
            sVt = cute.composition(sV, cute.make_ordered_layout((D, BLK, self.kv_stages), order=(1, 0, 2)))
        thr_qk = qk_mma.get_slice(ctid)
        thr_pv = pv_mma.get_slice(ctid)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))                 # (MMA, M, K, QS)
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
        tScS = rows_cols_view(thr_qk.partition_C(cute.make_identity_tensor((ROWS, BLK))))
        # O staging: the (ROWS, D) view of the slot-staged buffer (row = slot * G + g), written by stmatrix
        if const_expr(self.o_in_q):
            sO_tile = sQ                                                         # (ROWS, D, QS)
        else:
            sO_tile = cute.composition(sO, cute.make_layout(((G, self.tile_tokens), D), stride=((1, G * D), G)))
        st_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16), pv_mma)
        tRsO = st_copy.get_slice(ctid).partition_D(sO_tile)
        gO = cute.local_tile(gO_tma, (G, D), (None, 0))                          # (G, D, N * Hkv)
        tOsO, tOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                           cute.group_modes(gO, 0, 2))

        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((ROWS, BLK)), Float32)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((ROWS, D)), Float32)
        if const_expr(self.v_d_major):
            r_p = cute.make_rmem_tensor(thr_pv.partition_shape_A((ROWS, BLK)), self.dtype)
        else:
            r_p = cute.make_rmem_tensor_like(acc_to_frg_a(acc_s), self.dtype)
        n_rows = const_expr(cute.size(tScS, mode=[0]))
        m_run = cute.make_rmem_tensor((n_rows,), Float32)
        l_run = cute.make_rmem_tensor((n_rows,), Float32)
        alpha = cute.make_rmem_tensor((n_rows,), Float32)
        v = dict(tSrQ=tSrQ, tSrK=tSrK, tOrV=tOrV, tScS=tScS, acc_s=acc_s, acc_o=acc_o, r_p=r_p, m_run=m_run,
                 l_run=l_run, alpha=alpha)
        if const_expr(self.mma_sum):
            # a block's row sums P x ones: a thread's ((2 columns, 2 rows)) of the 64 x SUM_N accumulator, each
            # column its row's sum (value 2 r + c is row r, as rows_cols_view orders the rows of acc_s). Each
            # block's sum starts afresh and is added to l_run in fp32: summed over a whole walk in the fp8 wgmma
            # accumulator (its adds keep about 14 bits), the error against float64 rose from 0.024 to 0.032
            thr_sum = sum_mma.get_slice(ctid)
            v["sum_mma"] = sum_mma
            v["tLrOnes"] = thr_sum.make_fragment_B(thr_sum.partition_B(sOnes))
            v["acc_l"] = cute.make_rmem_tensor(thr_sum.partition_shape_C((ROWS, SUM_N)), Float32)
        if const_expr(self.residual):      # (row, column) of each value of acc_o: where its partials' values lie
            v["tOcO"] = rows_cols_view(thr_pv.partition_C(cute.make_identity_tensor((ROWS, D))))

        if const_expr(self.pingpong):
            if cwg == 1:
                self._turn_end(1)              # consumer warpgroup 0 takes the first turn
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        q_idx = Int32(0)
        q_phase = Int32(0)
        kv_idx = Int32(0)
        kv_phase = Int32(0)
        for tile in cutlass.range(cta, num_tiles, grid, unroll=1):
            head = tile // n_token_tiles
            wait(q_full + q_idx, q_phase)
            count = sMeta[0, q_idx]
            ntok = sMeta[1, q_idx]
            tok0 = sMeta[2, q_idx]
            # the warpgroup's blocks are union slots [lo, hi) (schedule.py orders the union by halves)
            lo = Int32(cutlass.select_(cwg == 0, Int32(0), sMeta[4, q_idx]))
            hi = Int32(cutlass.select_(cwg == 0, sMeta[3, q_idx], count))
            if const_expr(self.consumer_wgs == 3):        # the thirds: [0, e0), [s1, e1), [s2, count)
                lo = Int32(cutlass.select_(cwg == 0, Int32(0), cutlass.select_(cwg == 1, sMeta[4, q_idx],
                                                                                 sMeta[6, q_idx])))
                hi = Int32(cutlass.select_(cwg == 0, sMeta[3, q_idx], cutlass.select_(cwg == 1, sMeta[5, q_idx],
                                                                                        count)))
            if const_expr(self.pairs):
                # token a's n_a blocks (warpgroup 0) and b's n_b (1) in the order a0 b0 a1 b1 ... then the
                # longer's rest: warpgroup 1 passes a0 first; each passes the other's block after its own
                # while both have blocks (_pair_pass), then the other's rest
                n_a = sMeta[3, q_idx]
                n_b = sMeta[4, q_idx]
                both = cutlass.min(n_a, n_b)
                lo = Int32(cutlass.select_(cwg == 0, Int32(0), cutlass.min(both, 1)))
                hi = Int32(cutlass.select_(cwg == 0, n_a, n_b)) + both
                walk = Int32(cutlass.select_(cwg == 0, n_a, n_b))
            res_idx = Int32(-1)
            if const_expr(self.residual):
                # lane k: the warp's token's rank-k partial (its combine index), loaded now and used in the
                # epilogue, so that the load's latency passes under the tile's blocks
                mIdx, _, _, _, topk = res_args
                if (lane < topk) & (warp < ntok):
                    res_idx = mIdx[((tok0 + warp) * hkv + head) * topk + lane]
            # the Q rows arrived by cp.async (generic proxy); the wgmma reads them through the async proxy
            cute.arch.fence_view_async_shared()
            acc_o.fill(0.0)
            for r in cutlass.range_constexpr(n_rows):
                m_run[r] = -Float32.inf
                l_run[r] = Float32(0.0)
            kv_idx, kv_phase = self._pass(kv_full, kv_empty, kv_idx, kv_phase, lo, cwg, lane)
            if const_expr(self.s_ahead):
                kv_idx, kv_phase = self._blocks_s_ahead(qk_mma, pv_mma, v, sLim, kv_full, kv_empty, kv_idx,
                                                        kv_phase, q_idx, hi - lo, warp, cwg, lane, scale_log2)
            else:
                kv_idx, kv_phase = self._blocks(qk_mma, pv_mma, v, sLim, kv_full, kv_empty, kv_idx, kv_phase, q_idx,
                                                walk if const_expr(self.pairs) else hi - lo,
                                                both if const_expr(self.pairs) else None, warp, cwg, lane, scale_log2)
            kv_idx, kv_phase = self._pass(kv_full, kv_empty, kv_idx, kv_phase, count - hi, cwg, lane)
            if const_expr(not self.o_in_q):
                release(q_empty + q_idx, lane)            # every S of the tile has completed
            self._store(st_copy, tRsO, tma_o, tOsO, tOgO, mLse, res_args, res_idx, v, tok0, ntok, head, hkv, warp,
                        lane, ctid, out_scale, scale_log2, q_idx)
            if const_expr(self.o_in_q):
                release(q_empty + q_idx, lane)            # and the O store has read the warp's Q rows
            q_idx, q_phase = advance(q_idx, q_phase, self.q_stages)
        if const_expr(self.pingpong):
            if cwg == 0:
                self._turn_begin(0)            # takes warpgroup 1's last arrival: both barriers end idle
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0)          # O stores complete before the CTA exits

    def _turn_begin(self, cwg):
        """pingpong: wait until the other consumer warpgroup has issued its MMAs (no-op otherwise)."""
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=PINGPONG_BARRIER + cwg, number_of_threads=2 * self.wg_threads)

    def _turn_end(self, cwg):
        """pingpong: hand the turn to the other consumer warpgroup (no-op otherwise)."""
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER + 1 - cwg, number_of_threads=2 * self.wg_threads)

    @cute.jit
    def _pass(self, kv_full: cute.Pointer, kv_empty: cute.Pointer, kv_idx: Int32, kv_phase: Int32, n: Int32,
              cwg: Int32, lane: Int32):
        """The next n K/V stages, which none of the warpgroup's tokens selected: each released once full, after
        its pingpong turn (both warpgroups take one per union block). Their step would leave the rows as they
        are (alpha 1, P 0). No MMA under a branch: a wgmma there makes ptxas serialize every wgmma."""
        for j in cutlass.range(n, unroll=1):
            wait(kv_full + kv_idx, kv_phase)
            self._turn_begin(cwg)
            self._turn_end(cwg)
            release(kv_empty + kv_idx, lane)
            kv_idx, kv_phase = advance(kv_idx, kv_phase, self.kv_stages)
        return kv_idx, kv_phase

    @cute.jit
    def _pair_pass(self, kv_full: cute.Pointer, kv_empty: cute.Pointer, kv_idx: Int32, kv_phase: Int32, j: Int32,
                   both: Int32, cwg: Int32, lane: Int32):
        """pairs: the other token's block after the warpgroup's block j: warpgroup 0's b_j (j < both),
        warpgroup 1's a_(j+1) (j + 1 < both). Called only under const_expr(self.pairs): a call before a loop's
        other assignments, even one that passes nothing, reorders the loop's carried values and the code."""
        return self._pass(kv_full, kv_empty, kv_idx, kv_phase, Int32(cutlass.select_(j + cwg < both, 1, 0)), cwg,
                          lane)

    @cute.jit
    def _issue_s(self, qk_mma: cute.TiledMma, v, q_idx: Int32, kv_idx: Int32):
        """S = Q K^T of Q stage q_idx and K stage kv_idx, one wgmma group."""
        qk = _fresh(qk_mma)
        tSrQ, tSrK, acc_s = v["tSrQ"], v["tSrK"], v["acc_s"]
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            qk.set(warpgroup.Field.ACCUMULATE, kb != 0)
            cute.gemm(qk, acc_s, tSrQ[None, None, kb, q_idx], tSrK[None, None, kb, kv_idx], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def _issue_pv(self, pv_mma: cute.TiledMma, v, kv_idx: Int32):
        """O += P V with P from registers and V stage kv_idx, one wgmma group."""
        pv = _fresh(pv_mma)
        r_p, tOrV, acc_o = v["r_p"], v["tOrV"], v["acc_o"]
        warpgroup.fence()
        pv.set(warpgroup.Field.ACCUMULATE, True)
        for kb in cutlass.range_constexpr(cute.size(r_p, mode=[2])):
            cute.gemm(pv, acc_o, r_p[None, None, kb], tOrV[None, None, kb, kv_idx], acc_o)
        if const_expr(self.mma_sum):
            ls = _fresh(v["sum_mma"])
            for kb in cutlass.range_constexpr(cute.size(r_p, mode=[2])):
                ls.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(ls, v["acc_l"], r_p[None, None, kb], v["tLrOnes"][None, None, 0], v["acc_l"])
        warpgroup.commit_group()

    def _softmax(self, v, limit: Int32, scale_log2: Float32):
        """Mask the keys past the warp's limit, then the online softmax step on the S accumulator."""
        s_rc = rows_cols_view(v["acc_s"])
        mask_keys(s_rc, v["tScS"], limit, self.block)
        _online_softmax_step(s_rc, v["m_run"], v["l_run"], v["alpha"], scale_log2, self.p_shift,
                             sum_p=not self.mma_sum)

    def _rescale(self, v):
        """O (and mma_sum's l) times the rows' alpha."""
        _scale_rows(v["acc_o"], v["alpha"])
        if const_expr(self.mma_sum):
            for r in range(cute.size(v["l_run"])):
                v["l_run"][r] = v["l_run"][r] * v["alpha"][r]

    def _add_sums(self, v):
        """mma_sum: the block's row sums (its P V group has completed) into l_run."""
        if const_expr(self.mma_sum):
            for r in range(cute.size(v["l_run"])):
                v["l_run"][r] = v["l_run"][r] + v["acc_l"][2 * r]

    def _p_to_regs(self, v):
        """P (the softmax'd S accumulator) as the A operand of P V: bf16 the accumulator's k16 slices,
        fp8 regrouped (V's keys permuted to match)."""
        acc_s, r_p = v["acc_s"], v["r_p"]
        if const_expr(self.v_d_major):
            r_p.store(fp8_p_regs(acc_s, r_p).load().to(self.dtype))
        else:
            r_p.store(acc_to_frg_a(acc_s).load().to(self.dtype))

    @cute.jit
    def _blocks(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, v, sLim: cute.Tensor, kv_full: cute.Pointer,
                kv_empty: cute.Pointer, kv_idx: Int32, kv_phase: Int32, q_idx: Int32, count: Int32, both: Int32,
                warp: Int32, cwg: Int32, lane: Int32, scale_log2: Float32):
        """The warpgroup's count union blocks one after the other: S, softmax (O rescaled), P V; pairs: each
        followed by the other token's block while both have blocks. Returns the K/V ring's (stage, phase)
        after them."""
        for j in cutlass.range(count, unroll=1):
            wait(kv_full + kv_idx, kv_phase)
            limit = sLim[warp, kv_idx]
            self._turn_begin(cwg)
            self._issue_s(qk_mma, v, q_idx, kv_idx)
            self._turn_end(cwg)
            warpgroup.wait_group(0)
            self._softmax(v, limit, scale_log2)
            self._rescale(v)
            self._p_to_regs(v)
            self._issue_pv(pv_mma, v, kv_idx)
            warpgroup.wait_group(0)
            self._add_sums(v)
            release(kv_empty + kv_idx, lane)              # K and V of this stage have been read
            kv_idx, kv_phase = advance(kv_idx, kv_phase, self.kv_stages)
            if const_expr(self.pairs):
                kv_idx, kv_phase = self._pair_pass(kv_full, kv_empty, kv_idx, kv_phase, j, both, cwg, lane)
        return kv_idx, kv_phase

    @cute.jit
    def _blocks_s_ahead(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, v, sLim: cute.Tensor,
                        kv_full: cute.Pointer, kv_empty: cute.Pointer, kv_idx: Int32, kv_phase: Int32, q_idx: Int32,
                        count: Int32, warp: Int32, cwg: Int32, lane: Int32, scale_log2: Float32):
        """s_ahead: S(j) is issued with P V(j - 1), and the softmax of j runs while P V(j - 1) is on the tensor
        cores. P(j - 1) goes to registers and O is rescaled by block j - 1's alpha just before that issue, and
        the last block's the same way after the loop: with P converted at the end of each iteration instead,
        ptxas 13 (C7512) serialized every wgmma of the kernel for want of registers. Returns the K/V ring's
        (stage, phase)."""
        if count > 0:
            wait(kv_full + kv_idx, kv_phase)
            limit = sLim[warp, kv_idx]
            self._turn_begin(cwg)
            self._issue_s(qk_mma, v, q_idx, kv_idx)
            self._turn_end(cwg)
            warpgroup.wait_group(0)
            self._softmax(v, limit, scale_log2)            # O is zero: its alpha needs no rescale
            cur = kv_idx
            kv_idx, kv_phase = advance(kv_idx, kv_phase, self.kv_stages)
            for j in cutlass.range(1, count, unroll=1):
                wait(kv_full + kv_idx, kv_phase)
                limit = sLim[warp, kv_idx]
                self._p_to_regs(v)                         # P(j - 1), before S(j) overwrites its accumulator
                self._rescale(v)                           # block j - 1's alpha, before its P V
                self._turn_begin(cwg)
                self._issue_s(qk_mma, v, q_idx, kv_idx)
                self._issue_pv(pv_mma, v, cur)
                self._turn_end(cwg)
                warpgroup.wait_group(1)                    # S(j) done, P V(j - 1) may still run
                self._softmax(v, limit, scale_log2)
                warpgroup.wait_group(0)
                self._add_sums(v)
                release(kv_empty + cur, lane)
                cur = kv_idx
                kv_idx, kv_phase = advance(kv_idx, kv_phase, self.kv_stages)
            self._p_to_regs(v)
            self._rescale(v)
            self._issue_pv(pv_mma, v, cur)
            warpgroup.wait_group(0)
            self._add_sums(v)
            release(kv_empty + cur, lane)
        return kv_idx, kv_phase

    @cute.jit
    def _merge_residual(self, res_args, res_idx: Int32, v, lse: cute.Tensor):
        """The hybrid's residual (residual): the warp's token's KV-outer partials of this KV head merged into
        its rows in registers, instead of a combine pass that reads and rewrites the output. acc_o holds the
        tile's normalized O and lse its LSE (natural log); lane k's res_idx is the token's rank-k partial (its
        G rows; -1 for a rank the tile packed), (m, l, unnormalized O), merged by log-sum-exp as the combine
        merges it."""
        _, mO, mM, mL, topk = res_args
        G = self.group
        rc, tOcO = rows_cols_view(v["acc_o"]), v["tOcO"]
        n_rows = const_expr(cute.size(rc, mode=[0]))
        n_cols = const_expr(cute.size(rc, mode=[1]))
        big_m = cute.make_rmem_tensor((n_rows,), Float32)
        big_l = cute.make_rmem_tensor((n_rows,), Float32)
        for r in cutlass.range_constexpr(n_rows):
            big_m[r] = lse[r]
            big_l[r] = Float32(cutlass.select_(lse[r] != -Float32.inf, Float32(1.0), Float32(0.0)))
        for k in cutlass.range(topk, unroll=1):
            idx = cute.arch.shuffle_sync(res_idx, k)
            if idx >= 0:
                for r in cutlass.range_constexpr(n_rows):
                    row = idx * G + tOcO[r, 0][0] % G
                    # the partials' rows x D pass 2^31 elements (N 16384 with every entry KV-outer's)
                    o_row = gmem_tile(mO, cutlass.Int64(row) * self.head_dim, (self.head_dim,))
                    m_k = mM[row]
                    m_new = cute.arch.fmax(big_m[r], m_k)
                    safe = Float32(cutlass.select_(m_new == -Float32.inf, Float32(0.0), m_new))
                    a = cute.arch.exp2((big_m[r] - safe) * LOG2E)
                    b = cute.arch.exp2((m_k - safe) * LOG2E)
                    big_l[r] = big_l[r] * a + b * mL[row]
                    big_m[r] = m_new
                    for c in cutlass.range_constexpr(n_cols):
                        rc[r, c] = rc[r, c] * a + b * Float32(o_row[tOcO[r, c][1]])
        for r in cutlass.range_constexpr(n_rows):
            seen = big_l[r] > Float32(0.0)
            safe = Float32(cutlass.select_(seen, big_l[r], Float32(1.0)))
            inv = Float32(cutlass.select_(seen, Float32(1.0) / safe, Float32(0.0)))
            lse[r] = Float32(cutlass.select_(seen, big_m[r] + cute.math.log2(safe) * LN2, -Float32.inf))
            for c in cutlass.range_constexpr(n_cols):
                rc[r, c] = rc[r, c] * inv

    @cute.jit
    def _store(self, st_copy: cute.TiledCopy, tRsO: cute.Tensor, tma_o: cute.CopyAtom, tOsO: cute.Tensor,
               tOgO: cute.Tensor, mLse: cute.Tensor, res_args, res_idx: Int32, v, tok0: Int32, ntok: Int32,
               head: Int32, hkv: Int32, warp: Int32, lane: Int32, ctid: Int32, out_scale: Float32,
               scale_log2: Float32, q_idx: Int32):
        """The warp's token: l reduced over each row's quad, O * out_scale / l as bf16 by stmatrix into the
        warp's own staging slot and one TMA store of its (G, D) rows; the LSE of its rows. A token past
        ntok stores nothing; a row with no visible key gets O = 0 and LSE -inf. o_in_q: the slot is the warp's
        rows of Q stage q_idx, and lane 0 waits until the store has read them."""
        G = self.group
        acc_o, m_run, l_run, alpha, tScS = v["acc_o"], v["m_run"], v["l_run"], v["alpha"], v["tScS"]
        n_rows = const_expr(cute.size(tScS, mode=[0]))
        lse = cute.make_rmem_tensor((n_rows,), Float32)
        for r in cutlass.range_constexpr(n_rows):
            total = l_run[r]
            if const_expr(not self.mma_sum):              # the quad's partial sums (mma_sum's: whole rows)
                total += cute.arch.shuffle_sync_bfly(total, offset=1)
                total += cute.arch.shuffle_sync_bfly(total, offset=2)
            seen = total > Float32(0.0)
            safe = Float32(cutlass.select_(seen, total, Float32(1.0)))
            alpha[r] = Float32(cutlass.select_(seen, out_scale / safe, Float32(0.0)))
            lse[r] = Float32(cutlass.select_(seen, (m_run[r] * scale_log2 + cute.math.log2(safe) - self.p_shift) * LN2,
                                             -Float32.inf))
        _scale_rows(acc_o, alpha)
        live = warp < ntok
        token = tok0 + warp
        if const_expr(self.pairs):                         # slot 0: token tok0, slot P / 2: tok0 + 1
            live = (warp % (self.tile_tokens // 2) == 0) & (warp // (self.tile_tokens // 2) < ntok)
            token = tok0 + warp // (self.tile_tokens // 2)
        if const_expr(self.residual):
            if live:
                self._merge_residual(res_args, res_idx, v, lse)
        r_o = cute.make_rmem_tensor_like(acc_o, cutlass.BFloat16)
        r_o.store(acc_o.load().to(cutlass.BFloat16))
        if live:
            if ctid % 4 == 0:
                for r in cutlass.range_constexpr(n_rows):
                    mLse[token * (hkv * G) + head * G + tScS[r, 0][0] % G] = lse[r]
        # per-warp O store (v21's): the warp's previous store has read its slot before stmatrix refills it
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()
        slot = warp
        if const_expr(self.o_in_q):
            cute.copy(st_copy, st_copy.retile(r_o), tRsO[None, None, None, q_idx])
            slot = q_idx * self.tile_tokens + warp
        else:
            cute.copy(st_copy, st_copy.retile(r_o), tRsO)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        if lane == 0:
            if live:
                cute.copy(tma_o, tOsO[None, slot], tOgO[None, token * hkv + head])
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.o_in_q):
                cute.arch.cp_async_bulk_wait_group(0, read=True)
