"""What a CuTe DSL build holds and whether it may run here. Imports no DSL: the GPU host reads it.

A build directory holds one shared library per configuration plus manifest.json:
  {"format", "arch", "dsl_version", "cuda_version", "source_hash", "kernel_version", "built_at",
   "configs": [{"name", "dtype", "tile_q", "group", "head_dim", "block", "ctas_per_sm", "variant",
                "kernel_version", "library", "sha256"}]}
A library runs only if the manifest's arch is the device's, its source_hash is the hash of the
kernel sources in this checkout (SOURCE_FILES), and the file's sha256 matches the manifest.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
DEFAULT_ARCH = "sm_90a"
SUPPORTED_ARCHS = ("sm_90a",)
DTYPES = ("bf16", "fp8")
P_SHIFT = {"bf16": 0, "fp8": 8}   # fp8 P is cast as P * 2^P_SHIFT (as in the Triton stage)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]          # the repository root is the package
DEFAULT_BUILD_DIR = PACKAGE_ROOT / "build" / "cute"
# Files whose content decides the compiled code and the library's C ABI.
SOURCE_FILES = ("attention_sm90.py", "attention_sm90_pipe.py", "attention_sm90_ws.py", "attention_sm90_3wg.py", "build.py",
                "shim_template.py", "manifest.py")


@dataclass(frozen=True)
class CuteConfig:
    dtype: str
    tile_q: int = 8
    group: int = 16
    head_dim: int = 128
    block: int = 128
    ctas_per_sm: int = 2            # v2: 2 = P aliases Q in shared memory so two CTAs share an SM
    variant: str = "v2"             # kernel generation (VARIANTS); v2 names carry no suffix

    @property
    def name(self) -> str:
        suffix = "" if self.variant == "v2" else f"_{self.variant.replace('-', '_')}"   # a C identifier
        return (f"kvo_attn_{self.dtype}_q{self.tile_q}g{self.group}d{self.head_dim}b{self.block}"
                f"_c{self.ctas_per_sm}{suffix}")

    @property
    def library(self) -> str:
        return f"lib{self.name}.so"


CTAS_PER_SM = (1, 2)
# Kernel generations: v2 = attention_sm90.py (synchronous cp.async, SS wgmma, lock-step warpgroups);
# v3 = attention_sm90_pipe.py (double-buffered cp.async prefetch of the next tile, decoupled
# warpgroups, limits read a tile ahead, bf16 P in registers); v4 = attention_sm90_ws.py (warp-specialized:
# a producer warpgroup loads K/V by TMA and gathers Q by cp.async into mbarrier-guarded rings, two
# consumer warpgroups compute); v7 = v4 with O stored through shared memory by TMA, live slots only;
# v9 = v7 with the consumers software-pipelined across tiles; v10 = v9 with a cheaper softmax step (mask
# only where needed, tree reductions); v15 = v10 with fp8 P in registers (fp8 only); v16 = v15 with the
# softmax over a thread's rows at once and the tile's key from shared memory; v17 = v16 with O staged
# by stmatrix; v18 = v17 with the producer's global reads ahead of its Q-stage wait; v21 = v18 with each
# consumer warp storing its own slot of O (no warpgroup barriers in the store); v22 = v21 with bf16's
# output scale folded into P (bf16 only); v23 = v22's steps on three consumer warpgroups, each walking
# its own 64-row half tiles without pipelining (attention_sm90_3wg.py); v24 = v22 (fp8: v21) with every
# fourth exponential computed on the FMA pipe instead of MUFU; v28 = v23 with its O stores and K/V loads
# marked L2 evict-first (docs/perf-log.md has each one's numbers,
# and v5, v6, v8, v11, v12, v13, v14, v19, v20, v25, v26, v27, v29, v30-v32, measured and dropped).
# CTAs per SM each generation builds:
VARIANTS = ("v2", "v3", "v4", "v7", "v9", "v10", "v15", "v16", "v17", "v18", "v21", "v22", "v23", "v24",
            "v28")
VARIANT_CTAS = {("v2", "bf16"): (1, 2), ("v2", "fp8"): (1, 2), ("v3", "bf16"): (1,), ("v3", "fp8"): (1, 2),
                ("v4", "bf16"): (1,), ("v4", "fp8"): (1,), ("v7", "bf16"): (1,), ("v7", "fp8"): (1,),
                ("v9", "bf16"): (1,), ("v9", "fp8"): (1,), ("v10", "bf16"): (1,), ("v10", "fp8"): (1,),
                ("v15", "bf16"): (), ("v15", "fp8"): (1,),        # v15 changes fp8 only
                ("v16", "bf16"): (1,), ("v16", "fp8"): (1,), ("v17", "bf16"): (1,), ("v17", "fp8"): (1,),
                ("v18", "bf16"): (1,), ("v18", "fp8"): (1,), ("v21", "bf16"): (1,), ("v21", "fp8"): (1,),
                ("v22", "bf16"): (1,), ("v22", "fp8"): (),        # v22 changes bf16 only
                ("v23", "bf16"): (1,), ("v23", "fp8"): (1,), ("v24", "bf16"): (1,), ("v24", "fp8"): (1,),
                ("v28", "bf16"): (1,), ("v28", "fp8"): (1,)}

# Knock-out builds: a generation of KNOCKOUT_BASES with a piece of the consumers' per-tile chain removed
# ("o-store": O is staged but never stored to o_part; "exp": P is the exponent's argument, no exp2;
# "softmax": P = S, no mask, max, exp or sum; "bare": neither softmax nor O store, so the MMAs, the Q
# gather and the K/V loads are what is left; "o-half": only every other slot's O is stored, half the
# partial bytes, what partials of 8 bits per element would write). They bound what the rest of the chain
# runs at (benchmarks/bounds_gpu.py, energy_gpu.py); their outputs are not attention, so the harness
# cannot select them (not in VARIANTS) and nothing checks them.
KNOCKOUT_REMOVES = {"o-store": ("o-store",), "exp": ("exp",), "softmax": ("softmax",), "bare": ("softmax", "o-store"),
                    "o-half": ("o-half",)}
KNOCKOUTS = tuple(KNOCKOUT_REMOVES)
KNOCKOUT_BASES = ("v18", "v23", "v28")     # two consumer warpgroups pipelined; three not pipelined; fp8's default
KNOCKOUT_VARIANTS = tuple(f"{base}ko-{piece}" for base in KNOCKOUT_BASES for piece in KNOCKOUTS)


def knockout_piece(variant: str) -> tuple[str, str] | None:
    """(base generation, piece) of a knock-out variant name, else None."""
    base, sep, piece = variant.partition("ko-")
    return (base, piece) if sep and base in KNOCKOUT_BASES and piece in KNOCKOUTS else None


# Phase-trace builds: a generation whose consumer warps stamp the SM clock at each phase of every tile into
# m_part instead of the row maxima (attention_sm90_ws.TRACE_PHASES; benchmarks/trace_gpu.py). Diagnostic
# like the knock-outs: not in VARIANTS, never swept. Built for the dtypes their base generation is built for.
TRACE_VARIANTS = ("v18tr", "v22tr")
# The points of a pipelined consumer iteration a trace build stamps (SM clock cycles since the consumers'
# common start), in this order, into m_part[t * ROWS + 16 * warp + k] for the tile t whose P V the
# iteration runs (warp = consumer warp 0..7; the rest of the warp's 16 slots stay unwritten).
TRACE_PHASES = ("top", "q_ready", "issued", "s_done", "softmax_done", "pv_done", "stored", "p_ready")


def trace_base(variant: str) -> str | None:
    """The base generation of a trace variant name, else None."""
    base = variant[:-2] if variant.endswith("tr") else None
    return base if f"{base}tr" in TRACE_VARIANTS and base in VARIANTS else None


def diagnostic_base(variant: str) -> str | None:
    """The generation a diagnostic build (knock-out or trace) is made from, else None."""
    knock_out = knockout_piece(variant)
    return knock_out[0] if knock_out else trace_base(variant)


# Generations whose fp8 P V takes P from registers in the S accumulator's column order: they read V's
# keys permuted within every 16 (attention_sm90_ws._fp8_p_regs).
FP8_V_KEY_PERMUTED = ("v15", "v16", "v17", "v18", "v21", "v22", "v23", "v24", "v28") + KNOCKOUT_VARIANTS + TRACE_VARIANTS


def fp8_v_key_order() -> list[int]:
    """Stored key k of every 16 holds the true key 8 (i // 2) + 2 q + i % 2, with q, i = divmod(k, 4)."""
    return [8 * ((k % 4) // 2) + 2 * (k // 4) + (k % 4) % 2 for k in range(16)]


def sweep_configs(dtypes=DTYPES, variants=VARIANTS) -> list[CuteConfig]:
    """Every configuration the sweep can ask the CuTe stage for: the study geometry (G = 16, so a
    TILE_Q = 8 tile is 128 rows, D = 128, block = 128) in each data dtype and kernel generation, with
    the CTAs per SM that generation supports (VARIANT_CTAS)."""
    return [CuteConfig(d, ctas_per_sm=c, variant=v) for v in variants for d in dtypes
            for c in VARIANT_CTAS[(v, d)]]


def knockout_configs(dtypes=DTYPES) -> list[CuteConfig]:
    """The diagnostic builds, one CTA per SM: the knock-outs (KNOCKOUT_VARIANTS) in each dtype and the
    phase traces (TRACE_VARIANTS) in each dtype their base generation is built for."""
    return ([CuteConfig(d, ctas_per_sm=1, variant=v) for v in KNOCKOUT_VARIANTS for d in dtypes]
            + [CuteConfig(d, ctas_per_sm=1, variant=v) for v in TRACE_VARIANTS for d in dtypes
               if VARIANT_CTAS[(trace_base(v), d)]])


def source_hash() -> str:
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in SOURCE_FILES:
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


def write_manifest(out_dir: Path, arch: str, dsl_version: str, cuda_version: str, kernel_version: str,
                   entries: list[dict]) -> Path:
    """Write the manifest; entries of an existing manifest from the same sources and arch are kept
    unless rebuilt (so building one dtype does not drop the other)."""
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
                source_hash=source_hash(), kernel_version=kernel_version,
                built_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                configs=entries)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def config_entry(cfg: CuteConfig, library_path: Path, kernel_version: str | None = None) -> dict:
    entry = dict(asdict(cfg), name=cfg.name, library=cfg.library, sha256=file_sha256(library_path))
    if kernel_version:
        entry["kernel_version"] = kernel_version
    return entry


def build_command(cfg: CuteConfig, build_dir: Path, arch: str) -> str:
    out = "" if Path(build_dir).resolve() == DEFAULT_BUILD_DIR else f" --out {build_dir}"
    return f"msa-bench build-kernels --arch {arch} --dtype {cfg.dtype}{out}"


def find_library(cfg: CuteConfig, build_dir: Path, arch: str) -> tuple[Path | None, str | None]:
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
