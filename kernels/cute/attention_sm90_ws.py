"""KV-outer attention stage for Hopper (sm_90a), v4, v7, v9, v10, v15-v18: warp-specialized, TMA, mbarrier pipelines.

Same contract as attention_sm90.py (v2; see its docstring and kernels/kv_outer/__init__.py): the
same arguments, the raw tile-ordered partial o (bf16), m and l (fp32), causal masking through the
per-row limits, fp8 with V d-major and P scaled by 2^P_SHIFT. Every tile of a CTA's cta_range slice
is real (the scheduler's slices end at the real tile count).

v4 (KvOuterAttentionSm90WarpSpecialized), what changes from v3 (attention_sm90_pipe.py):
* Three warpgroups (384 threads). Warpgroup 0 is the producer (setmaxnreg down to PRODUCER_REGS),
  warpgroups 1 and 2 the consumers (up to CONSUMER_REGS), 64 rows of every tile each.
* K and V: one TMA descriptor per tensor, made in the launcher over the (rows, D) view of the cache
  (bf16 V: rows of D values; fp8 V d-major: rows of `block` keys), box = one block x D slab (fp8 V:
  D x block). Slab s = page * Hkv + head, the same offset v2/v3 compute. Warp 0 of the producer
  loads a key's K and V once per key run (consecutive tiles of one key reuse the stage) into a
  2-stage ring: kv_full[s] (1 arrive + expect_tx of both boxes' bytes, completed by the TMA),
  kv_empty[s] (one arrive per consumer warp when the consumers leave that key run).
* Q: the producer warpgroup gathers each tile's 128 rows (csr_query picks the query, row (slot, g)
  = q[query, head * G + g]; empty slots repeat the last query) with cp.async into a ring of
  q_stages (2 bf16, 4 fp8); each producer thread ends its copies with cp.async.mbarrier.arrive.noinc
  on q_full[s], and the TILE_Q threads that compute the tile's per-slot visibility limits
  (q_limit[query] - key base; -1 for an empty slot) store them in shared memory next to the stage
  and arrive normally, so q_full[s] expects 128 + TILE_Q arrivals. q_empty[s] takes one arrive per
  consumer warp: after S = Q K^T for bf16 (P stays in registers), after O = P V for fp8 (P goes
  through the warpgroup's own Q rows of that stage, as in v3).
* Consumers: wait kv_full at a key change, wait q_full, fence the async proxy (the cp.async writes
  become wgmma operands), S on wgmma, one masked softmax step, m and l, O = P V on wgmma, the raw
  tile to o_part by 4-byte stores from registers. Phases are explicit (index, phase) pairs that flip
  when the index wraps; the producer starts its empty-barrier waits on phase 1 (they pass at once),
  the consumers their full-barrier waits on phase 0. Stage releases fence the async proxy first
  (the stage was read by wgmma and is refilled by cp.async / TMA). Every barrier wait goes through
  _wait, a watchdog that traps after WATCHDOG_NS, so a protocol bug fails the launch instead of
  hanging the GPU.

v7 (KvOuterAttentionSm90TmaStore): the O tile goes registers -> shared memory (a slot-staged buffer,
128-byte swizzle, conflict-free 4-byte stores) -> o_part by one TMA store per live slot, issued by
one thread per consumer warpgroup; only live slots are stored (o, and m, l of their rows). v4's
scattered 4-byte global stores filled the LSU queue the Q gather shares (ncu: lg_throttle).

v9 (KvOuterAttentionSm90Pipelined): v7 with the consumers software-pipelined across tiles:
S(t+1) = Q K^T and O(t) = P(t) V are issued back to back and the softmax of t+1 runs while the
tensor cores do P(t) V; then O(t) is stored.

v10 (KvOuterAttentionSm90TreeSoftmax): v9 with a cheaper softmax step: the key mask only in rows whose
limit falls inside the block, the row max and sum as pairwise trees instead of dependent chains.

v15 (KvOuterAttentionSm90Fp8RegP, fp8 only): v10 with fp8 P kept in registers as the A operand of P V
(regrouped from the S accumulator without shuffles; V's keys are stored permuted to match), so P no
longer goes through shared memory and a warpgroup barrier every tile.

v16 (KvOuterAttentionSm90JointRows): v15 with the softmax step over both rows a thread holds at once (they
lie in one slot, so one limit and one warp-uniform mask branch), the rows' trees and shuffles interleaved,
and each tile's key read from shared memory (the producer writes it next to the limits).

v17 (KvOuterAttentionSm90Stmatrix): v16 with O written to its staging buffer by stmatrix, eight
instructions per warp and tile instead of 32 4-byte stores with their swizzled addresses.

v18 (KvOuterAttentionSm90ProducerAhead, the default of both dtypes): v17 with the producer's global reads
(the next tile's key, edge and count; a tile's query indices and limits) issued before it waits for the
Q stage, so a freed stage is refilled by cp.async at once.

Shared memory: bf16 Q 2 x 32 KiB + K, V 2 x 32 KiB each = 192 KiB (+ 32 KiB O staging in v7, v9, v10);
fp8 Q 4 x 16 KiB + K, V 2 x 16 KiB each = 128 KiB (+ 32 KiB). One CTA per SM.

Import this module only with CUTE_DSL_ARCH set (build.py does) when no GPU is present.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils as cutlass_utils
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from .attention_sm90 import (DSL_DTYPES, LOG2E, AttentionLaunch, _gather_q_row, _row_copy, _rows_cols_view,
                             _softmax_row, _tile, check_tile)
from .attention_sm90_pipe import _acc_to_frg_a, _staged_smem_layout
from .manifest import KNOCKOUT_REMOVES, P_SHIFT, TRACE_PHASES

PRODUCER_REGS = 56           # 128 x 56 + 256 x 224 = 384 x 168 (the launch allocation): setmaxnreg
CONSUMER_REGS = 224          # moves registers only within the CTA's own allocation
# Deadlock watchdog: a barrier wait still incomplete WATCHDOG_NS after its first failed try_wait
# (%globaltimer, read only on that slow path; a legitimate wait here is microseconds) executes `trap`,
# so a pipeline bug surfaces as a launch error (unspecified launch failure) instead of a hung GPU.
WATCHDOG_NS = 10_000_000_000
# L2 cache policy of a TMA copy (the createpolicy encoding CUTLASS names CacheHintSm90::EVICT_FIRST): lines it
# brings in or writes are the first to go when L2 needs room (v20 tried it on v18; v28 on v23)
L2_EVICT_FIRST = 0x12F0000000000000


@dsl_user_op
def _clock(*, loc=None, ip=None) -> Int32:
    """The SM's 32-bit cycle counter (%clock)."""
    return Int32(nvvm.read_ptx_sreg_clock(T.i32(), loc=loc, ip=ip))


# 2^f on [-0.5, 0.5] by a cubic (coefficients fitted for relative error, 7.6e-5 at most in fp32)
EXP2_POLY = (0.05517556518316269, 0.24262112379074097, 0.6932611465454102, 0.999927282333374)


def _f32_hex(v: float) -> str:
    import struct
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


