"""The test run's fast path for the Triton interpreter's xor_sum (conftest.interpreter_xor_reduce) gives the bits
the interpreter's own element-by-element reduce gives, and tl.sort, whose network takes those reduces, sorts."""
import pytest
import torch

from msa_bench.kernels import triton_common  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton loads)
import triton
import triton.language as tl


@triton.jit
def _xor_sums(x_ptr, rows_ptr, cols_ptr, sorted_ptr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    x = tl.load(x_ptr + r[:, None] * C + c[None, :])
    tl.store(rows_ptr + r, tl.xor_sum(x, 1))
    tl.store(cols_ptr + c, tl.xor_sum(x, 0))
    tl.store(sorted_ptr + tl.arange(0, R * C), tl.sort(tl.reshape(x, [R * C])))


def _run(x):
    rows, cols, srt = torch.empty(x.shape[0], dtype=x.dtype), torch.empty(x.shape[1], dtype=x.dtype), x.flatten().clone()
    _xor_sums[(1,)](x, rows, cols, srt, R=x.shape[0], C=x.shape[1])
    return rows, cols, srt


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
def test_xor_reduce_and_sort_equal_the_interpreters_own(interpreter_xor_reduce, monkeypatch):
    if interpreter_xor_reduce is None:
        pytest.skip("this Triton has no interpreter reduce to speed up")
    from triton.runtime import interpreter
    x = torch.randint(-2**31, 2**31 - 1, (8, 16), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    fast = _run(x)
    monkeypatch.setattr(interpreter.ReduceOps, "apply_impl", interpreter_xor_reduce)
    own = _run(x)
    for a, b in zip(fast, own):
        assert torch.equal(a, b)
    assert torch.equal(fast[2], x.flatten().sort().values)
    expect = x.clone()
    for axis, got in ((1, fast[0]), (0, fast[1])):
        acc = expect.select(axis, 0).clone()
        for i in range(1, x.shape[axis]):
            acc ^= expect.select(axis, i)
        assert torch.equal(got, acc)
