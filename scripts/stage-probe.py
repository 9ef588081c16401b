"""Two probes of one backend's stage on one real-prefill case, on the GPU.

  ncu      plan, run once, then run STAGE once inside cudaProfilerStart/Stop: profile exactly that stage
           with `ncu --profile-from-start off [sections] python3 scripts/stage-probe.py ncu ...`
  replans  REPLANS fresh plans in one process, each timed by the harness timer (cold L2, CUDA graphs);
           prints each plan's stage medians (us) and where its buffers landed, to tell a plan-dependent
           time (allocation, placement) from run-to-run noise

  python3 scripts/stage-probe.py replans --backend kv-outer-cute --dtype bf16 --replans 8
"""
from __future__ import annotations

import argparse

import torch

from msa_bench.harness.measure.timing import TimingConfig, summarize, time_plan
from msa_bench.kernels.base import get_backend
from msa_bench.kernels.cute.backend import KVOuterCuteBackend
from msa_bench.scenarios.prefill_cases import get_case, prefill_workload
from msa_bench.scenarios.workload import AttnShape


def build(args):
    w = prefill_workload(get_case(args.case), AttnShape(), args.dtype, seed=args.seed, device="cuda")
    return w, get_backend(args.backend).plan(w)


def profile_stage(args) -> None:
    _, plan = build(args)
    plan.run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    plan.stages[args.stage]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def replans(args) -> None:
    keep = []
    for k in range(args.replans):
        # a differently sized allocation before each plan moves where the next one's buffers land
        keep.append(torch.empty((k * 37 + 1) << 20, dtype=torch.uint8, device="cuda"))
        w, plan = build(args)
        samples = time_plan(plan, TimingConfig(cold_l2=not args.warm_l2), "cuda")
        medians = {s: round(summarize(v.seconds)["median_s"] * 1e6, 1) for s, v in samples.items() if s != "plan"}
        where = {n: hex(t.data_ptr()) for n, t in plan.buffers.items()
                 if isinstance(t, torch.Tensor) and t.numel() * t.element_size() >= 1 << 20}
        print(k, medians, "q", hex(w.q.data_ptr()), "out", hex(plan.output.data_ptr()), where, flush=True)
        del plan, w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("probe", choices=("ncu", "replans"))
    p.add_argument("--backend", default=KVOuterCuteBackend.name)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--case", default="prefill_c17ccf7fbbb5d1ee5648", help="a real-prefill case id")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--stage", default="attention", help="ncu: the stage to profile")
    p.add_argument("--replans", type=int, default=8, help="replans: how many fresh plans")
    p.add_argument("--warm-l2", action="store_true", help="replans: time without the L2 flush")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("stage-probe: needs a CUDA GPU")
    (profile_stage if args.probe == "ncu" else replans)(args)


if __name__ == "__main__":
    main()