@dsl_user_op
def _exp2_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x on the FMA and ALU pipes instead of MUFU (FlashAttention-4's trick, here for Hopper): x
    clamped to >= -126, split as n + f with n = round(x) (the 1.5 x 2^23 shifter), 2^f by EXP2_POLY,
    and n added to the exponent field. 8 instructions, relative error under 1e-4; for x <= -126 (a
    masked key) a denormal near 1e-38 where ex2.approx.ftz gives 0."""
    c3, c2, c1, c0 = (_f32_hex(c) for c in EXP2_POLY)
    asm = ("{ .reg .f32 x, xi, n, f, p; .reg .b32 bi, bp;\n"
           "max.f32 x, $1, 0fC2FC0000;\n"
           "add.rn.f32 xi, x, 0f4B400000;\n"
           "sub.rn.f32 n, xi, 0f4B400000;\n"
           "sub.rn.f32 f, x, n;\n"
           f"fma.rn.f32 p, f, {c3}, {c2};\n"
           f"fma.rn.f32 p, p, f, {c1};\n"
           f"fma.rn.f32 p, p, f, {c0};\n"
           "mov.b32 bi, xi;\n"
           "mov.b32 bp, p;\n"
           "mad.lo.u32 bp, bi, 8388608, bp;\n"
           "mov.b32 $0, bp; }")
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], asm, "=f,f",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _trap(*, loc=None, ip=None) -> None:
    llvm.inline_asm(res=None, operands_=[], asm_string="trap;", constraints="~{memory}", has_side_effects=True,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def _wait(bar: cute.Pointer, phase: Int32):
    """mbarrier wait for `phase` with the deadlock watchdog."""
    done = cute.arch.mbarrier_try_wait(bar, phase)
    if not done:
        t0 = cute.arch.globaltimer()
        while not done:
            if cute.arch.globaltimer() - t0 > cutlass.Int64(WATCHDOG_NS):
                _trap()
            done = cute.arch.mbarrier_try_wait(bar, phase)


@cute.jit
def _advance(idx: Int32, phase: Int32, stages: cutlass.Constexpr):
    """The next (stage, phase) of a ring: the phase flips when the index wraps."""
    idx += 1
    if idx == stages:
        idx = Int32(0)
        phase ^= 1
    return idx, phase


@cute.jit
def _release(bar: cute.Pointer, lane: Int32):
    """One arrive per consumer warp on an empty barrier, after the warp's async-proxy reads: the stage
    was read by wgmma and is refilled by cp.async or TMA."""
    cute.arch.fence_view_async_shared()
    cute.arch.sync_warp()
    if lane == 0:
        cute.arch.mbarrier_arrive(bar)


def _fresh(tiled_mma: cute.TiledMma) -> cute.TiledMma:
    """A new handle on the same MMA value: setting its ACCUMULATE field inside a loop body then does
    not rebind the caller's handle (a value made in the body would not dominate uses after the loop)."""
    return tiled_mma.__new_from_mlir_values__(tiled_mma.__extract_mlir_values__())


def _pairwise(values: list, op):
    """Reduce a trace-time list of values as a balanced tree: depth log2(n) instead of a chain of n
    dependent operations (plain Python: runs while the kernel is traced)."""
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def _row(s_rc: cute.Tensor, r: int) -> list:
    return [s_rc[r, c] for c in range(cute.size(s_rc, mode=[1]))]


@cute.jit
def _softmax_row_tree(s_rc: cute.Tensor, tScS: cute.Tensor, r: cutlass.Constexpr, limit: Int32,
                      scale_log2: Float32, p_shift: cutlass.Constexpr, block: cutlass.Constexpr):
    """The same step as _softmax_row with fewer instructions on the consumers' path (v10): keys
    are masked only in rows whose limit falls inside the block (a query's own block; the other picks
    are wholly visible), and the row max and sum are pairwise trees of FMNMX / FADD rather than chains
    of 32 dependent operations (ncu, v9: the consumer warps mostly stall on fixed-latency dependencies
    and on issue)."""
    if limit < block - 1:
        for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            if tScS[r, c][1] > limit:
                s_rc[r, c] = -Float32.inf
    row_max = _pairwise(_row(s_rc, r), cute.arch.fmax)
    row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=1))
    row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=2))
    m_shift = Float32(-p_shift)
    if row_max != -Float32.inf:
        m_shift = row_max * scale_log2 - p_shift
    for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
        s_rc[r, c] = cute.arch.exp2(s_rc[r, c] * scale_log2 - m_shift)
    row_sum = _pairwise(_row(s_rc, r), lambda a, b: a + b)
    row_sum += cute.arch.shuffle_sync_bfly(row_sum, offset=1)
    row_sum += cute.arch.shuffle_sync_bfly(row_sum, offset=2)
    return row_max, row_sum


@cute.jit
def _mask_keys(s_rc: cute.Tensor, tScS: cute.Tensor, limit: Int32, block: cutlass.Constexpr):
    """Keys past `limit` to -inf in every row of s_rc, when the limit falls inside the block."""
    if limit < block - 1:
        for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                if tScS[r, c][1] > limit:
                    s_rc[r, c] = -Float32.inf


def _softmax_rows_joint(s_rc: cute.Tensor, scale_log2: Float32, p_shift, exp: bool = True, fma_every: int = 0):
    """v16: _softmax_row_tree's step for all rows of s_rc at once, with no branch between them, so the
    rows' max and sum trees, shuffles and exp2 interleave (v10 ran one row after the other, each behind
    its own mask branch: the consumer warps stalled on fixed-latency dependencies). Plain Python, traced
    inline. p_shift: log2 of the factor P is scaled by (an int, or a Float32 when the output scale is
    folded in). exp False: the exponent's argument is kept as P (the knock-out build that measures
    what the exponentials cost; its output is not attention). fma_every k > 0: every k-th column of a
    thread's row takes _exp2_fma instead of MUFU.EX2. Returns the lists of row maxima and sums, reduced
    over the four threads of a row."""
    n_r = cute.size(s_rc, mode=[0])
    maxes = [_pairwise(_row(s_rc, r), cute.arch.fmax) for r in range(n_r)]
    for offset in (1, 2):
        other = [cute.arch.shuffle_sync_bfly(m, offset=offset) for m in maxes]
        maxes = [cute.arch.fmax(m, o) for m, o in zip(maxes, other)]
    shifts = [Float32(cutlass.select_(m != -Float32.inf, m * scale_log2 - p_shift, Float32(-p_shift)))
              for m in maxes]
    for r in range(n_r):
        for c in range(cute.size(s_rc, mode=[1])):
            x = s_rc[r, c] * scale_log2 - shifts[r]
            if not exp:
                s_rc[r, c] = x
            elif fma_every and c % fma_every == fma_every - 1:
                s_rc[r, c] = _exp2_fma(x)
            else:
                s_rc[r, c] = cute.arch.exp2(x)
    sums = [_pairwise(_row(s_rc, r), lambda a, b: a + b) for r in range(n_r)]
    for offset in (1, 2):
        other = [cute.arch.shuffle_sync_bfly(x, offset=offset) for x in sums]
        sums = [x + o for x, o in zip(sums, other)]
    return maxes, sums


