"""q-packed-cute's prebuilt libraries: their configurations, the build's manifest, whether one may run here,
and the ctypes launch. Imports no DSL: the GPU host reads it.

The libraries sit in the CuTe build directory (loader.build_dir(), `msa-bench build-kernels`) next to the
KV-outer ones, with their own manifest, q_packed_manifest.json:
  {"format", "arch", "dsl_version", "cuda_version", "source_hash", "built_at",
   "configs": [{"name", "dtype", "pingpong", "s_ahead", "tile_tokens", "group", "head_dim", "block",
                "kernel_version", "library", "sha256"}]}
A library runs only if the manifest's arch is the device's, its source_hash is manifest.source_hash() of
this checkout, and the file's sha256 matches the manifest.
"""
from __future__ import annotations

import ctypes
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..base import BackendUnavailable
from .loader import BUILD_DIR_ENV, _load_cudart, build_dir, cuda_error_text
from .manifest import DEFAULT_BUILD_DIR, DTYPES, SUPPORTED_ARCHS, device_arch, file_sha256, source_hash

MANIFEST_NAME = "q_packed_manifest.json"
MANIFEST_FORMAT = 1
# The kernel, the KV-outer modules it imports helpers from, its build (and C shim) and this file (the C ABI).
# The library's tensor arguments, in the order of QPackedSm90.__call__ (the shim and pack() follow it).
TENSOR_ARGS = ("mQ", "mK", "mV", "mTileTok0", "mTileNtok", "mTileCount", "mTilePage", "mTileLimit", "mO", "mLse")
OPTION_FLAGS = {"pp": "pingpong", "sa": "s_ahead"}
BUILD_SETS = ("default", "all", "none")


@dataclass(frozen=True)
class QPackedConfig:
    """One library: data dtype and schedule options (QPackedSm90's flags) at the study geometry."""
    dtype: str
    pingpong: bool = False
    s_ahead: bool = False
    tile_tokens: int = 8
    group: int = 16
    head_dim: int = 128
    block: int = 128

    @property
    def option(self) -> str:
        """The backend option naming these flags ('' for none, else 'pp', 'sa' or 'pp+sa')."""
        return "+".join(tag for tag, flag in OPTION_FLAGS.items() if getattr(self, flag))

    @property
    def name(self) -> str:
        tags = "".join(f"_{tag}" for tag in self.option.split("+") if tag)
        return f"qpk_attn_{self.dtype}_p{self.tile_tokens}g{self.group}d{self.head_dim}b{self.block}{tags}"

    @property
    def library(self) -> str:
        return f"lib{self.name}.so"


# (pingpong, s_ahead) of each dtype's default: the fastest on the H200's real-prefill N 16384 case
# (2026-12-01, commit d73e276): bf16 pingpong 540 TFLOP/s module against 513 plain and 462 with both;
# fp8 both 780 against 744 plain and 725 pingpong alone.
DEFAULT_OPTIONS = {"bf16": (True, False), "fp8": (True, True)}


def parse_option(option: str) -> dict:
    """'pp+sa' -> {'pingpong': True, 's_ahead': True}; 'plain' -> both False."""
    flags = dict.fromkeys(OPTION_FLAGS.values(), False)
    if option == "plain":
        return flags
    for part in option.split("+") if option else []:
        if part not in OPTION_FLAGS or flags[OPTION_FLAGS[part]]:
            raise ValueError(f"q-packed-cute options are pp (pingpong consumer warpgroups) and sa (S of the next "
                             f"block issued with P V), joined by '+', or plain (neither); got @{option}")
        flags[OPTION_FLAGS[part]] = True
    return flags


