"""`msa-bench calibrate`: the whole device profile in one pass, and the prefill fit it ends with.

Steps, each announced as it starts ([k/4]):
  1. ceilings (roofline/calibrate.py): HBM as the read stream the kernels run, L2 read plateau, bf16/fp8
     matmul peaks, with the vendor's figures of a matching preset recorded beside them;
  2. the prefill sweep: the built-in scenario FIT_SCENARIO (scenarios/calibrate.toml; --quick:
     calibrate-quick.toml), timed and checked like any sweep (its progress display), into OUT/prefill-fit;
     its points are in no shipped scenario, so what the calibration is validated on stays out of the fit;
  3. fixed costs (harness/fixed_costs.py): launch cost, per-stage fixed costs, decode fractions and the
     one-tile floor;
  4. the fit (fit_prefill): per backend and dtype, the median over the sweep's prefill units of roofline /
     (measured module time less the fixed costs of step 3) at the ceilings of step 1
     (harness.calibration.fit.fit_achieved, the one fit; scripts/fit-achieved.py wraps it).
The profile records what was fitted on what under "fitted" (points, units, run folder, commit, date).

`--backend A,B` (only): the ceilings are kept from the existing profile; those candidates' fixed costs
and fractions are measured again, every other entry kept (merge_fixed_costs, merge_fractions).
A backend in scope that the fit could not measure (unavailable here, every unit failed, fewer than
MIN_UNITS units) keeps the fraction the profile had, named under fitted.prefill.kept; without one it has
none, and `auto` then skips it with that reason (roofline.devices.has_achieved).
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

from ...errors import UserError
from ...kernels.auto import AutoBackend
from ...kernels.q_packed.hybrid import HybridBackend
from ...roofline.names import base_name
from ...roofline.devices import MAX_ACHIEVED, PRESETS, DeviceProfile, load_device, preset_key, profile_from_dict

FIT_SCENARIO, QUICK_SCENARIO = "calibrate", "calibrate-quick"
MIN_UNITS = 1          # a fraction is fitted on at least this many prefill units (flashinfer-packed: its union_ratio 1 points)
FIT_RULE = ("median over the run's selection generators of the median over each one's prefill units of roofline / "
            "(module time less the profile's fixed costs of the stages the unit ran), at the profile's ceilings "
            "(harness.calibration.fit.fit_achieved)")


def _base(key: str) -> str:
    return base_name(key.split("/")[0])


def fit_prefill(run, device: DeviceProfile, old: dict | None = None, only=None, min_units: int = MIN_UNITS) -> dict:
    """The achieved fractions a calibration writes, from the prefill sweep `run` at `device`'s ceilings
    and fixed costs: {"achieved": table, "fractions": {key: what each was fitted on}, "kept": {key: why}}.
    In scope (every backend, or those in `only`): each backend/dtype the run fits on `min_units` units or
    more is fitted; one the run has no fit for keeps `old`'s value (named under "kept"), or has none.
    Out of scope: `old`'s entries as they are."""
    from .fit import fit_achieved
    old = dict(old or {})
    # BASE in `only` takes every fraction of BASE (BASE@OPTION's too); BASE@OPTION that one alone
    mine = (lambda key: True) if not only else (lambda key: key.split("/")[0] in set(only) or _base(key) in set(only))  # noqa: E731
    table = fit_achieved(run, replace(device, achieved={}))
    prov = run.meta.get("provenance") or {}
    where = {"run": str(run.path), "commit": prov.get("git_commit"), "date": prov.get("time_utc")}
    fitted, fractions, short = {}, {}, {}
    for r in table.itertuples():
        key = f"{r.backend}/{r.dtype}"
        if not mine(key):
            continue
        value = float(r.achieved)
        if int(r.units) < min_units or not 0 < value <= MAX_ACHIEVED:
            short[key] = (f"{int(r.units)} prefill unit(s), {min_units} needed" if int(r.units) < min_units
                          else f"median {value:.3g} outside (0, {MAX_ACHIEVED:g}]")
            continue
        fitted[key] = round(value, 4)
        fractions[key] = {"value": fitted[key], "units": int(r.units), "min": round(float(r.min), 4),
                          "max": round(float(r.max), 4), **where}
    why = _unfitted_reasons(run)
    listed = run.meta.get("backends") or []
    # auto and the hybrid have no fraction of their own; an option beside its base (q-packed-cute@p8) fits
    # under the base's names
    planned = {f"{b}/{d}" for b in listed for d in _dtypes(run)
               if b not in (AutoBackend.name, HybridBackend.name) and not (b != base_name(b) and base_name(b) in listed)}
    kept = {}
    for key in sorted(({k for k in old if mine(k)} | {k for k in planned if mine(k)} | set(short)) - set(fitted)):
        reason = short.get(key) or why.get(_base(key)) or "no prefill unit of it in the fit's run"
        kept[key] = {"value": old.get(key), "why": reason}
    achieved = {**{k: v for k, v in old.items() if not mine(k) or k in kept}, **fitted}
    return {"achieved": achieved, "fractions": fractions, "kept": kept}


