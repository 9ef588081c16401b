"""The C++ dispatch of a module: its launches recorded at plan time and replayed from one prebuilt C library
(program.cu) at each call, so that an eager call pays one crossing from Python per stage instead of one per
launch. build.py compiles the library ahead of time (nvcc, no GPU); program.py loads it, adds the steps and
swaps a plan's stages for them; triton_launch.py records the Triton stages' launches; torch_op.py runs a
module's program as a torch op."""
from ..options import Choice

OPTION = "op"         # the option word of a backend dispatched from C++: NAME@op
DISPATCH = Choice("dispatch", (OPTION,))      # the constructor flag `dispatch` of every backend that has it


def checked(backend: str, dispatch: str | None) -> str | None:
    """`dispatch` as a backend's constructor takes it: None (Python) or OPTION; ValueError otherwise."""
    if dispatch not in (None, OPTION):
        raise ValueError(f"{backend} has no dispatch {dispatch!r} (have {OPTION})")
    return dispatch


def op_variants(names) -> list[str]:
    """NAME@op for each of `names` (registered backends) whose class takes the dispatch option."""
    from ..base import backend_class
    return [f"{n}@{OPTION}" for n in names if "dispatch" in backend_class(n).options]
