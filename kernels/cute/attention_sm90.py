"""KV-outer attention stage for Hopper (sm_90a) in CuTe DSL.

Reads and writes exactly what the Triton attention stage does (see kernels/kv_outer/__init__.py):
every CTA walks its [begin, end) slice of the scheduler's tile list; a tile is one (KV head, page)
key and up to TILE_Q queries that chose it. The CTA loads the key's K and V block (block x D) into
shared memory once per run of tiles with the same key, gathers the tile's Q rows (TILE_Q queries x
G heads, rows picked through csr_query), and two consumer warpgroups (64 rows each) run
S = Q K^T and O = P V on wgmma with one softmax step. It stores the raw P V (bf16), the row max
m and the row sum l (fp32, natural-log units of the scaled score).

Row r of a tile is (slot, g) = divmod(r, G). Rows of empty slots (slot >= tile_count) and keys a
query may not see (position page_block[page] * block + t > q_limit[query]) are masked: such rows
end with m = -inf, l = 0, o = 0.

Synchronous cp.async loads by all threads, P passed through shared memory (SS wgmma for both
products, which also serves fp8 where the register-A layout differs), no warp specialization.
With ctas_per_sm = 2, P overwrites the warpgroup's own Q rows (96 KiB bf16 / 48 KiB fp8 of shared
memory, <= 128 registers), so two CTAs share an SM and one's loads overlap the other's MMAs. fp8 wants K-major operands, so for fp8 V is read d-major ([pages, Hkv, D, block]).
As in the Triton stage, fp8 P is scaled by 2^P_SHIFT before the cast (keeps it out of e4m3's
subnormals); l is divided back here and the host folds 2^-P_SHIFT into out_scale.
Tile offsets are 64-bit (o_part exceeds 2^31 elements at the study size).

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
from cutlass.utils import LayoutEnum

from .manifest import P_SHIFT

LOG2E = math.log2(math.e)
DSL_DTYPES = {"bf16": cutlass.BFloat16, "fp8": cutlass.Float8E4M3FN}


def _row_major_smem_layout(dtype, rows: int, cols: int):
    """Swizzled shared-memory layout of a (rows, cols) tile whose cols are contiguous (K-major)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))


def _transposed(t: cute.Tensor) -> cute.Tensor:
    """The (cols, rows) view of a 2-D shared-memory tensor."""
    return cute.composition(t, cute.make_ordered_layout((t.shape[1], t.shape[0]), order=(1, 0)))


def _acc_rows_cols(layout: cute.Layout) -> cute.Layout:
    """Regroup a wgmma accumulator layout ((2, 2, V), M, N) into ((2, M), (2, V, N)): rows x columns
    of the values one thread holds, so that a row's values are one mode."""
    flat = cute.make_layout(layout.shape)
    s, d = flat.shape, flat.stride
    rows_cols = cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])))
    return cute.composition(layout, rows_cols)


def _tile(m: cute.Tensor, offset, shape) -> cute.Tensor:
    """A compact row-major tile of `shape` starting `offset` (64-bit) elements into m's storage."""
    ptr = cute.make_ptr(m.element_type, (m.iterator + offset).toint(), cute.AddressSpace.gmem, assumed_align=16)
    return cute.make_tensor(ptr, cute.make_layout(shape, stride=cute.make_layout(shape[::-1]).stride[::-1]))


def _rows_cols_view(t: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(t.iterator, _acc_rows_cols(t.layout))


@cute.jit
def _softmax_row(s_rc: cute.Tensor, tScS: cute.Tensor, r: cutlass.Constexpr, limit: Int32, scale_log2: Float32,
                 p_shift: cutlass.Constexpr):
    """Row r of the S accumulator (rows x cols view): keys past `limit` masked, then one softmax step in
    place, p = exp(score - max) * 2^p_shift. Returns the row's max score and the sum of its p, both
    reduced over the four threads that hold the row. Every kernel generation shares this step."""
    row_max = -Float32.inf
    for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
        if tScS[r, c][1] > limit:
            s_rc[r, c] = -Float32.inf
        row_max = cutlass.max(row_max, s_rc[r, c])
    row_max = cutlass.max(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=1))
    row_max = cutlass.max(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=2))
    m_shift = Float32(-p_shift)
    if row_max != -Float32.inf:
        m_shift = row_max * scale_log2 - p_shift
    row_sum = Float32(0.0)
    for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
        p = cute.arch.exp2(s_rc[r, c] * scale_log2 - m_shift)
        s_rc[r, c] = p
        row_sum += p
    row_sum += cute.arch.shuffle_sync_bfly(row_sum, offset=1)
    row_sum += cute.arch.shuffle_sync_bfly(row_sum, offset=2)
    return row_max, row_sum


