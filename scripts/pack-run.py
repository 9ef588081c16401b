"""Pack committed run folders whose raw samples were removed: each run's unit folders into one file
(harness/store/results.py pack_run), read by load_run, report and the replays as before; read-only. With
--from, put a newer sweep's units (the same scenario, some backends re-run) in place of a packed run's
(update_packed).

    python scripts/pack-run.py results/h200/decode [RUN ...]
    python scripts/pack-run.py results/h200/drift --from /tmp/h200/drift
"""
from __future__ import annotations

import sys

from msa_bench.errors import UserError
from msa_bench.harness.store.results import pack_run, update_packed


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    newer = None
    if "--from" in args:
        i = args.index("--from")
        if i + 1 >= len(args):
            print("error: --from needs the newer run folder", file=sys.stderr)
            return 2
        newer, args = args[i + 1], args[:i] + args[i + 2:]
    if not args or any(r.startswith("-") for r in args) or (newer and len(args) != 1):
        print("usage: " + " | ".join(line.strip() for line in __doc__.strip().splitlines()[-2:]), file=sys.stderr)
        return 2
    for run in args:
        try:
            if newer:
                print(f"{run}: {update_packed(run, newer)} units from {newer}")
            else:
                print(f"{run}: {pack_run(run)} units packed")
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
