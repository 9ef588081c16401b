"""What every FlashInfer backend shares: the import, the GPU gate, workspace sizing, fp8 Q."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..scenarios.workload import Workload
from .base import BackendUnavailable

MIB = 1 << 20

_IMPORT: dict = {}


def import_flashinfer():
    """The flashinfer module, or raise BackendUnavailable with the import error as the reason."""
    if "module" in _IMPORT:
        return _IMPORT["module"]
    if "error" in _IMPORT:
        raise BackendUnavailable(_IMPORT["error"])
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    try:
        import flashinfer
    except Exception as exc:  # ImportError, or a broken install failing at import time
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        _IMPORT["error"] = f"flashinfer is not importable ({msg}); install flashinfer-python 0.7.2.post1"
        raise BackendUnavailable(_IMPORT["error"]) from None
    _IMPORT["module"] = flashinfer
    return flashinfer


def jit_dirs() -> list:
    """The folders FlashInfer loads built modules from: its JIT cache and, where installed, its AOT ones."""
    try:
        import_flashinfer()
        from flashinfer.jit import env
    except Exception:           # no FlashInfer, or one without flashinfer.jit.env: nothing known built
        return []
    names = ("FLASHINFER_JIT_DIR", "FLASHINFER_AOT_DIR", "FLASHINFER_JIT_CACHE_DIR")
    return [Path(getattr(env, n)) for n in names if getattr(env, n, None)]


def jit_module_built(pattern: str, unless: str | None = None) -> bool:
    """Whether a built module (a shared library) whose folder or file name matches the glob `pattern` (and
    does not contain `unless`) is where FlashInfer loads modules from, so using it compiles nothing."""
    for d in jit_dirs():
        if not d.is_dir():
            continue
        found = [*d.glob(f"**/{pattern}/*.so"), *d.glob(f"**/{pattern}.so")]
        if any(unless is None or unless not in f"{f.parent.name}/{f.name}" for f in found):
            return True
    return False


FA3_MODULE_GLOB = "batch_prefill_with_kv_cache_*_sm90"       # FlashInfer's name for its FA3 prefill modules
FA3_SUFFIX = "_sm90"           # FA3's modules share the FA2 prefix: an FA2 match leaves out names holding it


def fa2_prefill_module(dtype: str, head_dim: int) -> str:
    """The glob of FlashInfer's FA2 paged prefill module with bf16 Q and output and K/V in `dtype`'s storage
    (e4m3 for fp8), the one the dense paths JIT-build; match it with jit_module_built(..., FA3_SUFFIX)."""
    kv = "e4m3" if dtype == "fp8" else "bf16"
    return (f"batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_{kv}_dtype_o_bf16_dtype_idx_i32_"
            f"head_dim_qk_{head_dim}_head_dim_vo_{head_dim}_posenc_0_*")


def gpu_reason(name: str, device, what: str = "FlashInfer kernels") -> str | None:
    """One line when `device` is no CUDA GPU of sm_80 or newer, else None (same line for every dtype)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return f"{name} needs a CUDA GPU ({what}); the workload is on {torch.device(device).type}"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major < 8:
        return f"{name} needs sm_80 or newer (this GPU is sm_{major}{minor})"
    return None


def workspace_sizes(wrapper, args, plan_kw, requests: int) -> tuple[int, int, str]:
    """FlashInfer's own workspace query, with headroom; generous fixed sizes if it has none."""
    try:
        f, i = wrapper.workspace_size(*args, **plan_kw)
        return int(f * 1.25) + 16 * MIB, int(i * 1.25) + 8 * MIB, "wrapper.workspace_size"
    except Exception as exc:  # backend without a size query: size by the request count
        return 1024 * MIB, max(64 * MIB, 512 * requests), f"fixed ({type(exc).__name__})"


def bf16_query(w: Workload) -> torch.Tensor:
    """Q as FA2 reads it: the bf16 data, or for fp8 q * q_scale in bf16 (exact: q_scale is a power of two)."""
    if w.dtype == "fp8":
        return (w.q.to(torch.float32) * w.q_scale).to(torch.bfloat16)
    return w.q


def flashinfer_reason(backend, dtype: str, device, fa3: bool = False) -> str | None:
    """Why a FlashInfer backend cannot run `dtype` on `device`, one line, or None: what the machine lacks
    first (no GPU, no FlashInfer: it holds for every dtype), then the backend's dtypes, then the GPU's
    architecture (sm_80 or newer; FA3's kernels sm_90 alone)."""
    from .base import Backend
    no_gpu = torch.device(device).type != "cuda" or not torch.cuda.is_available()
    try:
        import_flashinfer()
        missing = None
    except BackendUnavailable as exc:
        missing = str(exc)
    if no_gpu:
        return (f"{backend.name} needs a CUDA GPU and FlashInfer (pip install -e '.[gpu]' on a GPU host); this "
                f"machine has no GPU{' and no FlashInfer' if missing else ''}")
    reason = missing or Backend.unavailable_reason(backend, dtype, device)
    if reason:
        return reason
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major < 8:
        return f"{backend.name} needs sm_80 or newer (this GPU is sm_{major}{minor})"
    if fa3 and (major, minor) != (9, 0):
        return f"{backend.name} uses FlashInfer's FA3 kernels, which need sm_90 (this GPU is sm_{major}{minor})"
    return None
