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
    # the vendor's datasheet figures beside the measured ceilings ("hbm_bytes_per_s", "mma_flops", "source"):
    # a reader's reference, never divided by
    vendor: dict = field(default_factory=dict)
    # what `msa-bench calibrate` fitted on what: {"prefill": {"points", "units", "run", "commit", "date", ...}}
    fitted: dict = field(default_factory=dict)

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
               "MMA: NVIDIA B200 datasheet dense rates; L2 size: vendor figure",
        vendor={"hbm_bytes_per_s": 8.0 * TB, "mma_flops": {"bf16": 2.25e15, "fp8": 4.5e15},
                "source": "NVIDIA B200 datasheet (dense)"}),
    "h100": DeviceProfile(
        name="h100", hbm_bytes_per_s=3.35 * TB, l2_bytes_per_s=8.1 * TB,
        mma_flops={"bf16": 989e12, "fp8": 1979e12}, l2_bytes=50 * MIB, sms=132,
        source="HBM and MMA: NVIDIA H100 SXM datasheet; L2 read: the H200 measurement (same GH100 die and "
               "clocks), not measured on an H100: the ceilings of an H100 without a calibration",
        vendor={"hbm_bytes_per_s": 3.35 * TB, "mma_flops": {"bf16": 989e12, "fp8": 1979e12},
                "source": "NVIDIA H100 SXM datasheet (dense)"}),
    # the ceilings of results/h200/calibration/profile.json (`msa-bench calibrate`, 2026-11-29): HBM is the
    # read stream (a Triton sum over 4 GiB, 4.49 TB/s), what the kernels run, not the copy_ (4.19-4.25 TB/s,
    # read + write), which measured decode points ran above
    "h200": DeviceProfile(
        name="h200", hbm_bytes_per_s=4.494e12, l2_bytes_per_s=7.580e12,
        mma_flops={"bf16": 745.6e12, "fp8": 1243.4e12}, l2_bytes=60 * MIB, sms=132,
        source="measured on the lent H200 on 2026-11-29 by `msa-bench calibrate` (results/h200/calibration): "
               "HBM read 4.49 TB/s, L2 read 7.58 TB/s, bf16 8192^3 matmul 746 TFLOP/s, fp8 _scaled_mm 1243 TFLOP/s",
        vendor={"hbm_bytes_per_s": 4.8 * TB, "mma_flops": {"bf16": 989e12, "fp8": 1979e12},
                "source": "NVIDIA H200 SXM datasheet (dense)"}),
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
    host = fc.get("host", {})
    if not isinstance(host, dict) or not all("/" in k and isinstance(v, dict) and _seconds(v.get("s"))
                                             and _seconds(v.get("step_s", 0.0)) and _stage_seconds(v.get("stages", {}))
                                             and _seconds(v.get("probe_s", 0.0)) for k, v in host.items()):
        return ("host must map 'backend/dtype' to {'s': host seconds per stage launch, 'step_s': per-step "
                "planning seconds, 'stages': {stage: its own launch seconds}, 'probe_s': the host launch probe's "
                "seconds}, each in [0, 1)")
    return None


def _stage_seconds(stages) -> bool:
    return isinstance(stages, dict) and all(isinstance(k, str) and _seconds(v) for k, v in stages.items())


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


PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# where the calibrated profile of a GPU lives, under the working directory or the checkout (PACKAGE_ROOT):
# results/<gpu slug>/calibration/profile.json, the slug a preset's name (h100, h200, b200) or the GPU's name
CALIBRATION_DIR = "results/{slug}/calibration"
CALIBRATE_HINT = "msa-bench calibrate"


def gpu_slug(gpu_name: str) -> str:
    """The folder name of a GPU's calibration: its preset's name where one matches ('NVIDIA H200' -> h200),
    else its name in lower case, 'nvidia' dropped, runs of other characters as '-'."""
    key = preset_key(gpu_name)
    if key:
        return key
    import re
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower().replace("nvidia", "")).strip("-") or "gpu"


def preset_key(gpu_name: str) -> str | None:
    """The preset a GPU name as CUDA reports it matches ('NVIDIA H200' -> h200), or None."""
    lowered = (gpu_name or "").lower()
    for key in ("b200", "h200", "h100"):
        if key in lowered:
            return key
    return None


