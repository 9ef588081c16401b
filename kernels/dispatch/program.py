"""A module's program: the steps of program.cu, added at plan time from the plan's own buffers and kernels,
and run from one ctypes call: the module whole (`plan.module`), or one stage (each stage of a plan becomes
`ProgramStage(program, i)`, so that stages are timed alone).

The buffers and the CuTe libraries the steps point at are kept alive by the Program. Nothing here allocates,
syncs or reads back at run time, so a run is legal inside CUDA-graph capture.
"""
from __future__ import annotations

import ctypes

import torch

from ..base import BackendUnavailable
from .triton_launch import TritonLaunch

_LIB = None
_VOID, _I32, _I64, _SIZE, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_size_t, ctypes.c_float
_SIGNATURES = {
    "msa_prog_new": (_VOID, []), "msa_prog_free": (None, [_VOID]), "msa_prog_size": (ctypes.c_int, [_VOID, ctypes.c_int]),
    "msa_prog_failed_step": (ctypes.c_int, [_VOID]),
    "msa_sort_temp_bytes": (_SIZE, [ctypes.c_int, _I64, ctypes.c_int]), "msa_scan_temp_bytes": (_SIZE, [_I64]),
    "msa_prog_launch": (None, [_VOID, ctypes.c_int, _VOID] + [ctypes.c_uint] * 5 + [ctypes.c_char_p, _I32,
                                                                                    ctypes.POINTER(_I32), _I32]),
    "msa_prog_sort": (None, [_VOID, ctypes.c_int, ctypes.c_int, ctypes.c_int] + [_VOID] * 4 + [_I64, _VOID, _SIZE]),
    "msa_prog_scan": (None, [_VOID, ctypes.c_int, _VOID, _VOID, _I64, _VOID, _SIZE]),
    "msa_prog_lower_bound": (None, [_VOID, ctypes.c_int, ctypes.c_int, _VOID, _I64, _VOID, _I64]),
    "msa_prog_tile_counts": (None, [_VOID, ctypes.c_int, _VOID, _VOID, _I64, _I32]),
    "msa_prog_memset": (None, [_VOID, ctypes.c_int, _VOID, _I64]),
    "msa_prog_cute": (None, [_VOID, ctypes.c_int, ctypes.c_int, _VOID, ctypes.POINTER(_VOID), ctypes.POINTER(_I32),
                             _I32, ctypes.POINTER(_I32), _I32, _F32, _F32]),
    "msa_prog_run": (ctypes.c_int, [_VOID, ctypes.c_int, _VOID]),
    "msa_prog_instantiate": (ctypes.c_int, [_VOID]),
}


def library() -> ctypes.CDLL:
    """The prebuilt dispatch library (build.py), loaded once; BackendUnavailable with the build command."""
    global _LIB
    if _LIB is None:
        from ..cute.loader import _load_cudart
        from .build import find_library, not_built
        path = find_library()
        if path is None:
            raise BackendUnavailable(not_built())
        _load_cudart()
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        _LIB = lib
    return _LIB