def _dtypes(run) -> list[str]:
    st = run.status
    return sorted(set(st["dtype"])) if not st.empty and "dtype" in st else []


def _unfitted_reasons(run) -> dict:
    """{backend: the first reason a unit of it did not run}, for backends with no ok unit in the run."""
    st = run.status
    if st.empty:
        return {}
    out = {}
    for backend, g in st.groupby("backend"):
        if not (g["status"] == "ok").any():
            reasons = [r for r in g.get("reason", []) if isinstance(r, str) and r]
            out[backend] = f"{g['status'].iloc[0]}: {reasons[0]}" if reasons else str(g["status"].iloc[0])
    return out


def merge_fitted(old: dict, fit: dict, scenario: str, points: list[str]) -> dict:
    """The profile's "fitted" record after a fit: each fraction's own entry (fitted or kept), the
    scenario and points of every run behind them."""
    prefill = dict((old or {}).get("prefill") or {})
    fractions = {**(prefill.get("fractions") or {}), **fit["fractions"]}
    for key, e in fit["kept"].items():
        if e["value"] is None:
            fractions.pop(key, None)
        else:
            fractions[key] = {**(fractions.get(key) or {}), "kept": e["why"]}
    runs = {**(prefill.get("runs") or {})}
    for e in fit["fractions"].values():
        runs[e["run"]] = {"scenario": scenario, "points": points, "commit": e["commit"], "date": e["date"]}
    missing = {k: e["why"] for k, e in fit["kept"].items() if e["value"] is None}
    return {**(old or {}), "prefill": {"rule": FIT_RULE, "min_units": MIN_UNITS, "fractions": fractions,
                                       "runs": runs, **({"missing": missing} if missing else {})}}


def fitted_points(profile: DeviceProfile) -> set[str]:
    """Every point key the profile's prefill fractions were fitted on (out-of-sample checks leave them out)."""
    runs = ((profile.fitted or {}).get("prefill") or {}).get("runs") or {}
    return {p for r in runs.values() for p in r.get("points") or []}


def _step(log, k: int, what: str) -> float:
    log(f"[{k}/4] {what}")
    return time.perf_counter()


