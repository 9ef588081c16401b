"""KV-outer attention stage for Hopper (sm_90a), v3: software-pipelined loads, decoupled warpgroups.

Same contract as attention_sm90.py (v2; see its docstring and kernels/kv_outer/__init__.py). What
changes:

* Double-buffered shared memory. Q has two stages (one per tile parity) and K/V two stages (one per
  key-run parity). While the CTA computes tile t, the cp.async gather of tile t+1's Q rows (and, when
  t+1 starts a new key, its K and V block) is already in flight into the other stage; each tile
  waits only for data issued one tile earlier.
* Warpgroup w (64 rows) gathers its own Q rows and is the only reader of them, so within a key run
  the two warpgroups synchronise only with themselves (named barriers of 128 threads) and drift
  apart: one's softmax overlaps the other's wgmma. The CTA-wide barrier runs only at the first tile
  of a key run (the K/V block was loaded by all 256 threads). That barrier also protects the K/V
  stage reuse: the stage written for key run r+1 was last read by run r-1, which both warpgroups
  finished before the barrier at the start of run r.
* The per-row visibility limits (q_limit[csr_query[...]] - key base) of tile t+1 are read into
  registers one tile ahead, so the softmax never waits on a dependent global load.
* bf16: P stays in registers as the A operand of the P V wgmma (RS), no shared-memory round trip.
  fp8: P goes through shared memory over the warpgroup's own (dead) Q rows of the current stage, as
  in v2 (the e4m3 register-A layout would need a permute).

Shared memory: Q 2 x ROWS x D, K and V 2 x block x D each: 192 KiB bf16 (one CTA per SM), 96 KiB
fp8 (one or two CTAs per SM).

Import this module only with CUTE_DSL_ARCH set (build.py does) when no GPU is present.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils as cutlass_utils
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

from .attention_sm90 import (DSL_DTYPES, LOG2E, AttentionLaunch, _gather_q_row, _row_copy, _rows_cols_view,
                             _softmax_row, _tile, check_tile)
from .manifest import P_SHIFT


def _staged_smem_layout(dtype, rows: int, cols: int, stages: int):
    """Swizzled (rows, cols, stages) shared-memory layout, cols contiguous (K-major)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def _acc_to_frg_a(acc: cute.Tensor) -> cute.Tensor:
    """View a 16-bit wgmma accumulator ((2, 2, N/8), M, N') as the A-operand register fragment of
    the next wgmma ((2, 2, 2), M, (N/16, N')): the k16 slices of a 64 x N accumulator are exactly the
    register A fragments of m64nXk16 (the layout FA3 relies on)."""
    layout = acc.layout
    div = cute.logical_divide(layout, ((None, None, 2), None, None))
    view = cute.make_layout(
        ((div.shape[0][0], div.shape[0][1], div.shape[0][2][0]), div.shape[1], (div.shape[0][2][1], div.shape[2])),
        stride=((div.stride[0][0], div.stride[0][1], div.stride[0][2][0]), div.stride[1],
                (div.stride[0][2][1], div.stride[2])))
    return cute.make_tensor(acc.iterator, view)


