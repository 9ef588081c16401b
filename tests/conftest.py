"""Shared test helpers, and the hypothesis profiles: `ci` (the default: a few hundred examples per
property) and `slow` (2,000 and more). Pick one with HYPOTHESIS_PROFILE=slow or --hypothesis-profile=slow."""
import contextlib
import importlib.util
import io
import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=300, deadline=None)
settings.register_profile("slow", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load_script(name: str):
    """scripts/NAME.py as a module (its main() to call in-process)."""
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def load_script():
    return _load_script


def _run_cli(*args, env=None):
    """Run the real `msa-bench` entry point (cli.main) in-process: (exit code, stdout, stderr)."""
    from msa_bench.cli import main
    out, err = io.StringIO(), io.StringIO()
    old_argv = sys.argv
    sys.argv = ["msa-bench", *map(str, args)]
    mp = pytest.MonkeyPatch()
    for k, v in (env or {}).items():
        mp.setenv(k, v)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
            main()
    finally:
        sys.argv = old_argv
        mp.undo()
    return exc.value.code, out.getvalue(), err.getvalue()


def _one_error_line(err: str) -> str:
    """Assert the command failed with exactly one line 'error: ...' and no traceback; return it."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="session")
def cli():
    return _run_cli


@pytest.fixture(scope="session")
def one_error_line():
    return _one_error_line


def _graph_replay_equals_eager(plan):
    """Run the module eagerly, capture it in one CUDA graph, replay it into a NaN-filled output, and check
    the replay reproduces the eager result bit for bit."""
    import torch
    plan.run()
    torch.cuda.synchronize()
    first = plan.output.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan.run()
        with torch.cuda.graph(graph, stream=stream):
            plan.run()
    torch.cuda.current_stream().wait_stream(stream)
    plan.output.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(plan.output, first)


@pytest.fixture(scope="session")
def graph_replay_equals_eager():
    return _graph_replay_equals_eager


def _poisoned_run(plan):
    """NaN-fill every float output and intermediate, then run: anything not written stays NaN."""
    import torch
    for t in [plan.output, plan.lse] + [v for v in plan.buffers.values() if isinstance(v, torch.Tensor)]:
        if t is not None and t.is_floating_point():
            t.fill_(float("nan"))
    plan.run()
    if plan.output.is_cuda:
        torch.cuda.synchronize()


@pytest.fixture(scope="session")
def poisoned_run():
    return _poisoned_run


def _matches_reference(plan, w, tol):
    """The plan's output and LSE against the float64 reference within `tol`; rows that see no key must
    have LSE -inf and output 0."""
    import torch
    from msa_bench.scenarios.reference import reference_attention, relative_error
    ref_out, ref_lse = reference_attention(w)
    assert relative_error(plan.output, ref_out) <= tol
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(plan.lse) & (plan.lse < 0), empty)
    assert relative_error(plan.lse[~empty], ref_lse[~empty]) <= tol
    assert torch.equal(plan.output[empty.any(-1)].abs().sum(), torch.zeros((), dtype=plan.output.dtype,
                                                                             device=plan.output.device))


@pytest.fixture(scope="session")
def matches_reference():
    return _matches_reference


def _fake_run(path, units, scenario="gate-test", grid="g1", ref_clock=1980.0, clocks=True):
    """A small GPU-timed run folder written through the results format: units maps backend -> module
    seconds (a list; the attention stage gets 0.8 x them), or -> (seconds, sm_clock_mhz). One point."""
    import numpy as np
    from msa_bench.harness.store import results
    from msa_bench.harness.measure.timing import summarize
    key, ids = "pt-0", []
    for backend, spec in units.items():
        seconds, mhz = spec if isinstance(spec, tuple) else (spec, [ref_clock] * len(spec))
        stats, samples = [], []
        for stage, scale in (("module", 1.0), ("attention", 0.8)):
            sec = [float(s) * scale for s in seconds]
            stats += [{"point_key": key, "backend": backend, "schedule": "none", "dtype": "bf16", "stage": stage,
                       "statistic": k, "value": v, "timer": "cuda-graph"} for k, v in summarize(sec).items()]
            for i, s in enumerate(sec):
                row = {"point_key": key, "backend": backend, "dtype": "bf16", "stage": stage, "rep": i,
                       "seconds": s, "timer": "cuda-graph"}
                if clocks:
                    row.update(sm_clock_mhz=float(mhz[i]), clock_event_reasons=0)
                samples.append(row)
        uid = results.unit_id(key, backend)
        ids.append(uid)
        status = {"status": "ok", "reason": "", "point_key": key, "backend": backend, "dtype": "bf16",
                  "max_rel_err": 1e-3, "tol": 1e-2}
        if clocks:
            status["sm_clock_max_mhz"] = ref_clock
        results.write_unit(path, uid, status, stats, samples)
    results.write_meta(path, {"scenario": scenario, "grid_sha256": grid, "timer": "cuda-graph",
                              "backends": list(units), "units_planned": ids, "complete": True,
                              "provenance": {"device_name": "NVIDIA H200"}})
    return path


@pytest.fixture(scope="session")
def fake_run():
    return _fake_run


def _xor_reduce_fast_path():
    """The Triton interpreter reduces with a custom combine element by element in Python, and tl.sort's
    bitonic network takes an xor_sum at each of its steps: on CPU that reduce was half of a packed schedule's
    time (the hybrid's and q-packed's tests). XOR is associative and commutative, so numpy's reduce gives the
    same bits (test_interpreter_fast_path.py holds it to the interpreter's own). None where this Triton has
    no such reduce to speed up."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    combine = getattr(tl.standard, "_xor_combine", None)
    ops = getattr(interpreter, "ReduceOps", None)
    if combine is None or ops is None or not hasattr(ops, "apply_impl"):
        return None
    generic = ops.apply_impl

    def apply_impl(self, input):
        if self.combine_fn is combine and len(input) == 1:
            x = input[0]
            return self.to_tensor(np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims),
                                  x.dtype)
        return generic(self, input)
    return ops, generic, apply_impl


@pytest.fixture(scope="session", autouse=True)
def interpreter_xor_reduce():
    """The fast path above for the whole test run (the interpreter's own comes back after it)."""
    from msa_bench.kernels import triton_common  # noqa: F401  (sets TRITON_INTERPRET on CPU before triton loads)
    patch = _xor_reduce_fast_path()
    if patch is None:
        yield None
        return
    ops, generic, fast = patch
    ops.apply_impl = fast
    yield generic
    ops.apply_impl = generic


def _small_workload(n=12, blocks=4):
    """A bf16 workload of n tokens over `blocks` blocks of 8 keys, two selected per (token, KV head)."""
    import torch
    from msa_bench.scenarios.workload import AttnShape, build_workload
    shape = AttnShape(hq=8, hkv=2, head_dim=16, block=8, topk=2)
    sel = torch.stack([torch.stack([torch.tensor([(i + h) % blocks, (i + h + 1) % blocks]) for i in range(n)])
                       for h in range(shape.hkv)]).int()
    return build_workload(shape, "bf16", sel, torch.arange(blocks).view(1, -1).int(), torch.zeros(n).int(),
                          torch.full((n,), blocks * shape.block - 1).int(), blocks, causal=False, seed=0)


@pytest.fixture
def small_workload():
    return _small_workload
