"""The hybrid schedule: blocks that enough of a tile's tokens share go to the packed kernel, the rest to KV-outer.

Stage `schedule` builds the packed tiles keeping only union blocks at least `min_share` of the tile's
tokens select (roofline/hybrid.py predicts where packing gets cheaper) and writes the other entries'
pages as the residual selection; KV-outer's index map and scheduler then plan that residual. Stage
`attention` runs the packed kernel and KV-outer's attention; stage `combine` merges each (token, head)'s
KV-outer partials with the packed output as one more partial, in place. With every token of a tile sharing its
blocks this is pure packed; with no sharing, pure KV-outer.

`hybrid` runs the KV-outer part on the CuTe stage where its libraries are built, else on Triton. Its
default layout: in fp8, where the wide tile packs selections that drift (`wide_fits`), 12-token tiles whose
three warpgroups walk their thirds of the union, with the residual merged in their epilogue; elsewhere
8-token tiles and the combine stage.
Options, joined by '+': `p8` / `p16` tokens per tile (`p12`: q-packed-cute's wide tile), `m1` .. `m16`
the share threshold instead of the model's, `triton` / `cute` the KV-outer attention stage, `fused` /
`combine` where the residual's partials merge: `fused` runs KV-outer's attention first and q-packed-cute's
epilogue merges each token's partials into its output (no combine stage, no second pass over the output).
"""
from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from ..base import Backend, BackendUnavailable, Plan, get_backend, register
from ..cute.manifest import WIDE_TILE_TOKENS, WIDE_TOKENS, wide_config
from ..kv_outer.combine import Combine
from ..dispatch import DISPATCH, GRAPH, checked
from ..options import Choice, Number
from ..triton_common import partial_dtype, triton_dtype_reason
from ...roofline.devices import achieved, device_profile
from ...roofline.dtypes import model_dtype
from ...roofline.hybrid import min_shared_tokens
from ...roofline.model import ModelShape
from ...roofline.schedules import Schedule
from ...scenarios.stats import decode_tokens, useful_flops
from ...scenarios.workload import Workload
from . import TILE_TOKENS
from .attention import PackedAttention, packed_quantization
from .schedule import PackedSchedule

KV_STAGES = {"triton": "kv-outer", "cute": "kv-outer-cute"}
# The default wide tile with the epilogue merge (docs/perf-log.md, 2026-12-04): fp8 only (drift p 0.07-0.3:
# fp8 0.90-0.98 of the 8-token hybrid's module time, bf16 0.98-1.04). The loads bound sits between drift p 0.3
# (12-token tiles load 1.01x the 8-token tiles' union blocks, module 0.97) and co-selection in groups of 8
# (1.32x, 1.03-1.13); the packed floor below the least packed share measured faster (0.59; co-selection
# share 0, nothing packed, ran 1.03). Held out: indexer (0.89x, 0.92), sparsity's N 8192 chunks (0.77x,
# 0.87), real prefill (0.69x, 0.79-0.94).
WIDE_FUSED_DTYPES = ("fp8",)
WIDE_MAX_LOADS = 1.1
WIDE_MIN_PACKED = 0.5
FUSED_MAX_TOPK = 32                 # the epilogue reads a token's partials a lane each


