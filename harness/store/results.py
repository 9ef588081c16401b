"""The run folder: metadata, one folder per finished unit (point x backend), and the loader.

    RUN/run.json                         metadata + provenance + the units this run plans
    RUN/units/<unit>/status.json         status ok|failed|unavailable, reason, check error, telemetry
    RUN/units/<unit>/stats.parquet       tidy: one row per (stage, statistic) with point columns
    RUN/units/<unit>/samples.parquet     raw timing samples: (stage, rep, seconds)

A unit folder is written under a temporary name and renamed into place, so a unit either exists
complete or not at all: an interrupted sweep keeps every finished unit and `--resume` skips them.

A committed run whose raw samples were removed may be packed (pack_run): its units/ become one file,

    RUN/units.jsonl.gz                   a line per unit: {"unit", "status", "stats": [rows]}

read by load_run with the same checks, and read-only (no resume, no merge): a folder and two small
files per unit cost a checkout about 12 KB each, the packed line well under 1 KB.

Every reader goes through load_run, which checks content as well as bytes: the columns of each
table, finite and positive times, the samples the stats claim (count and median per stage), a
status file that names its own folder, an `ok` whose own error is within its tolerance, one timer
per run (the unit's; the plan stage's is `host`), no timings kept by a unit that did not pass, and
every planned unit of a run that says it is complete.
A damaged unit is never read as data: compare, merge and report refuse the run, naming the units,
and `sweep --resume` redoes them.

Every part is sealed when written and checked when read (seal.py: RUN/units/<unit>/seal.json, run.json's
`seal`, a packed line's `seal`), after the content checks, so the most telling reason is named; the
rules that follow from other data (a unit's tolerance from its dtype, the timer from the device) are
derived here, never read from the file they judge.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ...errors import UserError
from .migrate import MODEL_RECORD_SCHEMA, upgrade
from .seal import (SEAL_FIELD, SEAL_FILE, SEAL_HINT, UNSEALED, meta_change, record_change, seal_unit, sealed_meta,
                   sealed_record, unit_change)
from ..measure.timing import (EAGER_COLUMNS, EAGER_MEDIANS, HOST_STAGES, TIMER_CPU, TIMER_CPU_EAGER, TIMER_GPU,
                              TIMER_GPU_EAGER, TIMER_HOST, l2_flush_of)

SCHEMA_VERSION = MODEL_RECORD_SCHEMA    # harness/store/migrate.py upgrades rows of earlier ones where a run is loaded
RUN_FILE = "run.json"
UNITS_DIR = "units"
SAMPLES_REMOVED = "samples_removed"    # run.json: why and where a committed run's raw samples went
PACKED_FILE = "units.jsonl.gz"         # a packed run's units (pack_run)
STATUS_OK, STATUS_FAILED, STATUS_UNAVAILABLE = "ok", "failed", "unavailable"
STATUSES = (STATUS_OK, STATUS_FAILED, STATUS_UNAVAILABLE)
STATUS_FIELD = "the unit's status: " + ", ".join(STATUSES)
STAT_COLUMNS = ["point_key", "backend", "schedule", "dtype", "stage", "statistic", "value", "timer"]
SAMPLE_COLUMNS = ["point_key", "backend", "dtype", "stage", "rep", "seconds", "timer"]
# Optional sample columns (GPU-timed rows; runs made before them lack them): the spin-probed SM clock
# of each sample (MHz) and the NVML clock-event reason mask of its batch. Eager rows add EAGER_COLUMNS.
CLOCK_COLUMNS = ("sm_clock_mhz", "clock_event_reasons")


class UnreadableFile(UserError):
    """A results file this user may not read: no damage (nothing to redo or set aside), so never counted
    as a damaged unit."""

    def __init__(self, path: Path):
        super().__init__(f"cannot read {path}: permission denied (the file is not damaged: fix its permissions)")


def unit_id(point_key: str, backend: str) -> str:
    digest = hashlib.sha1(f"{point_key}|{backend}".encode()).hexdigest()[:16]
    return f"{backend.replace(':', '_')}-{digest}"          # a tile order's "2:p": no ':' in a path


def grid_digest(unit_ids) -> str:
    return hashlib.sha256("\n".join(sorted(unit_ids)).encode()).hexdigest()


def read_meta(run_dir: str | Path, sealed: bool = True) -> dict:
    """run.json, checked: the fields that follow from others agree with them (_check_meta), and nothing
    changed since it was written (seal.py). sealed False: a run.json never sealed is accepted (seal_run)."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise UserError(f"no run folder at {run_dir}")
    path = run_dir / RUN_FILE
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run folder (no {RUN_FILE})")
    meta = _read_json_object(path, "scenario", "the name of the scenario the run measured")
    if not isinstance(meta["scenario"], str) or not meta["scenario"]:
        raise UserError(f"corrupt results file {path}: field 'scenario' must be the scenario's name, got "
                        f"{meta['scenario']!r}")
    _check_meta(path, meta)
    _check_seal(path, meta_change(meta), sealed, "the run was written")
    return meta