def build_configs(which: str = "default", dtypes=DTYPES) -> list[QPackedConfig]:
    """The libraries `msa-bench build-kernels --q-packed WHICH` builds: default = each dtype's default options
    (DEFAULT_OPTIONS), all = every option set, none = nothing."""
    if which not in BUILD_SETS:
        raise ValueError(f"--q-packed must be one of {', '.join(BUILD_SETS)}, got {which!r}")
    if which == "default":
        return [QPackedConfig(d, *DEFAULT_OPTIONS[d]) for d in dtypes]
    flag_sets = {"all": [(False, False), (True, False), (False, True), (True, True)], "none": []}[which]
    return [QPackedConfig(d, pp, sa) for pp, sa in flag_sets for d in dtypes]




def q_packed_build_dir() -> Path:
    """$MSA_BENCH_CUTE_DIR if set; else the first of build/cute next to the package and ./build/cute that
    holds a q-packed manifest; else where the KV-outer libraries are looked for (loader.build_dir())."""
    if os.environ.get(BUILD_DIR_ENV):
        return Path(os.environ[BUILD_DIR_ENV])
    for cand in (DEFAULT_BUILD_DIR, Path.cwd() / "build" / "cute"):
        if (cand / MANIFEST_NAME).is_file():
            return cand
    return build_dir()


def write_manifest(out_dir: Path, arch: str, dsl_version: str, cuda_version: str, entries: list[dict]) -> Path:
    """Write the q-packed manifest; entries of an existing one from the same sources and arch are kept
    unless rebuilt."""
    import datetime
    path = Path(out_dir) / MANIFEST_NAME
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    if old.get("source_hash") == source_hash() and old.get("arch") == arch and old.get("format") == MANIFEST_FORMAT:
        rebuilt = {e["name"] for e in entries}
        entries = [e for e in old.get("configs", []) if e.get("name") not in rebuilt] + list(entries)
    data = dict(format=MANIFEST_FORMAT, arch=arch, dsl_version=dsl_version, cuda_version=cuda_version,
                source_hash=source_hash(),
                built_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), configs=entries)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def config_entry(cfg: QPackedConfig, library_path: Path, kernel_version: str) -> dict:
    from dataclasses import asdict
    return dict(asdict(cfg), name=cfg.name, kernel_version=kernel_version, library=cfg.library,
                sha256=file_sha256(library_path))


def build_command(cfg: QPackedConfig, where: Path, arch: str) -> str:
    which = "default" if cfg in build_configs("default") else "all"
    out = "" if Path(where).resolve() == DEFAULT_BUILD_DIR else f" --out {where}"
    return f"msa-bench build-kernels --arch {arch} --dtype {cfg.dtype} --no-kv-outer --q-packed {which}{out}"


def find_library(cfg: QPackedConfig, where: Path, arch: str) -> tuple[Path | None, str | None]:
    """(path, None) for a library that may run `cfg` on `arch`, else (None, one-line reason)."""
    where = Path(where)
    rebuild = build_command(cfg, where, arch)
    manifest = where / MANIFEST_NAME
    if not manifest.is_file():
        return None, f"no q-packed CuTe build at {where} (no {MANIFEST_NAME}); run `{rebuild}`"
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        return None, f"unreadable q-packed CuTe manifest {manifest}: {exc}; run `{rebuild}`"
    if data.get("format") != MANIFEST_FORMAT:
        return None, f"{manifest} has format {data.get('format')}, expected {MANIFEST_FORMAT}; run `{rebuild}`"
    if data.get("arch") != arch:
        return None, f"q-packed CuTe build in {where} is for {data.get('arch')}, this GPU is {arch}; run `{rebuild}`"
    if data.get("source_hash") != source_hash():
        return None, (f"q-packed CuTe build in {where} is stale (built from sources {data.get('source_hash')}, "
                      f"checkout has {source_hash()}); run `{rebuild}`")
    entry = next((e for e in data.get("configs", []) if e.get("name") == cfg.name), None)
    if entry is None:
        return None, f"q-packed CuTe build in {where} has no {cfg.name}; run `{rebuild}`"
    path = where / entry["library"]
    if not path.is_file():
        return None, f"CuTe library {path} listed in {MANIFEST_NAME} is missing; run `{rebuild}`"
    if file_sha256(path) != entry.get("sha256"):
        return None, f"CuTe library {path} does not match its manifest checksum; run `{rebuild}`"
    return path, None


