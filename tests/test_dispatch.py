"""The C++ dispatch on a CPU: the Triton launch records it replays, the library's build and its program
bookkeeping, the torch op's registration, and the backend option that selects it."""
from __future__ import annotations

import ctypes
import shutil
import struct
from types import SimpleNamespace

import pytest
import torch

from msa_bench.kernels.base import BackendUnavailable, get_backend
from msa_bench.kernels.dispatch import triton_launch as tl_launch
from msa_bench.kernels.dispatch.triton_launch import pack_arguments, recording, replayable


def test_arguments_are_packed_as_the_launcher_passes_them():
    t = torch.zeros(4)
    sig = {"x_ptr": "*fp32", "n": "i32", "big": "i64", "scale": "fp32", "BLOCK": "constexpr", "one": "constexpr"}
    names = ["x_ptr", "n", "big", "scale", "BLOCK", "one"]
    blob, offsets = pack_arguments(sig, names, dict(x_ptr=t, n=-7, big=1 << 40, scale=0.5, BLOCK=1024, one=1))
    assert offsets == (0, 8, 16, 24, 32, 40)                 # four arguments, then the two scratch pointers
    assert struct.unpack_from("<Q", blob, 0)[0] == t.data_ptr()
    assert struct.unpack_from("<i", blob, 8)[0] == -7
    assert struct.unpack_from("<q", blob, 16)[0] == 1 << 40
    assert struct.unpack_from("<f", blob, 24)[0] == 0.5
    assert blob[32:] == bytes(16)


def test_floats_and_flags_are_packed_as_the_launchers_storage_types():
    sig = {"h": "fp16", "b": "bf16", "d": "fp64", "flag": "i1"}
    blob, _ = pack_arguments(sig, list(sig), dict(h=1.5, b=-2.75, d=0.1, flag=True))
    assert struct.unpack_from("<e", blob, 0)[0] == 1.5                             # IEEE half
    top = struct.unpack_from("<I", struct.pack("<f", -2.75))[0] >> 16               # a float32's top half
    assert struct.unpack_from("<H", blob, 8)[0] == top
    assert struct.unpack_from("<d", blob, 16)[0] == 0.1
    assert blob[24] == 1 and blob[25:32] == bytes(7)                                # one byte (int8_t)


def test_an_argument_type_it_cannot_pass_is_refused():
    with pytest.raises(BackendUnavailable, match="tensordesc"):
        pack_arguments({"d": "tensordesc<fp16[64]>"}, ["d"], {"d": None})


def _compiled(**meta):
    fields = dict(name="k", num_warps=4, shared=1024, global_scratch_size=0, profile_scratch_size=0, num_ctas=1,
                  launch_pdl=False, launch_cooperative_grid=False) | meta
    return SimpleNamespace(metadata=SimpleNamespace(**fields), function=0xABC, _init_handles=lambda: None,
                           src=SimpleNamespace(signature={"a": "*i32", "n": "i32", "B": "constexpr"}))


class _Kernel:
    """A compiled kernel's stand-in: __getitem__ launches (records the call) and returns its CompiledKernel."""
    arg_names = ["a", "n", "B"]
    params = [SimpleNamespace(name="n", default=3, has_default=True)]

    def __init__(self, compiled):
        self.compiled, self.calls = compiled, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.compiled
        return run


def test_a_launch_inside_recording_is_kept_with_its_grid_block_and_arguments():
    kernel = _Kernel(_compiled())
    a = torch.zeros(3, dtype=torch.int32)
    tl_launch.launch(kernel, (5,), a, 9, B=128, num_warps=4)            # outside: launched, not kept
    with recording() as kept:
        tl_launch.launch(kernel, (5,), a, 9, B=128, num_warps=4)
    assert len(kernel.calls) == 2 and len(kept) == 1
    k = kept[0]
    assert (k.function, k.grid, k.threads, k.shared) == (0xABC, (5, 1, 1), 128, 1024)
    assert struct.unpack_from("<Qi", k.blob, 0) == (a.data_ptr(), 9) and k.offsets == (0, 8, 16, 24)


def test_an_argument_left_to_its_default_is_packed_at_its_default():
    a = torch.zeros(3, dtype=torch.int32)
    with recording() as kept:
        tl_launch.launch(_Kernel(_compiled()), (2,), a, B=128)                      # n left at 3
    assert struct.unpack_from("<Qi", kept[0].blob, 0) == (a.data_ptr(), 3)


@pytest.mark.parametrize("meta,what", [(dict(global_scratch_size=64), "global scratch"),
                                       (dict(num_ctas=2), "cluster"), (dict(launch_pdl=True), "dependent"),
                                       (dict(launch_cooperative_grid=True), "cooperative")])
def test_a_launch_that_needs_more_than_a_plain_launch_is_refused(meta, what):
    with pytest.raises(BackendUnavailable, match=what):
        replayable(_Kernel(None), _compiled(**meta), (1,), (torch.zeros(1), 1), {"B": 8})


