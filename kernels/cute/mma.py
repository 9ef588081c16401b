"""A consumer warpgroup's MMAs on wgmma (CuTe DSL, sm_90a): S = Q K^T with both operands in shared
memory, O = P V with P in registers, and P made into that register operand from the S accumulator.

Each issue is one wgmma group (fence, the k blocks, commit); the caller waits for it (wait_group) when
it needs the result, so a kernel may keep groups in flight.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from .layouts import acc_to_frg_a


def _fresh(tiled_mma: cute.TiledMma) -> cute.TiledMma:
    """A new handle on the same MMA value: setting its ACCUMULATE field inside a loop body then does
    not rebind the caller's handle (a value made in the body would not dominate uses after the loop)."""
    return tiled_mma.__new_from_mlir_values__(tiled_mma.__extract_mlir_values__())


@cute.jit
def mma_ss(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor, a_stage: Int32,
           b_stage: Int32):
    """acc = A B, A stage a_stage of tA and B stage b_stage of tB (shared-memory descriptors, modes (MMA,
    M or N, K blocks, stage)), as one wgmma group."""
    mma = _fresh(tiled_mma)
    warpgroup.fence()
    for kb in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
        cute.gemm(mma, acc, tA[None, None, kb, a_stage], tB[None, None, kb, b_stage], acc)
    warpgroup.commit_group()


@cute.jit
def mma_rs(tiled_mma: cute.TiledMma, acc: cute.Tensor, rA: cute.Tensor, tB: cute.Tensor, b_stage: Int32):
    """acc = A B, A from registers (modes (MMA, M, K blocks)) and B stage b_stage of tB, as one wgmma group."""
    mma = _fresh(tiled_mma)
    warpgroup.fence()
    for kb in cutlass.range_constexpr(cute.size(rA, mode=[2])):
        mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
        cute.gemm(mma, acc, rA[None, None, kb], tB[None, None, kb, b_stage], acc)
    warpgroup.commit_group()


def p_operand(thr_pv, acc_s: cute.Tensor, shape_mk, dtype):
    """The registers that hold P as the A operand of P V (make once, before the loop)."""
    if dtype.width == 8:
        return cute.make_rmem_tensor(thr_pv.partition_shape_A(shape_mk), dtype)
    return cute.make_rmem_tensor_like(acc_to_frg_a(acc_s), dtype)


def store_p(acc_s: cute.Tensor, r_p: cute.Tensor) -> None:
    """P (the softmax step's output in the S accumulator) cast into its operand registers: 16-bit P is the
    accumulator's own k16 slices; fp8 P is regrouped (fp8_p_regs) and V's keys are stored to match."""
    if r_p.element_type.width == 8:
        r_p.store(fp8_p_regs(acc_s, r_p).load().to(r_p.element_type))
    else:
        r_p.store(acc_to_frg_a(acc_s).load().to(r_p.element_type))


def fp8_p_regs(acc_s: cute.Tensor, r_p: cute.Tensor) -> cute.Tensor:
    """The S accumulator's values regrouped (fp32, a register renaming) into the fp8 A-operand fragment
    of m64nNk32: per thread, acc_s is ((2 cols, 2 row halves, 16 col groups of 8)) and the A fragment
    ((4 k, 2 row halves, 2 k halves), k blocks of 32). Byte i of A's register (h, kh) in k block kb takes
    column 32 kb + 16 kh + 8 (i // 2) + 2 q + i % 2 (q = lane % 4) where the MMA reads k = 32 kb + 16 kh +
    4 q + i: no shuffles or byte permutes, and the keys of V are stored in that order instead
    (manifest.fp8_v_key_order, applied to the d-major V copy)."""
    tmp = cute.make_rmem_tensor_like(r_p, Float32)
    for kb in range(cute.size(r_p, mode=[2])):               # plain Python: unrolled while tracing
        for kh in range(2):
            for h in range(2):
                for i in range(4):
                    tmp[i + 4 * h + 8 * kh + 16 * kb] = acc_s[i % 2 + 2 * h + 4 * (4 * kb + 2 * kh + i // 2)]
    return tmp
