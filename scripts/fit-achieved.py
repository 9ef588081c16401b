"""Fit a device's achieved fractions on one run folder and write them into its committed calibration.

Per backend and dtype, the median over the run's prefill units of today's roofline / (measured module time
less the profile's fixed costs of the stages the unit ran) (harness.report.tables.fit_achieved; units the model
does not predict left out; a q-packed-cute unit of 12-token tiles counts as `q-packed-cute@p12`, the wide
kernel's own fraction). The H200's are fitted on results/h200/co-selection, after its fixed costs were
measured (`msa-bench calibrate --fixed-costs-only`), the wide kernel's on results/h200/real-prefill (`--backend
q-packed-cute@p12`: co-selection runs none); every other run is out of sample (scripts/auto-validation.py).

    python scripts/fit-achieved.py results/h200/co-selection [--device h200] [--write]
"""
from __future__ import annotations

import argparse
import re
import json
import sys
from dataclasses import replace

from msa_bench.errors import UserError
from msa_bench.harness.store.results import load_run
from msa_bench.harness.report.tables import fit_achieved
from msa_bench.roofline.names import base_name
from msa_bench.roofline.devices import CALIBRATION_FILES, PACKAGE_ROOT, load_device


def _fitted(source: str) -> str | None:
    """The backend one `--backend` entry of achieved_source fitted (None for a whole-run fit)."""
    found = re.search(r"--backend (\S+)", source)
    return found[1] if found else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="the run folder to fit on (msa-bench sweep --out)")
    ap.add_argument("--device", default="h200", help="the preset whose calibration file gets them (default h200)")
    ap.add_argument("--write", action="store_true", help="write them into the preset's calibration file")
    ap.add_argument("--backend", help="fit and write only this backend's fractions, keeping the others "
                    "(a backend the fitting run lacks, e.g. dense-masked from the sparsity run)")
    args = ap.parse_args(argv)
    if args.device not in CALIBRATION_FILES:
        print(f"error: no calibration file for {args.device!r} (have {', '.join(CALIBRATION_FILES)})", file=sys.stderr)
        return 2
    try:
        run = load_run(args.run)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = replace(load_device(args.device), achieved={})      # roofline and fixed costs only
    table = fit_achieved(run, device)
    if args.backend and not table.empty:
        table = table[table["backend"] == args.backend]
    if table.empty:
        print(f"error: {args.run} has no prefill unit the model predicts"
              + (f" of {args.backend}" if args.backend else ""), file=sys.stderr)
        return 2
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if args.write:
        path = PACKAGE_ROOT / CALIBRATION_FILES[args.device]
        data = json.loads(path.read_text())
        fitted = {f"{r.backend}/{r.dtype}": round(float(r.achieved), 4) for r in table.itertuples()}
        # the commits that may have measured the fitted units: the run's and every update's that re-ran a
        # fitted backend (BASE@OPTION: BASE's units; an update's record does not say which units it replaced)
        commits = [(run.meta.get("provenance") or {}).get("git_commit") or "?"]
        bases = {base_name(b) for b in table["backend"]}
        for update in run.meta.get("updated_from") or []:
            if set(update.get("backends") or []) & bases:
                commits.append(update.get("commit") or "?")
        commit = ", ".join(dict.fromkeys(c[:7] for c in commits))
        source = (f"scripts/fit-achieved.py {args.run.rstrip('/')}{f' --backend {args.backend}' if args.backend else ''}"
                  f" (commit{'s' if ',' in commit else ''} {commit})")
        if args.backend:
            kept = {k: v for k, v in (data.get("achieved") or {}).items() if k.split("/")[0] != args.backend}
            data["achieved"] = {**kept, **fitted}
            others = [s for s in str(data.get("achieved_source", "")).split("; ") if s and _fitted(s) != args.backend]
            data["achieved_source"] = "; ".join([*others, source])
        else:
            # a whole-run fit keeps what `--backend` fits of backends this run does not hold wrote (dense-masked's
            # on sparsity, the 12-token tile's on real prefill)
            others = [s for s in str(data.get("achieved_source", "")).split("; ")
                      if s and _fitted(s) and _fitted(s) not in set(table["backend"])]
            lacked = {_fitted(s) for s in others}
            held = data.get("achieved") or {}
            data["achieved"] = {**{k: v for k, v in held.items() if k.split("/")[0] in lacked}, **fitted}
            data["achieved_source"] = "; ".join([*others, source])
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(data['achieved'])} achieved fractions into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
