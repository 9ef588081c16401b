"""The CuTe attention stages' libraries: what each kind holds, what a build of them records, and whether one
may run here. Imports no DSL: the GPU host reads it.

Two kinds of library, one per attention stage, each a frozen config class naming its kernel class and
constructor arguments, its C ABI (Abi: the launch's tensor and scalar arguments) and its library file:
* kv-outer (CuteConfig; backend kv-outer-cute). KERNELS is the one table of its kernels: name -> class,
  constructor options, data dtypes, CTAs per SM, the dtypes whose default it is, and its symbol.
  `msa-bench build-kernels` builds every kernel in each of its dtypes; the backend runs each dtype's
  default, or the kernel its option names.
* q-packed (QPackedConfig; backend q-packed-cute). One class, QPackedSm90, with two schedule flags
  (OPTION_FLAGS); each dtype has its default flags (DEFAULT_OPTIONS) and may have others for plans
  whose warpgroups skip blocks (SKIP_OPTIONS).

A build directory holds one shared library per configuration plus manifest.json:
  {"format", "arch", "dsl_version", "cuda_version", "cxx_version", "source_hash", "built_at",
   "configs": [{"kind", the config's fields, "class", "options", "name", "library", "sha256",
                "kernel_version" (where the kernel has one)}]}
A library runs only if the manifest's arch is the device's, its source_hash is the hash of the kernel
sources in this checkout (source_files()), and the file's sha256 matches the manifest.
"""
from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ClassVar

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 3
DEFAULT_ARCH = "sm_90a"
SUPPORTED_ARCHS = ("sm_90a",)
DTYPES = ("bf16", "fp8")
P_SHIFT = {"bf16": 0, "fp8": 8}   # fp8 P is cast as P * 2^P_SHIFT (as in the Triton stage)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]          # the repository root is the package
DEFAULT_BUILD_DIR = PACKAGE_ROOT / "build" / "cute"
# Files of this directory that do not decide the compiled code or the library's C ABI (every other one does).
HOST_ONLY_FILES = ("__init__.py", "backend.py", "loader.py")


# ---- the C ABI of a library ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Abi:
    """The arguments of a kernel's __call__, which its library's `<name>_launch(ptrs, rows, scalars...,
    stream)` passes on in order (shim_template.py). tensors: (name, element, columns): element "data" (the
    configuration's dtype), "bf16", "i32" or "f32"; columns "D" (head dim), "V" (a V row: `block` keys
    for fp8, whose V is d-major, else D) or a number (1: a vector); each is passed as its data pointer and
    its leading extent. scalars: (name, "i32" or "f32")."""
    tensors: tuple
    scalars: tuple
    optional: tuple = ()        # tensors a configuration may leave out (LibraryConfig.omitted): compiled as None

    @property
    def tensor_names(self) -> tuple:
        return tuple(name for name, _, _ in self.tensors)

    def columns(self, cfg) -> list[int]:
        """Each tensor's row width (elements) for `cfg`: its leading extent is numel // width."""
        named = {"D": cfg.head_dim, "V": cfg.block if cfg.dtype == "fp8" else cfg.head_dim}
        return [named.get(cols, cols) for _, _, cols in self.tensors]


KV_OUTER_ABI = Abi(
    tensors=(("mQ", "data", "D"), ("mK", "data", "D"), ("mV", "data", "V"), ("mCsrQuery", "i32", 1),
             ("mTileKey", "i32", 1), ("mTileEdge", "i32", 1), ("mTileCount", "i32", 1), ("mCtaRange", "i32", 2),
             ("mPageBlock", "i32", 1), ("mQLimit", "i32", 1), ("mO", "bf16", "D"), ("mM", "f32", 1),
             ("mL", "f32", 1)),
    scalars=(("hkv", "i32"), ("num_pages", "i32"), ("scale", "f32"), ("out_scale", "f32")))