def _check_seal(where: Path, change: str | None, sealed: bool, since: str) -> None:
    """Refuse a part of a run that changed since `since` (or, when `sealed`, that was never sealed)."""
    if change is None or (change == UNSEALED and not sealed):
        return
    if change == UNSEALED:
        raise UserError(f"{where} is unsealed (no integrity record): {SEAL_HINT}")
    raise UserError(f"edited results {where}: {change} since {since} (its sha256 differs from the seal); "
                    "results are re-measured, never edited")


# The timers each device kind's units may be timed with (provenance device_kind): graph replay, or eager.
DEVICE_TIMERS = {"cuda": (TIMER_GPU, TIMER_GPU_EAGER), "cpu": (TIMER_CPU, TIMER_CPU_EAGER)}


def _check_meta(path: Path, meta: dict) -> None:
    """The fields of run.json that follow from others: the timer from the device, the grid digest from
    the planned grid, each planned unit's backend among the backends."""
    _check_device(path, meta)
    grid = meta.get("grid_units")
    if grid is not None and grid_digest(grid) != meta.get("grid_sha256"):
        raise UserError(f"corrupt results file {path}: grid_units ({len(grid)}) are not the grid grid_sha256 names "
                        "(a planned unit added or dropped)")
    _check_backends(path, meta, (uid.rsplit("-", 1)[0] for uid in grid or ()), "grid_units")


def _check_device(path: Path, meta: dict) -> None:
    """A run names its timer, and the timer is its device's: a GPU in the provenance with host timings
    (or the reverse) would put one device's roofline over another's numbers."""
    timer, prov = meta.get("timer"), meta.get("provenance") or {}
    if not isinstance(timer, str):
        raise UserError(f"corrupt results file {path}: no timer field (every run names the clock its units used)")
    kind, name = prov.get("device_kind"), prov.get("device_name")
    gpu = kind == "cuda" or bool(prov.get("gpu_name")) or not str(name or "CPU").startswith("CPU")
    expected = DEVICE_TIMERS["cuda" if gpu else "cpu"]
    if (kind is not None and gpu != (kind == "cuda")) or timer not in expected:
        raise UserError(f"corrupt results file {path}: provenance device {name!r} ({kind}) and timer {timer!r} "
                        f"disagree (a {'CUDA GPU' if gpu else 'CPU'} run is timed by {' or '.join(map(repr, expected))})")


def _check_backends(path: Path, meta: dict, backends, whose: str) -> None:
    """Every backend of `whose` (units or unit ids) is one of run.json's backends."""
    named = {str(b).replace(":", "_") for b in meta.get("backends") or ()}
    stray = sorted({str(b).replace(":", "_") for b in backends} - named)
    if stray:
        raise UserError(f"corrupt results file {path}: {whose} hold backend {stray[0]!r}, which its backends "
                        f"({', '.join(sorted(named)) or 'none'}) do not name")


def _read_json_object(path: Path, required_key: str, what: str) -> dict:
    """A JSON object holding `required_key` (`what`: what that field holds); anything else is a one-line
    corrupt-file error."""
    try:
        data = json.loads(path.read_text())
    except PermissionError:
        raise UnreadableFile(path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"corrupt results file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"corrupt results file {path}: not a JSON object")
    if required_key not in data:
        raise UserError(f"corrupt results file {path}: no field {required_key!r} ({what})")
    return data


def write_meta(run_dir: str | Path, meta: dict) -> None:
    """run.json, sealed (seal.py): its fields as JSON values, as a reader sees them, and their digests."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{RUN_FILE}.tmp"
    values = json.loads(json.dumps(meta, default=str))
    tmp.write_text(json.dumps(sealed_meta(values), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, run_dir / RUN_FILE)


def require_empty(folder: str | Path, what: str) -> None:
    """Refuse to write a new run into a folder that exists and holds anything (what: how the user named it);
    a file there fails where it is written, as any path that cannot be used."""
    folder = Path(folder)
    if folder.is_dir() and any(folder.iterdir()):
        raise UserError(f"{what} {folder} exists and is not empty: name a new or empty folder")


def is_packed(run_dir: str | Path) -> bool:
    return (Path(run_dir) / PACKED_FILE).is_file()


def finished_units(run_dir: str | Path) -> set[str]:
    if is_packed(run_dir):
        return set(_packed_records(Path(run_dir)))
    units = Path(run_dir) / UNITS_DIR
    if not units.is_dir():
        return set()
    # an empty folder is nobody's finished unit (a copy that carries directories but not their
    # deleted files leaves them); a folder with files but no status.json is corrupt (load_run says so)
    return {p.name for p in units.iterdir() if p.is_dir() and not p.name.startswith(".") and any(p.iterdir())}


def clear_partial_units(run_dir: str | Path) -> None:
    """Remove half-written unit folders an interrupted run may have left."""
    units = Path(run_dir) / UNITS_DIR
    if units.is_dir():
        for p in units.iterdir():
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)


def write_unit(run_dir: str | Path, uid: str, status: dict, stats: list[dict], samples: list[dict]) -> None:
    units = Path(run_dir) / UNITS_DIR
    units.mkdir(parents=True, exist_ok=True)
    tmp = units / f".tmp-{uid}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / "status.json").write_text(json.dumps(status, indent=1, sort_keys=True, default=_json_default) + "\n")
    if stats:
        write_parquet(pd.DataFrame(stats), tmp / "stats.parquet")
    if samples:
        write_parquet(pd.DataFrame(samples), tmp / "samples.parquet")
    seal_unit(tmp)
    final = units / uid
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)


def write_parquet(df: pd.DataFrame, path: Path) -> None:
    """A unit's table as Parquet without pandas' schema metadata: the columns are plain strings and
    numbers that read back the same, and the metadata was half of a typical unit's bytes (results travel
    in git)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False).replace_schema_metadata(None), path)