GRAPH_LAUNCH_FAILED = -2     # msa_prog_failed_step after a failed graph launch (program.cu)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class Program:
    """Steps per stage (0, 1, ... in the plan's stage order), run by `run(stage)` on the current stream."""

    def __init__(self, device):
        self.lib = library()
        self.handle = self.lib.msa_prog_new()
        self.device = torch.device(device)
        self.keep: list = []                # what the steps point at
        self._stream = _stream_getter(self.device)

    def __del__(self):
        if getattr(self, "handle", None):
            self.lib.msa_prog_free(self.handle)
            self.handle = None

    def size(self, stage: int = -1) -> int:
        return self.lib.msa_prog_size(self.handle, stage)

    def _temp(self, nbytes: int) -> int:
        buf = torch.empty(max(1, nbytes), dtype=torch.uint8, device=self.device)
        self.keep.append(buf)
        return _ptr(buf)

    def triton(self, stage: int, launches: list[TritonLaunch]) -> None:
        for t in launches:
            offsets = (_I32 * len(t.offsets))(*t.offsets)
            self.lib.msa_prog_launch(self.handle, stage, t.function, *t.grid, t.threads, t.shared, t.blob,
                                     len(t.blob), offsets, len(t.offsets))

    def sort(self, stage: int, keys_in, keys_out, values_in, values_out, top: int | None = None) -> None:
        """A stable sort of keys (int16 or int32) carrying int64 values: torch.sort(stable=True)'s result
        when values_in is 0..n-1. top: the largest key there can be (keys are at least 0), so that the radix
        sort passes over its bits only; None: every bit of the key's type."""
        kb = keys_in.element_size()
        if kb not in (2, 4) or values_in.dtype != torch.int64:
            raise BackendUnavailable(f"the C++ dispatch sorts int16/int32 keys with int64 values, not {keys_in.dtype}")
        bits = 8 * kb
        if top is not None:
            bits = max(1, int(top).bit_length())
            if bits >= 8 * kb:
                raise BackendUnavailable(f"sort keys up to {top} do not fit a non-negative int{8 * kb}")
        n = keys_in.numel()
        temp = self.lib.msa_sort_temp_bytes(kb, n, bits)
        self.keep += [keys_in, keys_out, values_in, values_out]
        self.lib.msa_prog_sort(self.handle, stage, kb, bits, _ptr(keys_in), _ptr(keys_out), _ptr(values_in),
                               _ptr(values_out), n, self._temp(temp), temp)

    def scan(self, stage: int, inp, out) -> None:
        """out = inclusive prefix sum of inp (int32): torch.cumsum(inp, 0, dtype=torch.int32)."""
        n = inp.numel()
        temp = self.lib.msa_scan_temp_bytes(n)
        self.keep += [inp, out]
        self.lib.msa_prog_scan(self.handle, stage, _ptr(inp), _ptr(out), n, self._temp(temp), temp)

    def lower_bound(self, stage: int, sorted_keys, out) -> None:
        """out[t] = how many keys are below t, for t in 0..len(out)-1: torch.searchsorted(sorted_keys,
        arange(len(out)), out_int32=True)."""
        self.keep += [sorted_keys, out]
        self.lib.msa_prog_lower_bound(self.handle, stage, sorted_keys.element_size(), _ptr(sorted_keys),
                                      sorted_keys.numel(), _ptr(out), out.numel())

    def tile_counts(self, stage: int, csr_ptr, tiles, tile_q: int) -> None:
        """tiles[k] = ceil((csr_ptr[k + 1] - csr_ptr[k]) / tile_q)."""
        self.keep += [csr_ptr, tiles]
        self.lib.msa_prog_tile_counts(self.handle, stage, _ptr(csr_ptr), _ptr(tiles), tiles.numel(), tile_q)

    def zero(self, stage: int, t) -> None:
        self.keep.append(t)
        self.lib.msa_prog_memset(self.handle, stage, _ptr(t), t.numel() * t.element_size())

    def cute(self, stage: int, attention) -> None:
        """A CuTe attention stage's launch through its library's C entry point (kv-outer: hkv, num_pages;
        q-packed: the seven ints of manifest's ABI; then the two float scales), with its packed arguments.
        The stage itself is kept with the program: the packed pointers are its tensors' (fp8's d-major V
        copy is the stage's alone), which must live as long as the program replays them."""
        library, packed, scalars = attention.library, attention.packed, attention.scalars
        kinds = {"kv-outer": (0, 2), "q-packed": (1, 7)}
        kind, n_ints = kinds[library.cfg.kind]
        ints, floats = scalars[:-2], scalars[-2:]
        if len(ints) != n_ints:
            raise ValueError(f"{library.cfg.name}: expected {n_ints} int scalars, got {len(ints)}")
        entry = ctypes.cast(library._launch, _VOID).value
        ptrs, rows = packed
        self.keep.append(attention)           # its library, packed arrays and tensors
        self.lib.msa_prog_cute(self.handle, stage, kind, entry, ctypes.cast(ptrs, ctypes.POINTER(_VOID)),
                               ctypes.cast(rows, ctypes.POINTER(_I32)), len(ptrs), (_I32 * n_ints)(*ints), n_ints,
                               *floats)

    def run(self, stage: int = -1) -> None:
        """Run one stage's steps (-1: all, as one graph launch once instantiated) on the current stream;
        raises on the first failing step."""
        self._raise(self.lib.msa_prog_run(self.handle, stage, self._stream()))

    def instantiate(self) -> None:
        """Capture the whole program as one CUDA graph, which every later run(-1) outside capture launches."""
        self._raise(self.lib.msa_prog_instantiate(self.handle), "capturing the module as a graph")

    def _raise(self, err: int, doing: str = "") -> None:
        if err:
            from ..cute.loader import cuda_error_text
            step = self.lib.msa_prog_failed_step(self.handle)
            where = "the module's graph launch" if step == GRAPH_LAUNCH_FAILED else f"step {step}"
            raise RuntimeError(f"C++ dispatch: {doing + ': ' if doing else ''}{where} failed: {cuda_error_text(err)}")


def _stream_getter(device: torch.device):
    """A function returning the current stream's handle, to call at each run (under capture it is the
    capturing stream): torch's raw getter where it has one (what Triton's launcher reads; a few us less than
    the Stream object), bound to the device's index once."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None or device.type != "cuda":
        return lambda: torch.cuda.current_stream(device).cuda_stream
    index = device.index if device.index is not None else torch.cuda.current_device()
    return lambda: raw(index)


INFO = "C++ program (kernels/dispatch): the module in one call, a stage timed alone in one call each"
INFO_GRAPH = ("C++ program (kernels/dispatch) captured as one CUDA graph at plan time: the module one graph launch, "
              "a stage timed alone in one call each")


def dispatch_plan(plan, fill, graph: bool = False) -> None:
    """Swap `plan`'s stages for ProgramStages of one program (stage i: the plan's i-th), which `fill(prog)`
    builds from the plan's own stages, and run the module as the program whole (one call: `plan.module`).
    The program keeps the plan's buffers alive, and the stages it replaces: the recorded launches point at
    tensors a stage alone may own (a schedule's range counts, fp8's d-major V copy), which would be freed
    with it and their memory handed to the next allocation.
    graph: the program is also captured as one CUDA graph (instantiated here, at plan time, so an engine that
    plans every step pays it in the per-step plan), which the module call launches."""
    prog = Program(plan.output.device)
    prog.keep += [plan, dict(plan.stages)]
    fill(prog)
    graph = graph and prog.device.type == "cuda"          # a CPU program runs nothing to capture
    if prog.device.type == "cuda":
        torch.cuda.synchronize(prog.device)
    if graph:
        with torch.cuda.device(prog.device):              # the graph is made on the current device
            prog.instantiate()
    plan.stages = {name: ProgramStage(prog, i) for i, name in enumerate(plan.stages)}
    plan.module = prog.run
    plan.info["dispatch"] = INFO_GRAPH if graph else INFO


class ProgramStage:
    """A plan stage that runs its steps of a program."""

    def __init__(self, program: Program, stage: int):
        self.program, self.stage = program, stage

    def __call__(self) -> None:
        self.program.run(self.stage)
