"""The softmax step on a wgmma S accumulator, in its rows x columns view (layouts.rows_cols_view).

A thread holds two rows of a warp's 16-row band, four threads share a row. The rows of a band lie in one
tile slot (G % 16 == 0), so one visibility limit masks them all behind one warp-uniform branch, and the
rows' max and sum trees, shuffles and exponentials run as straight-line code that interleaves.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


def pairwise(values: list, op):
    """Reduce a trace-time list of values as a balanced tree: depth log2(n) instead of a chain of n
    dependent operations (plain Python: runs while the kernel is traced)."""
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def _row(s_rc: cute.Tensor, r: int) -> list:
    return [s_rc[r, c] for c in range(cute.size(s_rc, mode=[1]))]


@cute.jit
def mask_keys(s_rc: cute.Tensor, tScS: cute.Tensor, limit: Int32, block: cutlass.Constexpr):
    """Keys past `limit` (the last key offset in the block a row may see; -1: none) to -inf in every row
    of s_rc, when the limit falls inside the block (a query's own block; other picks are wholly visible)."""
    if limit < block - 1:
        for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                if tScS[r, c][1] > limit:
                    s_rc[r, c] = -Float32.inf


def softmax_rows(s_rc: cute.Tensor, scale_log2: Float32, p_bias):
    """One softmax step in place over every row of s_rc: P = exp2(S scale_log2 - row max scale_log2 + p_bias)
    (a fully masked row's max is -inf, its P 0). p_bias: log2 of the factor P carries (an int, or a
    Float32 when the output scale is folded in). Returns the lists of row maxima and of P's row sums,
    reduced over the four threads of a row. Plain Python, traced inline."""
    n_r = cute.size(s_rc, mode=[0])
    maxes = [pairwise(_row(s_rc, r), cute.arch.fmax) for r in range(n_r)]
    for offset in (1, 2):
        other = [cute.arch.shuffle_sync_bfly(m, offset=offset) for m in maxes]
        maxes = [cute.arch.fmax(m, o) for m, o in zip(maxes, other)]
    shifts = [Float32(cutlass.select_(m != -Float32.inf, m * scale_log2 - p_bias, Float32(-p_bias)))
              for m in maxes]
    for r in range(n_r):
        for c in range(cute.size(s_rc, mode=[1])):
            s_rc[r, c] = cute.arch.exp2(s_rc[r, c] * scale_log2 - shifts[r])
    sums = [pairwise(_row(s_rc, r), lambda a, b: a + b) for r in range(n_r)]
    for offset in (1, 2):
        other = [cute.arch.shuffle_sync_bfly(x, offset=offset) for x in sums]
        sums = [x + o for x, o in zip(sums, other)]
    return maxes, sums