def read_unit_status(run_dir: str | Path, uid: str) -> dict:
    path = Path(run_dir) / UNITS_DIR / uid / "status.json"
    return _read_json_object(path, "status", STATUS_FIELD) if path.is_file() else {}


def update_unit(run_dir: str | Path, uid: str, status_updates: dict, new_stats: list[dict],
                replace_statistics=()) -> None:
    """Add stat rows (and status fields) to a finished unit, e.g. counters collected after its timing.

    Rows whose statistic is in `replace_statistics` are dropped first, so a repeated update never
    duplicates them. The stats file is replaced before the status, so a status that names the new
    rows is never seen without them.
    """
    folder = Path(run_dir) / UNITS_DIR / uid
    status = read_unit_status(run_dir, uid)
    if not status:
        raise UserError(f"no finished unit {uid} in {run_dir}")
    _check_seal(folder, unit_change(folder), True, "the unit was written")     # never reseal an edit
    if new_stats:
        path = folder / "stats.parquet"
        old = _read_parquet(path) if path.is_file() else pd.DataFrame(columns=STAT_COLUMNS)
        if replace_statistics and len(old):
            old = old[~old["statistic"].isin(list(replace_statistics))]
        frames = [f for f in (old, pd.DataFrame(new_stats)) if len(f)]
        tmp = folder / ".stats.parquet.tmp"
        write_parquet(pd.concat(frames, ignore_index=True), tmp)
        os.replace(tmp, path)
    status.update(status_updates)
    tmp = folder / ".status.json.tmp"
    tmp.write_text(json.dumps(status, indent=1, sort_keys=True, default=_json_default) + "\n")
    os.replace(tmp, folder / "status.json")
    seal_unit(folder)


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


@dataclass
class Run:
    path: Path
    meta: dict
    status: pd.DataFrame      # one row per unit
    stats: pd.DataFrame       # tidy: unit x stage x statistic
    samples: pd.DataFrame     # raw timing samples
    missing: list[str] = field(default_factory=list)   # planned units with no folder (an unfinished run)

    @property
    def timer(self) -> str:
        return self.meta.get("timer", "unknown")

    @property
    def device_name(self) -> str:
        return (self.meta.get("provenance") or {}).get("device_name") or "unknown"

    def value(self, statistic: str, stage: str = "module") -> pd.DataFrame:
        """Rows of one statistic at one stage (ok units only), point columns included."""
        s = self.stats
        return s[(s["statistic"] == statistic) & (s["stage"] == stage)]


def _read_parquet(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except PermissionError:
        raise UnreadableFile(path) from None
    except Exception as exc:  # pyarrow raises several types for truncated or foreign files
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"corrupt results file {path}: {why}") from None


def _read_table(path: Path, columns: list[str], required: bool) -> pd.DataFrame | None:
    if not path.is_file():
        if required:
            raise UserError(f"corrupt results file {path}: missing (the unit says it was timed)")
        return None
    table = _read_parquet(path)
    lacking = [c for c in columns if c not in table.columns]
    if lacking:
        raise UserError(f"corrupt results file {path}: no column {', '.join(lacking)}")
    if required and table.empty:
        raise UserError(f"corrupt results file {path}: no rows (the unit says it was timed)")
    return table