def calibration_roots() -> list[Path]:
    """Where calibrations are looked for: the working directory, then the checkout the code runs from."""
    roots = [Path.cwd().resolve()]
    return roots + ([PACKAGE_ROOT] if PACKAGE_ROOT not in roots else [])


def calibration_path(slug: str) -> Path | None:
    """The calibrated profile of the GPU `slug` (CALIBRATION_DIR), the first found, or None."""
    for root in calibration_roots():
        path = root / CALIBRATION_DIR.format(slug=slug) / "profile.json"
        if path.is_file():
            return path
    return None


def preset(name: str) -> DeviceProfile:
    """The GPU `name`'s profile: its calibration (results/<name>/calibration/profile.json) where one is
    found, else the preset alone (its ceilings, every fraction 1, no fixed costs)."""
    found = calibration_path(name)
    return load_profile_file(found) if found is not None else PRESETS[name]


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
    return load_profile_file(path, name_or_path)


def load_profile_file(path: Path, origin: str | None = None) -> DeviceProfile:
    origin = origin or str(path)
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"device profile {origin} is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})")
    if not isinstance(data, dict):
        raise UserError(f"device profile {origin} must hold a JSON object")
    return profile_from_dict(data, origin)


def profile_for_gpu(gpu_name: str) -> DeviceProfile | None:
    """The profile of a GPU name as CUDA reports it: its calibration, else its preset; None for a GPU
    that matches no preset and has no calibration."""
    return resolve_profile(None, gpu_name).profile


