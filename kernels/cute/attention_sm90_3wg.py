"""KV-outer attention stage for Hopper (sm_90a), v23: three consumer warpgroups on 64-row half tiles.

Same contract as attention_sm90_ws.py (v4-v22): the same arguments, the raw tile-ordered partial o
(bf16), m and l (fp32), causal masking through the per-slot limits, fp8 with V d-major (keys permuted
within every 16, manifest.fp8_v_key_order) and P scaled by 2^P_SHIFT.

Why: the phase traces of v22 (benchmarks/trace_gpu.py) show each consumer warpgroup's chain per tile
(issue, wait for S, softmax, store) about 2.7x longer than the other warpgroup's MMAs, so with two
consumer warpgroups the tensor pipe idles half the time. v23 runs three, each with a chain that is
not pipelined across tiles (S, softmax, P V, store, then the next), so one warpgroup's S and P V fit
in the others' softmax and store. Registers decide it: a non-pipelined consumer keeps the S
accumulator or P plus the O accumulator live, not both accumulators, and fits in CONSUMER_REGS =
144: 128 x 72 (producer) + 384 x 144 = 64512 registers of the 65536 at 512 threads.

How:
* 512 threads: warpgroup 0 the producer, warpgroups 1-3 the consumers (c = 0, 1, 2). The work unit is
  a half tile, h = 2 i + j for the CTA's i-th tile: its slots 4 j .. 4 j + 3, 64 rows. Consumer c takes
  h = c, c + 3, c + 6, ... in order.
* Q: stage h mod QS (QS = 3 bf16, as shared memory allows, so consumer c always uses stage c; 6 fp8,
  two per consumer), 64 rows, gathered by the producer's 128 threads with cp.async. The producer walks
  tiles and gathers both halves of each (walking metadata per half was 9-14 % slower); it reads
  metadata two tiles ahead (tile t+2's key, edge and count and tile t+1's query indices while tile t
  is gathered), so per tile it waits on one level of loads (the slot limits). That was tried because
  v23 at boost clocks waits on something timed in ns; it changed nothing measurable (Q's DRAM reads
  are that limit, docs/perf-log.md) and costs nothing, so it stays. q_full expects 128 + 4 arrivals
  (copies, and the 4 threads that write the half's slot limits); q_empty the consumer's 4 warps,
  after its S (P stays in registers in both dtypes). Next to the limits the producer writes the
  half's live slots and the ordinal of its key run.
* K, V: a 2-stage ring loaded once per key run (run r in stage r mod 2), by the producer right after it
  has published the run's first half (not before: a consumer leaves a run only on reading a later
  half's run ordinal, so a load that waited first could wait for itself). A consumer may have no half
  tile in a short run, so every consumer warp walks every run in order: it waits for run r's K/V (that
  it completed is what guarantees run r - 2's stage was released by all, so arrivals never land in an
  older phase) and arrives on run r's empty barrier when it moves past it; kv_empty expects all 12
  consumer warps. At its end a consumer releases its last run (the producer may need that stage for
  the run two later); runs after it need no release, as no run follows two later. A run holds at least
  one tile, two halves, which is what keeps the loads free of deadlock.
* Consumer step: S on wgmma (m64 per warpgroup), wait, release Q, the joint-rows softmax (v16) with the
  warp's slot limit, m and l of live rows, P to registers (bf16 as the A fragment; fp8 regrouped as
  in v15), P V on wgmma, wait, O per warp by stmatrix into the warp's own staging slot and one TMA
  store (v21). bf16 folds the output scale into P (v22).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .attention_sm90 import LOG2E, _rows_cols_view
from .attention_sm90_pipe import _acc_to_frg_a, _staged_smem_layout
from .attention_sm90_ws import (KvOuterAttentionSm90FoldedScale, _mask_keys, _release, _softmax_rows_joint,
                                _wait)

PRODUCER_REGS = 72           # two tiles of metadata in flight
CONSUMER_REGS = 144          # 128 x 72 + 384 x 144 = 64512 <= 512 x 128, the launch's allocation


class KvOuterAttentionSm90ThreeConsumers(KvOuterAttentionSm90FoldedScale):
    """v23: v22's steps on three consumer warpgroups, each walking its own half tiles."""
    kernel_version = "v23-ws-three-consumers"
    num_threads = 512
    num_consumer_wgs = 3
    num_consumer_warps = 12
    q_stages_by_dtype = {"bf16": 3, "fp8": 6}       # per consumer warpgroup one (bf16: shared memory) or two

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.half_q = self.tile_q // 2               # slots per half tile
        self.half_rows = self.half_q * self.group    # 64: one wgmma M per warpgroup
        if self.half_rows != 64 or self.group != 16:
            raise ValueError(f"v23 needs 64-row half tiles of 16-row slots, got TILE_Q {self.tile_q}, G {self.group}")
        self.lim_extra = 2                           # after the half's 4 limits: live slots, key-run ordinal

    # ---- host side ----------------------------------------------------------------------------
    @cute.jit
    def _launch(self, mQ, mK, mV, mCsrQuery, mTileKey, mTileEdge, mTileCount, mCtaRange, mPageBlock, mQLimit,
                mO, mM, mL, hkv, num_pages, scale, out_scale, stream):
        dt = self.dtype
        D, BLK, HR = self.head_dim, self.block, self.half_rows
        kmaj, mnmaj = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        qk_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj, Float32, (1, 1, 1), (HR, BLK))
        pv_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj if const_expr(self.v_d_major) else mnmaj,
                                             Float32, (1, 1, 1), (HR, D), a_source=warpgroup.OperandSource.RMEM)
        sQ_layout = _staged_smem_layout(dt, HR, D, self.q_stages)
        sK_layout = _staged_smem_layout(dt, BLK, D, self.kv_stages)
        v_tile = (D, BLK) if const_expr(self.v_d_major) else (BLK, D)
        sV_layout = _staged_smem_layout(dt, v_tile[0], v_tile[1], self.kv_stages)
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, gK_tma = cpasync.make_tiled_tma_atom(tma_op, mK, cute.slice_(sK_layout, (None, None, 0)), (BLK, D))
        tma_v, gV_tma = cpasync.make_tiled_tma_atom(tma_op, mV, cute.slice_(sV_layout, (None, None, 0)), v_tile)
        # O staging: one (G, D) slot per consumer warp, stored by TMA slot by slot
        sO_layout = _staged_smem_layout(cutlass.BFloat16, self.group, D, self.num_consumer_warps)
        tma_o, gO_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO,
                                                    cute.slice_(sO_layout, (None, None, 0)), (self.group, D))

        SharedStorage = self._storage_struct(sQ_layout, sK_layout, sV_layout, self.half_q, cute.cosize(sO_layout))
        self.kernel(qk_mma, pv_mma, tma_k, gK_tma, tma_v, gV_tma, tma_o, gO_tma, mQ, mCsrQuery, mTileKey, mTileEdge,
                    mTileCount, mCtaRange, mPageBlock, mQLimit, mO, mM, mL, hkv, num_pages,
                    scale * LOG2E, scale, out_scale, sQ_layout, sK_layout, sV_layout, sO_layout).launch(
            grid=(mCtaRange.shape[0], 1, 1), block=(self.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=1,
            preferred_smem_carveout=100, stream=stream)

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
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group = cute.arch.make_warp_uniform(tidx // self.wg_threads)

        _, (q_full, q_empty, kv_full, kv_empty), sLim, sQ, sK, sV, sO = self._shared(
            sQ_layout, sK_layout, sV_layout, sO_layout, self.half_q)    # sQ (64, D, QS), sO (G, D, 12)
        self._init_barriers((q_full, q_empty, kv_full, kv_empty), warp_idx, self.wg_threads + self.half_q,
                            self.num_consumer_warps // self.num_consumer_wgs, (tma_k, tma_v, tma_o))

        begin = mCtaRange[cta, 0]
        n_tiles = mCtaRange[cta, 1] - begin
        if warp_group == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.producer3(tma_k, gK_tma, tma_v, gV_tma, mQ, mCsrQuery, mTileKey, mTileEdge, mTileCount,
                           mPageBlock, mQLimit, sQ, sK, sV, sLim, q_full, q_empty, kv_full, kv_empty,
                           begin, n_tiles, hkv, num_pages, tidx, warp_idx)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consumer3(qk_mma, pv_mma, tma_o, gO_tma, sO, mM, mL, sQ, sK, sV, sLim,
                           (q_full, q_empty, kv_full, kv_empty), begin, n_tiles, scale_log2, scale, out_scale,
                           tidx % self.wg_threads, warp_group - 1)

    # ---- producer warpgroup -----------------------------------------------------------------------
    @cute.jit
    def producer3(self, tma_k: cute.CopyAtom, gK_tma: cute.Tensor, tma_v: cute.CopyAtom, gV_tma: cute.Tensor,
                  mQ: cute.Tensor, mCsrQuery: cute.Tensor, mTileKey: cute.Tensor, mTileEdge: cute.Tensor,
                  mTileCount: cute.Tensor, mPageBlock: cute.Tensor, mQLimit: cute.Tensor,
                  sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sLim: cute.Tensor,
                  q_full: cute.Pointer, q_empty: cute.Pointer, kv_full: cute.Pointer, kv_empty: cute.Pointer,
                  begin: Int32, n_tiles: Int32, hkv: Int32, num_pages: Int32, tidx: Int32, warp_idx: Int32):
        """Half tiles in order: K/V once per key run (run r into stage r mod 2), Q of the half's four
        slots into stage h mod 3, its limits, live slots and run ordinal next to it."""
        dt, G, D, BLK, HQ = self.dtype, self.group, self.head_dim, self.block, self.half_q
        tKgK, tKsK, tVgV, tVsV, g2s, thr_q, tQcQ = self._producer_copies(tma_k, gK_tma, tma_v, gV_tma, sK, sV,
                                                                          self.half_rows, tidx)
        rows_per_pass = self.wg_threads // (D // (128 // dt.width))
        hq = hkv * G

        # Metadata two tiles ahead: at tile t the loop reads tile t+2's key, edge and count and tile t+1's
        # eight query indices (this thread's own one, threads 0-7, kept apart for its slot limit), so the
        # only load it waits for is t's limit (q_limit of a query already in a register, one level).
        end = begin + n_tiles
        meta = cute.make_rmem_tensor((3,), Int32)          # tile t
        meta_n = cute.make_rmem_tensor((3,), Int32)        # tile t + 1
        queries = cute.make_rmem_tensor((self.tile_q,), Int32)
        queries_n = cute.make_rmem_tensor((self.tile_q,), Int32)
        my_query = Int32(0)
        my_query_n = Int32(0)
        if n_tiles > 0:
            t1 = cutlass.min(begin + 1, end - 1)
            meta[0] = mTileKey[begin]
            meta[1] = mTileEdge[begin]
            meta[2] = mTileCount[begin]
            meta_n[0] = mTileKey[t1]
            meta_n[1] = mTileEdge[t1]
            meta_n[2] = mTileCount[t1]
            for s in cutlass.range_constexpr(self.tile_q):
                queries_n[s] = mCsrQuery[meta[1] + cutlass.min(s, meta[2] - 1)]
            my_query_n = mCsrQuery[meta[1] + cutlass.min(tidx % self.tile_q, meta[2] - 1)]
        q_idx = Int32(0)
        q_phase = Int32(1)           # empty barriers: the first wait on each stage passes at once
        kv_idx = Int32(0)
        kv_phase = Int32(1)
        loaded_key = Int32(-1)
        run = Int32(-1)
        for i in cutlass.range(n_tiles, unroll=1):
            t = begin + i
            key = meta[0]
            count = meta[2]
            for s in cutlass.range_constexpr(self.tile_q):
                queries[s] = queries_n[s]
            my_query = my_query_n
            # tile t+1's queries (its metadata was read a tile ago), then tile t+2's metadata
            edge_n = meta_n[1]
            count_n = meta_n[2]
            for s in cutlass.range_constexpr(self.tile_q):
                queries_n[s] = mCsrQuery[edge_n + cutlass.min(s, count_n - 1)]
            my_query_n = mCsrQuery[edge_n + cutlass.min(tidx % self.tile_q, count_n - 1)]
            for k in cutlass.range_constexpr(3):
                meta[k] = meta_n[k]
            t2 = cutlass.min(t + 2, end - 1)
            meta_n[0] = mTileKey[t2]
            meta_n[1] = mTileEdge[t2]
            meta_n[2] = mTileCount[t2]
            head = key // num_pages
            page = key - head * num_pages
            limit = Int32(-1)
            if tidx < count:
                if tidx < self.tile_q:
                    limit = mQLimit[my_query] - mPageBlock[page] * BLK
            new_run = key != loaded_key
            if new_run:
                run += 1
            for j in cutlass.range_constexpr(2):
                _wait(q_empty + q_idx, q_phase)
                self._gather_q(g2s, thr_q, tQcQ, sQ, q_idx, mQ, hq, head,
                               lambda m, row: queries[HQ * j + m * rows_per_pass // G])
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_mbarrier_arrive_noinc(q_full + q_idx)
                if tidx >= HQ * j:
                    if tidx < HQ * (j + 1):
                        sLim[tidx - HQ * j, q_idx] = limit
                        if tidx == HQ * j:
                            sLim[HQ, q_idx] = cutlass.max(cutlass.min(count - HQ * j, HQ), 0)
                            sLim[HQ + 1, q_idx] = run
                        cute.arch.mbarrier_arrive(q_full + q_idx)
                if const_expr(j == 0):
                    if new_run:
                        # K and V after the run's first half is published: the stage waits for every
                        # consumer to leave the run two before, which they do on reading a later half
                        self._load_kv(tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, kv_full, kv_empty, kv_idx, kv_phase,
                                      page * hkv + head, warp_idx)
                        loaded_key = key
                        kv_idx, kv_phase = self._advance2(kv_idx, kv_phase)
                q_idx += 1
                if q_idx == self.q_stages:
                    q_idx = Int32(0)
                    q_phase ^= 1
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _advance2(self, idx: Int32, phase: Int32):
        idx += 1
        if idx == self.kv_stages:
            idx = Int32(0)
            phase ^= 1
        return idx, phase

    # ---- consumer warpgroups ----------------------------------------------------------------------
    @cute.jit
    def consumer3(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_o: cute.CopyAtom, gO_tma: cute.Tensor,
                  sO: cute.Tensor, mM: cute.Tensor, mL: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor,
                  sV: cute.Tensor, sLim: cute.Tensor, bars, begin: Int32, n_tiles: Int32, scale_log2: Float32,
                  scale: Float32, out_scale: Float32, ctid: Int32, cwg: Int32):
        """Half tiles cwg, cwg + 3, ...: S, softmax, P V and the per-warp store, one after the other."""
        q_full, q_empty, kv_full, kv_empty = bars
        G, D, BLK, HQ, HR, ROWS = self.group, self.head_dim, self.block, self.half_q, self.half_rows, self.rows
        lane = cute.arch.lane_idx()
        warp = ctid // 32                                 # this warp's slot in the half tile
        if const_expr(self.v_d_major):
            sVt = sV
        else:
            sVt = cute.composition(sV, cute.make_ordered_layout((D, BLK, self.kv_stages), order=(1, 0, 2)))
        thr_qk = qk_mma.get_slice(ctid)
        thr_pv = pv_mma.get_slice(ctid)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
        tScS = _rows_cols_view(thr_qk.partition_C(cute.make_identity_tensor((HR, BLK))))
        # O staging: this warpgroup's four slots (G rows each) as a (64, D) view, written by stmatrix
        sO_all = cute.composition(sO, cute.make_layout(((G, self.num_consumer_warps), D), stride=((1, G * D), G)))
        sO_wg = cute.local_tile(sO_all, (HR, D), (None, 0))                  # (64, D, 3)
        st_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16), pv_mma)
        tRsO = st_copy.get_slice(ctid).partition_D(sO_wg)
        gO = cute.local_tile(gO_tma, (G, D), (None, 0))
        tOsO, tOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                           cute.group_modes(gO, 0, 2))

        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((HR, BLK)), Float32)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((HR, D)), Float32)
        if const_expr(self.fp8_reg_p):
            r_p = cute.make_rmem_tensor(thr_pv.partition_shape_A((HR, BLK)), self.dtype)
        else:
            r_p = cute.make_rmem_tensor_like(_acc_to_frg_a(acc_s), self.dtype)
        p_bias, l_scale = self._p_scales(out_scale)
        n_rows_acc = const_expr(cute.size(tScS, mode=[0]))
        o_slot = cwg * (self.num_consumer_warps // self.num_consumer_wgs) + warp   # this warp's staging slot

        run = Int32(-1)                   # the key run whose K/V this warpgroup has waited for
        for h in cutlass.range(cwg, 2 * n_tiles, self.num_consumer_wgs, unroll=1):
            t = begin + h // 2
            j = h % 2
            qs = h % self.q_stages                         # the producer fills the stages in order
            _wait(q_full + qs, (h // self.q_stages) % 2)
            lim = sLim[warp, qs]
            live = sLim[HQ, qs]
            want = sLim[HQ + 1, qs]
            while run < want:
                if run >= 0:
                    _release(kv_empty + run % self.kv_stages, lane)
                run += 1
                _wait(kv_full + run % self.kv_stages, (run // self.kv_stages) % 2)
            kv = run % self.kv_stages
            cute.arch.fence_view_async_shared()
            # S = Q K^T
            qk = qk_mma.__new_from_mlir_values__(qk_mma.__extract_mlir_values__())
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                qk.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(qk, acc_s, tSrQ[None, None, kb, qs], tSrK[None, None, kb, kv], acc_s)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            _release(q_empty + qs, lane)
            # softmax step over the warp's 16 rows (one slot: one limit), m and l of live rows
            s_rc = _rows_cols_view(acc_s)
            if const_expr(self.without("softmax")):
                row_max, row_sum = [Float32(0.0)] * n_rows_acc, [Float32(1.0)] * n_rows_acc
            else:
                _mask_keys(s_rc, tScS, lim, BLK)
                row_max, row_sum = _softmax_rows_joint(s_rc, scale_log2, p_bias, exp=not self.without("exp"),
                                                       fma_every=self.exp_fma_every)
            if ctid % 4 == 0:
                for r in cutlass.range_constexpr(n_rows_acc):
                    row = tScS[r, 0][0]
                    if row < live * G:
                        mM[t * ROWS + HR * j + row] = row_max[r] * scale
                        mL[t * ROWS + HR * j + row] = row_sum[r] * l_scale
            if const_expr(self.fp8_reg_p):
                r_p.store(self._fp8_p_regs(acc_s, r_p).load().to(self.dtype))
            else:
                r_p.store(_acc_to_frg_a(acc_s).load().to(self.dtype))
            # O = P V
            pv = pv_mma.__new_from_mlir_values__(pv_mma.__extract_mlir_values__())
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(r_p, mode=[2])):
                pv.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(pv, acc_o, r_p[None, None, kb], tOrV[None, None, kb, kv], acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            # O: v21's per-warp store (attention_sm90_ws._store_o), into this warp's own staging slot
            r_o = self._o_bf16(acc_o, out_scale)
            if lane == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)   # this warp's previous store has read its slot
            cute.arch.sync_warp()
            cute.copy(st_copy, st_copy.retile(r_o), tRsO[None, None, None, cwg])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()
            if lane == 0:
                if const_expr(not self.without("o-store")):
                    if warp < live:
                        if self.stores_slot(warp):
                            cute.copy(tma_o, tOsO[None, o_slot], tOgO[None, t * self.tile_q + HQ * j + warp],
                                      **self.l2_hint("o"))
                cute.arch.cp_async_bulk_commit_group()
        if run >= 0:
            _release(kv_empty + run % self.kv_stages, lane)   # the producer may reuse this stage two runs on
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0)          # O stores complete before the CTA exits


class KvOuterAttentionSm90ThreeConsumersEvictFirst(KvOuterAttentionSm90ThreeConsumers):
    """v28: v23 with its O stores and K/V loads marked L2 evict-first, so the partials (4.4 GB per launch
    at the perf point) and the K/V blocks (reloaded once per query range, phases apart) leave L2 to the
    gathered Q rows; with a grouped tile order one range's Q (16 MiB) then stays resident. v20 did this
    on v18 and changed nothing, but v18 was bound by its consumers; v23 in bursts is bound by DRAM (its
    knock-outs: without the O store +16 %, with Q aliased into L2 +7 % bf16, +15 % fp8). v27, the O
    stores alone, gave most of the gain (docs/perf-log.md, tenth session)."""
    kernel_version = "v28-3wg-evict-first"
    l2_evict_first = ("o", "kv")
