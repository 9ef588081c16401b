"""How accurate would smaller partials be? A CPU emulation for the KV-outer contract question.

    python3 benchmarks/partial_precision.py [--out DIR] [--dtypes bf16,fp8] [--tokens 256]
        [--context 65536] [--reuse 0.25,1] [--seed 3]

The KV-outer stages write one partial per (query, selected block): o (bf16, raw: not divided by l), m
and l (fp32). Those bf16 partials are most of the stage's DRAM traffic, so a contract with 8-bit
partials is one way to a faster stage. This script takes the float64 reference's exact partials of a
study-shaped workload (scenarios/reference.py, Q/K/V drawn as the harness draws them), rounds o to each
candidate format, merges with the reference combine, and prints the relative error of the output
against the exact output, next to the harness tolerance of the data dtype. Only the rounding of the
partials is emulated; a stage's own arithmetic (P cast to the data dtype, fp32 accumulation) adds its
own error on top, which `msa-bench check` measures on the GPU.

Formats (bytes per element of o):
- bf16 raw (2): the current contract;
- e4m3 of o / l (1): normalized partials in fp8, as the MSA-style scatter's epilogue normalizes (l and m
  stay fp32, the combine weights by l);
- e4m3 of o / l, row-scaled (1, plus one fp32 scale per 128-element row): each row divided by its
  absolute maximum / 448 before the cast.

Writes DIR/partial_precision.json and .log (DIR: --out, or results/cpu/partial-precision).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from msa_bench.harness.check import tolerance
from msa_bench.scenarios.reference import combine_partials, reference_partials, relative_error
from msa_bench.scenarios.selection import synthetic_workload
from msa_bench.harness.tee_log import TeeLog as Log
from msa_bench.scenarios.workload import AttnShape, WorkloadError

REPO = Path(__file__).resolve().parents[1]
E4M3_MAX = 448.0


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def round_partials(o: torch.Tensor, l: torch.Tensor, fmt: str) -> torch.Tensor:
    """o [.., G, D] as the combine would read it back from a partial of format `fmt`."""
    if fmt == "bf16":
        return o.to(torch.bfloat16).to(o.dtype)
    safe_l = torch.where(l > 0, l, torch.ones_like(l)).unsqueeze(-1)
    normalized = o / safe_l
    if fmt == "e4m3/l":
        return _e4m3(normalized) * safe_l
    if fmt == "e4m3/l row-scaled":
        scale = normalized.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return _e4m3(normalized / scale) * scale * safe_l
    raise ValueError(f"unknown partial format {fmt!r}")


FORMATS = {"bf16": 2.0, "e4m3/l": 1.0, "e4m3/l row-scaled": 1.0 + 4.0 / 128}


def measure(dtype: str, tokens: int, context: int, reuse: float, seed: int) -> dict:
    shape = AttnShape()
    w = synthetic_workload(shape, dtype, tokens, context, reuse, seed=seed)
    o, m, l = reference_partials(w)
    exact, _ = combine_partials(o, m, l)
    errors = {fmt: relative_error(combine_partials(round_partials(o, l, fmt), m, l)[0], exact) for fmt in FORMATS}
    return dict(dtype=dtype, tokens=tokens, context=context, reuse=reuse, seed=seed, tolerance=tolerance(dtype),
                errors=errors)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "results" / "cpu" / "partial-precision"))
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--reuse", default="0.25,1")
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        reuses = [float(r) for r in args.reuse.split(",")]
        dtypes = args.dtypes.split(",")
    except ValueError:
        print(f"error: --reuse takes comma-separated numbers, got {args.reuse!r}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "partial_precision.log")
    log(f"partials rounded to each format, merged by the reference combine; relative error of the output "
        f"against the exact float64 output (CPU emulation on {platform.machine()} {platform.system()}, "
        f"torch {torch.__version__})")
    log(f"{'dtype':5} {'reuse':>6} {'tolerance':>9}  " + "  ".join(f"{f + f' ({b:g} B)':>24}" for f, b in FORMATS.items()))
    rows = []
    for dtype in dtypes:
        for reuse in reuses:
            try:
                r = measure(dtype, args.tokens, args.context, reuse, args.seed)
            except (WorkloadError, ValueError, KeyError) as exc:
                print(f"error: {dtype} reuse {reuse}: {exc}", file=sys.stderr)
                return 2
            rows.append(r)
            log(f"{dtype:5} {reuse:6g} {r['tolerance']:9.0e}  " + "  ".join(f"{e:24.2e}" for e in r["errors"].values()))
    (out / "partial_precision.json").write_text(json.dumps(dict(formats=FORMATS, rows=rows), indent=2) + "\n")
    log(f"wrote {out / 'partial_precision.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