class KvOuterAttentionSm90WarpSpecialized(AttentionLaunch):
    """One compiled configuration of the v4 kernel (v7, v9 and v10 are subclasses that set the flags)."""

    num_threads = 384          # producer warpgroup + two consumer warpgroups
    wg_threads = 128
    num_consumer_warps = 8
    kernel_version = "v4-ws-tma"
    q_stages_by_dtype = {"bf16": 2, "fp8": 4}
    tma_store_o = False        # O through shared memory and TMA stores of live slots (m, l of live rows)
    pipelined = False          # consumers issue tile t+1's S with tile t's P V (with tma_store_o)
    tree_softmax = False       # mask only rows that need it; max and sum as pairwise trees
    fp8_reg_p = False          # fp8: P V takes P from registers (V's keys permuted to match, see _fp8_p_regs)
    joint_rows = False         # one softmax step over all of a thread's rows at once; next key from shared memory
    stmatrix_o = False         # O registers -> sO by stmatrix (with tma_store_o)
    prefetch_meta = False      # producer: next tile's metadata read ahead, query indices before the stage wait
    warp_store_o = False       # each consumer warp stores its own slot (no warpgroup barriers around the store)
    fold_out_scale = False     # bf16: out_scale applied to P through the exponent's shift, not to O
    l2_evict_first = ()        # TMA streams marked L2 evict-first: "kv" (K/V loads), "o" (O stores)
    exp_fma_every = 0          # k > 0: every k-th column's exponential on the FMA pipe (_exp2_fma), not MUFU
    # Knock-out builds (manifest.KNOCKOUTS; benchmarks/bounds_gpu.py): one piece of the consumers' per-tile
    # chain taken away to time the rest. Their outputs are not attention and are never checked or swept.
    knock_out = ""             # "", "o-store" (no TMA store of O), "exp" (no exp2), "softmax" (P = S), "bare" (both),
                               # "o-half" (every other slot's O store: half the partial bytes)
    # Phase-trace build (manifest.TRACE_VARIANTS, TRACE_PHASES; benchmarks/trace_gpu.py): each consumer warp
    # writes the SM clock at the TRACE_PHASES points of every pipelined iteration into m_part, in place of
    # the row maxima.
    trace_phases = False

    def __init__(self, dtype: str, tile_q: int = 8, group: int = 16, head_dim: int = 128, block: int = 128,
                 ctas_per_sm: int = 1):
        check_tile(dtype, tile_q, group, head_dim, block, fixed="v4")
        if ctas_per_sm != 1:
            raise ValueError(f"v4 runs one CTA per SM (384 threads, 128-224 KiB smem); got {ctas_per_sm}")
        if self.joint_rows and group % 16:
            raise ValueError(f"the joint-rows softmax needs each warp's 16 rows in one slot (G % 16 == 0), got G {group}")
        if self.pipelined and not self.tma_store_o:
            raise ValueError("the pipelined consumer stores O by TMA")
        self.dtype_name = dtype
        self.dtype = DSL_DTYPES[dtype]
        self.v_d_major = dtype == "fp8"
        self.fp8_reg_p = self.fp8_reg_p and dtype == "fp8"
        self.p_in_regs = dtype == "bf16" or self.fp8_reg_p
        self.tile_q, self.group, self.head_dim, self.block = tile_q, group, head_dim, block
        self.rows = tile_q * group
        self.ctas_per_sm = ctas_per_sm
        self.p_shift = P_SHIFT[dtype]
        self.q_stages = self.q_stages_by_dtype[dtype]
        self.kv_stages = 2
        self.kv_tx_bytes = 2 * block * head_dim * self.dtype.width // 8     # K box + V box
        self.lim_extra = 2 if self.joint_rows else 1     # after the slots' limits: the live count (and the key)
        # fp8 P keeps its 2^P_SHIFT scale: a factor v_scale in it would push P into e4m3's subnormals
        self.fold_out_scale = self.fold_out_scale and dtype == "bf16"
        if self.warp_store_o and not (self.stmatrix_o and self.joint_rows):
            raise ValueError("the per-warp O store needs stmatrix staging and one slot per warp (v17 and later)")
        if self.knock_out and self.knock_out not in KNOCKOUT_REMOVES:
            raise ValueError(f"unknown knock-out {self.knock_out!r}")

    # ---- host side ----------------------------------------------------------------------------
    @cute.jit
    def _launch(self, mQ, mK, mV, mCsrQuery, mTileKey, mTileEdge, mTileCount, mCtaRange, mPageBlock, mQLimit,
                mO, mM, mL, hkv, num_pages, scale, out_scale, stream):
        dt = self.dtype
        D, BLK = self.head_dim, self.block
        kmaj, mnmaj = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        qk_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj, Float32, (2, 1, 1), (64, BLK))
        if const_expr(self.p_in_regs):
            pv_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj if const_expr(self.v_d_major) else mnmaj,
                                                 Float32, (2, 1, 1), (64, D), a_source=warpgroup.OperandSource.RMEM)
        else:
            pv_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj if const_expr(self.v_d_major) else mnmaj,
                                                 Float32, (2, 1, 1), (64, D))
        sQ_layout = _staged_smem_layout(dt, self.rows, D, self.q_stages)
        sK_layout = _staged_smem_layout(dt, BLK, D, self.kv_stages)
        v_tile = (D, BLK) if const_expr(self.v_d_major) else (BLK, D)
        sV_layout = _staged_smem_layout(dt, v_tile[0], v_tile[1], self.kv_stages)
        sP_layout = _staged_smem_layout(dt, self.rows, BLK, self.q_stages)   # fp8: over sQ (same shape)

        # TMA descriptors: K as (rows, D), V as (rows, D) (bf16) or (rows, block) (fp8 d-major); one box
        # is one slab, the smem side is one stage of the same swizzled layout the wgmma reads.
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, gK_tma = cpasync.make_tiled_tma_atom(tma_op, mK, cute.slice_(sK_layout, (None, None, 0)), (BLK, D))
        tma_v, gV_tma = cpasync.make_tiled_tma_atom(tma_op, mV, cute.slice_(sV_layout, (None, None, 0)), v_tile)
        # O staging (v7, v9, v10): one (G, D) slab per tile slot (stage = slot), stored by TMA slot by slot
        sO_layout = _staged_smem_layout(cutlass.BFloat16, self.group, D, self.tile_q if const_expr(self.tma_store_o) else 1)
        tma_o, gO_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO,
                                                    cute.slice_(sO_layout, (None, None, 0)), (self.group, D))

        SharedStorage = self._storage_struct(sQ_layout, sK_layout, sV_layout, self.tile_q,
                                             cute.cosize(sO_layout) if const_expr(self.tma_store_o) else 8)
        self.kernel(qk_mma, pv_mma, tma_k, gK_tma, tma_v, gV_tma, tma_o, gO_tma, mQ, mCsrQuery, mTileKey, mTileEdge,
                    mTileCount, mCtaRange, mPageBlock, mQLimit, mO, mM, mL, hkv, num_pages,
                    scale * LOG2E, scale, out_scale, sQ_layout, sK_layout, sV_layout, sP_layout, sO_layout).launch(
            grid=(mCtaRange.shape[0], 1, 1), block=(self.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=1,
            preferred_smem_carveout=100, stream=stream)

    def _storage_struct(self, sQ_layout, sK_layout, sV_layout, lim_slots: int, o_elems: int):
        """The CTA's shared-memory struct (kept as self.shared_storage for the kernel's _shared): the
        four barrier arrays, the limits table (lim_slots + lim_extra per Q stage), the Q, K and V stages
        and o_elems bf16 of O staging, each stage 1024-byte aligned for the 128-byte swizzle."""
        dt, mem, align = self.dtype, cute.struct.MemRange, cute.struct.Align
        # the field types as objects, not annotations: this module's `from __future__ import annotations`
        # would hand cute.struct strings it cannot resolve outside a jit function's own scope
        fields = {"q_full": mem[cutlass.Int64, self.q_stages], "q_empty": mem[cutlass.Int64, self.q_stages],
                  "kv_full": mem[cutlass.Int64, self.kv_stages], "kv_empty": mem[cutlass.Int64, self.kv_stages],
                  "sLim": mem[Int32, self.q_stages * (lim_slots + self.lim_extra)],
                  "sQ": align[mem[dt, cute.cosize(sQ_layout)], 1024],
                  "sK": align[mem[dt, cute.cosize(sK_layout)], 1024],
                  "sV": align[mem[dt, cute.cosize(sV_layout)], 1024],
                  "sO": align[mem[cutlass.BFloat16, o_elems], 1024]}
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        return self.shared_storage

    # ---- device side --------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_k: cute.CopyAtom, gK_tma: cute.Tensor,
               tma_v: cute.CopyAtom, gV_tma: cute.Tensor, tma_o: cute.CopyAtom, gO_tma: cute.Tensor,
               mQ: cute.Tensor, mCsrQuery: cute.Tensor,
               mTileKey: cute.Tensor, mTileEdge: cute.Tensor, mTileCount: cute.Tensor,
               mCtaRange: cute.Tensor, mPageBlock: cute.Tensor, mQLimit: cute.Tensor,
               mO: cute.Tensor, mM: cute.Tensor, mL: cute.Tensor,
               hkv: Int32, num_pages: Int32, scale_log2: Float32, scale: Float32, out_scale: Float32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group = cute.arch.make_warp_uniform(tidx // self.wg_threads)

        storage, (q_full, q_empty, kv_full, kv_empty), sLim, sQ, sK, sV, sO = self._shared(
            sQ_layout, sK_layout, sV_layout, sO_layout, self.tile_q)   # sLim: limits, count[, key]
        sP = storage.sQ.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)       # fp8 P over Q (ROWS, BLK, QS)
        self._init_barriers((q_full, q_empty, kv_full, kv_empty), warp_idx, self.wg_threads + self.tile_q,
                            self.num_consumer_warps, (tma_k, tma_v, tma_o) if const_expr(self.tma_store_o)
                            else (tma_k, tma_v))

        begin = mCtaRange[cta, 0]
        n_tiles = mCtaRange[cta, 1] - begin
        if warp_group == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.producer(tma_k, gK_tma, tma_v, gV_tma, mQ, mCsrQuery, mTileKey, mTileEdge, mTileCount,
                          mPageBlock, mQLimit, sQ, sK, sV, sLim, q_full, q_empty, kv_full, kv_empty,
                          begin, n_tiles, hkv, num_pages, tidx, warp_idx)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            bars = (q_full, q_empty, kv_full, kv_empty)
            args = (qk_mma, pv_mma, tma_o, gO_tma, sO, mO, mM, mL, mTileKey, sQ, sK, sV, sP, sLim, bars, begin,
                    n_tiles, scale_log2, scale, out_scale, tidx - self.wg_threads, warp_group - 1)
            if const_expr(self.pipelined):
                self.consumer_pipelined(*args)
            else:
                self.consumer(*args)

    def _shared(self, sQ_layout, sK_layout, sV_layout, sO_layout, lim_slots: int):
        """The CTA's shared memory: the storage, its four barrier arrays (Q full / empty, K/V full /
        empty), the per-stage limits table (lim_slots limits + lim_extra values per Q stage) and the Q
        (rows, D, QS), K (BLK, D, KS), V (BLK, D or D, BLK, KS) and O staging (G, D, slots) tensors.
        Plain Python, traced inline."""
        storage = cutlass_utils.SmemAllocator().allocate(self.shared_storage)
        bars = (storage.q_full.data_ptr(), storage.q_empty.data_ptr(), storage.kv_full.data_ptr(),
                storage.kv_empty.data_ptr())
        sLim = storage.sLim.get_tensor(cute.make_layout((lim_slots + self.lim_extra, self.q_stages)))
        tensors = [getattr(storage, name).get_tensor(layout.outer, swizzle=layout.inner)
                   for name, layout in (("sQ", sQ_layout), ("sK", sK_layout), ("sV", sV_layout), ("sO", sO_layout))]
        return (storage, bars, sLim, *tensors)

    @cute.jit
    def _init_barriers(self, bars, warp_idx: Int32, q_full_count: int, q_empty_count: int, tmas):
        """Warp 0 initializes the barriers (Q full expects q_full_count arrivals, Q empty q_empty_count,
        K/V full one arrival plus the TMA bytes, K/V empty every consumer warp) and prefetches the TMA
        descriptors; then the whole CTA syncs."""
        q_full, q_empty, kv_full, kv_empty = bars
        if warp_idx == 0:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(self.q_stages):
                    cute.arch.mbarrier_init(q_full + s, q_full_count)
                    cute.arch.mbarrier_init(q_empty + s, q_empty_count)
                for s in cutlass.range_constexpr(self.kv_stages):
                    cute.arch.mbarrier_init(kv_full + s, 1)
                    cute.arch.mbarrier_init(kv_empty + s, self.num_consumer_warps)
            for atom in tmas:
                cpasync.prefetch_descriptor(atom)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

    # ---- producer warpgroup -----------------------------------------------------------------------
    @cute.jit
    def producer(self, tma_k: cute.CopyAtom, gK_tma: cute.Tensor, tma_v: cute.CopyAtom, gV_tma: cute.Tensor,
                 mQ: cute.Tensor, mCsrQuery: cute.Tensor, mTileKey: cute.Tensor, mTileEdge: cute.Tensor,
                 mTileCount: cute.Tensor, mPageBlock: cute.Tensor, mQLimit: cute.Tensor,
                 sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sLim: cute.Tensor,
                 q_full: cute.Pointer, q_empty: cute.Pointer, kv_full: cute.Pointer, kv_empty: cute.Pointer,
                 begin: Int32, n_tiles: Int32, hkv: Int32, num_pages: Int32, tidx: Int32, warp_idx: Int32):
        G, BLK, ROWS = self.group, self.block, self.rows
        tKgK, tKsK, tVgV, tVsV, g2s, thr_q, tQcQ = self._producer_copies(tma_k, gK_tma, tma_v, gV_tma, sK, sV,
                                                                          ROWS, tidx)
        hq = hkv * G

        if const_expr(self.prefetch_meta):
            self._producer_loop_prefetch(tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, g2s, thr_q, tQcQ, mQ, mCsrQuery, mTileKey,
                                         mTileEdge, mTileCount, mPageBlock, mQLimit, sQ, sLim, q_full, q_empty,
                                         kv_full, kv_empty, begin, n_tiles, hkv, num_pages, tidx, warp_idx)
            return
        q_idx = Int32(0)
        q_phase = Int32(1)           # empty barriers: the first wait on each stage passes at once
        kv_idx = Int32(0)
        kv_phase = Int32(1)
        loaded_key = Int32(-1)
        for i in cutlass.range(n_tiles, unroll=1):
            t = begin + i
            key = mTileKey[t]
            head = key // num_pages
            page = key - head * num_pages
            if key != loaded_key:
                # K and V of this key run: one TMA box each into the next K/V stage
                self._load_kv(tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, kv_full, kv_empty, kv_idx, kv_phase,
                              page * hkv + head, warp_idx)
                loaded_key = key
                kv_idx, kv_phase = _advance(kv_idx, kv_phase, self.kv_stages)

            edge = mTileEdge[t]
            count = mTileCount[t]
            _wait(q_empty + q_idx, q_phase)
            self._gather_q(g2s, thr_q, tQcQ, sQ, q_idx, mQ, hq, head,
                           lambda m, row: mCsrQuery[edge + cutlass.min(row // G, count - 1)])
            # arrives on q_full when this thread's copies have landed (counts as one of 128)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_mbarrier_arrive_noinc(q_full + q_idx)
            # the tile's per-slot visibility limits: last visible key offset in the block, -1 none
            if tidx < self.tile_q:
                limit = Int32(-1)
                if tidx < count:
                    limit = mQLimit[mCsrQuery[edge + tidx]] - mPageBlock[page] * BLK
                sLim[tidx, q_idx] = limit
                if const_expr(self.tma_store_o):
                    if tidx == 0:
                        sLim[self.tile_q, q_idx] = count
                        if const_expr(self.joint_rows):
                            sLim[self.tile_q + 1, q_idx] = key
                cute.arch.mbarrier_arrive(q_full + q_idx)
            q_idx, q_phase = _advance(q_idx, q_phase, self.q_stages)
        # drain (the consumers wait for every copy anyway)
        cute.arch.cp_async_wait_group(0)

    def _producer_copies(self, tma_k, gK_tma, tma_v, gV_tma, sK, sV, q_rows: int, tidx):
        """The producer's copies: TMA partitions of K and V (gK_tma tiled by slabs -> (TMA, slab), the
        stages -> (TMA, stage)), and the cp.async Q gather of q_rows rows by the 128 producer threads, a
        row of D elements per threads_per_row threads: the tiled copy, this thread's slice and its (row,
        col) coordinates. Plain Python, traced inline."""
        dt, D, BLK = self.dtype, self.head_dim, self.block
        v_tile = (D, BLK) if const_expr(self.v_d_major) else (BLK, D)
        gK = cute.local_tile(gK_tma, (BLK, D), (None, 0))                  # (BLK, D, slabs)
        gV = cute.local_tile(gV_tma, v_tile, (None, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        g2s = _row_copy(dt, D, self.wg_threads)
        thr_q = g2s.get_slice(tidx)
        tQcQ = thr_q.partition_S(cute.make_identity_tensor((q_rows, D)))
        return tKgK, tKsK, tVgV, tVsV, g2s, thr_q, tQcQ

    @cute.jit
    def _load_kv(self, tma_k: cute.CopyAtom, tKgK: cute.Tensor, tKsK: cute.Tensor, tma_v: cute.CopyAtom,
                 tVgV: cute.Tensor, tVsV: cute.Tensor, kv_full: cute.Pointer, kv_empty: cute.Pointer,
                 kv_idx: Int32, kv_phase: Int32, slab: Int32, warp_idx: Int32):
        """Warp 0: wait for K/V stage kv_idx to be free, then one TMA box each of K and V (slab) into it."""
        if warp_idx == 0:
            _wait(kv_empty + kv_idx, kv_phase)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(kv_full + kv_idx, self.kv_tx_bytes)
            cute.copy(tma_k, tKgK[None, slab], tKsK[None, kv_idx], tma_bar_ptr=kv_full + kv_idx, **self.l2_hint("kv"))
            cute.copy(tma_v, tVgV[None, slab], tVsV[None, kv_idx], tma_bar_ptr=kv_full + kv_idx, **self.l2_hint("kv"))

    def without(self, piece: str) -> bool:
        """Whether this build is a knock-out that removes `piece` of the per-tile chain
        (manifest.KNOCKOUT_REMOVES)."""
        return piece in KNOCKOUT_REMOVES.get(self.knock_out, ())

    def stores_slot(self, slot):
        """Whether the O store of a tile slot is issued: always (Python True, so no branch is traced),
        or, in the o-half knock-out, for even slots (a Python bool for an unrolled slot, else a runtime
        test)."""
        return slot % 2 == 0 if self.without("o-half") else True

    def l2_hint(self, stream: str) -> dict:
        """cute.copy's cache-policy argument for a TMA stream ("kv" loads, "o" stores): evict-first where
        l2_evict_first names it, else nothing (the default policy)."""
        return {"cache_policy": cutlass.Int64(L2_EVICT_FIRST)} if stream in self.l2_evict_first else {}

    def _gather_q(self, g2s, thr_q, tQcQ: cute.Tensor, sQ: cute.Tensor, q_idx, mQ: cute.Tensor, hq, head,
                  query_of):
        """This thread's cp.async copies of one tile's Q rows into stage q_idx: row r = (slot, g) comes
        from q[query, head * G + g], query = query_of(copy pass m, r) (a slot's query; empty slots
        repeat the last one: finite data, their rows are masked). Plain Python, traced inline."""
        dt, G, D = self.dtype, self.group, self.head_dim
        tQsQ = thr_q.partition_D(sQ[None, None, q_idx])
        for m in range(cute.size(tQcQ, mode=[1])):
            row = tQcQ[0, m, 0][0]
            q_row = _tile(mQ, cutlass.Int64(query_of(m, row) * hq + head * G + row % G) * D, (D,))
            _gather_q_row(dt, q_row, tQcQ, tQsQ, m, g2s)

    @cute.jit
    def _producer_loop_prefetch(self, tma_k: cute.CopyAtom, tKgK: cute.Tensor, tKsK: cute.Tensor,
                                tma_v: cute.CopyAtom, tVgV: cute.Tensor, tVsV: cute.Tensor, g2s, thr_q, tQcQ: cute.Tensor,
                                mQ: cute.Tensor, mCsrQuery: cute.Tensor, mTileKey: cute.Tensor,
                                mTileEdge: cute.Tensor, mTileCount: cute.Tensor, mPageBlock: cute.Tensor,
                                mQLimit: cute.Tensor, sQ: cute.Tensor, sLim: cute.Tensor, q_full: cute.Pointer,
                                q_empty: cute.Pointer, kv_full: cute.Pointer, kv_empty: cute.Pointer, begin: Int32,
                                n_tiles: Int32, hkv: Int32, num_pages: Int32, tidx: Int32, warp_idx: Int32):
        """v18: the producer loop with its global reads off the path from a free Q stage to the copies:
        the next tile's (key, edge, count) are read while this tile is gathered, and a tile's query
        indices (one per slot, the same eight for every thread) and visibility limit are read before
        the wait for its Q stage. A thread's rows in copy pass m all lie in slot m * rows_per_pass // G
        (rows_per_pass = 128 / threads_per_row divides G), so each pass reads its query from a register."""
        dt, G, D, BLK = self.dtype, self.group, self.head_dim, self.block
        rows_per_pass = self.wg_threads // (D // (128 // dt.width))
        hq = hkv * G
        end = begin + n_tiles
        meta = cute.make_rmem_tensor((3,), Int32)        # key, edge, count of the tile gathered next
        queries = cute.make_rmem_tensor((self.tile_q,), Int32)
        if n_tiles > 0:
            meta[0] = mTileKey[begin]
            meta[1] = mTileEdge[begin]
            meta[2] = mTileCount[begin]
        q_idx = Int32(0)
        q_phase = Int32(1)
        kv_idx = Int32(0)
        kv_phase = Int32(1)
        loaded_key = Int32(-1)
        for i in cutlass.range(n_tiles, unroll=1):
            t = begin + i
            key = meta[0]
            edge = meta[1]
            count = meta[2]
            t_next = cutlass.min(t + 1, end - 1)
            meta[0] = mTileKey[t_next]
            meta[1] = mTileEdge[t_next]
            meta[2] = mTileCount[t_next]
            for s in cutlass.range_constexpr(self.tile_q):
                queries[s] = mCsrQuery[edge + cutlass.min(s, count - 1)]
            head = key // num_pages
            page = key - head * num_pages
            limit = Int32(-1)
            if tidx < count:
                if tidx < self.tile_q:
                    limit = mQLimit[mCsrQuery[edge + tidx]] - mPageBlock[page] * BLK
            if key != loaded_key:
                self._load_kv(tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, kv_full, kv_empty, kv_idx, kv_phase,
                              page * hkv + head, warp_idx)
                loaded_key = key
                kv_idx, kv_phase = _advance(kv_idx, kv_phase, self.kv_stages)
            _wait(q_empty + q_idx, q_phase)
            self._gather_q(g2s, thr_q, tQcQ, sQ, q_idx, mQ, hq, head,
                           lambda m, row: queries[m * rows_per_pass // G])
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_mbarrier_arrive_noinc(q_full + q_idx)
            if tidx < self.tile_q:
                sLim[tidx, q_idx] = limit
                if tidx == 0:
                    sLim[self.tile_q, q_idx] = count
                    sLim[self.tile_q + 1, q_idx] = key
                cute.arch.mbarrier_arrive(q_full + q_idx)
            q_idx, q_phase = _advance(q_idx, q_phase, self.q_stages)
        cute.arch.cp_async_wait_group(0)

    # ---- consumer warpgroups ----------------------------------------------------------------------
    def _views(self, qk_mma, pv_mma, tma_o, gO_tma, sO, sQ, sK, sV, sP, ctid):
        """This thread's MMA operand fragments, row coordinates and O store partitions."""
        G, D, BLK, ROWS = self.group, self.head_dim, self.block, self.rows
        if const_expr(self.v_d_major):
            sVt = sV                                                             # (D, BLK, KS)
        else:
            sVt = cute.composition(sV, cute.make_ordered_layout((D, BLK, self.kv_stages), order=(1, 0, 2)))
        thr_qk = qk_mma.get_slice(ctid)
        thr_pv = pv_mma.get_slice(ctid)
        v = dict(thr_qk=thr_qk, thr_pv=thr_pv,
                 tSrQ=thr_qk.make_fragment_A(thr_qk.partition_A(sQ)),           # (MMA, M, K, stage)
                 tSrK=thr_qk.make_fragment_B(thr_qk.partition_B(sK)),
                 tOrV=thr_pv.make_fragment_B(thr_pv.partition_B(sVt)),
                 tScS=_rows_cols_view(thr_qk.partition_C(cute.make_identity_tensor((ROWS, BLK)))),
                 tOrP=None, tSsP=None, tRsO=None, tOsO=None, tOgO=None)
        if const_expr(not self.p_in_regs):
            v["tOrP"] = thr_pv.make_fragment_A(thr_pv.partition_A(sP))           # fp8 P over Q rows
            v["tSsP"] = thr_qk.partition_C(sP)
        if const_expr(self.tma_store_o):
            # registers -> sO in the accumulator's own layout over the (ROWS, D) view of the slot-staged
            # buffer (row = slot * G + g; 4-byte stores, conflict-free under the 128-byte swizzle); sO ->
            # o_part by one TMA store per live slot (a G x D slab, contiguous in o_part)
            sO_tile = cute.composition(sO, cute.make_layout(((G, self.tile_q), D), stride=((1, G * D), G)))
            if const_expr(self.stmatrix_o):
                # stmatrix: one instruction stores four 8x8 bf16 blocks (eight registers' worth of O)
                st_copy = cute.make_tiled_copy_C(
                    cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16), pv_mma)
                v["st_copy"] = st_copy
                v["tRsO"] = st_copy.get_slice(ctid).partition_D(sO_tile)
            else:
                v["tRsO"] = thr_pv.partition_C(sO_tile)
            gO = cute.local_tile(gO_tma, (G, D), (None, 0))                      # (G, D, slabs)
            v["tOsO"], v["tOgO"] = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                                         cute.group_modes(gO, 0, 2))
        return v

    def _consumer_state(self, qk_mma, pv_mma, tma_o, gO_tma, sO, sQ, sK, sV, sP, ctid, out_scale):
        """What every consumer loop starts from: the lane, the views (with P's scales) and the registers."""
        v = self._views(qk_mma, pv_mma, tma_o, gO_tma, sO, sQ, sK, sV, sP, ctid)
        v["p_bias"], v["l_scale"] = self._p_scales(out_scale)
        return cute.arch.lane_idx(), v, self._registers(v)

    def _p_scales(self, out_scale):
        """(p_bias, l_scale): P = exp2(S scale_log2 - row max scale_log2 + p_bias), l = row sum l_scale.
        p_bias is P_SHIFT, plus log2 out_scale where the output scale is folded into P (v22: P V comes out
        in output units, so O needs no multiply, and l is divided back; both once per thread)."""
        if const_expr(self.fold_out_scale):
            return (Float32(self.p_shift) + cute.math.log2(out_scale),
                    Float32(1.0 / (1 << self.p_shift)) / out_scale)
        return self.p_shift, 1.0 / (1 << self.p_shift)

    def _o_bf16(self, acc_o: cute.Tensor, out_scale):
        """O as bf16 in the accumulator's layout, times out_scale unless that is folded into P."""
        r_o = cute.make_rmem_tensor_like(acc_o, cutlass.BFloat16)
        if const_expr(self.fold_out_scale):
            r_o.store(acc_o.load().to(cutlass.BFloat16))
        else:
            r_o.store((acc_o.load() * out_scale).to(cutlass.BFloat16))
        return r_o

    def _registers(self, v):
        """The S and O accumulators, the per-row limits and P (bf16: the A operand of P V in registers;
        fp8: P before it goes to shared memory)."""
        thr_qk, thr_pv, tScS = v["thr_qk"], v["thr_pv"], v["tScS"]
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((self.rows, self.block)), Float32)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((self.rows, self.head_dim)), Float32)
        lim = cute.make_rmem_tensor((cute.size(tScS, mode=[0]),), Int32)
        if const_expr(self.fp8_reg_p):
            r_p = cute.make_rmem_tensor(thr_pv.partition_shape_A((self.rows, self.block)), self.dtype)
        else:
            r_p = cute.make_rmem_tensor_like(_acc_to_frg_a(acc_s) if const_expr(self.p_in_regs) else acc_s, self.dtype)
        return acc_s, acc_o, lim, r_p

    @cute.jit
    def consumer(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_o: cute.CopyAtom, gO_tma: cute.Tensor,
                 sO: cute.Tensor, mO: cute.Tensor, mM: cute.Tensor, mL: cute.Tensor, mTileKey: cute.Tensor,
                 sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sP: cute.Tensor, sLim: cute.Tensor, bars,
                 begin: Int32, n_tiles: Int32, scale_log2: Float32, scale: Float32, out_scale: Float32,
                 ctid: Int32, cwg: Int32):
        """v4, v7: one tile at a time: S, softmax, P V, store."""
        q_full, q_empty, kv_full, kv_empty = bars
        lane, v, (acc_s, acc_o, lim, r_p) = self._consumer_state(qk_mma, pv_mma, tma_o, gO_tma, sO, sQ, sK, sV, sP,
                                                                 ctid, out_scale)
        q_idx = Int32(0)
        q_phase = Int32(0)
        kv_idx = Int32(0)
        kv_phase = Int32(0)
        cur_key = Int32(-1)
        for i in cutlass.range(n_tiles, unroll=1):
            t = begin + i
            key = mTileKey[t]
            if key != cur_key:
                if cur_key >= 0:
                    _release(kv_empty + kv_idx, lane)          # leave the previous key run
                    kv_idx, kv_phase = _advance(kv_idx, kv_phase, self.kv_stages)
                _wait(kv_full + kv_idx, kv_phase)
                cur_key = key
            _wait(q_full + q_idx, q_phase)
            # the Q rows arrived by cp.async (generic proxy); the wgmma reads them through the async proxy
            cute.arch.fence_view_async_shared()
            self._issue_s(qk_mma, acc_s, v, q_idx, kv_idx)
            live = self._softmax_after_s(acc_s, sLim, lim, v, q_empty, q_idx, t, mM, mL, scale_log2, scale, lane,
                                         ctid, 0)
            self._prepare_p(acc_s, r_p, v, q_idx, cwg)
            self._issue_pv(pv_mma, acc_o, r_p, v, q_idx, kv_idx)
            warpgroup.wait_group(0)
            if const_expr(not self.p_in_regs):
                _release(q_empty + q_idx, lane)               # fp8: P (over Q) of this stage has been read
            self._store_o(tma_o, acc_o, out_scale, v, mO, t, live, ctid, cwg)
            q_idx, q_phase = _advance(q_idx, q_phase, self.q_stages)
        self._drain_o(ctid)

    @cute.jit
    def consumer_pipelined(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_o: cute.CopyAtom,
                           gO_tma: cute.Tensor, sO: cute.Tensor, mO: cute.Tensor, mM: cute.Tensor, mL: cute.Tensor,
                           mTileKey: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                           sP: cute.Tensor, sLim: cute.Tensor, bars, begin: Int32, n_tiles: Int32,
                           scale_log2: Float32, scale: Float32, out_scale: Float32, ctid: Int32, cwg: Int32):
        """v9, v10: per tile t, S(t+1) and P(t) V are issued back to back, the softmax of t+1 runs while
        the tensor cores do P(t) V, then O(t) is stored. (q_idx, kv_idx) are the stages of the tile
        whose S is issued next, (cur_q, cur_kv) those of the tile whose P V is."""
        q_full, q_empty, kv_full, kv_empty = bars
        lane, v, (acc_s, acc_o, lim, r_p) = self._consumer_state(qk_mma, pv_mma, tma_o, gO_tma, sO, sQ, sK, sV, sP,
                                                                 ctid, out_scale)
        q_idx = Int32(0)
        q_phase = Int32(0)
        kv_idx = Int32(0)
        kv_phase = Int32(0)
        cur_q = Int32(0)
        cur_kv = Int32(0)
        cur_key = Int32(-1)
        cur_live = Int32(0)
        if n_tiles > 0:
            # prologue: S and softmax of the first tile
            cur_key = mTileKey[begin]
            _wait(kv_full + kv_idx, kv_phase)
            _wait(q_full + q_idx, q_phase)
            cute.arch.fence_view_async_shared()
            self._issue_s(qk_mma, acc_s, v, q_idx, kv_idx)
            cur_live = self._softmax_after_s(acc_s, sLim, lim, v, q_empty, q_idx, begin, mM, mL, scale_log2,
                                             scale, lane, ctid, 0)
            self._prepare_p(acc_s, r_p, v, q_idx, cwg)
            cur_q, cur_kv = q_idx, kv_idx
            q_idx, q_phase = _advance(q_idx, q_phase, self.q_stages)
        t_start = Int32(0)
        if const_expr(self.trace_phases):
            cute.arch.barrier(barrier_id=5, number_of_threads=2 * self.wg_threads)   # one time base for both
            t_start = _clock()
        for i in cutlass.range(n_tiles - 1, unroll=1):
            t = begin + i
            stamps = [_clock()] if const_expr(self.trace_phases) else []
            if const_expr(self.joint_rows):
                # the producer wrote the key next to the limits: no dependent global load per tile
                _wait(q_full + q_idx, q_phase)
                next_key = sLim[self.tile_q + 1, q_idx]
                if next_key != cur_key:
                    kv_idx, kv_phase = _advance(kv_idx, kv_phase, self.kv_stages)
                    _wait(kv_full + kv_idx, kv_phase)
            else:
                next_key = mTileKey[t + 1]
                if next_key != cur_key:
                    kv_idx, kv_phase = _advance(kv_idx, kv_phase, self.kv_stages)
                    _wait(kv_full + kv_idx, kv_phase)
                _wait(q_full + q_idx, q_phase)
            if const_expr(self.trace_phases):
                stamps.append(_clock())
            cute.arch.fence_view_async_shared()
            self._issue_s(qk_mma, acc_s, v, q_idx, kv_idx)
            self._issue_pv(pv_mma, acc_o, r_p, v, cur_q, cur_kv)
            if const_expr(self.trace_phases):
                stamps.append(_clock())
                warpgroup.wait_group(1)                       # (the softmax step's own wait then passes)
                stamps.append(_clock())
            # softmax of t+1 while P(t) V runs on the tensor cores
            next_live = self._softmax_after_s(acc_s, sLim, lim, v, q_empty, q_idx, t + 1, mM, mL, scale_log2,
                                              scale, lane, ctid, 1)
            if const_expr(self.trace_phases):
                stamps.append(_clock())
            warpgroup.wait_group(0)
            if const_expr(self.trace_phases):
                stamps.append(_clock())
            if const_expr(not self.p_in_regs):
                _release(q_empty + cur_q, lane)               # P(t) over its Q rows has been read
            if next_key != cur_key:
                _release(kv_empty + cur_kv, lane)             # the key run of t is done
            self._store_o(tma_o, acc_o, out_scale, v, mO, t, cur_live, ctid, cwg)
            if const_expr(self.trace_phases):
                stamps.append(_clock())
            self._prepare_p(acc_s, r_p, v, q_idx, cwg)        # into the operand P(t) V has finished reading
            if const_expr(self.trace_phases):
                stamps.append(_clock())
                if lane == 0:
                    base = t * self.rows + 16 * (ctid // 32)
                    for k in cutlass.range_constexpr(len(TRACE_PHASES)):
                        mM[base + k] = Float32(stamps[k] - t_start)
            cur_q, cur_kv, cur_key, cur_live = q_idx, kv_idx, next_key, next_live
            q_idx, q_phase = _advance(q_idx, q_phase, self.q_stages)
        if n_tiles > 0:
            # the last tile: P V and its store only
            self._issue_pv(pv_mma, acc_o, r_p, v, cur_q, cur_kv)
            warpgroup.wait_group(0)
            if const_expr(not self.p_in_regs):
                _release(q_empty + cur_q, lane)
            self._store_o(tma_o, acc_o, out_scale, v, mO, begin + n_tiles - 1, cur_live, ctid, cwg)
        self._drain_o(ctid)

    # ---- consumer steps -----------------------------------------------------------------------------
    @cute.jit
    def _issue_s(self, qk_mma: cute.TiledMma, acc_s: cute.Tensor, v, q_idx: Int32, kv_idx: Int32):
        """S = Q K^T of stage q_idx and K stage kv_idx, committed as one wgmma group."""
        qk_mma = _fresh(qk_mma)
        tSrQ, tSrK = v["tSrQ"], v["tSrK"]
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            qk_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
            cute.gemm(qk_mma, acc_s, tSrQ[None, None, kb, q_idx], tSrK[None, None, kb, kv_idx], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def _issue_pv(self, pv_mma: cute.TiledMma, acc_o: cute.Tensor, r_p: cute.Tensor, v, q_idx: Int32,
                  kv_idx: Int32):
        """O = P V, one wgmma group: bf16 P from registers, fp8 P from the warpgroup's Q rows of q_idx."""
        pv_mma = _fresh(pv_mma)
        tOrV = v["tOrV"]
        warpgroup.fence()
        if const_expr(self.p_in_regs):
            for kb in cutlass.range_constexpr(cute.size(r_p, mode=[2])):
                pv_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(pv_mma, acc_o, r_p[None, None, kb], tOrV[None, None, kb, kv_idx], acc_o)
        else:
            tOrP = v["tOrP"]
            for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                pv_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(pv_mma, acc_o, tOrP[None, None, kb, q_idx], tOrV[None, None, kb, kv_idx], acc_o)
        warpgroup.commit_group()

    @cute.jit
    def _softmax_after_s(self, acc_s: cute.Tensor, sLim: cute.Tensor, lim: cute.Tensor, v, q_empty: cute.Pointer,
                         q_idx: Int32, t: Int32, mM: cute.Tensor, mL: cute.Tensor, scale_log2: Float32,
                         scale: Float32, lane: Int32, ctid: Int32, pending: cutlass.Constexpr):
        """Tile t's limits (read while its S runs), wait for its S (`pending` younger wgmma groups may
        stay in flight), release its Q stage (bf16: P stays in registers), one masked softmax step in
        place in acc_s, m and l of its live rows. Returns the tile's live rows."""
        G, ROWS = self.group, self.rows
        tScS = v["tScS"]
        n_rows_acc = const_expr(cute.size(tScS, mode=[0]))
        for r in cutlass.range_constexpr(1 if const_expr(self.joint_rows) else n_rows_acc):
            lim[r] = sLim[tScS[r, 0][0] // G, q_idx]
        live_rows = Int32(ROWS)
        if const_expr(self.tma_store_o):
            live_rows = sLim[self.tile_q, q_idx] * G
        warpgroup.wait_group(pending)
        if const_expr(self.p_in_regs):
            _release(q_empty + q_idx, lane)
        s_rc = _rows_cols_view(acc_s)
        if const_expr(self.joint_rows):
            # every row a thread holds is in its warp's 16-row band, one slot (G % 16 == 0): one limit,
            # one warp-uniform mask branch, then the rows' reductions interleaved in straight-line code
            if const_expr(self.without("softmax")):
                row_max, row_sum = [Float32(0.0)] * n_rows_acc, [Float32(1.0)] * n_rows_acc
            else:
                _mask_keys(s_rc, tScS, lim[0], self.block)
                row_max, row_sum = _softmax_rows_joint(s_rc, scale_log2, v["p_bias"], exp=not self.without("exp"),
                                                       fma_every=self.exp_fma_every)
            if ctid % 4 == 0:
                for r in cutlass.range_constexpr(n_rows_acc):
                    row = tScS[r, 0][0]
                    if row < live_rows:
                        if const_expr(not self.trace_phases):       # a trace build writes m_part itself
                            mM[t * ROWS + row] = row_max[r] * scale
                        mL[t * ROWS + row] = row_sum[r] * v["l_scale"]
            return live_rows
        for r in cutlass.range_constexpr(n_rows_acc):
            row = tScS[r, 0][0]
            if const_expr(self.tree_softmax):
                row_max, row_sum = _softmax_row_tree(s_rc, tScS, r, lim[r], scale_log2, self.p_shift, self.block)
            else:
                row_max, row_sum = _softmax_row(s_rc, tScS, r, lim[r], scale_log2, self.p_shift)
            if ctid % 4 == 0 and row < live_rows:
                mM[t * ROWS + row] = row_max * scale
                mL[t * ROWS + row] = row_sum * (1.0 / (1 << self.p_shift))
        return live_rows

    @cute.jit
    def _prepare_p(self, acc_s: cute.Tensor, r_p: cute.Tensor, v, q_idx: Int32, cwg: Int32):
        """P as the P V operand: bf16 in registers; fp8 over the warpgroup's own (dead) Q rows of stage
        q_idx, visible to its wgmma."""
        if const_expr(self.fp8_reg_p):
            r_p.store(self._fp8_p_regs(acc_s, r_p).load().to(self.dtype))
        elif const_expr(self.p_in_regs):
            r_p.store(_acc_to_frg_a(acc_s).load().to(self.dtype))
        else:
            r_p.store(acc_s.load().to(self.dtype))
            cute.autovec_copy(r_p, v["tSsP"][None, None, None, q_idx])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=1 + cwg, number_of_threads=self.wg_threads)

    def _fp8_p_regs(self, acc_s: cute.Tensor, r_p: cute.Tensor) -> cute.Tensor:
        """v15: the S accumulator's values regrouped (fp32, a register renaming) into the fp8 A-operand
        fragment of m64nNk32: per thread, acc_s is ((2 cols, 2 row halves, 16 col groups of 8)) and
        the A fragment ((4 k, 2 row halves, 2 k halves), k blocks of 32). Byte i of A's register (h,
        kh) in k block kb takes column 32 kb + 16 kh + 8 (i // 2) + 2 q + i % 2 (q = lane % 4) where the
        MMA reads k = 32 kb + 16 kh + 4 q + i: no shuffles or byte permutes, and the keys of V are
        stored in that order instead (manifest.fp8_v_key_order, applied to the d-major V copy)."""
        tmp = cute.make_rmem_tensor_like(r_p, Float32)
        for kb in range(cute.size(r_p, mode=[2])):               # plain Python: unrolled while tracing
            for kh in range(2):
                for h in range(2):
                    for i in range(4):
                        tmp[i + 4 * h + 8 * kh + 16 * kb] = acc_s[i % 2 + 2 * h + 4 * (4 * kb + 2 * kh + i // 2)]
        return tmp

    @cute.jit
    def _store_o(self, tma_o: cute.CopyAtom, acc_o: cute.Tensor, out_scale: Float32, v, mO: cute.Tensor, t: Int32,
                 live_rows: Int32, ctid: Int32, cwg: Int32):
        """O of tile t to o_part: v4 from registers (every row); v7, v9, v10 through sO (this warpgroup's
        rows) and one TMA store per live slot, issued by the warpgroup's first thread."""
        G, D, ROWS = self.group, self.head_dim, self.rows
        r_o = self._o_bf16(acc_o, out_scale)
        if const_expr(self.warp_store_o):
            # a warp's 16 accumulator rows are one slot (G = 16): it stages and stores them alone, its
            # lane 0 owning the bulk group, so no warpgroup barrier sits in the store
            lane = ctid % 32
            slot = cwg * (self.tile_q // 2) + (ctid % self.wg_threads) // 32
            if lane == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)   # this warp's previous store has read sO
            cute.arch.sync_warp()
            cute.copy(v["st_copy"], v["st_copy"].retile(r_o), v["tRsO"])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()
            if lane == 0:
                if const_expr(not self.without("o-store")):
                    if slot * G < live_rows:
                        if self.stores_slot(slot):
                            cute.copy(tma_o, v["tOsO"][None, slot], v["tOgO"][None, t * self.tile_q + slot])
                cute.arch.cp_async_bulk_commit_group()
        elif const_expr(self.tma_store_o):
            wg_barrier = 1 + cwg
            slots_per_wg = const_expr(self.tile_q // 2)
            if ctid % self.wg_threads == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)   # the previous tile's stores have read sO
            cute.arch.barrier(barrier_id=wg_barrier, number_of_threads=self.wg_threads)
            if const_expr(self.stmatrix_o):
                cute.copy(v["st_copy"], v["st_copy"].retile(r_o), v["tRsO"])
            else:
                cute.autovec_copy(r_o, v["tRsO"])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=wg_barrier, number_of_threads=self.wg_threads)
            if ctid % self.wg_threads == 0:
                for j in cutlass.range_constexpr(0 if const_expr(self.without("o-store")) else slots_per_wg):
                    slot = cwg * slots_per_wg + j
                    if slot * G < live_rows:
                        if self.stores_slot(j):
                            cute.copy(tma_o, v["tOsO"][None, slot], v["tOgO"][None, t * self.tile_q + slot])
                cute.arch.cp_async_bulk_commit_group()
        else:
            cute.autovec_copy(r_o, v["thr_pv"].partition_C(_tile(mO, cutlass.Int64(t) * (ROWS * D), (ROWS, D))))

    @cute.jit
    def _drain_o(self, ctid: Int32):
        if const_expr(self.warp_store_o):
            if ctid % 32 == 0:
                cute.arch.cp_async_bulk_wait_group(0)          # O stores complete before the CTA exits
        elif const_expr(self.tma_store_o):
            if ctid % self.wg_threads == 0:
                cute.arch.cp_async_bulk_wait_group(0)


class KvOuterAttentionSm90TmaStore(KvOuterAttentionSm90WarpSpecialized):
    """v7: v4 with the O tile stored through shared memory by TMA, live slots only."""
    kernel_version = "v7-ws-tma-store"
    tma_store_o = True


class KvOuterAttentionSm90Pipelined(KvOuterAttentionSm90TmaStore):
    """v9: v7 with the consumers software-pipelined across tiles (S(t+1) with P(t) V)."""
    kernel_version = "v9-ws-tma-store-pipelined"
    pipelined = True


class KvOuterAttentionSm90TreeSoftmax(KvOuterAttentionSm90Pipelined):
    """v10: v9 with the softmax step's mask only where a row needs it and tree reductions."""
    kernel_version = "v10-ws-pipelined-tree-softmax"
    tree_softmax = True


class KvOuterAttentionSm90Fp8RegP(KvOuterAttentionSm90TreeSoftmax):
    """v15: v10 with fp8 P kept in registers as the A operand of P V (bf16 as v10)."""
    kernel_version = "v15-ws-fp8-register-p"
    fp8_reg_p = True


class KvOuterAttentionSm90JointRows(KvOuterAttentionSm90Fp8RegP):
    """v16: v15 with the softmax step over both of a thread's rows at once (one mask branch, interleaved
    trees) and each tile's key read from shared memory instead of global memory."""
    kernel_version = "v16-ws-joint-rows"
    joint_rows = True


class KvOuterAttentionSm90Stmatrix(KvOuterAttentionSm90JointRows):
    """v17: v16 with O written to its staging buffer by stmatrix (8 instructions per warp and tile
    instead of 32 4-byte stores, each with its own swizzled address)."""
    kernel_version = "v17-ws-stmatrix-o"
    stmatrix_o = True


class KvOuterAttentionSm90ProducerAhead(KvOuterAttentionSm90Stmatrix):
    """v18: v17 with the producer's metadata and query-index reads ahead of its Q-stage wait."""
    kernel_version = "v18-ws-producer-ahead"
    prefetch_meta = True



class KvOuterAttentionSm90WarpStore(KvOuterAttentionSm90ProducerAhead):
    """v21: v18 with each consumer warp staging and storing its own slot of O, without the two
    warpgroup barriers per tile around the store."""
    kernel_version = "v21-ws-warp-store"
    warp_store_o = True


class KvOuterAttentionSm90FoldedScale(KvOuterAttentionSm90WarpStore):
    """v22 (bf16): v21 with the output scale folded into P's exponent shift: no multiply per O element."""
    kernel_version = "v22-ws-folded-scale"
    fold_out_scale = True


class KvOuterAttentionSm90FmaExp(KvOuterAttentionSm90FoldedScale):
    """v24: v22 (bf16; fp8 = v21) with every fourth exponential of a thread's row on the FMA pipe: the
    MUFU issues a warp instruction per 8 cycles and the softmax is 41-50 % of a consumer's cycles.
    (v25, every second one, was slower: commit e8b6ced, docs/perf-log.md.)"""
    kernel_version = "v24-ws-fma-exp"
    exp_fma_every = 4



def trace_class(base: type) -> type:
    """A phase-trace build of `base` (TRACE_PHASES stamps in m_part; l_part and o_part as the base)."""
    return type(f"{base.__name__}Trace", (base,),
                {"trace_phases": True, "kernel_version": f"{base.kernel_version}-trace",
                 "__module__": base.__module__,
                 "__doc__": f"{base.kernel_version} with its consumer phases stamped into m_part (diagnostic)."})


def knock_out_class(base: type, piece: str) -> type:
    """A knock-out build of `base`: the same kernel with `piece` of the per-tile chain removed."""
    return type(f"{base.__name__}KnockOut{piece.title().replace('-', '')}", (base,),
                {"knock_out": piece, "kernel_version": f"{base.kernel_version}-knockout-{piece}",
                 "__module__": base.__module__,
                 "__doc__": f"{base.kernel_version} without {piece} (a timing bound; output not attention)."})