def calibrate_profile(out_dir: Path, quick: bool = False, name: str | None = None, only=None, log=print,
                      sweep_console=None) -> dict:
    """Measure and fit the whole profile into out_dir/profile.json (module docstring). Returns
    {"path", "profile", "seconds", "steps": {step: seconds}, "fit": fit_prefill's dict}."""
    from ...errors import require_cuda
    from .ceilings import calibrate as measure_ceilings, write_profile
    from .fixed_costs import calibrate_fixed_costs
    require_cuda("msa-bench calibrate")
    import torch
    t0 = time.perf_counter()
    path = out_dir / "profile.json"
    steps = {}
    old = json.loads(path.read_text()) if path.is_file() else {}
    if only:
        if not old:
            raise UserError(f"--backend re-measures some candidates into an existing profile and {path} does not "
                            "exist; run `msa-bench calibrate` first or pass --out")
        load_device(str(path))             # a damaged profile is refused before anything runs
        data = dict(old)
        log(f"[1/4] ceilings kept from {path}")
    else:
        t = _step(log, 1, "ceilings: HBM read stream, L2 read plateau, matmul peaks")
        measure_ceilings(out_dir, quick=quick, name=name, log=log)
        data = json.loads(path.read_text())
        key = preset_key(torch.cuda.get_device_name())
        if key:
            data["vendor"] = PRESETS[key].vendor
        # entries the new calibration does not measure (a candidate skipped) are kept from the old one, named
        data["fixed_costs"], data["achieved"] = old.get("fixed_costs") or {}, old.get("achieved") or {}
        data["fitted"] = old.get("fitted") or {}
        steps["ceilings"] = time.perf_counter() - t
    profile = profile_from_dict(data, str(path))

    scenario = QUICK_SCENARIO if quick else FIT_SCENARIO
    t = _step(log, 2, f"prefill sweep: scenario {scenario} into {out_dir / 'prefill-fit'}")
    run_dir = _prefill_sweep(out_dir, scenario, only, sweep_console)
    steps["prefill sweep"] = time.perf_counter() - t

    t = _step(log, 3, "fixed costs: launch, stages, decode fractions, one tile alone")
    fc = calibrate_fixed_costs(profile, log=log, only=only, dtypes=("bf16",) if quick else ("bf16", "fp8"))
    data["fixed_costs"] = fc
    steps["fixed costs"] = time.perf_counter() - t

    t = _step(log, 4, "fit: prefill achieved fractions")
    from ..store.results import load_run
    from ...scenarios.grid import load_scenario
    profile = profile_from_dict(data, str(path))
    fit = {"achieved": data.get("achieved") or {}, "fractions": {}, "kept": {}}
    if run_dir is not None:
        run = load_run(run_dir)
        fit = fit_prefill(run, profile, data.get("achieved") or {}, only)
        points = sorted({p.key() for p in load_scenario(scenario).points})
        data["fitted"] = merge_fitted(data.get("fitted") or {}, fit, scenario, points)
    data["achieved"] = fit["achieved"]
    data["achieved_source"] = (f"msa-bench calibrate: {FIT_RULE}, on {run_dir}" if run_dir is not None
                               else data.get("achieved_source", ""))
    data["source"] = data.get("source", "")
    steps["fit"] = time.perf_counter() - t
    seconds = time.perf_counter() - t0
    data.setdefault("measured", {})["calibrate"] = {"seconds": round(seconds, 1), "steps": {k: round(v, 1) for k, v in steps.items()},
                                                    "quick": quick, "only": list(only) if only else None,
                                                    "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    profile = write_profile(profile_from_dict(data, str(path)), path)
    return {"path": path, "profile": profile, "seconds": seconds, "steps": steps, "fit": fit, "run": run_dir}


def _prefill_sweep(out_dir: Path, scenario: str, only, console) -> Path | None:
    """Run the fit's sweep into out_dir/prefill-fit (a calibration's own folder, replaced each time; with
    --backend, prefill-fit-<backends>); None when no backend in scope has a prefill fraction."""
    from ...scenarios.grid import load_scenario
    from ..running.sweep import SweepRequest, run_sweep
    backends = load_scenario(scenario).backends
    if only:
        backends = [b for b in backends if b in set(only) or base_name(b) in set(only)]
        if not backends:
            return None
    run_dir = out_dir / ("prefill-fit" if not only else "prefill-fit-" + "+".join(backends))
    req = SweepRequest(scenario=scenario, backends=backends if only else None, out=str(run_dir),
                       argv=["msa-bench", "calibrate", f"(prefill sweep: {scenario})"])
    if (run_dir / "run.json").is_file():
        # an interrupted calibration's sweep of the same grid is resumed, anything else replaced
        try:
            run_sweep(replace(req, resume=True), console=console)
            return run_dir
        except UserError:
            shutil.rmtree(run_dir)
    run_sweep(req, console=console)
    return run_dir


__all__ = ["FIT_SCENARIO", "QUICK_SCENARIO", "MIN_UNITS", "fit_prefill", "merge_fitted", "fitted_points",
           "calibrate_profile"]
