"""Where and with what a run was measured: device, software versions, source tree, command, scenario."""
from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[1]


def _version(dist: str, module: str | None = None) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    if module:
        try:
            mod = __import__(module)
            return str(getattr(mod, "__version__", "unknown"))
        except ImportError:
            pass
    return "not installed"


STATED_COMMIT_ENV = "MSA_BENCH_GIT_COMMIT"
STATED_DIRTY_ENV = "MSA_BENCH_GIT_DIRTY"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(SOURCE_ROOT), *args], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_tree() -> dict:
    """Commit and dirty flag of the msa-bench checkout, or 'unknown' when it is not a git checkout."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != SOURCE_ROOT:
        # a copy without git (the offline GPU host): the sender may state the commit it copied
        stated = os.environ.get(STATED_COMMIT_ENV, "").strip()
        if stated:
            dirty = os.environ.get(STATED_DIRTY_ENV, "unknown").strip().lower()
            return {"git_commit": stated, "git_dirty": {"true": True, "false": False}.get(dirty, "unknown"),
                    "git_commit_source": f"stated by the sender (${STATED_COMMIT_ENV}); source_sha256 is the check"}
        return {"git_commit": "unknown", "git_dirty": "unknown"}
    commit = _git("rev-parse", "HEAD") or "unknown"
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": "unknown" if status is None else bool(status)}


SOURCE_PARTS = ("cli.py", "__init__.py", "harness", "kernels", "roofline", "scenarios")
SOURCE_SUFFIXES = {".py", ".toml", ".cpp", ".cu", ".h", ".json"}


def source_sha256() -> str:
    """Hash of the code that measures (relative paths and contents), so a run copied to a host
    without git still names the exact source it ran."""
    h = hashlib.sha256()
    files = []
    for part in SOURCE_PARTS:
        p = SOURCE_ROOT / part
        files += [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file() and f.suffix in SOURCE_SUFFIXES
                                          and "__pycache__" not in f.parts]
    for f in sorted(files):
        h.update(str(f.relative_to(SOURCE_ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def device_info(device) -> dict:
    """Name, SM count, L2 size and driver of the CUDA device; a CPU description otherwise."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        cpu = platform.processor() or platform.machine()
        return {"device_kind": "cpu", "device_name": f"CPU ({cpu}, {os.cpu_count()} cores)",
                "gpu_name": None, "sm_count": None, "l2_bytes": None, "driver": None}
    props = torch.cuda.get_device_properties(device)
    driver = None
    try:
        import pynvml as nv
        nv.nvmlInit()
        driver = nv.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:
        driver = "unknown (NVML unavailable)"
    return {"device_kind": "cuda", "device_name": props.name, "gpu_name": props.name,
            "sm_count": props.multi_processor_count, "l2_bytes": props.L2_cache_size,
            "compute_capability": f"{props.major}.{props.minor}", "driver": driver}


def file_sha256(path: str | Path | None) -> str | None:
    if not path:
        return None
    p = Path(path)
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None


def collect(device, scenario_name: str, scenario_file: str | Path | None, argv: list[str] | None = None) -> dict:
    import torch
    return {
        **device_info(device),
        "cuda": torch.version.cuda or "none",
        "torch": torch.__version__,
        "triton": _version("triton", "triton"),
        "flashinfer": _version("flashinfer-python", "flashinfer"),
        "python": platform.python_version(),
        **source_tree(),
        "source_sha256": source_sha256(),
        "command": " ".join(argv if argv is not None else sys.argv),
        "scenario": scenario_name,
        "scenario_file": str(scenario_file) if scenario_file else None,
        "scenario_sha256": file_sha256(scenario_file),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
    }


def gpu_identity(device, nvml_handle=None) -> dict:
    """The GPU a unit ran on, as its status.json names it: the index the parent process saw it under
    (CUDA_VISIBLE_DEVICES as given to the sweep), its UUID, and its clock limits and settings (NVML).
    Empty on a CPU."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "")
    out = {"gpu_index": int(os.environ.get(GPU_INDEX_ENV, index)), "gpu_name": props.name,
           "gpu_uuid": uuid if uuid.startswith(("GPU-", "MIG-")) or not uuid else f"GPU-{uuid}"}
    if nvml_handle is not None:
        import pynvml as nv
        for key, read, clock in (("gpu_sm_clock_max_mhz", nv.nvmlDeviceGetMaxClockInfo, nv.NVML_CLOCK_SM),
                                 ("gpu_mem_clock_max_mhz", nv.nvmlDeviceGetMaxClockInfo, nv.NVML_CLOCK_MEM),
                                 ("gpu_sm_clock_app_mhz", nv.nvmlDeviceGetApplicationsClock, nv.NVML_CLOCK_SM)):
            try:
                out[key] = float(read(nvml_handle, clock))
            except Exception:   # an NVMLError where the GPU or driver does not report it
                out[key] = None
    return out


GPU_INDEX_ENV = "MSA_BENCH_GPU_INDEX"     # set by the worker pool: the GPU's index in the sweep's own view