Q_PACKED_ABI = Abi(
    tensors=(("mQ", "data", "D"), ("mK", "data", "D"), ("mV", "data", "V"), ("mTileTok0", "i32", 1),
             ("mTileNtok", "i32", 1), ("mTileCount", "i32", 1), ("mTilePage", "i32", 1), ("mTileLimit", "i32", 1),
             ("mTileSplit", "i32", 1), ("mPages", "i32", 1), ("mSel", "i32", 1), ("mQLimit", "i32", 1),
             ("mO", "bf16", "D"), ("mLse", "f32", 1), ("mResIdx", "i32", 1), ("mResO", "bf16", "D"),
             ("mResM", "f32", 1), ("mResL", "f32", 1)),
    scalars=(("hkv", "i32"), ("n_token_tiles", "i32"), ("union_cap", "i32"), ("num_ctas", "i32"),
             ("n_tokens", "i32"), ("topk", "i32"), ("direct", "i32"), ("scale", "f32"), ("out_scale", "f32")),
    # the hybrid's KV-outer partials, which only a residual library reads: left out of the others, whose
    # kernels (and cubins) are then those of the ABI without them
    optional=("mResIdx", "mResO", "mResM", "mResL"))


class LibraryConfig:
    """What the build, the manifest and the loader ask of a configuration (CuteConfig, QPackedConfig): its
    kind, ABI, name; the kernel class ("module.Class" in kernels/cute, imported only to build), the
    constructor's arguments after the dtype (geometry) and its keywords (kernel_options); and the
    build-kernels flags that build it (rebuild_flags)."""
    kind: ClassVar[str]
    abi: ClassVar[Abi]

    @property
    def library(self) -> str:
        return f"lib{self.name}.so"

    @property
    def omitted(self) -> tuple:
        """The ABI's optional tensors this configuration leaves out (its launch still passes them; the shim
        drops them)."""
        return ()

    def entry(self) -> dict:
        """The configuration's manifest fields (without the library's checksum)."""
        return dict(kind=self.kind, **asdict(self), **{"class": self.kernel_class}, options=self.options,
                    name=self.name, library=self.library)


# ---- kv-outer ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kernel:
    """A kernel of the KV-outer stage. cls: its class, "module.Class" in kernels/cute (imported only to
    build); options: the constructor flags it is built with; dtypes and ctas_per_sm: what it is built for;
    default_for: the dtypes whose default it is; symbol: its name in the compiled library (the DSL names
    the entry points after str(kernel))."""
    cls: str
    options: dict = field(default_factory=dict)
    dtypes: tuple = DTYPES
    ctas_per_sm: int = 1
    default_for: tuple = ()
    symbol: str = ""


# Measured on the H200 (2026-11-29; docs/perf-log.md). fp8: v28, at N 16384 attention 655 TFLOP/s against
# v23's 613 in five interleaved burst rounds at 1980 MHz, +5-6 % in the harness and on real prefill's long
# cases, level at high reuse. bf16: v23; v28 was +2.5 % in those bursts but -3 to -9 % in two other A/Bs
# and at nsb/N >= 2. The symbols are the ones these kernels were measured with (commit 9821365), so a change
# of structure alone keeps their libraries byte-identical (tests/test_cute_build.py).
KERNELS = {
    # a producer warpgroup (TMA K/V, cp.async Q gather) and three consumer warpgroups on 64-row half tiles
    "v23": Kernel("kv_outer_sm90.KvOuterSm90", default_for=("bf16",),
                  symbol="msa_benchkernelscuteattention_sm90_3wgKvOuterAttentionSm90ThreeConsumers_object_at_"),
    # v23 with its O stores and K/V loads marked L2 evict-first, leaving L2 to the gathered Q rows
    "v28": Kernel("kv_outer_sm90.KvOuterSm90", {"evict_first": True}, default_for=("fp8",),
                  symbol="msa_benchkernelscuteattention_sm90_3wgKvOuterAttentionSm90ThreeConsumersEvictFirst_object_at_"),
}


def default_kernel(dtype: str) -> str:
    """The name of the dtype's default kernel (bf16's for a dtype without one)."""
    for want in (dtype, "bf16"):
        for name, k in KERNELS.items():
            if want in k.default_for:
                return name
    raise ValueError("KERNELS names no default for bf16")


