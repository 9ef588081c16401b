"""The gate's false-regression rate and power on the runs of scripts/gate-protocol.sh.

    python3 scripts/gate-power.py OUTROOT --baseline-runs K [--threshold 5%] [--out FILE.md]

OUTROOT/run-01.. (sorted): runs 1..K are the baseline set, each later run is judged against it with
every --clock mode (msa_bench.harness.gate.gate_power). Prints one table per mode and writes them as
markdown (default OUTROOT/gate-power.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from msa_bench.errors import UserError
from msa_bench.harness.gate.compare import parse_threshold
from msa_bench.harness.gate.gate_power import gate_power, power_table
from msa_bench.harness.store.results import RUN_FILE, load_run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outroot", type=Path, help="folder holding run-01, run-02, ... (gate-protocol.sh)")
    ap.add_argument("--baseline-runs", type=int, required=True, help="K: runs 1..K form the baseline set")
    ap.add_argument("--threshold", default="5%", help="regression threshold (default 5%%)")
    ap.add_argument("--out", type=Path, help="markdown file to write (default OUTROOT/gate-power.md)")
    args = ap.parse_args(argv)
    try:
        folders = sorted(d for d in args.outroot.glob("run-*") if (d / RUN_FILE).is_file())
        if not folders:
            raise UserError(f"no run-* folders with a {RUN_FILE} under {args.outroot}")
        runs = [load_run(d) for d in folders]
        result = gate_power(runs, args.baseline_runs, parse_threshold(args.threshold))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = (f"## Gate power: {len(runs)} runs under {args.outroot}, baseline runs 1..{args.baseline_runs}, "
            f"threshold {args.threshold}\n\n" + "\n".join(power_table(m, p) for m, p in result.items()))
    print(text)
    out = args.out or args.outroot / "gate-power.md"
    out.write_text(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
