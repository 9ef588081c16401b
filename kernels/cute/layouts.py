"""Shared-memory layouts, global tiles and register views of the Hopper attention kernels (CuTe DSL).

Import only with CUTE_DSL_ARCH set when no GPU is present (build.py sets it).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

LOG2E = math.log2(math.e)
DSL_DTYPES = {"bf16": cutlass.BFloat16, "fp8": cutlass.Float8E4M3FN}


def staged_smem_layout(dtype, rows: int, cols: int, stages: int):
    """Swizzled (rows, cols, stages) shared-memory layout, cols contiguous (K-major): the layout wgmma
    reads and TMA writes, one stage per ring slot."""
    atom = warpgroup.make_smem_layout_atom(
        sm90.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def gmem_tile(m: cute.Tensor, offset, shape) -> cute.Tensor:
    """A compact row-major tile of `shape` starting `offset` (64-bit) elements into m's storage."""
    ptr = cute.make_ptr(m.element_type, (m.iterator + offset).toint(), cute.AddressSpace.gmem, assumed_align=16)
    return cute.make_tensor(ptr, cute.make_layout(shape, stride=cute.make_layout(shape[::-1]).stride[::-1]))


def rows_cols_view(t: cute.Tensor) -> cute.Tensor:
    """A wgmma accumulator ((2, 2, V), M, N) seen as ((2, M), (2, V, N)): rows x columns of the values one
    thread holds, so that a row's values are one mode."""
    flat = cute.make_layout(t.layout.shape)
    s, d = flat.shape, flat.stride
    rows_cols = cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])))
    return cute.make_tensor(t.iterator, cute.composition(t.layout, rows_cols))


def acc_to_frg_a(acc: cute.Tensor) -> cute.Tensor:
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