FALLBACK_DEVICE = "h200"    # the study's GPU: the profile of a command run without a GPU (roofline, workload)
PROFILE_ENV = "MSA_BENCH_PROFILE"          # --device as `sweep` passes it on to its workers and `auto`
_SAID_ENV = "MSA_BENCH_PROFILE_SAID"       # the no-calibration line was said (by this process or its parent)
HERE = "here"                              # resolve_profile's gpu: this machine's GPU (None without one)


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a command uses and why: `origin` "flag" (--device), "calibration" (the GPU's calibrated
    profile), "preset" (the GPU's preset: no calibration found), "cpu" (no GPU: the study's GPU, h200) or
    "none" (a GPU that matches no preset and has no calibration: no model). `note`: the one line a user is
    told where there is no calibration."""
    profile: DeviceProfile | None
    origin: str
    gpu: str | None = None
    path: str | None = None
    sha256: str | None = None
    note: str | None = None

    def provenance(self) -> dict:
        """What a run records of the profile it used (run.json provenance["profile"])."""
        return {"name": self.profile.name if self.profile else None, "origin": self.origin,
                "path": self.path, "sha256": self.sha256, **({"note": self.note} if self.note else {})}

    def required(self, what: str = "this command") -> DeviceProfile:
        """The profile, or a UserError (one line) for a GPU without one."""
        if self.profile is None:
            raise UserError(f"{what} needs the roofline's ceilings: {self.note}")
        return self.profile

    def say(self, echo=None) -> None:
        """Print the note once (a sweep's workers inherit that it was said)."""
        import os
        import sys
        if not self.note or os.environ.get(_SAID_ENV) == self.note:
            return
        os.environ[_SAID_ENV] = self.note
        (echo or (lambda line: print(line, file=sys.stderr)))(f"note: {self.note}")


def _shown(path: Path) -> str:
    """A profile's path as a run records it: relative to the working directory where it lies under it (a
    checkout's results/<gpu>/calibration/profile.json reads the same on every machine), else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _sha256(path: Path) -> str:
    import hashlib
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def this_gpu() -> str | None:
    """The name CUDA gives this machine's GPU, or None without one."""
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def resolve_profile(flag: str | None = None, gpu: str | None = HERE) -> ProfileChoice:
    """The one rule for which profile a command uses. In order: `flag` (--device: a preset name, read as
    that GPU's calibration where one is found, or a PROFILE.json; else $MSA_BENCH_PROFILE, which `sweep
    --device` sets for its workers); the calibrated profile of the GPU the command runs on
    (results/<slug>/calibration/profile.json under the working directory or the checkout); that GPU's
    preset, with unit fractions and no fixed costs, and a note that says so and how to make a
    calibration; for a GPU that matches no preset, no profile (never another GPU's numbers) and a note.
    `gpu`: the GPU's name as CUDA reports it, HERE for this machine's, None for none (then the study's
    GPU, h200, as `roofline` and `workload` model it)."""
    import os
    flag = flag or os.environ.get(PROFILE_ENV) or None
    if gpu == HERE:
        gpu = this_gpu()
    if flag:
        key = flag.lower()
        if key in PRESETS:
            found = calibration_path(key)
            if found is None:           # asked for by name: its preset, as asked (no note)
                return ProfileChoice(PRESETS[key], "flag", gpu, f"preset:{key}", None)
            return ProfileChoice(load_profile_file(found), "flag", gpu, _shown(found), _sha256(found))
        prof = load_device(flag)
        return ProfileChoice(prof, "flag", gpu, _shown(Path(flag)), _sha256(Path(flag)))
    if gpu is None:
        found = calibration_path(FALLBACK_DEVICE)
        if found is None:
            return ProfileChoice(PRESETS[FALLBACK_DEVICE], "cpu", None, f"preset:{FALLBACK_DEVICE}", None)
        return ProfileChoice(load_profile_file(found), "cpu", None, _shown(found), _sha256(found))
    slug = gpu_slug(gpu)
    found = calibration_path(slug)
    if found is not None:
        return ProfileChoice(load_profile_file(found), "calibration", gpu, _shown(found), _sha256(found))
    where = f"{CALIBRATION_DIR.format(slug=slug)}/profile.json"
    key = preset_key(gpu)
    if key is not None:
        return ProfileChoice(PRESETS[key], "preset", gpu, f"preset:{key}", None,
                             f"no calibration of {gpu} ({where}): the {key} preset's ceilings, every fraction 1, "
                             f"no fixed costs; run `{CALIBRATE_HINT}` on it to make one")
    return ProfileChoice(None, "none", gpu, None, None,
                         f"{gpu} matches no preset and has no calibration ({where}): no roofline model; run "
                         f"`{CALIBRATE_HINT}` on it, or pass --device PROFILE.json")


def run_profile(meta: dict) -> ProfileChoice:
    """The profile a run's report re-predicts with: the one the run recorded (provenance["profile"]: a
    file whose sha256 still matches, or a preset), else the one the run's GPU resolves to today (runs
    made before profiles were recorded, or a file changed since: the choice's note says which); for a
    CPU run, none."""
    prov = meta.get("provenance") or {}
    gpu = prov.get("gpu_name")
    rec = prov.get("profile") or {}
    where = rec.get("path")
    if isinstance(where, str) and where.startswith("preset:") and where[7:] in PRESETS:
        return ProfileChoice(PRESETS[where[7:]], "recorded", gpu, where, None)
    if isinstance(where, str) and rec.get("sha256"):
        for path in [Path(where)] + [r / where for r in calibration_roots() if not Path(where).is_absolute()]:
            if path.is_file() and _sha256(path) == rec["sha256"]:
                return ProfileChoice(load_profile_file(path), "recorded", gpu, str(path), rec["sha256"])
    if not gpu:
        return ProfileChoice(None, "none", None)
    choice = resolve_profile(None, gpu)
    if where:
        said = (f"the run's profile {where} (sha256 {str(rec.get('sha256'))[:12]}) is not here as it was; "
                f"re-predicted with {choice.path or 'none'}")
        choice = replace(choice, note=said + (f" ({choice.note})" if choice.note else ""))
    return choice


def device_profile(device) -> DeviceProfile:
    """The profile a workload's device plans with (`auto`, the hybrid's split): resolve_profile for its
    GPU (the study's GPU, h200, on a CPU); a UserError on a GPU without one."""
    import torch
    dev = torch.device(device)
    choice = resolve_profile(None, torch.cuda.get_device_name(dev) if dev.type == "cuda" else None)
    choice.say()
    return choice.required("`auto`")


def default_device_name() -> str:
    """The preset of this machine's GPU where one matches it, else h200 (kept for callers that want a
    name; resolve_profile is the rule)."""
    return preset_key(this_gpu() or "") or FALLBACK_DEVICE
