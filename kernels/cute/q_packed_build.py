"""Ahead-of-time build of q-packed-cute's attention stage (q_packed_sm90.py): DSL compile for the target
arch -> export_to_c -> lib<name>.so with the C shim below, as build.py does for the KV-outer stage (same
toolchain: nvidia-cutlass-dsl[cu13]==4.8.1, g++, the CUDA 13 headers; no GPU)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .build import BuildError, _import_dsl, cuda_home, cuda_version, dsl_runtime_lib, dsl_version
from .manifest import DEFAULT_ARCH
from .q_packed_library import TENSOR_ARGS, QPackedConfig, config_entry, write_manifest

# The C entry points of one configuration (QPK_NAME is replaced by its name). Python calls them through
# ctypes (q_packed_library.QPackedLibrary):
#   QPK_NAME_load()                   loads the embedded module once; returns a cudaError_t
#   QPK_NAME_launch(ptrs, rows, ...)  launches on `stream`; returns a cudaError_t. No allocation, sync or
#                                     attribute setting (the module load did those): legal in stream capture.
# ptrs[i] / rows[i]: data pointer and leading extent of tensor argument i, in TENSOR_ARGS order.
SHIM_CPP = r"""#include "QPK_NAME.h"

static QPK_NAME_Kernel_Module_t qpk_module;
static int qpk_loaded = 0;

extern "C" int QPK_NAME_load(void) {
  if (!qpk_loaded) {
    cudaError_t err = cudaGetLastError();   // do not blame the load for an earlier error
    (void)err;
    QPK_NAME_Kernel_Module_Load(&qpk_module);
    err = cudaGetLastError();
    if (err != cudaSuccess) return (int)err;
    qpk_loaded = 1;
  }
  return 0;
}

#define QPK_TENSOR(arg, i)          \
  QPK_NAME_Tensor_##arg##_t arg;    \
  arg.data = ptrs[i];               \
  arg.dynamic_shapes[0] = rows[i];

extern "C" int QPK_NAME_launch(void *const *ptrs, const int32_t *rows, int32_t hkv, int32_t n_token_tiles,
                               int32_t union_cap, int32_t num_ctas, float scale, float out_scale, void *stream) {
  if (!qpk_loaded) return (int)cudaErrorInitializationError;
  QPK_TENSOR(mQ, 0) QPK_TENSOR(mK, 1) QPK_TENSOR(mV, 2) QPK_TENSOR(mTileTok0, 3) QPK_TENSOR(mTileNtok, 4)
  QPK_TENSOR(mTileCount, 5) QPK_TENSOR(mTilePage, 6) QPK_TENSOR(mTileLimit, 7) QPK_TENSOR(mO, 8)
  QPK_TENSOR(mLse, 9)
  int32_t ret = cute_dsl_QPK_NAME_wrapper(&qpk_module, &mQ, &mK, &mV, &mTileTok0, &mTileNtok, &mTileCount,
                                          &mTilePage, &mTileLimit, &mO, &mLse, hkv, n_token_tiles, union_cap,
                                          num_ctas, scale, out_scale, (cudaStream_t)stream);
  cudaError_t err = cudaGetLastError();   // the launch's own error (consumed: it is reported here)
  if (ret != 0) return (int)ret;
  return (int)err;
}
"""


def kernel_for(cfg: QPackedConfig):
    from .q_packed_sm90 import QPackedSm90
    return QPackedSm90(cfg.dtype, cfg.tile_tokens, cfg.group, cfg.head_dim, cfg.block, pingpong=cfg.pingpong,
                       s_ahead=cfg.s_ahead)


def _fake_args(cfg: QPackedConfig):
    """Argument descriptions for cute.compile in QPackedSm90.__call__'s order: leading extents dynamic,
    rows contiguous; fp8 V d-major (rows of `block` keys)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor as fake

    from .layouts import DSL_DTYPES
    dt, D = DSL_DTYPES[cfg.dtype], cfg.head_dim
    v_cols = cfg.block if cfg.dtype == "fp8" else D

    def mat(dtype, cols):
        return fake(dtype, (cute.SymInt(), cols), stride_order=(1, 0), assumed_align=16)

    def vec(dtype):
        return fake(dtype, (cute.SymInt(),), assumed_align=4)

    i32 = cutlass.Int32
    return [mat(dt, D), mat(dt, D), mat(dt, v_cols), vec(i32), vec(i32), vec(i32), vec(i32), vec(i32),
            mat(cutlass.BFloat16, D), vec(cutlass.Float32), i32(1), i32(1), i32(1), i32(1),
            cutlass.Float32(1.0), cutlass.Float32(1.0), cuda.CUstream(0)]


