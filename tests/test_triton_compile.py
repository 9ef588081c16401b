"""The scheduler's Triton kernels compiled for sm_90 on this CPU machine (Triton's own ptxas), with the
runtime ints Triton specializes to constexprs when they equal 1 (one CTA, chunks of one tile, one query
range, one group). The interpreter runs every other test and does not specialize, so a `.to()` on such
an argument passed every CPU test and failed only on the GPU (found so on the H200, 2026-11-29).

A child process: the interpreter decides at decoration time, and the test session's kernels are
interpreted ones.
"""
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent('''
    import os
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from msa_bench.kernels.kv_outer import scheduler as S

    INT64_PTRS = {"phase_base"}
    failed = []

    def compile_for_sm90(fn, consts):
        sig = {n: ("*i64" if n in INT64_PTRS else "*i32") if n.endswith(POINTER_SUFFIXES) or n in POINTERS
               else "i32" for n in fn.arg_names}
        sig.update({c: "constexpr" for c in consts})
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        except Exception as exc:
            failed.append(f"{fn.__name__} {consts}: {str(exc).splitlines()[-1][:200]}")

    POINTER_SUFFIXES = ("_ptr", "_key", "_edge", "_count", "_end", "_start", "_base", "_range")
    POINTERS = {"csr_query", "below", "count", "position", "src", "dst"}
    ones = ({}, {"num_ctas": 1}, {"num_ctas": 1, "order_chunk": 1, "q_ranges": 1})
    for extra in ones:
        for grouped in (False, True):
            for deal in (0, 1, 2):
                if grouped and extra.get("q_ranges") == 1:
                    continue
                compile_for_sm90(S.schedule_tiles_kernel, dict(TILE_Q=8, GROUPED=grouped, DEAL=deal, SEARCH_STEPS=13,
                                                              BLOCK=1024, BLOCK_C=256, **extra))
    for extra in ({}, {"num_ctas": 1, "groups": 1}):
        compile_for_sm90(S.phase_table_kernel, dict(BLOCK_C=256, **extra))
    for extra in ({}, {"num_pages": 1}):
        compile_for_sm90(S.range_tiles_kernel, dict(TILE_Q=1, SEARCH_STEPS=16, BLOCK=32, RANGES=4, **extra))
    for extra in ({}, {"n": 1}):
        compile_for_sm90(S.run_ends_kernel, dict(BLOCK=1024, **extra))
        compile_for_sm90(S.reindex_kernel, dict(TILE_Q=8, BLOCK=2048, **extra))
    print("\\n".join(failed) or "all compiled")
    raise SystemExit(1 if failed else 0)
''')


@pytest.mark.slow
def test_scheduler_kernels_compile_for_sm90_with_ints_specialized_to_one():
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


PACKED_CHILD = textwrap.dedent('''
    import os
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from msa_bench.kernels.q_packed.attention import packed_attention_kernel
    from msa_bench.kernels.q_packed.schedule import pack_tile_kernel
    from msa_bench.kernels.kv_outer.combine import combine_tiles_kernel

    failed = []

    def compile_for_sm90(fn, types, consts):
        sig = {n: types.get(n, "*i32" if n.endswith("_ptr") else "i32") for n in fn.arg_names}
        sig.update({c: "constexpr" for c in consts})
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        except Exception as exc:
            failed.append(f"{fn.__name__} {consts}: {str(exc).splitlines()[-1][:300]}")

    for P, share, residual in ((8, 1, False), (16, 3, True), (1, 1, False), (12, 1, False)):
        compile_for_sm90(pack_tile_kernel, {}, dict(P=P, TOPK=16, K_P2=16, U=16 * P,
                                                    U_P2=triton.next_power_of_2(16 * P), BLOCK=128,
                                                    MIN_SHARE=share, RESIDUAL=residual, THIRDS=P == 12,
                                                    FIELD=triton.next_power_of_2(16 * P).bit_length(),
                                                    CELLS=triton.next_power_of_2(16 * P * P)))
    for dt, vd, shift in (("bf16", False, 0), ("fp8e4nv", True, 8)):
        types = {"q_ptr": "*" + dt, "k_ptr": "*" + dt, "v_ptr": "*" + dt, "out_ptr": "*bf16", "lse_ptr": "*fp32",
                 "qk_scale_log2": "fp32", "out_scale": "fp32"}
        for P in (8, 16):
            compile_for_sm90(packed_attention_kernel, types, dict(HQ=64, HKV=4, G=16, D=128, BLOCK=128, P=P,
                             U=16 * P, V_DMAJOR=vd, IEEE=False, P_SHIFT=shift, SOFT_ROUND_P=False, NUM_STAGES=2))
    types = {"o_part_ptr": "*bf16", "m_part_ptr": "*fp32", "l_part_ptr": "*fp32", "out_ptr": "*bf16",
             "lse_ptr": "*fp32"}
    for extra in (False, True):
        compile_for_sm90(combine_tiles_kernel, types, dict(HKV=4, G=16, D=128, TOPK=16, TOPK_P2=16, PAIRS=4,
                                                           EXTRA=extra))
    print("\\\\n".join(failed) or "all compiled")
    raise SystemExit(1 if failed else 0)
''')


@pytest.mark.slow
def test_packed_kernels_compile_for_sm90():
    """q-packed's schedule and attention kernels and the combine with the packed partial, compiled as the GPU
    compiles them (the interpreter accepted a global the compiler refuses)."""
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", PACKED_CHILD], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
