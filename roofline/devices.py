"""Device profiles: the bandwidths, MMA peaks and L2 size the roofline divides by.

Presets carry their sources. A profile written by `msa-bench calibrate` (JSON) loads the same way.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..errors import UserError
from .names import base_name

TB = 1e12
MIB = 1 << 20


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    hbm_bytes_per_s: float
    l2_bytes_per_s: float
    mma_flops: dict            # {"bf16": flop/s, "fp8": flop/s}
    l2_bytes: int
    sms: int
    source: str = ""
    measured: dict = field(default_factory=dict)
    # "backend/dtype" -> the fraction of its roofline time the backend's kernel reaches here, measured
    achieved: dict = field(default_factory=dict)
    # what `msa-bench calibrate` measures beyond the roofline: "launch_s", one kernel launch inside a CUDA
    # graph; "stages", "backend/stage/dtype" -> {"s": the stage's time at zero roofline time, "launches"};
    # "decode_achieved", "backend/dtype" -> the fraction reached on decode batches (model.is_decode); "items",
    # "backend/dtype" -> {"s", "block_s"}: the time one work item (a packed tile) of b blocks takes alone,
    # s + b x block_s, a floor on the module where too few items fill the GPU
    fixed_costs: dict = field(default_factory=dict)

    def peak_flops(self, dtype: str) -> float:
        # fp16 runs at the bf16 rate and fp32 inputs run tf32-or-slower: bf16's rate is an upper bound.
        return self.mma_flops.get(dtype) or self.mma_flops["bf16"]

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


PRESETS: dict[str, DeviceProfile] = {
    "b200": DeviceProfile(
        name="b200", hbm_bytes_per_s=7.4 * TB, l2_bytes_per_s=24.0 * TB,
        mma_flops={"bf16": 2.25e15, "fp8": 4.5e15}, l2_bytes=126 * MIB, sms=148,
        source="L2 and HBM: the measured peaks quoted by the KV-outer design study (shared/reference/000); "
               "MMA: NVIDIA B200 datasheet dense rates; L2 size: vendor figure"),
    "h100": DeviceProfile(
        name="h100", hbm_bytes_per_s=3.35 * TB, l2_bytes_per_s=8.1 * TB,
        mma_flops={"bf16": 989e12, "fp8": 1979e12}, l2_bytes=50 * MIB, sms=132,
        source="HBM and MMA: NVIDIA H100 SXM datasheet; L2 read: the H200 measurement (same GH100 die and "
               "clocks), not measured on an H100"),
    "h200": DeviceProfile(
        name="h200", hbm_bytes_per_s=4.19 * TB, l2_bytes_per_s=8.1 * TB,
        mma_flops={"bf16": 788e12, "fp8": 1435e12}, l2_bytes=60 * MIB, sms=132,
        source="measured on the lent H200 on 2026-11-29 (shared/measured/h200.json): HBM copy 4.19 TB/s, "
               "L2 read 8.1 TB/s, bf16 8192^3 matmul 788 TFLOP/s, fp8 _scaled_mm 1435 TFLOP/s"),
}

_REQUIRED = {"name": str, "hbm_bytes_per_s": (int, float), "l2_bytes_per_s": (int, float),
             "mma_flops": dict, "l2_bytes": int, "sms": int}


# above 1 where the model over-counts a kernel's bytes (FlashInfer's Q-outer bf16 read 1.55 before its L2
# window was modelled)
MAX_ACHIEVED = 2.0


def _seconds(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1.0


def fractions_ok(table) -> bool:
    """Whether `table` maps "backend/dtype" to a fraction of the roofline in (0, MAX_ACHIEVED]."""
    return isinstance(table, dict) and all(isinstance(k, str) and "/" in k and isinstance(v, (int, float))
                                           and not isinstance(v, bool) and 0 < v <= MAX_ACHIEVED
                                           for k, v in table.items())


def fixed_costs_problem(fc) -> str | None:
    """None if `fc` is a valid fixed_costs table, else what is wrong with it."""
    if not isinstance(fc, dict):
        return "must be a JSON object"
    if "launch_s" in fc and not _seconds(fc["launch_s"]):
        return "launch_s must be seconds in [0, 1)"
    stages = fc.get("stages", {})
    if not isinstance(stages, dict):
        return "stages must map 'backend/stage' to {'s': seconds, 'launches': count}"
    for key, v in stages.items():
        if "/" not in key or not isinstance(v, dict) or not _seconds(v.get("s")) or \
                not isinstance(v.get("launches", 0), int) or v.get("launches", 0) < 0:
            return f"stages[{key!r}] must be {{'s': seconds in [0, 1), 'launches': count}}"
    if not fractions_ok(fc.get("decode_achieved", {})):
        return f"decode_achieved must map 'backend/dtype' to a fraction in (0, {MAX_ACHIEVED}]"
    items = fc.get("items", {})
    if not isinstance(items, dict) or not all("/" in k and isinstance(v, dict) and _seconds(v.get("s"))
                                              and _seconds(v.get("block_s")) for k, v in items.items()):
        return "items must map 'backend/dtype' to {'s': seconds, 'block_s': seconds per block}, each in [0, 1)"
    return None


def achieved(profile: DeviceProfile, backend: str, dtype: str, decode: float = 0.0) -> float:
    """The measured fraction of its roofline a backend reaches on this device, 1 where none is recorded.
    `decode`: the share of the work that is decode (model.decode_share; True counts as 1). On decode work
    the fraction calibrated on decode batches, where there is one: the `achieved` table was measured on
    prefill (co-selection), and a kernel's efficiency there says little about a request of one token
    (KV-outer: one query per block pair); a backend without one (FlashInfer's FA2, whose fraction leaves
    its HBM term out: Backend.fraction_terms) takes its prefill fraction. A step
    that mixes both runs each share at its own rate: the harmonic blend, share / decode + rest / prefill.
    BASE@OPTION takes its own prefill fraction where the profile holds one (a kernel of its own, such as
    q-packed-cute's 12-token tile, `q-packed-cute@p12`), else BASE's."""
    table = profile.achieved or {}
    key = f"{base_name(backend)}/{dtype}"
    prefill = float(table.get(f"{backend}/{dtype}", table.get(key, 1.0)))
    share = min(max(float(decode), 0.0), 1.0)
    dec = ((profile.fixed_costs or {}).get("decode_achieved") or {}).get(key)
    if share == 0.0 or dec is None:
        return prefill
    if share == 1.0:
        return float(dec)
    return 1.0 / (share / float(dec) + (1.0 - share) / prefill)


def has_achieved(profile: DeviceProfile, backend: str, dtype: str) -> bool:
    """Whether the profile measured `backend` in `dtype`, or measured nothing (then every fraction is 1)."""
    return not profile.achieved or f"{base_name(backend)}/{dtype}" in profile.achieved


def has_fixed_costs(profile: DeviceProfile, backend: str, dtype: str) -> bool:
    """Whether the profile measured `backend`'s stages (in `dtype`, or for every dtype), or measured no
    stage at all (then every fixed cost is 0, or its launches')."""
    stages = (profile.fixed_costs or {}).get("stages") or {}
    base = base_name(backend)
    keys = [k.split("/") for k in stages]
    return not stages or any(k[0] == base and (len(k) == 2 or k[2] == dtype) for k in keys)


def device_profile(device) -> DeviceProfile:
    """The roofline profile of a workload's device: its GPU's preset, the H200's on a CPU or unknown GPU."""
    import torch
    if torch.device(device).type == "cuda":
        return profile_for_gpu(torch.cuda.get_device_name(device)) or preset(FALLBACK_DEVICE)
    return preset(FALLBACK_DEVICE)


def _positive(v) -> bool:
    """A finite number above 0: what every rate and size the roofline divides by must be (JSON's NaN and
    Infinity parse as floats)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def profile_from_dict(data: dict, origin: str) -> DeviceProfile:
    for key, kind in _REQUIRED.items():
        if key not in data:
            raise UserError(f"device profile {origin}: missing key {key!r}")
        if not isinstance(data[key], kind) or isinstance(data[key], bool):
            raise UserError(f"device profile {origin}: key {key!r} has the wrong type")
    for key in ("hbm_bytes_per_s", "l2_bytes_per_s", "l2_bytes", "sms"):
        if not _positive(data[key]):
            raise UserError(f"device profile {origin}: {key} must be a positive finite number, got {data[key]!r}")
    flops = data["mma_flops"]
    bad = [k for k, v in flops.items() if not _positive(v)]
    if "bf16" not in flops or bad:
        got = f", got {bad[0]!r}: {flops[bad[0]]!r}" if bad else ""
        raise UserError(f"device profile {origin}: mma_flops needs a positive finite rate (flop/s) for 'bf16' "
                        f"and every dtype it names{got}")
    if not fractions_ok(data.get("achieved", {})):
        raise UserError(f"device profile {origin}: achieved must map 'backend/dtype' to a fraction in "
                        f"(0, {MAX_ACHIEVED:g}]")
    problem = fixed_costs_problem(data.get("fixed_costs", {}))
    if problem:
        raise UserError(f"device profile {origin}: fixed_costs {problem}")
    known = {k: data[k] for k in DeviceProfile.__dataclass_fields__ if k in data}
    return DeviceProfile(**known)


# a preset GPU's fixed costs as `msa-bench calibrate --fixed-costs-only` measured them and its achieved
# fractions as scripts/fit-achieved.py fitted them (the committed copy)
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
CALIBRATION_FILES = {"h200": "roofline/profiles/h200.json"}     # package data: an installed copy reads it too


def preset(name: str) -> DeviceProfile:
    """The preset `name` with the fixed costs and achieved fractions of its committed calibration, where
    that holds valid ones (else the preset alone: every fraction 1, no fixed costs)."""
    base = PRESETS[name]
    path = PACKAGE_ROOT / CALIBRATION_FILES.get(name, "-")
    if not path.is_file():
        return base
    try:
        data = json.loads(path.read_text())
        fc, ach = data.get("fixed_costs") or {}, data.get("achieved") or {}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return base
    changes, said = {}, []
    if fc and not base.fixed_costs and not fixed_costs_problem(fc):
        changes["fixed_costs"], said = fc, ["fixed costs"]
    if ach and not base.achieved and fractions_ok(ach):
        changes["achieved"] = ach
        said.append(f"achieved fractions ({data.get('achieved_source', 'fitted')})")
    if not changes:
        return base
    return replace(base, **changes, source=f"{base.source}; {' and '.join(said)}: {CALIBRATION_FILES[name]}")


def load_device(name_or_path: str) -> DeviceProfile:
    """A preset by name (b200, h100, h200) or a profile JSON written by `msa-bench calibrate`."""
    key = name_or_path.lower()
    if key in PRESETS:
        return preset(key)
    path = Path(name_or_path)
    if path.is_dir():
        inside = path / "profile.json"
        hint = f"; pass {inside}, the one `msa-bench calibrate` wrote there" if inside.is_file() else ""
        raise UserError(f"device profile {name_or_path} is a directory, not a profile file (PROFILE.json){hint}")
    if path.suffix != ".json" and not path.exists():
        raise UserError(f"unknown device {name_or_path!r}; use one of {', '.join(PRESETS)} or a profile .json file")
    if not path.is_file():
        raise UserError(f"device profile {name_or_path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"device profile {name_or_path} is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})")
    if not isinstance(data, dict):
        raise UserError(f"device profile {name_or_path} must hold a JSON object")
    return profile_from_dict(data, name_or_path)


def profile_for_gpu(gpu_name: str) -> DeviceProfile | None:
    """The preset for a GPU name as CUDA reports it ('NVIDIA H200' -> h200), or None."""
    lowered = gpu_name.lower()
    for key in ("b200", "h200", "h100"):
        if key in lowered:
            return preset(key)
    return None


FALLBACK_DEVICE = "h200"    # the study's GPU


def default_device_name() -> str:
    """The preset of this machine's GPU where one matches it, else h200: the one default of
    `msa-bench roofline` and `msa-bench workload`."""
    import torch
    if torch.cuda.is_available():
        prof = profile_for_gpu(torch.cuda.get_device_name())
        if prof is not None:
            return prof.name
    return FALLBACK_DEVICE
