"""Pack committed run folders whose raw samples were removed: each run's unit folders into one file
(harness/results.py pack_run), read by load_run, report and the replays as before; read-only.

    python scripts/pack-run.py results/h200/decode [RUN ...]
"""
from __future__ import annotations

import sys

from msa_bench.errors import UserError
from msa_bench.harness.results import pack_run


def main(argv=None) -> int:
    runs = sys.argv[1:] if argv is None else argv
    if not runs or any(r.startswith("-") for r in runs):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    for run in runs:
        try:
            print(f"{run}: {pack_run(run)} units packed")
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