def _check_timed(folder: Path, status: dict, stats: pd.DataFrame, samples: pd.DataFrame | None) -> None:
    """The content of a timed unit: its own rows only, finite positive times, the samples its stats claim
    (samples None: a run whose raw samples were removed, see SAMPLES_REMOVED)."""
    for name, table in (("stats.parquet", stats), ("samples.parquet", samples)):
        if table is None:
            continue
        # plain lists: pandas' comparisons cost more than the check on a unit's few dozen rows
        keys, backends = table["point_key"].tolist(), table["backend"].tolist()
        foreign = sum(k != status["point_key"] or b != status["backend"] for k, b in zip(keys, backends))
        if foreign:
            raise UserError(f"corrupt results file {folder / name}: {foreign} row(s) of another unit")
        dtypes = [str(d) for d in table["dtype"].tolist()]
        other = [d for d in dtypes if d != str(status.get("dtype"))]
        if other:
            raise UserError(f"corrupt results file {folder / name}: {len(other)} row(s) of dtype "
                            f"{', '.join(sorted(set(other)))}, the unit's status.json says {status.get('dtype')!r}")
    values = pd.to_numeric(stats["value"], errors="coerce").to_numpy(dtype=float)
    if not np.isfinite(values).all():
        raise UserError(f"corrupt results file {folder / 'stats.parquet'}: "
                        f"{int((~np.isfinite(values)).sum())} values are not finite numbers")
    if samples is None:
        return
    seconds = pd.to_numeric(samples["seconds"], errors="coerce").to_numpy(dtype=float)
    bad = ~np.isfinite(seconds)
    if bad.any():
        raise UserError(f"corrupt results file {folder / 'samples.parquet'}: {int(bad.sum())} of {len(seconds)} "
                        "times are not finite numbers")
    if (seconds <= 0).any():
        raise UserError(f"corrupt results file {folder / 'samples.parquet'}: {int((seconds <= 0).sum())} of "
                        f"{len(seconds)} times are not positive")
    _check_clocks(folder, samples)
    planning = samples["stage"].isin(HOST_STAGES)
    timers, expected = set(samples.loc[~planning, "timer"].astype(str)), status.get("timer")
    foreign_plan_timer = set(samples.loc[planning, "timer"].astype(str)) - {TIMER_HOST}
    if len(timers) > 1 or (expected is not None and timers - {expected}) or foreign_plan_timer:
        found = ", ".join(sorted(set(samples["timer"].astype(str))))
        raise UserError(f"corrupt results file {folder / 'samples.parquet'}: timers {found}, the unit's status says "
                        f"{expected!r} (one timer per run and device; {TIMER_HOST!r} for the plan stage)")
    by_stage = pd.Series(seconds).groupby(samples["stage"].to_numpy())
    claims = stats[stats["statistic"].isin(("n_reps", "median_s"))]
    claimed = {(r.stage, r.statistic): float(r.value) for r in claims.itertuples()}
    stages = set(by_stage.groups)
    if {stage for stage, stat in claimed if stat == "n_reps"} != stages:
        raise UserError(f"corrupt results file {folder / 'samples.parquet'}: its stages "
                        f"({', '.join(sorted(map(str, stages)))}) are not the ones stats.parquet summarizes")
    for stage, group in by_stage:
        n, median = claimed.get((stage, "n_reps")), claimed.get((stage, "median_s"))
        if n != len(group) or median is None or not math.isclose(median, float(group.median()), rel_tol=1e-9):
            claim = "nothing" if n is None or median is None else f"{int(n)} (median {median:.6g} s)"
            raise UserError(f"corrupt results file {folder / 'samples.parquet'}: stage {stage} holds {len(group)} "
                            f"samples (median {float(group.median()):.6g} s), stats.parquet claims {claim}")
    _check_eager(folder, stats, samples)


def _check_eager(folder: Path, stats: pd.DataFrame, samples: pd.DataFrame) -> None:
    """Where an eager column is present: every eager-timed row has one, finite and non-negative, and the
    stage's median of it is the one stats.parquet claims."""
    eager = samples["timer"].isin((TIMER_GPU_EAGER, TIMER_CPU_EAGER)).to_numpy()
    for column in EAGER_COLUMNS:
        statistic = EAGER_MEDIANS[column]
        claimed = stats[stats["statistic"] == statistic]
        if column not in samples.columns:
            if len(claimed):
                raise UserError(f"corrupt results file {folder / 'stats.parquet'}: {statistic} of samples that "
                                f"samples.parquet lacks (no column {column})")
            continue
        v = pd.to_numeric(samples[column], errors="coerce").to_numpy(dtype=float)
        given = ~np.isnan(v)
        bad = (eager & ~given) | (given & ~(np.isfinite(v) & (v >= 0)))
        if bad.any():
            raise UserError(f"corrupt results file {folder / 'samples.parquet'}: {int(bad.sum())} of {len(v)} "
                            f"{column} values are missing, not finite or negative")
        medians = pd.Series(v[given]).groupby(samples["stage"].to_numpy()[given]).median()
        for r in claimed.itertuples():
            if r.stage not in medians or not math.isclose(float(r.value), float(medians[r.stage]), rel_tol=1e-9):
                raise UserError(f"corrupt results file {folder / 'stats.parquet'}: stage {r.stage} claims {statistic} "
                                f"{float(r.value):.6g}, its samples say {medians.get(r.stage, float('nan')):.6g}")


