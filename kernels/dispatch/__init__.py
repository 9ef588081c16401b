"""The C++ dispatch of a module: its launches recorded at plan time and replayed from one prebuilt C library
(program.cu) at each call, so that an eager call pays one crossing from Python per stage instead of one per
launch. build.py compiles the library ahead of time (nvcc, no GPU); program.py loads it and adds the steps;
triton_launch.py records the Triton stages' launches; op.py registers a module's program as a torch op."""
