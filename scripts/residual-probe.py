"""Probes of the hybrid's residual path on drift points, on the GPU: what KV-outer's index map spends
where, and what merging the residual in q-packed-cute's epilogue costs (knock-outs). Each part is
timed alone by the harness timer (harness/measure/timing.py: its CUDA graph replayed after a cold-L2 flush),
median in us.

  index-map  the index map of drift p 0.15 (every selection and the hybrid's residual), a decode batch
             and two mixed steps: whole, and its parts (edge keys, the sort at int16 / int32 / int64
             keys, searchsorted, counts, the placing pass); the hybrid's schedule stage at drift p 0.15
             in each dtype, part by part (its packed tiles, KV-outer's index map and schedule)
  merge      per option: the packed stage alone with its plain library, the residual library with every
             rank -1 (the index alone) and with the real combine index, and KV-outer's attention

  python3 scripts/residual-probe.py merge --option @p12+m3+fused --dtype fp8 --point drift0.15 --out m.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from msa_bench.harness.measure.timing import TimingConfig, summarize, time_plan
from msa_bench.kernels.base import Plan, get_backend
from msa_bench.kernels.kv_outer.index_map import PLACE_BLOCK, IndexMap, edge_keys_kernel, place_edges_kernel
from msa_bench.kernels.q_packed.cute_backend import QPackedCuteBackend
from msa_bench.kernels.q_packed.hybrid import HybridBackend
from msa_bench.scenarios.grid import load_scenario, make_workload


def part_us(fn) -> float:
    """The harness timer's median of one part, run as the only stage of a plan, in us."""
    plan = Plan(backend="residual-probe", stages={"part": fn}, output=torch.empty(0))
    samples = time_plan(plan, TimingConfig(), "cuda")
    return round(summarize(samples["part"].seconds)["median_s"] * 1e6, 1)


def workload(scenario: str, dtype: str, text: str):
    found = [p for p in load_scenario(scenario).points if p.dtype == dtype and text in p.key()]
    if not found:
        raise SystemExit(f"residual-probe: no {dtype} point of {scenario} has {text!r} in its key")
    return make_workload(found[0], device="cuda")


def index_map_parts(pages: torch.Tensor, num_pages: int) -> dict:
    im = IndexMap(pages, num_pages, 8)
    r = {"edges": pages.numel(), "keys": im.num_keys, "key_dtype": str(im.keys.dtype), "whole_us": part_us(im)}
    im.sort_and_count()
    n = pages.numel()
    keys = im.keys.int()
    r["edge_keys_us"] = part_us(lambda: edge_keys_kernel[(triton.cdiv(n, PLACE_BLOCK),)](
        pages, im.keys, n, im.n_tokens * im.topk, num_pages, BLOCK=PLACE_BLOCK))
    r["sort_int32_us"] = part_us(lambda: torch.sort(keys, stable=True))
    if im.num_keys < torch.iinfo(torch.int16).max:
        k16 = keys.to(torch.int16)
        r["sort_int16_us"] = part_us(lambda: torch.sort(k16, stable=True))
    unique = keys.long() * n + torch.arange(n, device=keys.device)
    r["sort_int64_unique_us"] = part_us(lambda: torch.sort(unique))
    r["searchsorted_us"] = part_us(lambda: torch.searchsorted(im.sorted_key, im.key_ids, out_int32=True,
                                                               out=im.csr_ptr))
    r["place_us"] = part_us(lambda: place_edges_kernel[(triton.cdiv(n, PLACE_BLOCK),)](
        im.sorted_key, im.perm, im.csr_ptr, im.tile_ptr, im.csr_query, im.combine_index, n, im.num_keys,
        im.n_tokens, HKV=im.hkv, TOPK=im.topk, TILE_Q=8, BLOCK=PLACE_BLOCK))
    return r


def index_map(args) -> dict:
    out = {}
    w = workload("drift", "bf16", "drift0.15")
    out["drift0.15"] = index_map_parts(w.pages, w.num_pages)
    out["drift0.15 hybrid residual"] = index_map_parts(get_backend("hybrid").plan(w).buffers["residual_pages"],
                                                       w.num_pages)
    for dtype in ("bf16", "fp8"):            # the hybrid's schedule stage, part by part
        kv_plan, packed = get_backend("hybrid").plan(workload("drift", dtype, "drift0.15"))._parts
        out[f"drift0.15 {dtype} hybrid schedule"] = {
            "packed_tiles_us": part_us(packed), "kv_index_map_us": part_us(kv_plan.stages["index_map"]),
            "kv_schedule_us": part_us(kv_plan.stages["schedule"])}
    for scenario in ("decode", "mixed"):
        points = [p for p in load_scenario(scenario).points if p.dtype == "bf16"]
        for p in points[:1] + points[-1:]:
            w = make_workload(p, device="cuda")
            out[p.key()] = index_map_parts(w.pages, w.num_pages)
    return out


def merge(args) -> dict:
    w = workload("drift", args.dtype, args.point)
    plan = get_backend("hybrid" + args.option).plan(w)
    plan.run()
    kv_plan, packed = plan._parts
    kvb = kv_plan.buffers
    entries = float((w.selection >= 0).sum()) - float((packed.residual_pages >= 0).sum())
    parts = (kvb["combine_index"], kvb["o_part"], kvb["m_part"], kvb["l_part"])
    no_ranks = (torch.full_like(kvb["combine_index"], -1),) + parts[1:]
    out, lse = plan.output.clone(), plan.lse.clone()

    def stage(residual):
        return HybridBackend.packed_attention(w, QPackedCuteBackend.name, packed, out, lse, entries, residual)
    return {"option": args.option, "dtype": args.dtype, "point": args.point,
            "packed_plain_us": part_us(stage(None)), "packed_index_only_us": part_us(stage(no_ranks)),
            "packed_merged_us": part_us(stage(parts)), "kv_outer_attention_us": part_us(kv_plan.stages["attention"]),
            "residual_partials": int((kvb["combine_index"] >= 0).sum()),
            "pairs_with_residual": int((kvb["combine_index"] >= 0).any(-1).sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("index-map").add_argument("--out", required=True)
    m = sub.add_parser("merge")
    m.add_argument("--option", default="@p12+m3+fused", help="the hybrid's options (default @p12+m3+fused)")
    m.add_argument("--dtype", default="fp8")
    m.add_argument("--point", default="drift0.15", help="text in the drift point's key (default drift0.15)")
    m.add_argument("--out", required=True)
    args = ap.parse_args()
    result = index_map(args) if args.cmd == "index-map" else merge(args)
    print(json.dumps(result, indent=1))
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
