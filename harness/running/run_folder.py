"""Where a sweep writes: the run folder it opens (new, named, or the latest unfinished one for
--resume), its run.json, and the summary read back from it at the end."""
from __future__ import annotations

import datetime as _dt
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..measure import provenance
from ..store import results
from ...errors import UserError
from .request import Grid, SweepRequest
from ..measure.timing import l2_flush_of, timer_for

CPU_NOTE = ("CPU RUN: timings are host perf_counter timings of the CPU pipeline, NOT GPU timings; "
            "they only show that the pipeline works")
RUNS_ROOT = Path("results") / "runs"                    # default home of run folders (relative to the cwd)


@dataclass
class SweepSummary:
    run_dir: Path
    counts: dict          # status -> number of units, this run folder as a whole
    skipped: int          # finished units found by --resume
    notes: list[str]      # every note of the run (printed when they arose)
    failures: list[tuple[str, str, str]]   # failed units: (point key, backend, reason)
    unavailable: dict = field(default_factory=dict)   # (backend, reason) -> units
    late_notes: list[str] = field(default_factory=list)   # notes that arose after the start


def latest_unfinished(grid: Grid) -> Path:
    """The most recently started unfinished run of this very grid (and shard) under results/runs."""
    found = []
    if RUNS_ROOT.is_dir():
        for d in RUNS_ROOT.iterdir():
            try:
                meta = results.read_meta(d)
            except UserError:
                continue
            if (not meta.get("complete") and meta.get("grid_sha256") == grid.grid_sha
                    and sorted(meta.get("units_planned", [])) == sorted(grid.mine_ids)):
                found.append((str(meta.get("started_utc", "")), d))
    if not found:
        raise UserError(f"nothing to resume: no unfinished run of scenario {grid.scenario.name!r} with these options "
                        f"under {RUNS_ROOT}; pass --out RUN to name one")
    return max(found)[1]


def run_dir_for(req: SweepRequest, grid: Grid) -> Path:
    if req.out:
        return Path(req.out)
    if req.resume:
        return latest_unfinished(grid)
    stamp = f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%d-%H%M%S}"
    shard = f"-shard{grid.shard[0]}of{grid.shard[1]}" if grid.shard else ""
    return RUNS_ROOT / f"{grid.scenario.name}-{stamp}{shard}"


def open_run(run_dir: Path, req: SweepRequest, grid: Grid, device) -> dict:
    """The run's metadata: the existing run's for --resume (same grid, same GPU), else a new one."""
    if (run_dir / results.RUN_FILE).exists():
        if not req.resume:
            raise UserError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --out")
        old = results.read_meta(run_dir)
        if results.is_packed(run_dir):
            raise UserError(f"{run_dir} is a packed run ({results.PACKED_FILE}), read-only: sweep into another --out")
        if old.get("grid_sha256") != grid.grid_sha or sorted(old.get("units_planned", [])) != sorted(grid.mine_ids):
            raise UserError(f"{run_dir} was started with a different grid (scenario, overrides or shard); "
                            "resume it with the same options or choose another --out")
        here = provenance.device_info(device)["device_name"]
        there = (old.get("provenance") or {}).get("device_name")
        if here != there:
            raise UserError(f"{run_dir} was measured on {there!r}; this machine is {here!r}: "
                            "resume it there or choose another --out")
        timer = timer_for(device.type, grid.timing.timer)
        if old.get("timer") != timer:
            raise UserError(f"{run_dir} was timed by {old.get('timer')!r}, this sweep times by {timer!r}: resume it "
                            "with the same --timer or choose another --out")
        flushed, flushes = l2_flush_of(old), l2_flush_of({"timing": asdict(grid.timing)})
        if flushed != flushes:
            raise UserError(f"{run_dir} was timed after the L2 flush {flushed!r}, this version flushes "
                            f"{flushes!r}: sweep into another --out")
        results.clear_partial_units(run_dir)
        return old
    if req.resume:
        raise UserError(f"nothing to resume at {run_dir} (no {results.RUN_FILE})")
    results.require_empty(run_dir, "--out")
    sc = grid.scenario
    return {
        "schema": results.SCHEMA_VERSION,
        "scenario": sc.name,
        "scenario_description": getattr(sc, "description", ""),
        "scenario_source": str(getattr(sc, "source", "") or ""),
        "overrides": grid.overrides,
        "backends": grid.backends,
        "grid_sha256": grid.grid_sha,
        "grid_units": sorted(results.unit_id(p.key(), b) for p, b in grid.every),
        "units_planned": grid.mine_ids,
        "shard": {"index": grid.shard[0], "count": grid.shard[1]} if grid.shard else None,
        "timing": asdict(grid.timing),
        "timer": timer_for(device.type, grid.timing.timer),
        "provenance": provenance.collect(device, sc.name, scenario_file(sc), req.argv or None),
        "started_utc": now(),
        # the selections a trace's points hold are the file's: its digest names them as the scenario's does
        **({"traces": traces} if (traces := {t: provenance.file_sha256(t) for t in
                                             sorted({p.trace for p, _ in grid.every if p.trace})}) else {}),
    }


def set_aside_damaged(run_dir: Path) -> dict[str, str]:
    """Damaged unit folders moved to units/.damaged-<uid>, so their units run again: uid -> why."""
    damaged = results.damaged_units(run_dir)
    for uid in damaged:
        results.set_aside(run_dir, uid)
    return damaged


def close_run(run_dir: Path, meta: dict, grid: Grid, notes: list[str]) -> None:
    """run.json at the end of a sweep, finished or not: its notes, whether every planned unit is in."""
    meta["notes"] = notes
    finished = results.finished_units(run_dir)
    meta["complete"] = all(uid in finished for uid in grid.mine_ids)
    meta["finished_utc" if meta["complete"] else "interrupted_utc"] = now()
    results.write_meta(run_dir, meta)


def summarize(run_dir: Path, skipped: int, notes: list[str], start_notes: int) -> SweepSummary:
    run = results.load_run(run_dir)
    counts = run.status["status"].value_counts().to_dict() if len(run.status) else {}
    failures, unavailable = [], {}
    for r in run.status.itertuples():
        if r.status == results.STATUS_FAILED:
            failures.append((r.point_key, r.backend, r.reason))
        elif r.status == results.STATUS_UNAVAILABLE:
            unavailable[(r.backend, r.reason)] = unavailable.get((r.backend, r.reason), 0) + 1
    return SweepSummary(run_dir, counts, skipped, notes, failures, unavailable, notes[start_notes:])


def scenario_file(scenario) -> str | None:
    """The TOML the scenario came from: a user's file, or the shipped one inside the package."""
    src = getattr(scenario, "source", None)
    if src and Path(str(src)).is_file():
        return str(src)
    shipped = Path(__file__).resolve().parents[1] / "scenarios" / f"{scenario.name}.toml"
    return str(shipped) if shipped.is_file() else None


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
