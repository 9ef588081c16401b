"""Refit a profile's prefill achieved fractions on committed run folders: a thin wrapper of the fit that
`msa-bench calibrate` ends with (harness.calibration.calibrate.fit_prefill over harness.calibration.fit.fit_achieved).

`msa-bench calibrate` fits them on its own prefill sweep; this wrapper fits the same rule on runs already
made, for a profile whose ceilings or fixed costs changed and whose GPU is not at hand (the H200's, whose
ceilings moved to its measured read stream). Per backend and dtype: the median over the run's selection
generators of the median over each one's prefill units of roofline / (measured module time less the
profile's fixed costs of the stages the unit ran), at the profile's ceilings. The fitted runs are recorded under the profile's "fitted" (points, commit, date),
and scripts/auto-validation.py leaves those points out.

    python scripts/fit-achieved.py RUN [--profile results/h200/calibration/profile.json] [--backend B] [--write]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from msa_bench.errors import UserError
from msa_bench.harness.calibration.calibrate import fit_prefill, merge_fitted
from msa_bench.harness.store.results import load_run
from msa_bench.roofline.devices import load_device

DEFAULT_PROFILE = "results/h200/calibration/profile.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="the run folder to fit on (msa-bench sweep --out)")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help=f"the profile JSON whose fractions are refit "
                    f"(default {DEFAULT_PROFILE})")
    ap.add_argument("--backend", help="fit only these backends' fractions (comma-separated; BASE@OPTION that "
                    "option's alone), keeping the others")
    ap.add_argument("--write", action="store_true", help="write them into the profile")
    args = ap.parse_args(argv)
    try:
        run = load_run(args.run)
        device = load_device(args.profile)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    only = [b.strip() for b in args.backend.split(",")] if args.backend else None
    fit = fit_prefill(run, device, device.achieved, only)
    if not fit["fractions"]:
        print(f"error: {args.run} has no prefill unit the model predicts" + (f" of {args.backend}" if only else ""),
              file=sys.stderr)
        return 2
    for key, e in sorted(fit["fractions"].items()):
        old = device.achieved.get(key)
        print(f"{key:<28} {e['value']:.4f} ({e['units']} units, {e['min']:.3f}-{e['max']:.3f})"
              + (f", was {old:.4f}" if old is not None else ""))
    if args.write:
        path = Path(args.profile)
        data = json.loads(path.read_text())
        points = sorted(set(run.status["point_key"])) if not run.status.empty else []
        data["achieved"] = fit["achieved"]
        data["fitted"] = merge_fitted(data.get("fitted") or {}, fit, str(run.meta.get("scenario")), points)
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {len(fit['fractions'])} fitted fractions into {path} ({len(data['achieved'])} in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