def _check_header(header: Path, name: str) -> None:
    text = header.read_text()
    for arg in TENSOR_ARGS:
        body = re.search(r"typedef struct \{([^}]*)\}\s*" + re.escape(f"{name}_Tensor_{arg}_t;"), text)
        if body is None or "dynamic_strides" in body.group(1) or "dynamic_shapes[1]" not in body.group(1):
            raise BuildError(f"{header.name}: tensor {arg} is not exported as data + one dynamic extent; "
                             "the shim in q_packed_build.py needs updating")


def _link(name: str, obj_dir: Path, out: Path) -> None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise BuildError("no C++ compiler found (g++ or $CXX) to link the CuTe libraries")
    shim = obj_dir / f"{name}_shim.cpp"
    shim.write_text(SHIM_CPP.replace("QPK_NAME", name))
    cuda = cuda_home()
    cmd = [cxx, "-shared", "-fPIC", "-O2", "-o", str(out), str(shim), str(obj_dir / f"{name}.o"),
           str(dsl_runtime_lib()), f"-I{obj_dir}", f"-I{cuda / 'include'}", f"-L{cuda / 'lib64'}",
           "-lcudart", "-Wl,--no-undefined", "-Wl,--exclude-libs,ALL"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        first = (proc.stderr.strip().splitlines() or ["(no output)"])[0]
        raise BuildError(f"linking {out.name} failed: {first}")


def build_config(cfg: QPackedConfig, out_dir: Path, arch: str = DEFAULT_ARCH) -> tuple[Path, str]:
    """Compile one configuration for `arch` into out_dir/lib<name>.so; returns (library, kernel version)."""
    _import_dsl(arch)
    import cutlass.cute as cute

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"{cfg.name}_") as tmp:
        tmp = Path(tmp)
        try:
            kernel = kernel_for(cfg)
            compiled = cute.compile(kernel, *_fake_args(cfg))
            compiled.export_to_c(file_path=str(tmp), file_name=cfg.name, function_prefix=cfg.name)
        except Exception as exc:  # a DSL compile error: report its first line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise BuildError(f"CuTe compile of {cfg.name} for {arch} failed: {first}") from exc
        _check_header(tmp / f"{cfg.name}.h", cfg.name)
        lib = out_dir / cfg.library
        _link(cfg.name, tmp, lib)
    return lib, kernel.kernel_version


def build_all(configs: list[QPackedConfig], out_dir: Path, arch: str = DEFAULT_ARCH, log=print) -> dict:
    """Build every configuration and write q_packed_manifest.json; returns a summary dict."""
    _import_dsl(arch)
    out_dir = Path(out_dir)
    entries, start = [], time.perf_counter()
    for cfg in configs:
        t0 = time.perf_counter()
        lib, version = build_config(cfg, out_dir, arch)
        entries.append(config_entry(cfg, lib, version))
        log(f"built {lib} ({lib.stat().st_size // 1024} KiB, {time.perf_counter() - t0:.1f} s)")
    manifest = write_manifest(out_dir, arch, dsl_version(), cuda_version(), entries)
    return dict(manifest=str(manifest), libraries=[e["library"] for e in entries],
                seconds=round(time.perf_counter() - start, 1))