def _check_clocks(folder: Path, samples: pd.DataFrame) -> None:
    """Where a clock column is present: every GPU-timed row has one, finite and positive (a reason
    mask: a non-negative integer); other rows (host `plan`, CPU) may leave it empty."""
    gpu = (samples["timer"] == TIMER_GPU).to_numpy()
    for column in CLOCK_COLUMNS:
        if column not in samples.columns:
            continue
        v = pd.to_numeric(samples[column], errors="coerce").to_numpy(dtype=float)
        given = ~np.isnan(v)
        if column == "sm_clock_mhz":
            bad = (gpu & ~given) | (given & ~(np.isfinite(v) & (v > 0)))
        else:
            bad = (gpu & ~given) | (given & ~(np.isfinite(v) & (v >= 0) & (v == np.round(v))))
        if bad.any():
            raise UserError(f"corrupt results file {folder / 'samples.parquet'}: {int(bad.sum())} of {len(v)} "
                            f"{column} values are missing, not finite or out of range")


def _check_status(status_path: Path, status: dict, name: str) -> bool:
    """A unit's status record is sound and names unit `name`; True if it was timed (ok)."""
    if status["status"] not in STATUSES:
        raise UserError(f"corrupt results file {status_path}: unknown status {status['status']!r}")
    key, backend = status.get("point_key"), status.get("backend")
    if not isinstance(key, str) or not isinstance(backend, str) or unit_id(key, backend) != name:
        raise UserError(f"corrupt results file {status_path}: its point and backend are not the ones its folder "
                        "is named after")
    return status["status"] == STATUS_OK


def read_unit(folder: Path, samples_kept: bool = True, sealed: bool = True
              ) -> tuple[dict, pd.DataFrame | None, pd.DataFrame | None]:
    """(status, stats, samples) of one finished unit folder; UserError (one line) when it is damaged or
    changed since it was written (its content checked first, so the most telling reason is named).
    samples_kept False (the run says its raw samples were removed): no samples read or required.
    sealed False: a unit never sealed is accepted (seal_run)."""
    status_path = folder / "status.json"
    if not status_path.is_file():
        raise UserError(f"corrupt results file {status_path}: missing")
    status = _read_json_object(status_path, "status", STATUS_FIELD)
    timed = _check_status(status_path, status, folder.name)
    if not timed:
        kept = [name for name in ("stats.parquet", "samples.parquet") if (folder / name).exists()]
        if kept:
            raise UserError(f"corrupt results file {status_path}: status {status['status']!r} but the unit keeps "
                            f"{' and '.join(kept)} (a unit that did not pass keeps no timings)")
    stats = _read_table(folder / "stats.parquet", STAT_COLUMNS, required=timed)
    samples = _read_table(folder / "samples.parquet", SAMPLE_COLUMNS, required=timed) if samples_kept else None
    if timed:
        _check_timed(folder, status, stats, samples)
        _check_passed(status_path, status)
    _check_seal(folder, unit_change(folder, samples_kept), sealed, "the unit was written")
    return status, stats, samples


def _packed_records(run_dir: Path) -> dict[str, dict]:
    """{unit: record} of a packed run's file; UserError (one line) when it cannot be read."""
    import gzip
    path = run_dir / PACKED_FILE
    out = {}
    try:
        with gzip.open(path, "rt") as f:
            for i, line in enumerate(f, 1):
                rec = json.loads(line)
                if not isinstance(rec, dict) or not isinstance(rec.get("unit"), str) \
                        or not isinstance(rec.get("status"), dict) or "status" not in rec["status"]:
                    raise UserError(f"corrupt results file {path}: line {i} is no unit record")
                out[rec["unit"]] = rec
    except (OSError, EOFError, ValueError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"corrupt results file {path}: {why}") from None
    return out


def _packed_unit(run_dir: Path, rec: dict, sealed: bool = True) -> tuple[dict, pd.DataFrame | None]:
    """(status, stats) of one packed unit record, with read_unit's checks."""
    where = run_dir / PACKED_FILE / rec["unit"]
    status = rec["status"]
    timed = _check_status(where / "status.json", status, rec["unit"])
    rows = rec.get("stats")
    if not timed and rows:
        raise UserError(f"corrupt results file {where}: status {status['status']!r} but the unit keeps stats "
                        "(a unit that did not pass keeps no timings)")
    stats = None
    if timed:
        stats = pd.DataFrame(rows or [])
        lacking = [c for c in STAT_COLUMNS if c not in stats.columns]
        if stats.empty or lacking:
            raise UserError(f"corrupt results file {where}: "
                            + (f"no column {', '.join(lacking)}" if lacking else "no stats (the unit says it was timed)"))
        _check_timed(where, status, stats, None)
        _check_passed(where / "status.json", status)
    _check_seal(where, record_change(rec), sealed, "it was packed")
    return status, stats


