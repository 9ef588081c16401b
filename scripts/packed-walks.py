"""The packed schedules' walks per scenario point (GPU: the schedule stage runs there): per tile size, the
union ratio, the mean walk of a tile's groups (each consumer warpgroup's slots, its tokens' rows) and the
critical walk (each tile at its longest group walk, cute_backend.critical_ratio), and the plan's own
tiles. One JSON line per point; the model's critical walk was validated with them (docs/perf-log.md).

    python scripts/packed-walks.py OUT.jsonl SCENARIO [SCENARIO ...]
"""
from __future__ import annotations

import json
import sys


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    import torch
    from msa_bench.errors import UserError
    from msa_bench.kernels.base import get_backend
    from msa_bench.kernels.q_packed.cute_backend import QPackedCuteBackend, critical_ratio, one_token_tiles
    from msa_bench.kernels.q_packed.schedule import PackedSchedule
    from msa_bench.scenarios.grid import load_scenario, make_workload
    if not torch.cuda.is_available():
        print("error: packed-walks runs the schedule stage on a CUDA GPU", file=sys.stderr)
        return 2
    cute = get_backend(QPackedCuteBackend.name)
    with open(args[0], "w") as out:
        for name in args[1:]:
            try:
                points = load_scenario(name).points
            except UserError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            for p in points:
                w = make_workload(p, "cuda", with_tensors=p.generator == "indexer")
                if w.n_tokens == 0 or one_token_tiles(w):
                    continue
                selected = float((w.selection >= 0).sum())
                plan, _, _, _ = cute.layout(w)
                row = dict(scenario=name, key=p.key(), dtype=p.dtype, plan_tokens=plan.P)
                for tokens in (8, 12):
                    sch = PackedSchedule(w, tokens)
                    sch()
                    slots = torch.stack(sch.group_slots())
                    row[f"p{tokens}"] = dict(union=float(sch.tile_count.double().sum()) * tokens / selected,
                                             mean=float(slots.sum()) * cute.mma_tokens / selected,
                                             critical=critical_ratio(sch, selected))
                out.write(json.dumps(row) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