@dataclass(frozen=True)
class CuteConfig(LibraryConfig):
    """One kv-outer library: a KERNELS kernel in one dtype at the study geometry."""
    kind: ClassVar[str] = "kv-outer"
    abi: ClassVar[Abi] = KV_OUTER_ABI
    kernel: str
    dtype: str
    tile_q: int = 8
    group: int = 16
    head_dim: int = 128
    block: int = 128
    ctas_per_sm: int = 1

    @property
    def name(self) -> str:
        return (f"kvo_attn_{self.dtype}_q{self.tile_q}g{self.group}d{self.head_dim}b{self.block}"
                f"_c{self.ctas_per_sm}_{self.kernel}")

    @property
    def spec(self) -> Kernel:
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown CuTe kernel {self.kernel!r} (have {', '.join(KERNELS)})")
        return KERNELS[self.kernel]

    @property
    def kernel_class(self) -> str:
        return self.spec.cls

    @property
    def options(self) -> dict:
        return self.spec.options

    @property
    def geometry(self) -> tuple:
        return self.tile_q, self.group, self.head_dim, self.block

    @property
    def kernel_options(self) -> dict:
        return dict(self.spec.options, symbol=self.spec.symbol)

    @property
    def rebuild_flags(self) -> str:
        return ""


def library_configs(dtypes=DTYPES, kernels=None) -> list[CuteConfig]:
    """Every kv-outer configuration the sweep can ask the CuTe stage for: the study geometry (G = 16, so a
    TILE_Q = 8 tile is 128 rows, D = 128, block = 128), each kernel in each of its dtypes."""
    return [CuteConfig(name, d, ctas_per_sm=KERNELS[name].ctas_per_sm) for name in (kernels or KERNELS)
            for d in dtypes if d in KERNELS[name].dtypes]


# ---- q-packed ------------------------------------------------------------------------------------------

OPTION_FLAGS = {"pp": "pingpong", "sa": "s_ahead"}
Q_PACKED_SETS = ("default", "all", "none")
# (pingpong, s_ahead) of each dtype's default, measured on the H200 (2026-12-02) with the warpgroups
# skipping the blocks their tokens did not select, on two N 16384 real-prefill cases (u 1), drift p 0.03 /
# 0.07 / 0.15 and decode batches: bf16 plain is within 2 % of pingpong at u 1 and 1-4 % faster where the
# warpgroups skip; fp8 both is 3-6 % faster than plain at u 1, and 2-12 % faster than s_ahead alone on
# real prefill's small cases (one or two tiles per SM) and on decode's one-token tiles.
DEFAULT_OPTIONS = {"bf16": (False, False), "fp8": (True, True)}
# The flags a dtype runs instead where its warpgroups skip blocks: where they walk more than SKIP_RATIO
# times the entries their tokens selected (QPackedCuteBackend.walked_ratio). fp8 s_ahead alone with five
# K/V stages: 1.1-5.9 % faster than both where tokens drift, an indexer picks or groups share part of their
# blocks (walked ratio 1.085-1.88), and up to 12 % slower at ratio 1 (real prefill), where pingpong lets one
# warpgroup's softmax run under the other's MMAs on the same blocks (docs/perf-log.md, 2026-12-02).
SKIP_OPTIONS = {"fp8": (False, True)}
SKIP_RATIO = 1.05
# Wide tiles: 12 tokens, three consumer warpgroups, each walking its third of the union (QPackedSm90 with
# tile_tokens 12; the schedule orders the union by thirds). A default plan runs them where their warpgroups
# walk at most WIDE_MAX_RATIO times the 8-token warpgroups' entries, their tiles load no more union blocks
# than the 8-token tiles, there are at least WIDE_MIN_TILES_PER_SM tiles per SM and no request holds one
# token. H200, docs/perf-log.md: the tile count fitted on fp8 real prefill (2026-12-03: 5-8 % faster from 21
# tiles an SM, 6-31 % slower at 4 and fewer) and held out on bf16 (2026-12-04); the walk ratio fitted on drift
# (2026-12-04: 2-8 % faster at 1.000-1.012, 2-3 % slower at 1.043 in fp8) and held out on indexer (1.082,
# declined, 0.7-0.9 % slower); the loads on co-selection in groups of 8 (walk 1.000, 16 % slower); the one-token
# requests on mixed steps (1.3-5 % slower).
WIDE_TOKENS = 12                      # three consumer warpgroups of 4 tokens; the schedule orders its union by thirds
WIDE_TILE_TOKENS = {"bf16": WIDE_TOKENS, "fp8": WIDE_TOKENS}
# The wide tiles' row sums by wgmma (QPackedSm90's mma_sum): 62 adds a thread and block fewer in the
# softmax, where three consumer warpgroups' instructions bound the tile (docs/perf-log.md, 2026-12-04).
WIDE_MMA_SUM = ("fp8",)
WIDE_MAX_RATIO = 1.02
WIDE_MIN_TILES_PER_SM = 12