class KvOuterAttentionSm90Pipelined(AttentionLaunch):
    """One compiled configuration of the v3 kernel."""

    num_threads = 256          # two warpgroups, 64 rows each, decoupled within a key run
    kernel_version = "v3-pipe-wgdecoupled"
    wg_threads = 128

    def __init__(self, dtype: str, tile_q: int = 8, group: int = 16, head_dim: int = 128, block: int = 128,
                 ctas_per_sm: int = 1):
        check_tile(dtype, tile_q, group, head_dim, block, fixed="v3")
        if ctas_per_sm not in (1, 2) or (ctas_per_sm == 2 and dtype != "fp8"):
            raise ValueError(f"v3 runs 1 CTA/SM (bf16, 192 KiB smem) or 1-2 (fp8, 96 KiB); got {ctas_per_sm} for {dtype}")
        self.dtype_name = dtype
        self.dtype = DSL_DTYPES[dtype]
        self.v_d_major = dtype == "fp8"
        self.p_in_regs = dtype == "bf16"
        self.tile_q, self.group, self.head_dim, self.block = tile_q, group, head_dim, block
        self.rows = tile_q * group
        self.wg_rows = self.rows // 2
        self.ctas_per_sm = ctas_per_sm
        self.p_shift = P_SHIFT[dtype]

    # ---- host side ----------------------------------------------------------------------------
    @cute.jit
    def _launch(self, mQ, mK, mV, mCsrQuery, mTileKey, mTileEdge, mTileCount, mCtaRange, mPageBlock, mQLimit,
                mO, mM, mL, hkv, num_pages, scale, out_scale, stream):
        dt = self.dtype
        kmaj, mnmaj = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        qk_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj, Float32, (2, 1, 1), (64, self.block))
        if const_expr(self.p_in_regs):
            pv_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, mnmaj, Float32, (2, 1, 1), (64, self.head_dim),
                                                 a_source=warpgroup.OperandSource.RMEM)
        else:
            pv_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj if const_expr(self.v_d_major) else mnmaj,
                                                 Float32, (2, 1, 1), (64, self.head_dim))
        sQ_layout = _staged_smem_layout(dt, self.rows, self.head_dim, 2)
        sK_layout = _staged_smem_layout(dt, self.block, self.head_dim, 2)
        if const_expr(self.v_d_major):
            sV_layout = _staged_smem_layout(dt, self.head_dim, self.block, 2)
        else:
            sV_layout = _staged_smem_layout(dt, self.block, self.head_dim, 2)
        sP_layout = _staged_smem_layout(dt, self.rows, self.block, 2)     # fp8: over sQ (same shape)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(qk_mma, pv_mma, mQ, mK, mV, mCsrQuery, mTileKey, mTileEdge, mTileCount, mCtaRange,
                    mPageBlock, mQLimit, mO, mM, mL, hkv, num_pages, scale * LOG2E, scale, out_scale,
                    sQ_layout, sK_layout, sV_layout, sP_layout).launch(
            grid=(mCtaRange.shape[0], 1, 1), block=(self.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=100, stream=stream)

    # ---- device side --------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, mQ: cute.Tensor, mK: cute.Tensor,
               mV: cute.Tensor, mCsrQuery: cute.Tensor, mTileKey: cute.Tensor, mTileEdge: cute.Tensor,
               mTileCount: cute.Tensor, mCtaRange: cute.Tensor, mPageBlock: cute.Tensor,
               mQLimit: cute.Tensor, mO: cute.Tensor, mM: cute.Tensor, mL: cute.Tensor,
               hkv: Int32, num_pages: Int32, scale_log2: Float32, scale: Float32, out_scale: Float32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout):
        dt = self.dtype
        G, D, BLK, ROWS, WGR = self.group, self.head_dim, self.block, self.rows, self.wg_rows
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp_group = cute.arch.make_warp_uniform(tidx // self.wg_threads)
        wg_tidx = tidx % self.wg_threads
        wg_barrier = 1 + warp_group

        storage = cutlass_utils.SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)       # (ROWS, D, 2)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)       # (BLK, D, 2)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if const_expr(self.v_d_major):
            sVt = sV                                                             # (D, BLK, 2)
        else:
            sVt = cute.composition(sV, cute.make_ordered_layout((D, BLK, 2), order=(1, 0, 2)))

        thr_qk = qk_mma.get_slice(tidx)
        thr_pv = pv_mma.get_slice(tidx)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))          # (MMA, M, K, stage)
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
        if const_expr(not self.p_in_regs):
            sP = storage.sQ.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
            tOrP = thr_pv.make_fragment_A(thr_pv.partition_A(sP))
            tSsP = thr_qk.partition_C(sP)                                # (.., stage)
        tScS = _rows_cols_view(thr_qk.partition_C(cute.make_identity_tensor((ROWS, BLK))))

        # cp.async tiled copies: K/V by all 256 threads, Q rows by the owning warpgroup's 128
        g2s = _row_copy(dt, D, self.num_threads)
        g2s_wg = _row_copy(dt, D, self.wg_threads)
        thr_g2s = g2s.get_slice(tidx)
        thr_q = g2s_wg.get_slice(wg_tidx)
        cQ = cute.local_tile(cute.make_identity_tensor((ROWS, D)), (WGR, D), (warp_group, 0))
        tQcQ = thr_q.partition_S(cQ)                                     # this thread's (row, col) coords
        n_rows_acc = const_expr(cute.size(tScS, mode=[0]))

        lim_cur = cute.make_rmem_tensor((n_rows_acc,), Int32)
        lim_next = cute.make_rmem_tensor((n_rows_acc,), Int32)

        begin = mCtaRange[cta, 0]
        end = mCtaRange[cta, 1]
        stage = Int32(0)          # Q stage of the current tile
        kv_stage = Int32(0)       # K/V stage of the current key run
        kv_fresh = cutlass.Boolean(True)   # the current tile's K/V were loaded for it (first of a run)
        if begin < end:
            key0 = mTileKey[begin]
            if key0 >= 0:
                self.issue_kv(g2s, thr_g2s, mK, mV, sK, sV, key0, Int32(0), hkv, num_pages)
                self.issue_q(g2s_wg, thr_q, tQcQ, mQ, mCsrQuery, sQ, key0, mTileEdge[begin], mTileCount[begin], Int32(0),
                             warp_group, hkv, num_pages)
                self.read_limits(tScS, mPageBlock, mQLimit, mCsrQuery, key0, mTileEdge[begin], mTileCount[begin],
                                 lim_cur, num_pages)
        cute.arch.cp_async_commit_group()

        for t in cutlass.range(begin, end, unroll=1):
            key = mTileKey[t]
            if key >= 0:
                edge = mTileEdge[t]
                count = mTileCount[t]
                # this tile's loads (issued one tile ago) have landed for this thread ...
                cute.arch.cp_async_wait_group(0)
                cute.arch.fence_view_async_shared()
                # ... and for everyone who loaded them: the whole CTA on a new K/V block, else the warpgroup
                if kv_fresh:
                    cute.arch.sync_threads()
                else:
                    cute.arch.barrier(barrier_id=wg_barrier, number_of_threads=self.wg_threads)

                # S = Q K^T (issued, completed below)
                acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((ROWS, BLK)), Float32)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    qk_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                    cute.gemm(qk_mma, acc_s, tSrQ[None, None, kb, stage], tSrK[None, None, kb, kv_stage], acc_s)
                warpgroup.commit_group()

                # while S is on the tensor cores: prefetch tile t+1 into the other stages (the
                # csr_query / q_limit reads behind its addresses and limits wait here, not in the softmax)
                new_kv_next = cutlass.Boolean(False)
                if t + 1 < end:
                    key_n = mTileKey[t + 1]
                    if key_n >= 0:
                        edge_n = mTileEdge[t + 1]
                        count_n = mTileCount[t + 1]
                        if key_n != key:
                            new_kv_next = cutlass.Boolean(True)
                            self.issue_kv(g2s, thr_g2s, mK, mV, sK, sV, key_n, 1 - kv_stage, hkv, num_pages)
                        self.issue_q(g2s_wg, thr_q, tQcQ, mQ, mCsrQuery, sQ, key_n, edge_n, count_n, 1 - stage,
                                     warp_group, hkv, num_pages)
                        self.read_limits(tScS, mPageBlock, mQLimit, mCsrQuery, key_n, edge_n, count_n, lim_next, num_pages)
                cute.arch.cp_async_commit_group()

                warpgroup.wait_group(0)

                # mask, one softmax step, write m and l
                s_rc = _rows_cols_view(acc_s)
                for r in cutlass.range_constexpr(n_rows_acc):
                    row = tScS[r, 0][0]
                    limit = lim_cur[r]
                    row_max, row_sum = _softmax_row(s_rc, tScS, r, limit, scale_log2, self.p_shift)
                    if tidx % 4 == 0:
                        mM[t * ROWS + row] = row_max * scale
                        mL[t * ROWS + row] = row_sum * (1.0 / (1 << self.p_shift))

                # O = P V
                acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((ROWS, D)), Float32)
                if const_expr(self.p_in_regs):
                    p_acc = _acc_to_frg_a(acc_s)
                    r_p = cute.make_rmem_tensor_like(p_acc, dt)
                    r_p.store(p_acc.load().to(dt))
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(cute.size(r_p, mode=[2])):
                        pv_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                        cute.gemm(pv_mma, acc_o, r_p[None, None, kb], tOrV[None, None, kb, kv_stage], acc_o)
                else:
                    # P over this warpgroup's own Q rows of this stage (dead since S completed)
                    r_p = cute.make_rmem_tensor_like(acc_s, dt)
                    r_p.store(acc_s.load().to(dt))
                    cute.autovec_copy(r_p, tSsP[None, None, None, stage])
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=wg_barrier, number_of_threads=self.wg_threads)
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                        pv_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                        cute.gemm(pv_mma, acc_o, tOrP[None, None, kb, stage], tOrV[None, None, kb, kv_stage], acc_o)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                r_o = cute.make_rmem_tensor_like(acc_o, cutlass.BFloat16)
                r_o.store((acc_o.load() * out_scale).to(cutlass.BFloat16))
                cute.autovec_copy(r_o, thr_pv.partition_C(_tile(mO, cutlass.Int64(t) * (ROWS * D), (ROWS, D))))

                # advance the pipeline
                for r in cutlass.range_constexpr(n_rows_acc):
                    lim_cur[r] = lim_next[r]
                stage = 1 - stage
                if new_kv_next:
                    kv_stage = 1 - kv_stage
                kv_fresh = new_kv_next
        cute.arch.cp_async_wait_group(0)

    # ---- device helpers (explicit arguments: staged control flow cannot capture closures) ---------
    @cute.jit
    def issue_kv(self, g2s: cute.TiledCopy, thr_g2s, mK: cute.Tensor, mV: cute.Tensor, sK: cute.Tensor,
                 sV: cute.Tensor, t_key: Int32, stage: Int32, hkv: Int32, num_pages: Int32):
        """cp.async the K and V block of key t_key into K/V stage `stage` (all 256 threads)."""
        D, BLK = self.head_dim, self.block
        head = t_key // num_pages
        page = t_key - head * num_pages
        kv_offset = cutlass.Int64(page * hkv + head) * (BLK * D)
        cute.copy(g2s, thr_g2s.partition_S(_tile(mK, kv_offset, (BLK, D))),
                  thr_g2s.partition_D(sK[None, None, stage]))
        v_shape = (D, BLK) if const_expr(self.v_d_major) else (BLK, D)
        cute.copy(g2s, thr_g2s.partition_S(_tile(mV, kv_offset, v_shape)),
                  thr_g2s.partition_D(sV[None, None, stage]))

    @cute.jit
    def issue_q(self, g2s_wg: cute.TiledCopy, thr_q, tQcQ: cute.Tensor, mQ: cute.Tensor,
                mCsrQuery: cute.Tensor, sQ: cute.Tensor, t_key: Int32, t_edge: Int32, t_count: Int32,
                stage: Int32, warp_group: Int32, hkv: Int32, num_pages: Int32):
        """cp.async this warpgroup's Q rows of a tile into Q stage `stage`: row r = (slot, g) comes
        from q[csr_query[edge + slot], head * G + g]; empty slots repeat the last query (finite data;
        their rows are masked)."""
        dt, G, D, WGR = self.dtype, self.group, self.head_dim, self.wg_rows
        head = t_key // num_pages
        hq = hkv * G
        sQ_wg = cute.local_tile(sQ[None, None, stage], (WGR, D), (warp_group, 0))
        tQsQ = thr_q.partition_D(sQ_wg)
        for m in cutlass.range_constexpr(cute.size(tQcQ, mode=[1])):
            row = tQcQ[0, m, 0][0]
            slot = cutlass.min(row // G, t_count - 1)
            query = mCsrQuery[t_edge + slot]
            q_row = _tile(mQ, cutlass.Int64(query * hq + head * G + row % G) * D, (D,))
            _gather_q_row(dt, q_row, tQcQ, tQsQ, m, g2s_wg)

    @cute.jit
    def read_limits(self, tScS: cute.Tensor, mPageBlock: cute.Tensor, mQLimit: cute.Tensor,
                    mCsrQuery: cute.Tensor, t_key: Int32, t_edge: Int32, t_count: Int32, lim: cute.Tensor,
                    num_pages: Int32):
        """Last visible key offset within the block (-1: none) of this thread's accumulator rows."""
        head = t_key // num_pages
        page = t_key - head * num_pages
        key_base = mPageBlock[page] * self.block
        for r in cutlass.range_constexpr(cute.size(tScS, mode=[0])):
            slot = tScS[r, 0][0] // self.group
            limit = Int32(-1)
            if slot < t_count:
                limit = mQLimit[mCsrQuery[t_edge + slot]] - key_base
            lim[r] = limit