class QPackedLibrary:
    """One configuration's shared library: `<name>_load()` once, then `<name>_launch(...)` per call."""

    def __init__(self, path: Path, cfg: QPackedConfig):
        _load_cudart()
        self.path, self.cfg = Path(path), cfg
        try:
            self.lib = ctypes.CDLL(str(self.path))
            self._load = getattr(self.lib, f"{cfg.name}_load")
            self._launch = getattr(self.lib, f"{cfg.name}_launch")
        except (OSError, AttributeError) as exc:
            raise BackendUnavailable(f"cannot load CuTe library {self.path}: {exc}") from exc
        self._load.restype = ctypes.c_int
        self._load.argtypes = []
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int32)] + \
            [ctypes.c_int32] * 4 + [ctypes.c_float, ctypes.c_float, ctypes.c_void_p]
        self.module_loaded = False

    def load_module(self) -> None:
        """Load the embedded GPU module (needs a CUDA context; once, before any launch or capture)."""
        if not self.module_loaded:
            err = self._load()
            if err:
                raise RuntimeError(f"{self.cfg.name}: loading the CUDA module failed: {cuda_error_text(err)}")
            self.module_loaded = True

    @staticmethod
    def pack(ptrs: list[int], rows: list[int]):
        """ctypes arrays of the TENSOR_ARGS' data pointers and leading extents, built once per plan."""
        n = len(TENSOR_ARGS)
        if len(ptrs) != n or len(rows) != n:
            raise ValueError(f"expected {n} tensors ({', '.join(TENSOR_ARGS)}), got {len(ptrs)} pointers "
                             f"and {len(rows)} extents")
        for r in rows:
            if not 0 <= r < 2 ** 31:
                raise ValueError(f"tensor extent {r} does not fit int32")
        return (ctypes.c_void_p * n)(*ptrs), (ctypes.c_int32 * n)(*rows)

    def launch(self, packed, hkv: int, n_token_tiles: int, union_cap: int, num_ctas: int, scale: float,
               out_scale: float, stream: int) -> None:
        """Launch on `stream` (a cudaStream_t as an int, read at each call so that graph capture records
        the launch); raises on a launch error."""
        if not self.module_loaded:
            raise RuntimeError(f"{self.cfg.name}: load_module() must run (outside any graph capture) before launch")
        err = self._launch(packed[0], packed[1], hkv, n_token_tiles, union_cap, num_ctas, scale, out_scale,
                           ctypes.c_void_p(stream))
        if err:
            raise RuntimeError(f"{self.cfg.name}: launch failed: {cuda_error_text(err)}")


_LOADED: dict[str, QPackedLibrary] = {}


def resolve_library(cfg: QPackedConfig, device) -> QPackedLibrary:
    """A loaded library for `cfg` on `device`, compiled on the spot where the DSL is installed, else
    BackendUnavailable saying what to build."""
    arch = device_arch(device)
    if arch not in SUPPORTED_ARCHS:
        raise BackendUnavailable(f"the q-packed CuTe stage is built for {', '.join(SUPPORTED_ARCHS)}; this GPU is {arch}")
    where = q_packed_build_dir()
    path, reason = find_library(cfg, where, arch)
    if path is None:
        from .build import dsl_unavailable_reason
        if dsl_unavailable_reason() is not None:
            raise BackendUnavailable(reason)
        from .q_packed_build import build_all
        build_all([cfg], where, arch, log=lambda *_: None)
        path, reason = find_library(cfg, where, arch)
        if path is None:
            raise BackendUnavailable(reason)
    key = str(path.resolve())
    if key not in _LOADED:
        _LOADED[key] = QPackedLibrary(path, cfg)
    return _LOADED[key]
