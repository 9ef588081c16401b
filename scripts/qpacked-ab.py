"""Interleaved A/B of q-packed-cute's attention libraries: the same plans, each variant's kernel in turn.

A variant is QPackedSm90's constructor flags joined by '+': pp, sa, pairs, ms (mma_sum), kvN (K/V stages), pN (N tokens a
tile: p12 is three consumer warpgroups; its plan's schedule stage cuts 12-token tiles); `plain` is none
of them, `default` the plan's own library (build/cute).

  build (CPU or GPU host; no GPU needed):
    python3 scripts/qpacked-ab.py build --out build/ab --dtype fp8 --variant sa+kv4
  run (GPU): the plans of each point, then ROUNDS rounds of every variant in turn (round 0 dropped: the first
  timed plan of a process can run slow), timed by the harness timer (cold L2, CUDA graphs); each variant's
  output and LSE are checked bitwise against the first variant's and, on sampled rows, against the float64
  reference with the harness's tolerance (harness/measure/check.py). One JSON line per point and variant:
    python3 scripts/qpacked-ab.py run --lib build/ab --dtype fp8 --variant default,sa+kv4 \\
        --point drift:drift0.07 --point real-prefill:c17ccf --rounds 4 --out ab.jsonl

A point is SCENARIO:TEXT, the shipped scenario's point of this dtype whose key contains TEXT.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median_high

FLAGS = {"pp": "pingpong", "sa": "s_ahead", "pairs": "pairs", "ms": "mma_sum"}


def parse_variant(text: str, dtype: str):
    """The QPackedConfig a variant names (None for `default`)."""
    from msa_bench.kernels.cute.manifest import QPackedConfig
    if text == "default":
        return None
    kw = {}
    for tag in filter(None, text.split("+")):
        if tag in FLAGS:
            kw[FLAGS[tag]] = True
        elif tag[:2] == "kv" and tag[2:].isdigit():
            kw["kv_stages"] = int(tag[2:])
        elif tag[:1] == "p" and tag[1:].isdigit():
            kw["tile_tokens"] = int(tag[1:])
        elif tag != "plain":
            sys.exit(f"qpacked-ab: unknown variant tag {tag!r} in {text!r} (pp, sa, pairs, ms, kvN, pN, plain)")
    return QPackedConfig(dtype, **kw)


def build(args) -> None:
    from msa_bench.kernels.cute.build import build_all
    configs = [parse_variant(v, d) for v in args.variant for d in args.dtype.split(",")]
    print(build_all([c for c in configs if c is not None], Path(args.out)))


def points(specs: list[str], dtype: str):
    from msa_bench.scenarios.grid import load_scenario
    for spec in specs:
        name, _, text = spec.partition(":")
        found = [p for p in load_scenario(name).points if p.dtype == dtype and text in p.key()]
        if not found:
            sys.exit(f"qpacked-ab: no {dtype} point of scenario {name} has {text!r} in its key")
        yield spec, found[0]


def run(args) -> None:
    import torch

    from msa_bench.harness.measure.check import compare_output, poison, sample_rows
    from msa_bench.harness.measure.timing import TimingConfig, summarize, time_plan
    from msa_bench.kernels.base import get_backend
    from msa_bench.kernels.cute.loader import CuteLibrary
    from msa_bench.kernels.cute.manifest import find_library, device_arch
    from msa_bench.kernels.q_packed.cute_backend import QPackedCuteAttention, QPackedCuteBackend
    from msa_bench.kernels.q_packed.schedule import PackedSchedule
    from msa_bench.scenarios.grid import make_workload

    variants = [(v, parse_variant(v, args.dtype)) for v in args.variant]
    libraries = {}
    for name, cfg in variants:
        if cfg is not None:
            path, reason = find_library(cfg, Path(args.lib), device_arch())
            if reason:
                sys.exit(f"qpacked-ab: {reason}")
            libraries[name] = CuteLibrary(path, cfg)
    out = open(args.out, "a")
    for spec, point in points(args.point, args.dtype):
        w = make_workload(point, device="cuda")
        backend = get_backend(QPackedCuteBackend.name)
        plan = backend.plan(w)
        default = plan.stages["attention"]
        stages, schedules = {}, {}
        for name, cfg in variants:
            sch = default.sch
            if cfg is not None and cfg.tile_tokens != sch.P:      # its own tiles, and their schedule stage
                sch = PackedSchedule(w, cfg.tile_tokens)
                sch()
            schedules[name] = sch
            stages[name] = default if cfg is None else QPackedCuteAttention(
                w, sch, plan.output, plan.lse, cfg, library=libraries[name], direct=default.direct)
        reference = None
        times = {name: {"module": [], "attention": []} for name, _ in variants}
        for r in range(args.rounds + 1):
            for name, _ in variants:
                plan.stages["attention"] = stages[name]
                if "schedule" in plan.stages:
                    plan.stages["schedule"] = schedules[name]
                poison(plan)
                plan.run()
                torch.cuda.synchronize()
                if r == 0:
                    err, tol, _ = compare_output(plan, w, sample_rows(w.n_tokens))
                    times[name]["rel_err"], times[name]["tol"] = err, tol
                got = (plan.output.clone(), plan.lse.clone())
                if reference is None:
                    reference = got
                equal = torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])
                if not equal:
                    times[name]["unequal"] = True
                samples = time_plan(plan, TimingConfig(reps=args.reps), "cuda")
                if r:
                    for stage in ("module", "attention"):
                        times[name][stage].append(summarize(samples[stage].seconds)["median_s"] * 1e6)
        base = median_high(times[variants[0][0]]["module"])
        selected = float((w.selection >= 0).sum())
        for name, cfg in variants:
            t = times[name]
            row = dict(point=spec, key=point.key(), variant=name, library=(cfg or default.cfg).name,
                       module_us=median_high(t["module"]), attention_us=median_high(t["attention"]),
                       rounds_module_us=[round(x, 1) for x in t["module"]],
                       equal_to_first=not t.get("unequal"), rel_err=t["rel_err"], passes=t["rel_err"] <= t["tol"])
            row["vs_first"] = round(row["module_us"] / base, 4)
            if "schedule" in plan.stages:            # the entries each token's warpgroup walks, over those selected
                row["walked_ratio"] = backend.walked_ratio(w, schedules[name], selected)
            row["tiles"] = stages[name].num_tiles
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"{spec:28s} {name:22s} module {row['module_us']:9.1f} us  x{row['vs_first']:.3f}  "
                  f"attention {row['attention_us']:9.1f}  equal {row['equal_to_first']}  err {row['rel_err']:.1e}"
                  f"{'' if row['passes'] else ' FAILS'}", flush=True)
        plan.stages["attention"] = default
        if "schedule" in plan.stages:
            plan.stages["schedule"] = default.sch
        del plan, w, stages
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("build", "run"))
    p.add_argument("--dtype", default="bf16", help="bf16 or fp8 (build: a comma list)")
    p.add_argument("--variant", action="append", default=[], help="variants, comma lists or repeated")
    p.add_argument("--out", default="ab.jsonl", help="build: the library folder; run: JSON lines (appended)")
    p.add_argument("--lib", default="build/ab", help="run: the folder `build` wrote")
    p.add_argument("--point", action="append", default=[], help="SCENARIO:TEXT, repeated")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after the dropped first")
    p.add_argument("--reps", type=int, default=20, help="timed runs per plan and round")
    args = p.parse_args()
    args.variant = [v for item in args.variant for v in item.split(",")]
    if not args.variant:
        p.error("name at least one --variant")
    build(args) if args.what == "build" else run(args)


if __name__ == "__main__":
    main()