def pack_run(run_dir: str | Path) -> int:
    """Pack a checked run whose raw samples were removed: its unit folders into PACKED_FILE (module
    docstring), units/ removed, run.json saying so. Returns the units packed."""
    run_dir = Path(run_dir)
    if is_packed(run_dir):
        raise UserError(f"{run_dir} is packed already")
    run = load_run(run_dir)                       # every unit checked before anything is written
    if samples_kept(run.meta):
        raise UserError(f"{run_dir} keeps raw timing samples: pack takes runs whose samples were removed "
                        f"(run.json {SAMPLES_REMOVED}), which compare and merge refuse anyway")
    units = run_dir / UNITS_DIR
    records = {uid: _unit_record(units / uid, uid) for uid in finished_units(run_dir)}
    _write_packed(run_dir, records, dict(run.meta))
    shutil.rmtree(units)
    return len(records)


def _unit_record(folder: Path, uid: str) -> dict:
    status, stats, _ = read_unit(folder, samples_kept=False)
    return {"unit": uid, "status": status, "stats": None if stats is None else stats.to_dict("records")}


def _write_packed(run_dir: Path, records: dict, meta: dict) -> None:
    """PACKED_FILE of `records`, then run.json (`meta`) saying so."""
    import gzip
    # sealed as JSON values, as a reader sees them (a record read back is not resealed: its seal is replaced)
    lines = [json.dumps(sealed_record(json.loads(json.dumps(records[uid], default=_json_default))), sort_keys=True)
             for uid in sorted(records)]
    tmp = run_dir / f".tmp-{PACKED_FILE}"
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:   # same bytes for same units
        f.write(("\n".join(lines) + "\n").encode())
    os.rename(tmp, run_dir / PACKED_FILE)
    meta["packed"] = f"{len(records)} units in {PACKED_FILE} (read-only: no resume, no merge)"
    write_meta(run_dir, meta)


def update_packed(run_dir: str | Path, newer_dir: str | Path) -> int:
    """Put the units of `newer_dir` (a sweep of the same scenario on the same GPU, usually with --backend:
    some backends re-run after a change, or a backend the scenario now lists) in place of a packed run's
    copies, as merge --force does for whole runs. Every newer unit must be one of the packed run's planned
    units or a new backend's at one of its points; run.json lists each update (its commit, backends and
    units). Returns the units replaced or added."""
    run_dir, newer_dir = Path(run_dir), Path(newer_dir)
    if not is_packed(run_dir):
        raise UserError(f"{run_dir} is not packed: merge --force NEWER {run_dir} joins whole runs")
    run, newer = load_run(run_dir), load_run(newer_dir)       # both checked before anything is written
    meta, new_meta = run.meta, newer.meta
    if new_meta.get("scenario") != meta.get("scenario"):
        raise UserError(f"{newer_dir} has scenario {new_meta.get('scenario')!r}, {run_dir} {meta.get('scenario')!r}")
    why = measured_apart(new_meta, meta)
    if why:
        raise UserError(f"{newer_dir} and {run_dir} were measured apart: {why}")
    records = _packed_records(run_dir)
    planned = set(meta.get("units_planned") or meta.get("grid_units") or []) | set(records)
    uids = sorted(finished_units(newer_dir))
    points = {r["status"].get("point_key") for r in records.values()}
    new = {uid: _unit_record(newer_dir / UNITS_DIR / uid, uid) for uid in uids}
    stray = [u for u, r in new.items() if u not in planned and r["status"].get("point_key") not in points]
    if stray:
        raise UserError(f"{len(stray)} unit(s) of {newer_dir} are no point of {run_dir} (e.g. {stray[0]}): "
                        "the same scenario's grid is needed")
    records.update(new)
    prov = new_meta.get("provenance") or {}
    meta = dict(meta)
    meta["updated_from"] = [*meta.get("updated_from", []),
                            {"commit": prov.get("git_commit"), "dirty": prov.get("git_dirty"),
                             "finished_utc": new_meta.get("finished_utc"), "backends": new_meta.get("backends"),
                             "units": len(uids)}]
    meta["backends"] = list(dict.fromkeys([*(meta.get("backends") or []),
                                           *(r["status"].get("backend") for r in new.values())]))
    _write_packed(run_dir, records, meta)
    return len(uids)