@dataclass(frozen=True)
class QPackedConfig(LibraryConfig):
    """One q-packed library: data dtype and schedule options (QPackedSm90's flags) at the study geometry."""
    kind: ClassVar[str] = "q-packed"
    abi: ClassVar[Abi] = Q_PACKED_ABI
    kernel_class: ClassVar[str] = "q_packed_sm90.QPackedSm90"
    dtype: str
    pingpong: bool = False
    s_ahead: bool = False
    pairs: bool = False
    tile_tokens: int = 8
    residual: bool = False      # the hybrid's KV-outer partials merged in the epilogue (QPackedSm90's residual)
    group: int = 16
    head_dim: int = 128
    block: int = 128
    kv_stages: int = 0          # QPackedSm90's K/V ring; 0: the kernel's own count for the dtype and flags
    mma_sum: bool = False       # P's row sums by a wgmma against ones (QPackedSm90's mma_sum)

    @property
    def option(self) -> str:
        """The backend option naming these flags ('' for none, else their tags joined by '+', as 'pp+sa')."""
        return "+".join(tag for tag, flag in OPTION_FLAGS.items() if getattr(self, flag))

    @property
    def name(self) -> str:
        tags = "".join(f"_{tag}" for tag in self.option.split("+") if tag) + ("_pairs" if self.pairs else "")
        tags += f"_kv{self.kv_stages}" if self.kv_stages else ""
        tags += "_res" if self.residual else ""
        tags += "_ms" if self.mma_sum else ""
        return f"qpk_attn_{self.dtype}_p{self.tile_tokens}g{self.group}d{self.head_dim}b{self.block}{tags}"

    @property
    def options(self) -> dict:
        return {flag: getattr(self, flag) for flag in (*OPTION_FLAGS.values(), "pairs", "residual", "mma_sum")}

    @property
    def omitted(self) -> tuple:
        return () if self.residual else self.abi.optional

    @property
    def geometry(self) -> tuple:
        return self.tile_tokens, self.group, self.head_dim, self.block

    @property
    def kernel_options(self) -> dict:
        return self.options | ({"kv_stages": self.kv_stages} if self.kv_stages else {})

    @property
    def rebuild_flags(self) -> str:
        which = "default" if self in q_packed_configs("default") else "all"
        return f" --no-kv-outer --q-packed {which}"


def q_packed_configs(which: str = "default", dtypes=DTYPES) -> list[QPackedConfig]:
    """The libraries `msa-bench build-kernels --q-packed WHICH` builds: default = each dtype's default options
    (DEFAULT_OPTIONS), those it runs where its warpgroups skip (SKIP_OPTIONS), its wide tiles
    (WIDE_TILE_TOKENS) and each of those with the hybrid's residual merged (residual), all = every option set
    and the wide tiles, none = nothing."""
    if which not in Q_PACKED_SETS:
        raise ValueError(f"--q-packed must be one of {', '.join(Q_PACKED_SETS)}, got {which!r}")
    # each dtype's decode library: two tokens a tile (QPackedSm90's pairs)
    pairs = [QPackedConfig(d, pairs=True) for d in dtypes] if which != "none" else []
    wide = [wide_config(d) for d in dtypes if d in WIDE_TILE_TOKENS] if which != "none" else []
    if which == "default":
        skip = [QPackedConfig(d, *SKIP_OPTIONS[d]) for d in dtypes if d in SKIP_OPTIONS]
        plans = [QPackedConfig(d, *DEFAULT_OPTIONS[d]) for d in dtypes] + skip
        # and each prefill library with the hybrid's residual merged in its epilogue (`hybrid@fused`)
        return plans + pairs + wide + [replace(c, residual=True) for c in plans + wide]
    flag_sets = list(itertools.product((False, True), repeat=len(OPTION_FLAGS))) if which == "all" else []
    return [QPackedConfig(d, *flags) for flags in flag_sets for d in dtypes] + pairs + wide


def wide_config(dtype: str) -> QPackedConfig:
    """The dtype's wide-tile library: WIDE_TILE_TOKENS tokens a tile, neither schedule flag (pingpong's turns
    are two warpgroups'; s_ahead's second S makes ptxas serialize every wgmma at 160 registers a thread), its
    row sums by wgmma where WIDE_MMA_SUM names the dtype."""
    return QPackedConfig(dtype, tile_tokens=WIDE_TILE_TOKENS[dtype], mma_sum=dtype in WIDE_MMA_SUM)


