"""Out-of-sample check of `auto` and of the model, on committed run folders (CPU, a few seconds each).

The device profile's achieved fractions were fitted on results/h200/co-selection; every other run is out of
sample. Per run: `auto` as measured against the fastest backend per point; today's model's pick replayed
over the backends measured at each point (ratio pick / fastest); and the fraction of units whose predicted
module time (roofline / achieved + fixed costs) is within 25 % of the measured one.

    python scripts/auto-validation.py results/h200/*/ [--device h200|PROFILE.json] [--fit-fixed RUN ...]
                                      [--write-profile PATH]

--fit-fixed fits the fixed costs on the named runs instead (the calibration's rule, roofline time as x,
each stage's and the module's median as y; the GPU's own `msa-bench calibrate` measures them on
small workloads) and checks them on every run: the runs named there are in sample. --write-profile writes
them as a preset's fixed-costs file (roofline/profiles/<gpu>.json, package data). A candidate with no
fitted costs (hybrid: its units have no model time) is named, since `auto` then skips it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from dataclasses import replace

from msa_bench.errors import UserError
from msa_bench.harness import tables
from msa_bench.harness.fixed_costs import fit_series
from msa_bench.harness.results import load_run
from msa_bench.kernels.auto import candidate_names
from msa_bench.roofline.devices import load_device

FITTED_ON = "co-selection"


def series_of(runs) -> dict:
    """fit_series' input from measured units: (roofline s, {stage: median s}) per backend and dtype."""
    out = {}
    for run in runs:
        t = tables.ok_units(run)
        if "module.model_time_s" not in t:
            continue
        for _, r in t[t["module.model_time_s"].notna()].iterrows():
            medians = {s: r[f"{s}.median_s"] for s in (*tables.STAGE_ORDER, "gather", "output", "module")
                       if f"{s}.median_s" in r and r[f"{s}.median_s"] == r[f"{s}.median_s"]}
            out.setdefault((r["backend"], r["dtype"]), []).append((r["module.model_time_s"], medians, {}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run folders (msa-bench sweep --out)")
    ap.add_argument("--device", default="h200", help="device profile: a preset name or PROFILE.json (default h200)")
    ap.add_argument("--within", type=float, default=0.05, help="auto's target, a fraction of the fastest (0.05)")
    ap.add_argument("--fit-fixed", nargs="+", default=[], metavar="RUN",
                    help="fit the fixed costs on these runs (in sample) instead of the profile's")
    ap.add_argument("--write-profile", default="", metavar="PATH",
                    help="write the fitted fixed costs to PATH as a preset's fixed-costs JSON (needs --fit-fixed)")
    args = ap.parse_args(argv)
    if args.write_profile and not args.fit_fixed:
        print("--write-profile writes fitted fixed costs: name the runs to fit with --fit-fixed", file=sys.stderr)
        return 2
    dev = load_device(args.device)
    if args.fit_fixed:
        try:
            fitted = fit_series(series_of([load_run(p) for p in args.fit_fixed]))
        except UserError as exc:
            print(f"--fit-fixed: {exc}", file=sys.stderr)
            return 2
        dev = replace(dev, fixed_costs={"stages": fitted})
        print(f"fixed costs fitted on {', '.join(args.fit_fixed)}: " + ", ".join(
            f"{k} {v['s'] * 1e6:.0f} us" for k, v in sorted(fitted.items())
            if k.split("/")[0] in ("kv-outer-cute", "q-packed-cute", "flashinfer", "hybrid")))
        fitted_backends = {k.split("/")[0] for k in fitted}
        print("no fixed costs fitted for (auto skips them): "
              + (", ".join(sorted(set(candidate_names()) - fitted_backends)) or "none"))
        if args.write_profile:
            source = (f"fitted by scripts/auto-validation.py --fit-fixed on {', '.join(args.fit_fixed)}, "
                      f"date {time.strftime('%Y-%m-%d')}")
            with open(args.write_profile, "w") as f:
                json.dump({"source": source, "fixed_costs": {"stages": fitted}}, f, indent=1, sort_keys=True)
            print(f"wrote {args.write_profile} ({len(fitted)} stages)")
    print(f"{'run':<28} {'pts':>4} {'auto<=5%':>8} {'worst':>6} | {'pick<=5%':>8} {'worst':>6} | "
          f"{'fid<=25%':>8} {'units':>5}")
    for path in args.runs:
        try:
            run = load_run(path)
        except UserError as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            return 2
        name = path.rstrip("/").split("/")[-1] + (" (fit)" if path.rstrip("/").endswith(FITTED_ON) else "")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