def samples_kept(meta: dict) -> bool:
    """False for a committed run whose raw samples.parquet were removed to keep results/ small; its
    run.json says so under SAMPLES_REMOVED (where they are), and its stats.parquet keeps their statistics."""
    return not meta.get(SAMPLES_REMOVED)


def _check_passed(path: Path, status: dict) -> None:
    """An ok unit's own check: a finite, non-negative error within the tolerance of its dtype. The
    tolerance follows from the dtype (check.tolerance); the recorded tol must be that one, never a
    number the file judges itself by."""
    from ..measure.check import TOLERANCE
    for field in ("max_rel_err", "tol"):
        if field not in status:
            raise UserError(f"corrupt results file {path}: status 'ok' but no field {field!r} (an ok unit "
                            "records its error against the reference and the tolerance it passed)")
    err, tol, dtype = status.get("max_rel_err"), status.get("tol"), status.get("dtype")
    if dtype not in TOLERANCE:
        raise UserError(f"corrupt results file {path}: dtype {dtype!r} is none of {', '.join(TOLERANCE)}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (err, tol)):
        raise UserError(f"corrupt results file {path}: status 'ok' without a finite max_rel_err and tol "
                        f"({err!r}, {tol!r})")
    if tol != TOLERANCE[dtype]:
        raise UserError(f"corrupt results file {path}: tol {tol:g} is not the {dtype} tolerance {TOLERANCE[dtype]:g}")
    if not 0 <= err <= tol:
        raise UserError(f"corrupt results file {path}: status 'ok' but max_rel_err {err:.3g} is "
                        + ("negative" if err < 0 else f"over the {dtype} tolerance {tol:g}"))


def damaged_units(run_dir: str | Path) -> dict[str, str]:
    """Finished units whose files cannot be trusted: unit id -> why (one line)."""
    units = Path(run_dir) / UNITS_DIR
    kept = samples_kept(read_meta(run_dir))
    out = {}
    for uid in sorted(finished_units(run_dir)):
        try:
            read_unit(units / uid, kept)
        except UnreadableFile:
            raise
        except UserError as exc:
            out[uid] = str(exc)
    return out


def set_aside(run_dir: str | Path, uid: str) -> Path:
    """Move a damaged unit folder to units/.damaged-<uid> (kept for inspection, no longer a unit)."""
    units = Path(run_dir) / UNITS_DIR
    dest = units / f".damaged-{uid}"
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(units / uid, dest)
    return dest


def _named(items: list[str], limit: int = 4) -> str:
    shown = "; ".join(items[:limit])
    return shown + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def load_run(run_dir: str | Path, sealed: bool = True) -> Run:
    """The whole run as three tables. Raises UserError (one line, naming the units) on a missing,
    corrupt, damaged or edited folder, and on a run that says it is complete but lacks planned units.
    sealed False: parts never sealed are accepted (seal_run); a sealed part must still match its seal."""
    run_dir = Path(run_dir)
    meta = read_meta(run_dir, sealed)
    status_rows, stats, samples, damaged = [], [], [], []
    packed = _packed_records(run_dir) if is_packed(run_dir) else None
    done = set(packed) if packed is not None else finished_units(run_dir)
    kept = samples_kept(meta)
    if packed is not None and kept:
        raise UserError(f"{run_dir} is packed but its run.json does not say where its samples went "
                        f"({SAMPLES_REMOVED}): a packed run keeps none")
    for uid in sorted(done):
        try:
            if packed is not None:
                (status, st), sa = _packed_unit(run_dir, packed[uid], sealed), None
            else:
                status, st, sa = read_unit(run_dir / UNITS_DIR / uid, kept, sealed)
        except UnreadableFile:
            raise
        except UserError as exc:
            damaged.append(str(exc))
            continue
        if not meta.get("merged_from") and status.get("timer", meta.get("timer")) != meta.get("timer"):
            damaged.append(f"corrupt results file {run_dir / UNITS_DIR / uid / 'status.json'}: timer "
                           f"{status.get('timer')!r} in a run timed by {meta.get('timer')!r}")
            continue
        status_rows.append({"unit": uid, **upgrade(status, int(meta.get("schema") or 1))})
        stats += [st] if st is not None and len(st) else []
        samples += [sa] if sa is not None and len(sa) else []
    if damaged:
        raise UserError(f"{run_dir} holds {len(damaged)} damaged unit(s): {_named(damaged)}"
                        + ("; `msa-bench sweep --resume` redoes them" if not meta.get("merged_from") else ""))
    _check_backends(run_dir / RUN_FILE, meta, (r["backend"] for r in status_rows), "its units")
    missing = sorted(set(meta.get("units_planned") or []) - done)
    if missing and meta.get("complete"):
        raise UserError(f"{run_dir} says it is complete but {len(missing)} planned unit folder(s) are missing: "
                        f"{_named(missing)}")
    status_df = pd.DataFrame(status_rows)
    stats_df = pd.concat(stats, ignore_index=True) if stats else pd.DataFrame(columns=STAT_COLUMNS)
    samples_df = pd.concat(samples, ignore_index=True) if samples else pd.DataFrame(columns=SAMPLE_COLUMNS)
    return Run(run_dir, meta, status_df, stats_df, samples_df, missing)


def seal_run(run_dir: str | Path) -> int:
    """Seal a run written before integrity records (seal.py): its content is checked as load_run checks
    it, then each part without a seal gets one. A part sealed already must match its seal: an edit is
    refused, never resealed. Returns the parts sealed (0: the run was sealed already)."""
    run_dir = Path(run_dir)
    run = load_run(run_dir, sealed=False)
    if is_packed(run_dir):
        records = _packed_records(run_dir)
        parts = sum(SEAL_FIELD not in r for r in records.values()) + (SEAL_FIELD not in run.meta)
        if parts:
            _write_packed(run_dir, records, dict(run.meta))
    else:
        folders = [run_dir / UNITS_DIR / uid for uid in sorted(finished_units(run_dir))]
        unsealed = [f for f in folders if not (f / SEAL_FILE).is_file()]
        for folder in unsealed:
            seal_unit(folder)
        parts = len(unsealed) + (SEAL_FIELD not in run.meta)
        if SEAL_FIELD not in run.meta:
            write_meta(run_dir, run.meta)
    load_run(run_dir)
    return parts


def measured_apart(a: dict, b: dict) -> str | None:
    """Why two runs' timings (their run.json) cannot sit in one run: another GPU, timer or L2 flush."""
    dev = lambda m: (m.get("provenance") or {}).get("device_name")          # noqa: E731
    for what, x, y in (("GPU", dev(a), dev(b)), ("timer", a.get("timer"), b.get("timer")),
                       ("L2 flush", l2_flush_of(a), l2_flush_of(b))):
        if x != y:
            return f"{what} {x!r} against {y!r}"
    return None


def merge_runs(out_dir: str | Path, shard_dirs: list[str | Path], force: bool = False) -> dict:
    """Join shard run folders into `out_dir`. Refuses shards of different scenarios/grids or devices
    unless `force`. Returns a summary dict (units copied, duplicates, missing)."""
    if not shard_dirs:
        raise UserError("merge needs at least one shard folder")
    out_dir = Path(out_dir)
    metas = [read_meta(d) for d in shard_dirs]
    for d, m in zip(shard_dirs, metas):
        if not samples_kept(m):
            raise UserError(f"{d} keeps no raw timing samples ({m[SAMPLES_REMOVED]}): merge needs whole runs")
    first = metas[0]
    for d, m in zip(shard_dirs[1:], metas[1:]):
        for key, what in (("grid_sha256", "scenario grid"), ("scenario", "scenario")):
            if m.get(key) != first.get(key) and not force:
                raise UserError(f"{d} is from a different {what} than {shard_dirs[0]} "
                                f"({m.get(key)} vs {first.get(key)}); pass --force to merge anyway")
        why = measured_apart(m, first)
        if why and not force:
            raise UserError(f"{d} and {shard_dirs[0]} were measured apart: {why}; pass --force to merge anyway")
    require_empty(out_dir, "merge output")
    runs = [load_run(d) for d in shard_dirs]    # validates every unit of every shard before anything is copied
    source, duplicates = {}, []                  # unit -> the shard its copy comes from
    for d in shard_dirs:
        for uid in sorted(finished_units(d)):
            if uid in source:
                duplicates.append((uid, source[uid], str(d)))
            else:
                source[uid] = str(d)
    if duplicates and not force:
        uid, a, b = duplicates[0]
        raise UserError(f"{len(duplicates)} unit(s) are in more than one folder (e.g. {uid} in {a} and {b}); "
                        "the shards of one sweep never overlap: pass --force to keep the first folder's copy")
    for uid, d in source.items():
        dest = out_dir / UNITS_DIR / uid
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(Path(d) / UNITS_DIR / uid, dest)
    copied = set(source)
    planned = set()
    for m in metas:
        planned.update(m.get("grid_units") or m.get("units_planned") or [])
    merged = {k: v for k, v in first.items() if k not in ("shard", "units_planned", "complete")}
    merged.update(shard=None, units_planned=sorted(planned) if planned else sorted(copied),
                  backends=list(dict.fromkeys(b for m in metas for b in m.get("backends") or [])),
                  merged_from=[str(r.path) for r in runs],
                  shard_provenance=[m.get("provenance") for m in metas],
                  duplicates_kept_from_first=[uid for uid, _, _ in duplicates],
                  complete=bool(planned) and planned <= copied)
    write_meta(out_dir, merged)
    return {"units": len(copied), "duplicates": duplicates, "missing": sorted(planned - copied)}
