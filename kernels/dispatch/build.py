"""Ahead-of-time build of the dispatch library (program.cu): nvcc, the CUDA 13 toolkit (CUB ships with it),
no GPU. The library's name carries a hash of its source and flags, so a stale build is never loaded."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ..cute.build import BuildError, cuda_home

SOURCE = Path(__file__).with_name("program.cu")
# sm_90 code and compute_90 PTX: the Triton and CuTe binaries it launches are built apart
FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared",
         "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90")
DIR_ENV = "MSA_BENCH_DISPATCH_DIR"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "build" / "dispatch"


def library_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]
    return f"libmsa_dispatch_{digest}.so"


def nvcc() -> str:
    home = cuda_home()
    found = shutil.which("nvcc") or (str(home / "bin" / "nvcc") if (home / "bin" / "nvcc").is_file() else None)
    if not found:
        raise BuildError("nvcc not found (install the CUDA 13 toolkit or set CUDA_HOME) to build the dispatch library")
    return found


def search_dirs() -> list[Path]:
    """$MSA_BENCH_DISPATCH_DIR if set; else build/dispatch next to the package, then in the working directory."""
    if os.environ.get(DIR_ENV):
        return [Path(os.environ[DIR_ENV])]
    return [DEFAULT_DIR, Path.cwd() / "build" / "dispatch"]


def find_library() -> Path | None:
    name = library_name()
    return next((d / name for d in search_dirs() if (d / name).is_file()), None)


def build(out_dir: Path | None = None) -> Path:
    """Compile program.cu into out_dir (default: the first search directory); returns the library's path."""
    out_dir = Path(out_dir or search_dirs()[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / library_name()
    tmp = out.with_suffix(".tmp")
    proc = subprocess.run([nvcc(), *FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
    if proc.returncode:
        first = (proc.stderr.strip().splitlines() or ["(no output)"])[0]
        raise BuildError(f"building {out.name} failed: {first}")
    tmp.replace(out)
    return out


def not_built() -> str | None:
    """Why the library cannot be loaded here (it is not built), or None."""
    if find_library() is None:
        return f"the C++ dispatch library {library_name()} is not built (`msa-bench build-kernels`, needs nvcc)"
    return None


def unavailable_reason(backend: str) -> str | None:
    """Why `backend@op` cannot run here."""
    why = not_built()
    return f"{backend}: {why}" if why else None
