"""mbarrier rings between a producer and its consumers (CuTe DSL, sm_90a).

A ring of S stages has a full and an empty barrier per stage. Its position is an (index, phase) pair;
the phase flips each time the index wraps (advance). The producer's first wait on each empty barrier is
on phase 1 (it passes at once), the consumers' first wait on each full barrier on phase 0. Every wait
goes through wait(), a watchdog that traps after WATCHDOG_NS, so a protocol bug fails the launch
instead of hanging the GPU.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

# A barrier wait still incomplete WATCHDOG_NS after its first failed try_wait (%globaltimer, read only on
# that slow path; a legitimate wait here is microseconds) executes `trap`: an unspecified launch failure.
WATCHDOG_NS = 10_000_000_000


@dsl_user_op
def _trap(*, loc=None, ip=None) -> None:
    llvm.inline_asm(res=None, operands_=[], asm_string="trap;", constraints="~{memory}", has_side_effects=True,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def wait(bar: cute.Pointer, phase: Int32):
    """mbarrier wait for `phase` with the deadlock watchdog."""
    done = cute.arch.mbarrier_try_wait(bar, phase)
    if not done:
        t0 = cute.arch.globaltimer()
        while not done:
            if cute.arch.globaltimer() - t0 > cutlass.Int64(WATCHDOG_NS):
                _trap()
            done = cute.arch.mbarrier_try_wait(bar, phase)


@cute.jit
def release(bar: cute.Pointer, lane: Int32):
    """One arrive per consumer warp on an empty barrier, after the warp's async-proxy reads: the stage
    was read by wgmma and is refilled by cp.async or TMA."""
    cute.arch.fence_view_async_shared()
    cute.arch.sync_warp()
    if lane == 0:
        cute.arch.mbarrier_arrive(bar)


@cute.jit
def advance(idx: Int32, phase: Int32, stages: cutlass.Constexpr):
    """The next (index, phase) of a ring of `stages` stages."""
    idx += 1
    if idx == stages:
        idx = Int32(0)
        phase ^= 1
    return idx, phase


@cute.jit
def init_rings(q_full: cute.Pointer, q_empty: cute.Pointer, kv_full: cute.Pointer, kv_empty: cute.Pointer,
               q_stages: cutlass.Constexpr, kv_stages: cutlass.Constexpr, q_full_count: cutlass.Constexpr,
               q_empty_count: cutlass.Constexpr, kv_empty_count: cutlass.Constexpr, tmas, warp_idx: Int32):
    """Warp 0 initializes the Q ring (full: q_full_count arrivals; empty: q_empty_count) and the K/V ring
    (full: one arrival plus the TMA bytes; empty: kv_empty_count) and prefetches the TMA descriptors;
    then the whole CTA syncs."""
    if warp_idx == 0:
        with cute.arch.elect_one():
            for s in cutlass.range_constexpr(q_stages):
                cute.arch.mbarrier_init(q_full + s, q_full_count)
                cute.arch.mbarrier_init(q_empty + s, q_empty_count)
            for s in cutlass.range_constexpr(kv_stages):
                cute.arch.mbarrier_init(kv_full + s, 1)
                cute.arch.mbarrier_init(kv_empty + s, kv_empty_count)
        for atom in tmas:
            cpasync.prefetch_descriptor(atom)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