def test_the_interpreter_leaves_nothing_to_replay():
    kernel = _Kernel(None)                     # the CPU interpreter's launch returns no CompiledKernel
    with recording() as kept:
        tl_launch.launch(kernel, (1,), torch.zeros(1), 1, B=8)
    assert kept == []


def test_the_op_option_selects_the_cpp_dispatch_and_refuses_a_misspelling():
    assert get_backend("kv-outer-cute@op").dispatch == "op"
    b = get_backend("kv-outer-cute@v23+op+2:p")
    assert (b.dispatch, b.kernel, b.order) == ("op", "v23", "2:p")
    assert get_backend("kv-outer-cute").dispatch is None
    assert get_backend("q-packed-cute@op+p12").dispatch == "op" and get_backend("q-packed-cute@op").flags is None
    assert get_backend("hybrid@op+fused").dispatch == "op" and get_backend("hybrid@op+fused").fused
    assert get_backend("q-packed-cute@graph").dispatch == "graph"
    assert get_backend("hybrid@graph+fused").dispatch == "graph"
    with pytest.raises(KeyError, match="sets its dispatch twice"):
        get_backend("kv-outer-cute@op+op")
    with pytest.raises(KeyError, match="sets its dispatch twice"):
        get_backend("kv-outer-cute@op+graph")


def test_the_torch_op_is_registered_with_its_schema():
    from msa_bench.kernels.dispatch import torch_op
    schema = str(torch.ops.msa_bench.run_program.default._schema)
    assert schema.startswith("msa_bench::run_program(Tensor(a0!) out, Tensor(a1!) lse")
    with pytest.raises(ValueError, match="no program registered"):
        torch_op.run_program(torch.zeros(1), torch.zeros(1), 12345)


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA 13 toolkit)")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from msa_bench.kernels.dispatch.build import build
    return build(tmp_path_factory.mktemp("dispatch"))


@needs_nvcc
def test_the_library_builds_without_a_gpu_under_a_name_that_follows_its_source(built, monkeypatch):
    from msa_bench.kernels.dispatch import build as b
    assert built.name == b.library_name() and built.stat().st_size > 0
    monkeypatch.setenv(b.DIR_ENV, str(built.parent))
    assert b.find_library() == built
    monkeypatch.setattr(b, "FLAGS", b.FLAGS + ("-G",))
    assert b.library_name() != built.name and b.find_library() is None       # other flags: another library


@needs_nvcc
def test_a_program_counts_its_steps_per_stage_without_running_them(built, monkeypatch):
    from msa_bench.kernels.dispatch import build as b, program as p
    from msa_bench.kernels.dispatch.triton_launch import TritonLaunch
    monkeypatch.setenv(b.DIR_ENV, str(built.parent))
    monkeypatch.setattr(p, "_LIB", None)
    prog = p.Program("cpu")
    t = torch.zeros(8, dtype=torch.int32)
    prog.triton(0, [TritonLaunch(1, (2, 1, 1), 128, 0, bytes(24), (0, 8, 16), "k")] * 2)
    prog.tile_counts(0, t, t[:7], 8)
    prog.zero(1, t[:1])
    prog.lower_bound(3, t.to(torch.int16), t)
    assert [prog.size(s) for s in (-1, 0, 1, 2, 3)] == [5, 3, 1, 0, 1]
    assert p.ProgramStage(prog, 1).stage == 1
    assert callable(prog.lib.msa_prog_instantiate)          # the module as one graph (run on a GPU only)
    del prog                                   # freed through msa_prog_free
    assert ctypes.sizeof(ctypes.c_void_p) == 8


@needs_nvcc
def test_a_dispatched_plan_keeps_the_stages_it_replaced_alive(built, monkeypatch):
    # a recorded launch points at tensors its stage alone may own: they must live as long as the program
    import gc
    import weakref
    from types import SimpleNamespace
    from msa_bench.kernels.dispatch import build as b, program as p
    monkeypatch.setenv(b.DIR_ENV, str(built.parent))
    monkeypatch.setattr(p, "_LIB", None)

    class Stage:
        def __init__(self):
            self.owned = torch.zeros(4)

        def __call__(self):
            pass
    plan = SimpleNamespace(output=torch.zeros(1), stages={"a": Stage(), "b": Stage()}, info={})
    alive = [weakref.ref(s) for s in plan.stages.values()]
    p.dispatch_plan(plan, lambda prog: None)
    gc.collect()
    assert all(isinstance(s, p.ProgramStage) for s in plan.stages.values())
    assert all(ref() is not None for ref in alive)
    prog = plan.stages["a"].program
    assert plan.module == prog.run and plan.stages["b"].program is prog     # the module: the program whole
    del prog
    plan.stages, plan.module = {}, None
    gc.collect()
    assert all(ref() is None for ref in alive)                 # freed with the program


def test_without_the_library_the_op_backend_says_how_to_build_it(monkeypatch, tmp_path):
    from msa_bench.kernels.dispatch import build as b, program as p
    monkeypatch.setenv(b.DIR_ENV, str(tmp_path))
    monkeypatch.setattr(p, "_LIB", None)
    with pytest.raises(BackendUnavailable, match="msa-bench build-kernels"):
        p.library()
