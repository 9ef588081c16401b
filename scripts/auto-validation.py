"""Out-of-sample check of `auto` and of the model, on committed run folders (CPU, a few seconds each).

The points a profile's prefill fractions were fitted on (its "fitted" record: `msa-bench calibrate`'s own
sweep, or the runs scripts/fit-achieved.py fitted) are left out of every number; a run that holds some says
how many ("fit: k"). Its fixed costs, decode fractions and item times were measured by `msa-bench
calibrate` on synthetic decode batches and single requests, so every run is out of sample for those.
Per run: `auto` as measured against
the fastest backend per point; today's model's pick replayed over the backends measured at each point
(ratio pick / fastest); and the fraction of units whose predicted module time (roofline.model.module_time)
is within 25 % of the measured one.

    python scripts/auto-validation.py results/h200/*/ [--device h200|PROFILE.json] [--within 0.05]
    (--device: default the profile the first run recorded, else its GPU's; roofline.devices.run_profile)
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from msa_bench.errors import UserError
from msa_bench.harness.calibration.calibrate import fitted_points
from msa_bench.harness.report import tables
from msa_bench.harness.store.results import load_run
from msa_bench.roofline.devices import load_device, run_profile


def out_of_sample(run, fitted: set):
    """The run without the units of the points the profile was fitted on, and how many points those were."""
    if not fitted or run.status.empty:
        return run, 0
    drop = set(run.status["point_key"]) & fitted
    keep = lambda t: t[~t["point_key"].isin(drop)] if "point_key" in t else t   # noqa: E731
    return replace(run, status=keep(run.status), stats=keep(run.stats), samples=keep(run.samples)), len(drop)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run folders (msa-bench sweep --out)")
    ap.add_argument("--device", help="device profile: a preset name or PROFILE.json (default: the profile the first "
                    "run recorded, else its GPU's calibration or preset)")
    ap.add_argument("--within", type=float, default=0.05, help="auto's target, a fraction of the fastest (0.05)")
    args = ap.parse_args(argv)
    try:
        if args.device:
            dev = load_device(args.device)
        else:
            dev = run_profile(load_run(args.runs[0]).meta).profile or load_device("h200")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fitted = fitted_points(dev)
    print(f"{'run':<28} {'pts':>4} {'auto<=5%':>8} {'worst':>6} | {'pick<=5%':>8} {'worst':>6} | "
          f"{'fid<=25%':>8} {'units':>5}")
    total = dict(points=0, auto_within=0, within=0, units=0, worst=0.0)
    for path in args.runs:
        try:
            run = load_run(path)
        except UserError as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            return 2
        run, dropped = out_of_sample(run, fitted)
        name = path.rstrip("/").split("/")[-1] + (f" (fit: {dropped})" if dropped else "")
        av = tables.auto_summary(tables.auto_vs_fastest(run), args.within)
        mp = tables.model_pick_table(run, dev)
        fid = tables.fidelity_table(run, dev)
        within = fid.filter(like="within").sum(axis=1).sum() if not fid.empty else 0
        units = int(fid["units"].sum()) if not fid.empty else 0
        r = mp["pick/fastest"] if not mp.empty else None
        print(f"{name:<28} {av.get('points', 0):>4} "
              f"{(format(av['share_within'], '.0%') if av else '-'):>8} {(format(av['worst'], '.3f') if av else '-'):>6} | "
              f"{(format(float((r <= 1 + args.within).mean()), '.0%') if r is not None else '-'):>8} "
              f"{(format(float(r.max()), '.3f') if r is not None else '-'):>6} | "
              f"{(format(within / units, '.0%') if units else '-'):>8} {units:>5}")
        if av:
            total["points"] += av["points"]
            total["auto_within"] += av["count_within"]
            total["worst"] = max(total["worst"], av["worst"])
        total["within"] += int(within)
        total["units"] += units
    if len(args.runs) > 1:
        print(f"all: auto within {args.within:.0%} at {total['auto_within']} of {total['points']} points (worst "
              f"{total['worst']:.3f}); model within 25 % at {total['within']} of {total['units']} units"
              + (" (the profile's fitted points left out)" if fitted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