def _row_copy(dt, row_elems: int, threads: int):
    """A tiled 16-byte cp.async (global -> shared) for `threads` threads, row_elems // (16 B) threads per
    row of row_elems elements."""
    vec = 128 // dt.width
    threads_per_row = row_elems // vec
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dt, num_bits_per_copy=128),
        cute.make_ordered_layout((threads // threads_per_row, threads_per_row), order=(1, 0)),
        cute.make_layout((1, vec)))


def _gather_q_row(dt, q_row: cute.Tensor, tQcQ: cute.Tensor, tQsQ: cute.Tensor, m, copy_atom) -> None:
    """cp.async of staged Q row m's 16-byte chunks from the global row q_row (a plain Python helper: its
    loop unrolls while the caller is traced)."""
    for k in range(cute.size(tQcQ, mode=[2])):
        col = tQcQ[0, m, k][1]
        src = cute.make_tensor(cute.make_ptr(dt, (q_row.iterator + col).toint(), cute.AddressSpace.gmem,
                                             assumed_align=16), tQsQ[None, m, k].layout)
        cute.copy(copy_atom, src, tQsQ[None, m, k])


def check_tile(dtype: str, tile_q: int, group: int, head_dim: int, block: int, fixed: str | None = None) -> None:
    """The configuration checks every generation shares: a DSL dtype and 128-row tiles (two 64-row
    warpgroups); `fixed` names a generation written for head_dim = block = 128 only."""
    if dtype not in DSL_DTYPES:
        raise ValueError(f"CuTe attention supports {', '.join(DSL_DTYPES)}, not {dtype}")
    if tile_q * group != 128:
        raise ValueError(f"TILE_Q * G must be 128 (two 64-row warpgroups), got {tile_q} * {group}")
    if fixed and (head_dim != 128 or block != 128):
        raise ValueError(f"the {fixed} kernel is written for head_dim = block = 128, got {head_dim}, {block}")


class AttentionLaunch:
    """The launcher every generation exports (its C ABI: loader.py packs these arguments in this
    order). Tracing it runs the generation's `_launch`, which builds the MMAs, layouts and copy atoms
    and launches its kernel."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCsrQuery: cute.Tensor,
                 mTileKey: cute.Tensor, mTileEdge: cute.Tensor, mTileCount: cute.Tensor,
                 mCtaRange: cute.Tensor, mPageBlock: cute.Tensor, mQLimit: cute.Tensor,
                 mO: cute.Tensor, mM: cute.Tensor, mL: cute.Tensor,
                 hkv: Int32, num_pages: Int32, scale: Float32, out_scale: Float32,
                 stream: cuda.CUstream):
        self._launch(mQ, mK, mV, mCsrQuery, mTileKey, mTileEdge, mTileCount, mCtaRange, mPageBlock, mQLimit,
                     mO, mM, mL, hkv, num_pages, scale, out_scale, stream)


class KvOuterAttentionSm90(AttentionLaunch):
    """One compiled configuration: data dtype, TILE_Q, G (query heads per KV head), D, block."""

    num_threads = 256          # two consumer warpgroups, 64 rows each
    kernel_version = "v2-sync-ss-ctas"

    def __init__(self, dtype: str, tile_q: int = 8, group: int = 16, head_dim: int = 128, block: int = 128,
                 ctas_per_sm: int = 1):
        check_tile(dtype, tile_q, group, head_dim, block)
        if head_dim % 64 or block % 64 or not (64 <= head_dim <= 256) or not (64 <= block <= 256):
            raise ValueError(f"head_dim and block must be multiples of 64 in [64, 256], got {head_dim}, {block}")
        self.dtype_name = dtype
        self.dtype = DSL_DTYPES[dtype]
        self.v_d_major = dtype == "fp8"
        self.tile_q, self.group, self.head_dim, self.block = tile_q, group, head_dim, block
        self.rows = tile_q * group
        if ctas_per_sm not in (1, 2):
            raise ValueError(f"ctas_per_sm must be 1 or 2, got {ctas_per_sm}")
        # Two CTAs per SM (one loads while the other computes) fit when P reuses Q's shared memory:
        # a warpgroup's P rows are its own Q rows, dead once its S = Q K^T has completed.
        self.ctas_per_sm = ctas_per_sm
        self.p_in_q = ctas_per_sm > 1 and head_dim == block
        if ctas_per_sm > 1 and not self.p_in_q:
            raise ValueError("ctas_per_sm 2 needs head_dim == block (P aliases Q in shared memory)")
        self.p_shift = P_SHIFT[dtype]

    # ---- host side (traced once at compile time) --------------------------------------------
    @cute.jit
    def _launch(self, mQ, mK, mV, mCsrQuery, mTileKey, mTileEdge, mTileCount, mCtaRange, mPageBlock, mQLimit,
                mO, mM, mL, hkv, num_pages, scale, out_scale, stream):
        dt = self.dtype
        kmaj, mnmaj = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        qk_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj, Float32, (2, 1, 1), (64, self.block))
        pv_mma = sm90.make_trivial_tiled_mma(dt, dt, kmaj, kmaj if const_expr(self.v_d_major) else mnmaj,
                                             Float32, (2, 1, 1), (64, self.head_dim))
        sQ_layout = _row_major_smem_layout(dt, self.rows, self.head_dim)
        sK_layout = _row_major_smem_layout(dt, self.block, self.head_dim)
        if const_expr(self.v_d_major):
            sV_layout = _row_major_smem_layout(dt, self.head_dim, self.block)
        else:
            sV_layout = _row_major_smem_layout(dt, self.block, self.head_dim)
        sP_layout = _row_major_smem_layout(dt, self.rows, self.block)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dt, 0 if self.p_in_q else cute.cosize(sP_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(qk_mma, pv_mma, mQ, mK, mV, mCsrQuery, mTileKey, mTileEdge, mTileCount, mCtaRange,
                    mPageBlock, mQLimit, mO, mM, mL, hkv, num_pages, scale * LOG2E, scale, out_scale,
                    sQ_layout, sK_layout, sV_layout, sP_layout).launch(
            grid=(mCtaRange.shape[0], 1, 1), block=(self.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=100 if const_expr(self.ctas_per_sm > 1) else None, stream=stream)

    # ---- device side ------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, mQ: cute.Tensor, mK: cute.Tensor,
               mV: cute.Tensor, mCsrQuery: cute.Tensor, mTileKey: cute.Tensor, mTileEdge: cute.Tensor,
               mTileCount: cute.Tensor, mCtaRange: cute.Tensor, mPageBlock: cute.Tensor,
               mQLimit: cute.Tensor, mO: cute.Tensor, mM: cute.Tensor, mL: cute.Tensor,
               hkv: Int32, num_pages: Int32, scale_log2: Float32, scale: Float32, out_scale: Float32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout):
        dt = self.dtype
        G, D, BLK, ROWS = self.group, self.head_dim, self.block, self.rows
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp_group = cute.arch.make_warp_uniform(tidx // 128)

        storage = cutlass_utils.SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if const_expr(self.p_in_q):
            sP = storage.sQ.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        else:
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sVt = sV if const_expr(self.v_d_major) else _transposed(sV)     # (D, keys) B operand

        # wgmma operand fragments (descriptors over shared memory)
        thr_qk = qk_mma.get_slice(tidx)
        thr_pv = pv_mma.get_slice(tidx)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_A(sP))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
        tSsP = thr_qk.partition_C(sP)                                   # where this thread's P goes
        tScS = _rows_cols_view(thr_qk.partition_C(cute.make_identity_tensor((ROWS, BLK))))

        # global -> shared: 16-byte cp.async, a row of D (or block) elements per D / 8 (bf16) threads
        g2s = _row_copy(dt, D, self.num_threads)
        thr_g2s = g2s.get_slice(tidx)
        tQsQ = thr_g2s.partition_D(sQ)
        tQcQ = thr_g2s.partition_S(cute.make_identity_tensor((ROWS, D)))
        tKsK = thr_g2s.partition_D(sK)
        tVsV = thr_g2s.partition_D(sV)

        hq = hkv * G
        begin = mCtaRange[cta, 0]
        end = mCtaRange[cta, 1]
        loaded_key = Int32(-1)
        for t in cutlass.range(begin, end, unroll=1):
            key = mTileKey[t]
            if key >= 0:
                head = key // num_pages
                page = key - head * num_pages
                slab = page * hkv + head                  # [pages, Hkv, ...] folded: slab-th block x D tile
                edge = mTileEdge[t]
                count = mTileCount[t]
                if key != loaded_key:
                    kv_offset = cutlass.Int64(slab) * (BLK * D)
                    cute.copy(g2s, thr_g2s.partition_S(_tile(mK, kv_offset, (BLK, D))), tKsK)
                    v_shape = (D, BLK) if const_expr(self.v_d_major) else (BLK, D)
                    cute.copy(g2s, thr_g2s.partition_S(_tile(mV, kv_offset, v_shape)), tVsV)
                    loaded_key = key
                # gather Q: row r = (slot, g) comes from q[csr_query[edge + slot], head * G + g];
                # empty slots repeat the last query (finite data; their rows are masked below)
                for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
                    row = tQcQ[0, m, 0][0]
                    slot = cutlass.min(row // G, count - 1)
                    query = mCsrQuery[edge + slot]
                    q_row = _tile(mQ, cutlass.Int64(query * hq + head * G + row % G) * D, (D,))
                    _gather_q_row(dt, q_row, tQcQ, tQsQ, m, g2s)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()

                # S = Q K^T
                acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((ROWS, BLK)), Float32)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    qk_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                    cute.gemm(qk_mma, acc_s, tSrQ[None, None, kb], tSrK[None, None, kb], acc_s)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                # mask, one softmax step, write m and l
                s_rc = _rows_cols_view(acc_s)
                key_base = mPageBlock[page] * BLK
                for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
                    row = tScS[r, 0][0]
                    slot = row // G
                    limit = Int32(-1)
                    if slot < count:
                        limit = mQLimit[mCsrQuery[edge + slot]] - key_base
                    row_max, row_sum = _softmax_row(s_rc, tScS, r, limit, scale_log2, self.p_shift)
                    if tidx % 4 == 0:
                        mM[t * ROWS + row] = row_max * scale
                        mL[t * ROWS + row] = row_sum * (1.0 / (1 << self.p_shift))

                # P -> shared memory (data dtype), visible to this warpgroup's wgmma
                r_p = cute.make_rmem_tensor_like(acc_s, dt)
                r_p.store(acc_s.load().to(dt))
                cute.autovec_copy(r_p, tSsP)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=1 + warp_group, number_of_threads=128)

                # O = P V
                acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((ROWS, D)), Float32)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    pv_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                    cute.gemm(pv_mma, acc_o, tOrP[None, None, kb], tOrV[None, None, kb], acc_o)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                r_o = cute.make_rmem_tensor_like(acc_o, cutlass.BFloat16)
                r_o.store((acc_o.load() * out_scale).to(cutlass.BFloat16))
                cute.autovec_copy(r_o, thr_pv.partition_C(_tile(mO, cutlass.Int64(t) * (ROWS * D), (ROWS, D))))
                cute.arch.sync_threads()               # shared Q/P (and K/V) are reused next tile
