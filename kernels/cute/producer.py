"""What a producer warpgroup loads (CuTe DSL, sm_90a): K/V blocks by TMA, page by page, and Q rows
gathered by cp.async through the query indices of a tile.

K/V: one TMA descriptor per tensor over the (rows, D) view of the paged cache (fp8 V d-major: rows of
`block` keys); one box is one block x D slab, slab = page * Hkv + head, loaded into a stage of the K/V
ring, which completes on the stage's full barrier (expect_tx of both boxes' bytes).
Q: row (slot, g) of a tile is q[query of the slot, head * G + g]; 16-byte cp.async copies, a row of D
elements per D / 8 (bf16) threads.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from .barriers import wait
from .layouts import gmem_tile

# L2 cache policy of a TMA copy (the createpolicy encoding CUTLASS names CacheHintSm90::EVICT_FIRST): lines
# it brings in or writes are the first to go when L2 needs room.
L2_EVICT_FIRST = 0x12F0000000000000


def l2_policy(evict_first: bool) -> dict:
    """cute.copy's cache-policy argument for a TMA copy: evict-first, or nothing (the default policy)."""
    return {"cache_policy": cutlass.Int64(L2_EVICT_FIRST)} if evict_first else {}


def kv_tma_atoms(mK: cute.Tensor, mV: cute.Tensor, sK_layout, sV_layout, block: int, head_dim: int, v_d_major: bool):
    """Host side: the TMA atoms and tensors of K and V, one block x D box (fp8 V d-major: D x block) into
    one stage of the swizzled layouts the wgmma reads."""
    op = cpasync.CopyBulkTensorTileG2SOp()
    tma_k, gK_tma = cpasync.make_tiled_tma_atom(op, mK, cute.slice_(sK_layout, (None, None, 0)), (block, head_dim))
    tma_v, gV_tma = cpasync.make_tiled_tma_atom(op, mV, cute.slice_(sV_layout, (None, None, 0)),
                                                (head_dim, block) if v_d_major else (block, head_dim))
    return tma_k, gK_tma, tma_v, gV_tma


def kv_partitions(tma_k, gK_tma, tma_v, gV_tma, sK: cute.Tensor, sV: cute.Tensor, block: int, head_dim: int,
                  v_d_major: bool):
    """The TMA partitions of K and V: (TMA, slab) on the global side, (TMA, stage) on the shared side.
    Plain Python, traced inline."""
    gK = cute.local_tile(gK_tma, (block, head_dim), (None, 0))                        # (BLK, D, slabs)
    gV = cute.local_tile(gV_tma, (head_dim, block) if v_d_major else (block, head_dim), (None, 0))
    tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                       cute.group_modes(gK, 0, 2))
    tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                       cute.group_modes(gV, 0, 2))
    return tKgK, tKsK, tVgV, tVsV


@cute.jit
def load_kv(tma_k: cute.CopyAtom, tKgK: cute.Tensor, tKsK: cute.Tensor, tma_v: cute.CopyAtom, tVgV: cute.Tensor,
            tVsV: cute.Tensor, kv_full: cute.Pointer, kv_empty: cute.Pointer, stage: Int32, phase: Int32, slab: Int32,
            tx_bytes: cutlass.Constexpr, evict_first: cutlass.Constexpr, warp_idx: Int32):
    """Warp 0: wait for K/V stage `stage` to be free, then one TMA box each of K and V (slab) into it."""
    if warp_idx == 0:
        wait(kv_empty + stage, phase)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(kv_full + stage, tx_bytes)
        cute.copy(tma_k, tKgK[None, slab], tKsK[None, stage], tma_bar_ptr=kv_full + stage, **l2_policy(evict_first))
        cute.copy(tma_v, tVgV[None, slab], tVsV[None, stage], tma_bar_ptr=kv_full + stage, **l2_policy(evict_first))


def q_row_copy(dt, head_dim: int, threads: int, tidx, q_rows: int):
    """The Q gather's tiled 16-byte cp.async (global -> shared) for `threads` threads, a row of head_dim
    elements per head_dim // (16 B) threads: the tiled copy, this thread's slice and its (row, col)
    coordinates over a (q_rows, head_dim) stage. Plain Python, traced inline."""
    vec = 128 // dt.width
    threads_per_row = head_dim // vec
    g2s = cute.make_tiled_copy_tv(
        cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dt, num_bits_per_copy=128),
        cute.make_ordered_layout((threads // threads_per_row, threads_per_row), order=(1, 0)),
        cute.make_layout((1, vec)))
    thr_q = g2s.get_slice(tidx)
    tQcQ = thr_q.partition_S(cute.make_identity_tensor((q_rows, head_dim)))
    return g2s, thr_q, tQcQ


def gather_q(g2s, thr_q, tQcQ: cute.Tensor, sQ_stage: cute.Tensor, mQ: cute.Tensor, hq, head, group: int,
             head_dim: int, query_of) -> None:
    """This thread's cp.async copies of a tile's Q rows into one stage: row r = (slot, g) comes from
    q[query_of(copy pass m, r), head * G + g] (empty slots repeat the last query: finite data, their rows
    are masked). Plain Python, traced inline; the caller commits the group."""
    dt = sQ_stage.element_type
    tQsQ = thr_q.partition_D(sQ_stage)
    for m in range(cute.size(tQcQ, mode=[1])):
        row = tQcQ[0, m, 0][0]
        q_row = gmem_tile(mQ, cutlass.Int64(query_of(m, row) * hq + head * group + row % group) * head_dim,
                          (head_dim,))
        for k in range(cute.size(tQcQ, mode=[2])):
            col = tQcQ[0, m, k][1]
            src = cute.make_tensor(cute.make_ptr(dt, (q_row.iterator + col).toint(), cute.AddressSpace.gmem,
                                                 assumed_align=16), tQsQ[None, m, k].layout)
            cute.copy(g2s, src, tQsQ[None, m, k])
