"""The C++ dispatch of a module: its launches recorded at plan time and replayed from one prebuilt C library
(program.cu) at each call, so that an eager call pays one crossing from Python a module instead of one per
launch (NAME@op), or launches the program captured at plan time as one CUDA graph (NAME@graph). build.py
compiles the library ahead of time (nvcc, no GPU); program.py loads it, adds the steps and swaps a plan's
stages for them; triton_launch.py records the Triton stages' launches; torch_op.py runs a module's program
as a torch op."""

from ..options import Choice
from ...roofline.names import LAUNCH_WORDS as WORDS

# NAME@op: the module's launches replayed from C; NAME@graph: the same program, captured once per plan as a
# CUDA graph the module launches
OPTION, GRAPH = WORDS
DISPATCH = Choice("dispatch", WORDS)      # the constructor flag `dispatch` of every backend that has it


def checked(backend: str, dispatch: str | None) -> str | None:
    """`dispatch` as a backend's constructor takes it: None (Python), OPTION or GRAPH; ValueError otherwise."""
    if dispatch is not None and dispatch not in WORDS:
        raise ValueError(f"{backend} has no dispatch {dispatch!r} (have {', '.join(WORDS)})")
    return dispatch


def op_variants(names) -> list[str]:
    """NAME@op and NAME@graph for each of `names` (registered backends) whose class takes the dispatch option."""
    from ..base import backend_class
    return [f"{n}@{w}" for n in names if "dispatch" in backend_class(n).options for w in WORDS]