@register("hybrid")
class HybridBackend(Backend):
    name = "hybrid"
    description = ("token-packed tiles for the blocks a tile's tokens share, KV-outer for the rest; the "
                   "combine merges the packed output as one more partial")
    dtypes = ("bf16", "fp8", "fp16", "fp32")
    schedule = Schedule.HYBRID
    candidate = True
    stage_names = ("schedule", "attention", "combine")
    options = {"tokens_per_tile": Number("tile size", "p", tuple(sorted(TILE_TOKENS + (WIDE_TOKENS,)))),
               "min_share": Number("share threshold", "m", tuple(range(1, max(TILE_TOKENS) + 1))),
               "kv_stage": Choice("KV-outer attention", tuple(KV_STAGES)),
               "fused": Choice("residual merged in the packed epilogue", {"fused": True, "combine": False}),
               "dispatch": DISPATCH}

    def __init__(self, tokens_per_tile: int | None = None, min_share: int | None = None, kv_stage: str | None = None,
                 fused: bool | None = None, dispatch: str | None = None):
        """dispatch "op": the stages replayed from the C++ dispatch library (both parts CuTe), "graph": that
        program captured at plan time as one CUDA graph the module launches, None: Python."""
        self.tokens_per_tile, self.min_share, self.kv_stage = tokens_per_tile, min_share, kv_stage
        self.fused, self.dispatch = fused, checked("hybrid", dispatch)
        # (weakref to a workload, {key: what was made of it}): its layout, packed schedules and split record,
        # which wide_fits, the model (auto asks before planning) and the plan each need
        self._memo = None

    def _memo_of(self, w: Workload) -> dict:
        if self._memo is None or self._memo[0]() is not w:
            self._memo = (weakref.ref(w), {})
        return self._memo[1]

    def layout(self, w: Workload, profile=None) -> tuple[int, bool]:
        """(tokens a tile, residual merged in the packed epilogue) of a plan of `w`: the named options, else
        the wide tile with the merge where `wide_fits`, else 8 tokens and the combine stage."""
        memo = self._memo_of(w)
        if "layout" not in memo:
            wide = (self.tokens_per_tile in (None, WIDE_TOKENS) and self.fused in (None, True)
                    and self.wide_fits(w, profile))
            tokens = self.tokens_per_tile or (WIDE_TOKENS if wide else 8)
            memo["layout"] = tokens, self.fused if self.fused is not None else (wide and tokens == WIDE_TOKENS)
        return memo["layout"]

    def packed_schedule(self, w: Workload, tokens: int, share: int) -> PackedSchedule:
        """The packed schedule of `w` at `tokens` a tile and threshold `share`, run (its residual selection is
        what KV-outer plans from), built once however many of wide_fits, the model and the plan ask for it."""
        memo = self._memo_of(w)
        key = ("schedule", tokens, share)
        if key not in memo:
            memo[key] = PackedSchedule(w, tokens, min_share=share, residual=True)
            memo[key]()
        return memo[key]

    def _release_schedules(self) -> None:
        """Drop the memo's schedules (a plan holds its own): they hold device buffers and the workload."""
        if self._memo is not None:
            self._memo = (self._memo[0], {k: v for k, v in self._memo[1].items() if k[0] != "schedule"})

    def wide_fits(self, w: Workload, profile=None) -> bool:
        """Whether the wide tile with the epilogue merge may run `w` by default: in WIDE_FUSED_DTYPES, where
        q-packed-cute's wide rule lets a tile hold 12 tokens (`wide_tiles_fit`), the epilogue can read a
        token's partials, the 12-token tiles (each tile size at its own threshold) load at most
        WIDE_MAX_LOADS times the union blocks the 8-token tiles load, and they pack at least
        WIDE_MIN_PACKED of the entries."""
        if w.dtype not in WIDE_FUSED_DTYPES or w.shape.topk > FUSED_MAX_TOPK or w.n_tokens == 0:
            return False
        from .cute_backend import wide_tiles_fit
        if get_backend("q-packed-cute").workload_unavailable_reason(w) is not None or not wide_tiles_fit(w):
            return False
        kv, schedules = self.kv_backend(w.dtype, w.device, w), {}
        for tokens in (8, WIDE_TOKENS):
            share, _ = self.threshold(w, kv, "q-packed-cute", tokens, profile)
            schedules[tokens] = self.packed_schedule(w, tokens, share)
        loads = {tokens: int(sch.tile_count.sum()) for tokens, sch in schedules.items()}
        selected = float((w.selection >= 0).sum())
        residual = float((schedules[WIDE_TOKENS].residual_pages >= 0).sum())
        packed = 1.0 - residual / selected if selected else 0.0
        return 0 < loads[WIDE_TOKENS] <= WIDE_MAX_LOADS * loads[8] and packed >= WIDE_MIN_PACKED

    def stages_for(self, w: Workload) -> tuple[str, ...]:
        fused = self.fused if w is None or self.fused is not None else self.layout(w)[1]
        return ("schedule", "attention") if fused else self.stage_names

    def kv_backend(self, dtype: str, device, w: Workload | None = None) -> Backend:
        """The KV-outer backend of the residual: the asked one, else CuTe where it can run (and, given the
        workload, is built for its shape), else Triton."""
        if self.kv_stage:
            return get_backend(KV_STAGES[self.kv_stage])
        cute = get_backend("kv-outer-cute")
        reason = cute.unavailable_reason(dtype, device) if w is None else cute.workload_unavailable_reason(w)
        return cute if reason is None else get_backend("kv-outer")

    def unavailable_reason(self, dtype, device):
        reason = super().unavailable_reason(dtype, device) or triton_dtype_reason(self.name, dtype, device)
        if reason is None:
            kv = self.kv_backend(dtype, device)
            inner = kv.unavailable_reason(dtype, device)
            reason = f"{self.name}: its KV-outer part ({kv.name}): {inner}" if inner else None
        # the wide tile and the epilogue merge exist only as q-packed-cute libraries
        runs = WIDE_TILE_TOKENS if self.wide else get_backend("q-packed-cute").dtypes if self.fused else None
        if reason is None and runs is not None and dtype not in runs:
            reason = f"{self.name} runs {', '.join(runs)} only"
        if reason is None and self.dispatch:
            from ..dispatch.build import unavailable_reason
            reason = unavailable_reason(self.name)
        return reason

    @property
    def wide(self) -> bool:
        """12-token tiles: only q-packed-cute's wide library runs them."""
        return self.tokens_per_tile == WIDE_TOKENS

    def workload_unavailable_reason(self, w: Workload) -> str | None:
        reason = self.unavailable_reason(w.dtype, w.device)
        if reason is None and (self.wide or self.fused):
            inner = get_backend("q-packed-cute").workload_unavailable_reason(w)
            reason = f"{self.name}: its packed part runs on q-packed-cute: {inner}" if inner else None
        if reason is None and self.fused and w.shape.topk > FUSED_MAX_TOPK:
            reason = f"{self.name}: the epilogue reads a token's partials a lane each, top-k at most {FUSED_MAX_TOPK}"
        return reason

    @staticmethod
    def packed_backend(w: Workload) -> str:
        """The packed part's kernel: q-packed-cute's where its libraries are built for the workload, else Triton's."""
        return "q-packed-cute" if get_backend("q-packed-cute").workload_unavailable_reason(w) is None else "q-packed"

    @staticmethod
    def packed_attention(w: Workload, kernel: str, packed: PackedSchedule, out: torch.Tensor, lse: torch.Tensor,
                         entries: float, residual: tuple | None = None):
        """The packed part's stage over the schedule's tiles (run), which hold `entries` selected entries;
        with `residual` (KV-outer's combine index and partials), merging them in its epilogue."""
        if kernel == "q-packed-cute":
            from .cute_backend import QPackedCuteAttention
            cute = get_backend("q-packed-cute")
            cfg = (wide_config(w.dtype) if packed.P == WIDE_TOKENS
                   else cute.config_for(w.dtype, cute.walked_ratio(w, packed, entries)))
            return QPackedCuteAttention(w, packed, out, lse, replace(cfg, residual=residual is not None),
                                        residual=residual)
        return PackedAttention(w, packed, out, lse)

    def threshold(self, w: Workload, kv: Backend, packed: str, tokens: int, dev=None) -> tuple[int, str]:
        """(fewest of a `tokens`-token tile's tokens that must select a block to pack it, where it came from)."""
        if self.min_share is not None:
            return self.min_share, "option"
        dev = dev or device_profile(w.device)
        dtype = model_dtype(w.dtype)
        shape = ModelShape.of(w.shape, dtype=dtype)
        share = min_shared_tokens(shape, dev, tokens, achieved(dev, packed, dtype), achieved(dev, kv.name, dtype),
                                  group_tokens=get_backend(packed).mma_tokens)
        return share, f"roofline ({dev.name})"

    def achieved_names(self, w: Workload) -> tuple[str, ...]:
        return self.packed_backend(w), self.kv_backend(w.dtype, w.device, w).name

    def split(self, w: Workload, profile=None) -> tuple[PackedSchedule, dict, int, str]:
        """(the packed schedule a plan of `w` runs, run; the model's record of the split; its threshold; where
        the threshold came from), each made once per workload: auto asks for the record before it plans."""
        profile = profile or device_profile(w.device)
        kv, packed_kernel = self.kv_backend(w.dtype, w.device, w), self.packed_backend(w)
        P, _ = self.layout(w, profile)
        threshold, source = self.threshold(w, kv, packed_kernel, P, profile)
        sch = self.packed_schedule(w, P, threshold)
        memo = self._memo_of(w)
        key = ("record", P, threshold)
        if key not in memo:
            memo[key] = self._split_record(w, sch, kv, packed_kernel)
        return sch, memo[key], threshold, source

    def model_record(self, w: Workload, profile=None) -> dict:
        return self.split(w, profile)[1]

    def _split_record(self, w: Workload, sch: PackedSchedule, kv: Backend, packed_kernel: str) -> dict:
        """The split of schedule `sch` (run) for the model (roofline/predict.hybrid_time): the packed part's
        statistics and the residual's, each with its kernel's facts and its decode share."""
        s, n, P, threshold = w.shape, w.n_tokens, sch.P, sch.min_share
        packer = get_backend(packed_kernel)
        res = sch.residual_pages
        selected = float((w.selection >= 0).sum())
        flops = useful_flops(w)
        residual = float((res >= 0).sum())
        packed = selected - residual
        executed = float(sch.tile_count.double().sum()) * P     # P x G rows per union block
        from .cute_backend import critical_ratio
        head = torch.arange(s.hkv, device=res.device).view(-1, 1, 1) * w.num_pages
        # each part's decode share (achieved()): its entries that decode tokens hold; a decode token alone in
        # its tile packs nothing, so a chunked-prefill step's decode tokens are mostly the residual's
        decode = decode_tokens(w)
        chosen = w.pages >= 0
        in_res = res >= 0
        dims = {"hq": s.hq, "hkv": s.hkv, "head_dim": s.head_dim, "block": s.block, "topk": s.topk, "n_tokens": n}
        split = {"tile_tokens": P, "min_share": threshold,
                 "packed_entry_share": packed / selected if selected else 0.0,
                 "packed": packed_kernel, "kv_outer": kv.name}
        if packed > 0:
            tiles = sch.tile_page.view(s.hkv, -1)
            # traffic: the tiles' unions; MMAs: each tile's longest group walk where its groups skip (mma_tokens)
            record = {"tile_tokens": P, "union_ratio": executed / packed}
            if packer.mma_tokens:
                record["executed_union_ratio"] = critical_ratio(sch, packed)
            split["parts"] = {"packed": {
                "schedule": Schedule.Q_PACKED, "dtype": w.dtype, "record": record,
                "stats": {**dims, "nsb": float(torch.unique((tiles + head.view(-1, 1))[tiles >= 0]).numel()),
                          "selected_blocks_per_query": packed / (n * s.hkv), "useful_flops": flops * packed / selected},
                # the packed kernel's fraction at this tile size (the threshold above keeps the 8-token one,
                # with which the drift scan measured it)
                "fraction": dict(packer.tile_fractions).get(P, packer.name),
                "fraction_terms": list(packer.fraction_terms),
                "decode_share": float((chosen & ~in_res)[:, decode].sum()) / packed}}
        if residual > 0:
            split.setdefault("parts", {})["kv_outer"] = {
                "schedule": Schedule.KV_OUTER, "dtype": w.dtype,
                "record": {"launch": kv.model_record(w).get("launch", {})},
                "stats": {**dims, "nsb": float(torch.unique((res + head)[res >= 0]).numel()),
                          "selected_blocks_per_query": residual / (n * s.hkv),
                          "useful_flops": flops * residual / selected},
                "fraction": kv.name, "fraction_terms": list(kv.fraction_terms),
                "decode_share": float(in_res[:, decode].sum()) / residual}
        return {"stages": list(self.stages_for(w)), "split": split}

    def _plan(self, w: Workload) -> Plan:
        s, dev = w.shape, w.device
        kv = self.kv_backend(w.dtype, dev, w)
        packed_kernel = self.packed_backend(w)
        P, fused = self.layout(w)
        if (P == WIDE_TOKENS or fused) and packed_kernel != "q-packed-cute":
            raise BackendUnavailable(self.workload_unavailable_reason(w) or f"{self.name}: needs q-packed-cute")
        try:
            packed, record, share, source = self.split(w)   # its residual selection is what KV-outer plans from
        finally:
            self._release_schedules()
        w_res = replace(w, pages=packed.residual_pages)
        kv_plan = kv.plan(w_res)
        if set(kv_plan.stages) != {"index_map", "schedule", "attention", "combine"}:
            raise BackendUnavailable(f"{self.name}: {kv.name} has stages {list(kv_plan.stages)}")
        # the packed kernel writes the final output of every (token, head); the combine then merges in place
        # the pairs that also have KV-outer partials
        out = torch.empty(w.n_tokens, s.hq, s.head_dim, dtype=partial_dtype(w.dtype), device=dev)
        lse = torch.empty(w.n_tokens, s.hq, dtype=torch.float32, device=dev)
        selected = float((w.selection >= 0).sum())
        residual = float((packed.residual_pages >= 0).sum())
        kvb = kv_plan.buffers
        parts = (kvb["combine_index"], kvb["o_part"], kvb["m_part"], kvb["l_part"]) if fused else None
        attention = self.packed_attention(w, packed_kernel, packed, out, lse, selected - residual, parts)
        cfg = kv_plan.info.get("config", {})
        combine = None if fused else Combine(w_res, kvb, out, lse, cfg.get("combine_pairs", 4),
                                                  cfg.get("combine_num_warps", 4), merge_into_output=True)
        kvs = kv_plan.stages

        def schedule():
            packed()
            kvs["index_map"]()
            kvs["schedule"]()

        # fused: KV-outer first, its partials the packed epilogue reads
        parts_in_order = (kvs["attention"], attention) if fused else (attention, kvs["attention"])

        def attend():
            for part in parts_in_order:
                part()

        executed = float(packed.tile_count.double() @ packed.tile_ntok.double().repeat(s.hkv))
        info = dict(schedule=Schedule.HYBRID, tile_tokens=P, min_share=share, min_share_from=source,
                    packed_entry_share=1.0 - residual / selected if selected else 0.0,
                    packed_executed_blocks_per_selected=executed / selected if selected else 0.0,
                    kv_outer=kv.name, kv_outer_info=kv_plan.info, attention=attention.describe(),
                    residual_merge="packed epilogue" if fused else "combine",
                    quantization=f"packed part: {packed_quantization(w)}; KV-outer part: "
                                 f"{kv_plan.info.get('quantization', '')}")
        # the KV-outer part's buffers under "kv." names: its stage checks hold for the full selection only
        buffers = {**{f"kv.{k}": v for k, v in kv_plan.buffers.items()}, **packed.buffers}
        stages = {"schedule": schedule, "attention": attend} | ({} if fused else {"combine": combine})
        plan = Plan(backend=self.name, stages=stages,
                    output=out, lse=lse, buffers=buffers, info=info, model_record=record)
        plan._parts = (kv_plan, packed)          # keep the KV-outer plan's state alive with this one
        if self.dispatch:
            if kv.name != "kv-outer-cute" or packed_kernel != "q-packed-cute":
                raise BackendUnavailable(f"{self.name}@op runs CuTe parts only (here {kv.name} and {packed_kernel})")
            from .op import dispatch_hybrid
            dispatch_hybrid(plan, packed, kvs, parts_in_order, combine, self.dispatch == GRAPH)
        return plan