# ---- both: data layout, sources, manifest ----------------------------------------------------------------

def fp8_v_key_order() -> list[int]:
    """fp8 V's keys as the kernels read them (mma.fp8_p_regs): stored key k of every 16 holds the true key
    8 (i // 2) + 2 q + i % 2, with q, i = divmod(k, 4)."""
    return [8 * ((k % 4) // 2) + 2 * (k // 4) + (k % 4) % 2 for k in range(16)]


def source_files() -> list[str]:
    here = Path(__file__).resolve().parent
    return sorted(p.name for p in here.glob("*.py") if p.name not in HOST_ONLY_FILES)


def source_hash() -> str:
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in source_files():
        h.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def device_arch(device=None) -> str:
    """The sm_XX(a) name of a CUDA device, as the DSL names targets (Hopper: sm_90a)."""
    import torch
    major, minor = torch.cuda.get_device_capability(device)
    suffix = "a" if major >= 9 else ""
    return f"sm_{major}{minor}{suffix}"


def write_manifest(out_dir: Path, arch: str, toolchain: dict, entries: list[dict]) -> Path:
    """Write the manifest (toolchain: dsl_version, cuda_version, cxx_version); entries of an existing
    manifest from the same sources and arch are kept unless rebuilt (so building one dtype or kind does not
    drop the others)."""
    import datetime
    path = Path(out_dir) / MANIFEST_NAME
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    if old.get("source_hash") == source_hash() and old.get("arch") == arch and old.get("format") == MANIFEST_FORMAT:
        rebuilt = {e["name"] for e in entries}
        entries = [e for e in old.get("configs", []) if e.get("name") not in rebuilt] + list(entries)
    data = dict(format=MANIFEST_FORMAT, arch=arch, **toolchain, source_hash=source_hash(),
                built_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                configs=entries)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def config_entry(cfg: LibraryConfig, library_path: Path, kernel_version: str | None = None) -> dict:
    entry = dict(cfg.entry(), sha256=file_sha256(library_path))
    if kernel_version is not None:
        entry["kernel_version"] = kernel_version
    return entry


def build_command(cfg: LibraryConfig, build_dir: Path, arch: str) -> str:
    out = "" if Path(build_dir).resolve() == DEFAULT_BUILD_DIR else f" --out {build_dir}"
    return f"msa-bench build-kernels --arch {arch} --dtype {cfg.dtype}{cfg.rebuild_flags}{out}"


def find_library(cfg: LibraryConfig, build_dir: Path, arch: str) -> tuple[Path | None, str | None]:
    """(path, None) for a library that may run `cfg` on `arch`, else (None, one-line reason)."""
    build_dir = Path(build_dir)
    rebuild = build_command(cfg, build_dir, arch)
    manifest = build_dir / MANIFEST_NAME
    if not manifest.is_file():
        return None, f"no CuTe build at {build_dir} (no {MANIFEST_NAME}); run `{rebuild}`"
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        return None, f"unreadable CuTe manifest {manifest}: {exc}; run `{rebuild}`"
    if data.get("format") != MANIFEST_FORMAT:
        return None, f"CuTe manifest {manifest} has format {data.get('format')}, expected {MANIFEST_FORMAT}; run `{rebuild}`"
    if data.get("arch") != arch:
        return None, f"CuTe build in {build_dir} is for {data.get('arch')}, this GPU is {arch}; run `{rebuild}`"
    current = source_hash()
    if data.get("source_hash") != current:
        return None, (f"CuTe build in {build_dir} is stale (built from sources {data.get('source_hash')}, "
                      f"checkout has {current}); run `{rebuild}`")
    entry = next((e for e in data.get("configs", []) if e.get("name") == cfg.name), None)
    if entry is None:
        return None, f"CuTe build in {build_dir} has no {cfg.name}; run `{rebuild}`"
    path = build_dir / entry["library"]
    if not path.is_file():
        return None, f"CuTe library {path} listed in the manifest is missing; run `{rebuild}`"
    if file_sha256(path) != entry.get("sha256"):
        return None, f"CuTe library {path} does not match its manifest checksum; run `{rebuild}`"
    return path, None
