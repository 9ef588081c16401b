"""The KV-outer attention stage for Hopper (sm_90a) in CuTe DSL: a producer warpgroup and three consumer
warpgroups on 64-row half tiles.

Contract (kernels/kv_outer/__init__.py, the same as the Triton stage's): every CTA walks its [begin, end)
slice of the scheduler's tile list (cta_range); a tile is one (KV head, page) key and up to TILE_Q
queries that chose it, row (slot, g) = query of the slot x query head g of the KV head's group. For each
tile the stage writes the raw P V (bf16, not divided by l), the row max m and the row sum l (fp32,
natural-log units of the scaled score) at the tile's rows of o_part, m_part and l_part; only the rows of
live slots are written. A key past a query's visibility limit (q_limit[query] - page_block[page] *
block) is masked. fp8: V is read d-major with its keys permuted within every 16 (manifest.fp8_v_key_order)
and P is scaled by 2^P_SHIFT before the cast (out of e4m3's subnormals; the host folds 2^-P_SHIFT into
out_scale). bf16 folds out_scale into P, so O needs no multiply.

Work split (512 threads, one CTA per SM):
* Warpgroup 0, the producer (72 registers), walks the tiles: per key run it loads K and V once by TMA
  into a 2-stage ring (run r into stage r mod 2), right after publishing the run's first half tile; per
  half tile h = 2 i + j (slots 4 j .. 4 j + 3 of the CTA's i-th tile, 64 rows) it gathers Q by cp.async
  into stage h mod QS of the Q ring (QS = 3 bf16, as shared memory allows, so consumer c always uses
  stage c; 6 fp8) and writes next to it the half's four slot limits, its live slots and the ordinal of
  its key run. It reads metadata two tiles ahead (tile t+2's key, edge and count and tile t+1's query
  indices while tile t is gathered), so per tile it waits on one level of loads (the limits).
* Warpgroups 1-3, the consumers (144 registers; 128 x 72 + 384 x 144 = 64512 of the 65536 at 512
  threads), take half tiles c, c + 3, c + 6, ... each and run them one after the other, not pipelined:
  S on wgmma, the softmax step with the warp's slot limit, m and l of live rows, P into registers, P V
  on wgmma, O per warp by stmatrix into the warp's own staging slot and one TMA store. A consumer that
  is not pipelined keeps the S accumulator or P plus the O accumulator live, not both accumulators, which
  is what lets three of them fit; one warpgroup's MMAs then run in the others' softmax and store.
* K/V release: a consumer may have no half tile in a short run, so every consumer warp walks every run
  in order: it waits for run r's K/V (that it completed is what guarantees run r - 2's stage was released
  by all) and arrives on run r's empty barrier when it moves past it (kv_empty expects all 12 consumer
  warps); at its end it releases its last run. A run holds at least one tile, two halves, which is what
  keeps the loads free of deadlock (the producer loads a run's K/V only after publishing its first half:
  a consumer leaves a run on reading a later half's run ordinal).

Option: evict_first marks the O stores and K/V loads L2 evict-first, so the partials (4.4 GB per launch at
the perf point) and the K/V blocks leave L2 to the gathered Q rows (kernel v28).

Import only with CUTE_DSL_ARCH set when no GPU is present (build.py sets it).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils as cutlass_utils
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .barriers import advance, init_rings, release, wait
from .layouts import DSL_DTYPES, LOG2E, rows_cols_view, staged_smem_layout
from .manifest import P_SHIFT
from .mma import mma_rs, mma_ss, p_operand, store_p
from .producer import gather_q, kv_partitions, kv_tma_atoms, l2_policy, load_kv, q_row_copy
from .softmax import mask_keys, softmax_rows

PRODUCER_REGS = 72           # two tiles of metadata in flight
CONSUMER_REGS = 144          # 128 x 72 + 384 x 144 = 64512 <= 512 x 128, the launch's allocation
WG_THREADS = 128
CONSUMER_WGS = 3
CONSUMER_WARPS = 12


class KvOuterSm90:
    """One compiled configuration: data dtype, TILE_Q, G (query heads per KV head), D, block, and the
    options (constructor flags). `symbol` is the kernel's name in the compiled library: the DSL names its
    entry points after str(kernel)."""

    num_threads = WG_THREADS * (1 + CONSUMER_WGS)

    def __init__(self, dtype: str, tile_q: int = 8, group: int = 16, head_dim: int = 128, block: int = 128, *,
                 evict_first: bool = False, symbol: str = "kv_outer_sm90"):
        if dtype not in DSL_DTYPES:
            raise ValueError(f"CuTe attention supports {', '.join(DSL_DTYPES)}, not {dtype}")
        if tile_q * group != 128 or group != 16 or head_dim != 128 or block != 128:
            raise ValueError(f"the kernel is written for TILE_Q 8, G 16 (two 64-row half tiles of 16-row slots), "
                             f"D = block = 128; got TILE_Q {tile_q}, G {group}, D {head_dim}, block {block}")
        self.dtype = DSL_DTYPES[dtype]
        self.evict_first = evict_first
        self.symbol = symbol
        self.v_d_major = dtype == "fp8"              # fp8 wgmma wants K-major operands
        self.tile_q, self.group, self.head_dim, self.block = tile_q, group, head_dim, block
        self.rows = tile_q * group
        self.half_q = tile_q // 2                    # slots per half tile
        self.half_rows = self.half_q * group         # 64: one wgmma M per warpgroup
        self.p_shift = P_SHIFT[dtype]
        # fp8 P keeps its 2^P_SHIFT scale: a factor v_scale in it would push P into e4m3's subnormals
        self.fold_out_scale = dtype == "bf16"
        self.q_stages = {"bf16": 3, "fp8": 6}[dtype]    # per consumer warpgroup one (bf16: shared memory) or two
        self.kv_stages = 2
        self.kv_tx_bytes = 2 * block * head_dim * self.dtype.width // 8     # K box + V box
        self.lim_extra = 2                           # after a half's 4 limits: live slots, key-run ordinal

    def __str__(self) -> str:
        return self.symbol

    # ---- host side: the exported entry point (its C ABI: loader.py packs these arguments in this order) ----
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCsrQuery: cute.Tensor,
                 mTileKey: cute.Tensor, mTileEdge: cute.Tensor, mTileCount: cute.Tensor,
                 mCtaRange: cute.Tensor, mPageBlock: cute.Tensor, mQLimit: cute.Tensor,
                 mO: cute.Tensor, mM: cute.Tensor, mL: cute.Tensor,
                 hkv: Int32, num_pages: Int32, scale: Float32, out_scale: Float32,
                 stream: cuda.CUstream):
        dt = self.dtype
        D, BLK, HR = self.head_dim, self.block, self.half_rows
        kmaj, mnmaj = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        qk_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj, Float32, (1, 1, 1), (HR, BLK))
        pv_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj if const_expr(self.v_d_major) else mnmaj,
                                             Float32, (1, 1, 1), (HR, D), a_source=warpgroup.OperandSource.RMEM)
        sQ_layout = staged_smem_layout(dt, HR, D, self.q_stages)
        sK_layout = staged_smem_layout(dt, BLK, D, self.kv_stages)
        v_tile = (D, BLK) if const_expr(self.v_d_major) else (BLK, D)
        sV_layout = staged_smem_layout(dt, v_tile[0], v_tile[1], self.kv_stages)
        tma_k, gK_tma, tma_v, gV_tma = kv_tma_atoms(mK, mV, sK_layout, sV_layout, BLK, D, self.v_d_major)
        # O staging: one (G, D) slot per consumer warp, stored by TMA slot by slot
        sO_layout = staged_smem_layout(cutlass.BFloat16, self.group, D, CONSUMER_WARPS)
        tma_o, gO_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO,
                                                    cute.slice_(sO_layout, (None, None, 0)), (self.group, D))

        SharedStorage = self._storage_struct(sQ_layout, sK_layout, sV_layout, cute.cosize(sO_layout))
        self.kernel(qk_mma, pv_mma, tma_k, gK_tma, tma_v, gV_tma, tma_o, gO_tma, mQ, mCsrQuery, mTileKey, mTileEdge,
                    mTileCount, mCtaRange, mPageBlock, mQLimit, mO, mM, mL, hkv, num_pages,
                    scale * LOG2E, scale, out_scale, sQ_layout, sK_layout, sV_layout, sO_layout).launch(
            grid=(mCtaRange.shape[0], 1, 1), block=(self.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=1,
            preferred_smem_carveout=100, stream=stream)

    def _storage_struct(self, sQ_layout, sK_layout, sV_layout, o_elems: int):
        """The CTA's shared-memory struct (kept as self.shared_storage for _shared): the four barrier
        arrays, the limits table (half_q + lim_extra per Q stage), the Q, K and V stages and o_elems bf16 of
        O staging, each stage 1024-byte aligned for the 128-byte swizzle."""
        dt, mem, align = self.dtype, cute.struct.MemRange, cute.struct.Align
        # the field types as objects, not annotations: this module's `from __future__ import annotations`
        # would hand cute.struct strings it cannot resolve outside a jit function's own scope
        fields = {"q_full": mem[cutlass.Int64, self.q_stages], "q_empty": mem[cutlass.Int64, self.q_stages],
                  "kv_full": mem[cutlass.Int64, self.kv_stages], "kv_empty": mem[cutlass.Int64, self.kv_stages],
                  "sLim": mem[Int32, self.q_stages * (self.half_q + self.lim_extra)],
                  "sQ": align[mem[dt, cute.cosize(sQ_layout)], 1024],
                  "sK": align[mem[dt, cute.cosize(sK_layout)], 1024],
                  "sV": align[mem[dt, cute.cosize(sV_layout)], 1024],
                  "sO": align[mem[cutlass.BFloat16, o_elems], 1024]}
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        return self.shared_storage

    # ---- device side ------------------------------------------------------------------------------
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
        warp_group = cute.arch.make_warp_uniform(tidx // WG_THREADS)

        (q_full, q_empty, kv_full, kv_empty), sLim, sQ, sK, sV, sO = self._shared(
            sQ_layout, sK_layout, sV_layout, sO_layout)                  # sQ (64, D, QS), sO (G, D, 12)
        init_rings(q_full, q_empty, kv_full, kv_empty, self.q_stages, self.kv_stages, WG_THREADS + self.half_q,
                   CONSUMER_WARPS // CONSUMER_WGS, CONSUMER_WARPS, (tma_k, tma_v, tma_o), warp_idx)

        begin = mCtaRange[cta, 0]
        n_tiles = mCtaRange[cta, 1] - begin
        if warp_group == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.producer(tma_k, gK_tma, tma_v, gV_tma, mQ, mCsrQuery, mTileKey, mTileEdge, mTileCount,
                          mPageBlock, mQLimit, sQ, sK, sV, sLim, q_full, q_empty, kv_full, kv_empty,
                          begin, n_tiles, hkv, num_pages, tidx, warp_idx)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consumer(qk_mma, pv_mma, tma_o, gO_tma, sO, mM, mL, sQ, sK, sV, sLim,
                          (q_full, q_empty, kv_full, kv_empty), begin, n_tiles, scale_log2, scale, out_scale,
                          tidx % WG_THREADS, warp_group - 1)

    def _shared(self, sQ_layout, sK_layout, sV_layout, sO_layout):
        """The CTA's shared memory: its four barrier arrays (Q full / empty, K/V full / empty), the
        per-stage limits table (half_q limits + lim_extra values per Q stage) and the Q (rows, D, QS),
        K (BLK, D, KS), V (BLK, D or D, BLK, KS) and O staging (G, D, slots) tensors. Plain Python, traced
        inline."""
        storage = cutlass_utils.SmemAllocator().allocate(self.shared_storage)
        bars = (storage.q_full.data_ptr(), storage.q_empty.data_ptr(), storage.kv_full.data_ptr(),
                storage.kv_empty.data_ptr())
        sLim = storage.sLim.get_tensor(cute.make_layout((self.half_q + self.lim_extra, self.q_stages)))
        tensors = [getattr(storage, name).get_tensor(layout.outer, swizzle=layout.inner)
                   for name, layout in (("sQ", sQ_layout), ("sK", sK_layout), ("sV", sV_layout), ("sO", sO_layout))]
        return (bars, sLim, *tensors)

    # ---- producer warpgroup -----------------------------------------------------------------------
    @cute.jit
    def producer(self, tma_k: cute.CopyAtom, gK_tma: cute.Tensor, tma_v: cute.CopyAtom, gV_tma: cute.Tensor,
                 mQ: cute.Tensor, mCsrQuery: cute.Tensor, mTileKey: cute.Tensor, mTileEdge: cute.Tensor,
                 mTileCount: cute.Tensor, mPageBlock: cute.Tensor, mQLimit: cute.Tensor,
                 sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sLim: cute.Tensor,
                 q_full: cute.Pointer, q_empty: cute.Pointer, kv_full: cute.Pointer, kv_empty: cute.Pointer,
                 begin: Int32, n_tiles: Int32, hkv: Int32, num_pages: Int32, tidx: Int32, warp_idx: Int32):
        """Half tiles in order: K/V once per key run (run r into stage r mod 2), Q of the half's four
        slots into stage h mod QS, its limits, live slots and run ordinal next to it."""
        dt, G, D, BLK, HQ = self.dtype, self.group, self.head_dim, self.block, self.half_q
        tKgK, tKsK, tVgV, tVsV = kv_partitions(tma_k, gK_tma, tma_v, gV_tma, sK, sV, BLK, D, self.v_d_major)
        g2s, thr_q, tQcQ = q_row_copy(dt, D, WG_THREADS, tidx, self.half_rows)
        rows_per_pass = WG_THREADS // (D // (128 // dt.width))     # a copy pass's rows lie in one slot
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
                wait(q_empty + q_idx, q_phase)
                gather_q(g2s, thr_q, tQcQ, sQ[None, None, q_idx], mQ, hq, head, G, D,
                         lambda m, row: queries[HQ * j + m * rows_per_pass // G])
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_mbarrier_arrive_noinc(q_full + q_idx)    # one of 128 when its copies land
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
                        load_kv(tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, kv_full, kv_empty, kv_idx, kv_phase,
                                page * hkv + head, self.kv_tx_bytes, self.evict_first, warp_idx)
                        loaded_key = key
                        kv_idx, kv_phase = advance(kv_idx, kv_phase, self.kv_stages)
                q_idx += 1
                if q_idx == self.q_stages:
                    q_idx = Int32(0)
                    q_phase ^= 1
        cute.arch.cp_async_wait_group(0)       # drain (the consumers wait for every copy anyway)

    # ---- consumer warpgroups ----------------------------------------------------------------------
    @cute.jit
    def consumer(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_o: cute.CopyAtom, gO_tma: cute.Tensor,
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
        tScS = rows_cols_view(thr_qk.partition_C(cute.make_identity_tensor((HR, BLK))))
        # O staging: this warpgroup's four slots (G rows each) as a (64, D) view, written by stmatrix
        sO_all = cute.composition(sO, cute.make_layout(((G, CONSUMER_WARPS), D), stride=((1, G * D), G)))
        sO_wg = cute.local_tile(sO_all, (HR, D), (None, 0))                  # (64, D, 3)
        st_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16), pv_mma)
        tRsO = st_copy.get_slice(ctid).partition_D(sO_wg)
        gO = cute.local_tile(gO_tma, (G, D), (None, 0))
        tOsO, tOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                           cute.group_modes(gO, 0, 2))

        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((HR, BLK)), Float32)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((HR, D)), Float32)
        r_p = p_operand(thr_pv, acc_s, (HR, BLK), self.dtype)
        p_bias, l_scale = self._p_scales(out_scale)
        n_rows_acc = const_expr(cute.size(tScS, mode=[0]))
        o_slot = cwg * (CONSUMER_WARPS // CONSUMER_WGS) + warp   # this warp's staging slot

        run = Int32(-1)                   # the key run whose K/V this warpgroup has waited for
        for h in cutlass.range(cwg, 2 * n_tiles, CONSUMER_WGS, unroll=1):
            t = begin + h // 2
            j = h % 2
            qs = h % self.q_stages                         # the producer fills the stages in order
            wait(q_full + qs, (h // self.q_stages) % 2)
            lim = sLim[warp, qs]
            live = sLim[HQ, qs]
            want = sLim[HQ + 1, qs]
            while run < want:
                if run >= 0:
                    release(kv_empty + run % self.kv_stages, lane)
                run += 1
                wait(kv_full + run % self.kv_stages, (run // self.kv_stages) % 2)
            kv = run % self.kv_stages
            cute.arch.fence_view_async_shared()            # Q arrived by cp.async; wgmma reads it async
            # S = Q K^T
            mma_ss(qk_mma, acc_s, tSrQ, tSrK, qs, kv)
            warpgroup.wait_group(0)
            release(q_empty + qs, lane)
            # softmax step over the warp's 16 rows (one slot: one limit), m and l of live rows
            s_rc = rows_cols_view(acc_s)
            mask_keys(s_rc, tScS, lim, BLK)
            row_max, row_sum = softmax_rows(s_rc, scale_log2, p_bias)
            if ctid % 4 == 0:
                for r in cutlass.range_constexpr(n_rows_acc):
                    row = tScS[r, 0][0]
                    if row < live * G:
                        mM[t * ROWS + HR * j + row] = row_max[r] * scale
                        mL[t * ROWS + HR * j + row] = row_sum[r] * l_scale
            store_p(acc_s, r_p)
            # O = P V
            mma_rs(pv_mma, acc_o, r_p, tOrV, kv)
            warpgroup.wait_group(0)
            # O per warp: stmatrix into its own staging slot, one TMA store of the slot
            r_o = self._o_bf16(acc_o, out_scale)
            if lane == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)   # this warp's previous store has read its slot
            cute.arch.sync_warp()
            cute.copy(st_copy, st_copy.retile(r_o), tRsO[None, None, None, cwg])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()
            if lane == 0:
                if warp < live:
                    cute.copy(tma_o, tOsO[None, o_slot], tOgO[None, t * self.tile_q + HQ * j + warp],
                              **l2_policy(self.evict_first))
                cute.arch.cp_async_bulk_commit_group()
        if run >= 0:
            release(kv_empty + run % self.kv_stages, lane)   # the producer may reuse this stage two runs on
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0)          # O stores complete before the CTA exits

    def _p_scales(self, out_scale):
        """(p_bias, l_scale): P = exp2(S scale_log2 - row max scale_log2 + p_bias), l = row sum l_scale.
        p_bias is P_SHIFT, plus log2 out_scale where the output scale is folded into P (P V comes out in
        output units, so O needs no multiply, and l is divided back; both once per thread)."""
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
