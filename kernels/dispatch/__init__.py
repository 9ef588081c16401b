"""The C++ dispatch of a module: its launches recorded at plan time and replayed from one prebuilt C library
(program.cu) at each call, so that an eager call pays one crossing from Python per stage instead of one per
launch. build.py compiles the library ahead of time (nvcc, no GPU); program.py loads it and adds the steps;
triton_launch.py records the Triton stages' launches; op.py registers a module's program as a torch op."""

OPTION = "op"         # the option word of a backend dispatched from C++: NAME@op


def op_variants(names) -> list[str]:
    """NAME@op for each of `names` (registered backends) whose class takes the dispatch option."""
    from ..base import backend_class
    return [f"{n}@{OPTION}" for n in names if "dispatch" in getattr(backend_class(n), "options", {})]
