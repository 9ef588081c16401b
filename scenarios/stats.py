"""Workload statistics: reuse, fan-in, co-selection, selected tokens, useful FLOPs, and the roofline's
predicted times.

Everything is computed from the selection, page tables and q_limit only, so a selection-only
workload (with_tensors=False) gives the same numbers as the full one.
"""
from __future__ import annotations

import math

import torch

from ..roofline.model import ALL_SCHEDULES, DECODE_TOKENS, decode_share
from ..roofline.schedules import Schedule
from ..roofline.shape import SHAPE_FIELDS
from .tiling import query_tiles
from .workload import Workload

SCHEDULES = ALL_SCHEDULES      # q-packed at P = 8, this union_ratio
UNION_TILES = (8, 16)          # P of the union_ratio statistics every result row stores
MMA_TILES = (4,)               # and of the executed ones only: a q-packed-cute warpgroup's tokens


def visible_tokens(w: Workload) -> torch.Tensor:
    """[Hkv, N, topk] number of keys of each selected block the query may see (0 for padding)."""
    sel = w.selection.long()
    start = sel * w.shape.block
    n_vis = (w.q_limit.long().view(1, -1, 1) - start + 1).clamp(min=0, max=w.shape.block)
    return torch.where(sel >= 0, n_vis, torch.zeros_like(n_vis))


def useful_flops(w: Workload) -> float:
    """4 x G x D per visible selected key token, summed over queries and KV heads (QK^T and PV,
    2 flop per multiply-add). Equals 4 x Hq x D x selected tokens per query when all heads alike;
    a causal local block counts only its visible tokens."""
    return flops_of(w.shape, float(visible_tokens(w).sum()))


def flops_of(shape, visible: float) -> float:
    """useful_flops of `visible` selected key tokens summed over queries and KV heads."""
    return 4.0 * shape.group * shape.head_dim * visible


def selected_pairs(w: Workload, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct selected (KV head, physical page) pairs and how many queries select each (fan-in); of the
    query tokens `tokens` (an [N] bool mask) only, where given."""
    pages = (w.pages if tokens is None else w.pages[:, tokens]).long()
    head = torch.arange(w.shape.hkv, device=pages.device).view(-1, 1, 1).expand_as(pages)
    key = (head * w.num_pages + pages)[pages >= 0]
    return torch.unique(key, return_counts=True)


def union_ratio(selection: torch.Tensor, q_request: torch.Tensor, tile: int, padded: bool = False,
                q_limit: torch.Tensor | None = None, causal: bool = False) -> float | None:
    """Co-selection at tile size P = `tile`: sum over (query tile, KV head) of tokens in the tile x distinct
    valid blocks its tokens select, over the valid (token, KV head, block) entries. Query tiles as a
    token-packed kernel cuts them (scenarios/tiling.py; causal ones need q_limit). 1 when every token
    of every tile selects the same blocks, at most P; the FLOPs a token-packed schedule executes are
    the useful ones times this. None when nothing is selected.
    padded: count every tile as P tokens, as a kernel of P-token tiles computes them: a request's
    shorter tiles (a decode request's single token) still run P x G rows per union block."""
    sel = selection.to(torch.int32).cpu()
    hkv, n, topk = sel.shape
    total = int(torch.count_nonzero(sel >= 0))
    if total == 0:
        return None
    ids, pos = query_tiles(q_request.cpu(), None if q_limit is None else q_limit.cpu(), tile, causal)
    sizes = torch.bincount(ids)
    # each (KV head, tile) row holds its tokens' entries (-1 where none); sorted, its distinct values
    # are 1 + the steps between neighbours, less one for the -1 (which sorts first) where present
    tiles = sizes.numel()
    row_of = (torch.arange(hkv).view(-1, 1) * tiles + ids.view(1, -1)) * tile + pos.view(1, -1)   # [hkv, N]
    rows = torch.full((hkv * tiles * tile, topk), -1, dtype=torch.int32)
    rows.index_copy_(0, row_of.view(-1), sel.view(-1, topk))
    rows = rows.view(hkv, tiles, tile * topk)
    srt = rows.sort(-1).values
    distinct = (srt[..., 1:] != srt[..., :-1]).sum(-1) + (srt[..., 0] >= 0).long()
    weight = torch.full_like(sizes, tile) if padded else sizes
    return float((distinct * weight.view(1, -1)).sum()) / total


def workload_union_ratio(w: Workload, tile: int, padded: bool = False) -> float | None:
    """union_ratio of the workload's selection over its query tiles."""
    return union_ratio(w.selection, w.q_request, tile, padded, w.q_limit, w.causal)


def nearest_rank(srt, q: float):
    """The nearest-rank q-quantile of `srt`, a non-empty sorted sequence (a list or a 1-D tensor)."""
    return srt[min(len(srt) - 1, max(0, math.ceil(q * len(srt)) - 1))]


def _quantiles(counts: torch.Tensor) -> dict:
    if counts.numel() == 0:
        return {f"fanin_{k}": 0.0 for k in ("mean", "p50", "p90", "p99", "max")}
    srt = counts.sort().values.double()
    at = lambda q: float(nearest_rank(srt, q))    # noqa: E731
    return {"fanin_mean": float(srt.mean()), "fanin_p50": at(0.5), "fanin_p90": at(0.9),
            "fanin_p99": at(0.99), "fanin_max": float(srt[-1])}


def kv_lens(w: Workload) -> list[int]:
    if "kv_lens" in w.meta:
        return list(w.meta["kv_lens"])
    return [int((row >= 0).sum()) * w.shape.block for row in w.page_table.cpu()]


def dense_extent(w: Workload) -> tuple[int, int]:
    """(context blocks summed over requests, keys summed over queries) of dense attention over each
    request's visible context: blocks 0 to its last query's local block (the dense-masked schedule)."""
    req = w.q_request.long().cpu()
    lim = w.q_limit.long().cpu()
    if req.numel() == 0:
        return 0, 0
    last = torch.full((int(w.page_table.shape[0]),), -1, dtype=torch.long).scatter_reduce(0, req, lim, "amax")
    blocks = torch.where(last >= 0, last // w.shape.block + 1, 0)
    return int(blocks.sum()), int(blocks[req].sum()) * w.shape.block


def visible_keys(w: Workload) -> int:
    """Keys summed over queries that each query may see, its own position's causal limit exactly: the
    dense floor's work (dense_extent's keys count every query at its request's last limit)."""
    return int((w.q_limit.long() + 1).sum())


def workload_decode_share(w: Workload) -> float:
    """model.decode_share of the workload's requests (their query tokens from q_request)."""
    return decode_share(torch.bincount(w.q_request.long().cpu()).tolist())


def decode_tokens(w: Workload) -> torch.Tensor:
    """[N] bool on the workload's device: the query tokens of requests of at most DECODE_TOKENS tokens."""
    req = w.q_request.long().cpu()
    return (torch.bincount(req) <= DECODE_TOKENS)[req].to(w.pages.device)


def workload_decode_kv_share(w: Workload, nsb: int) -> float:
    """The share of the workload's nsb distinct selected (KV head, page) pairs (selected_pairs) that decode
    tokens select: the decode share model.decode_work_share takes where HBM binds."""
    return selected_pairs(w, decode_tokens(w))[0].numel() / nsb if nsb else 0.0


FANIN_KEYS = tuple(f"fanin_{k}" for k in ("mean", "p50", "p90", "p99", "max"))


class ModelStats:
    """A workload's statistics under workload_stats' keys, each computed here and once, on first use: a
    prediction (roofline/predict.py) asks for the few it needs (`auto` weighs every candidate on one of
    these), workload_stats takes them all. Statistics computed together share their work (one unique over
    the selected pairs gives nsb, its re-read part and the fan-in)."""

    def __init__(self, w: Workload):
        self.w = w
        s = w.shape
        self._values = {**{k: getattr(s, k) for k in SHAPE_FIELDS}, "n_tokens": w.n_tokens}

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    def __getitem__(self, key):
        return self.get(key)

    def get(self, key, default=None):
        if key not in self._values:
            self._values[key] = self._compute(key)
        value = self._values[key]
        return default if value is None else value

    def take(self, keys) -> dict:
        """{key: value} of `keys`, None where a statistic has no value."""
        return {k: self.get(k) for k in keys}

    def _compute(self, key: str):
        w = self.w
        if key.startswith(("union_ratio_p", "executed_union_ratio_p")):
            return workload_union_ratio(w, int(key.rpartition("_p")[2]), padded=key.startswith("executed"))
        for keys, group in _GROUPS:
            if key in keys:
                self._values.update(group(self))
                return self._values[key]
        return None

    def _pairs(self) -> dict:
        w, n = self.w, self.w.n_tokens
        _, fanin = selected_pairs(w)
        nsb = int(fanin.numel())
        return {"nsb": nsb, "nsb_per_n": nsb / n if n else 0.0,
                "nsb_shared": int((fanin > 1).sum()),                 # the blocks re-reads go to (model.traffic)
                "decode_kv_share": workload_decode_kv_share(w, nsb), **_quantiles(fanin)}

    def _entries(self) -> dict:
        w, n = self.w, self.w.n_tokens
        entries = int((w.selection >= 0).sum())
        return {"selected_entries": entries, "selected_blocks_per_query": entries / (n * w.shape.hkv) if n else 0.0}

    def _visible(self) -> dict:
        w, n = self.w, self.w.n_tokens
        vis = float(visible_tokens(w).sum())
        return {"selected_tokens": vis, "selected_tokens_per_query": vis / (n * w.shape.hkv) if n else 0.0,
                "useful_flops": flops_of(w.shape, vis)}

    def _dense(self) -> dict:
        blocks, keys = dense_extent(self.w)
        entries = self["selected_entries"]
        return {"dense_kv_blocks": blocks, "dense_keys": keys, "visible_keys": visible_keys(self.w),
                "sparsity_ratio": keys * self.w.shape.hkv / (entries * self.w.shape.block) if entries else None}

    def _requests(self) -> dict:
        w = self.w
        return {"requests": int(w.page_table.shape[0]), "context_tokens": max(kv_lens(w)),
                "context_blocks": int((w.page_table >= 0).sum(1).max()), "decode_share": workload_decode_share(w)}


_GROUPS = (
    (("nsb", "nsb_per_n", "nsb_shared", "decode_kv_share", *FANIN_KEYS), ModelStats._pairs),
    (("selected_entries", "selected_blocks_per_query"), ModelStats._entries),
    (("selected_tokens", "selected_tokens_per_query", "useful_flops"), ModelStats._visible),
    (("dense_kv_blocks", "dense_keys", "visible_keys", "sparsity_ratio"), ModelStats._dense),
    (("requests", "context_tokens", "context_blocks", "decode_share"), ModelStats._requests),
)


def workload_stats(w: Workload, device_profile=None) -> dict:
    """Flat dict of statistics (ModelStats computes the workload's; the rest is what its generator aimed
    at); with a device profile (roofline.devices.DeviceProfile or preset name) also the roofline's
    predicted time and binding resource per schedule."""
    m = ModelStats(w)
    out = {
        "generator": w.meta.get("generator", ""), "dtype": w.dtype, "causal": w.causal,
        **m.take((*SHAPE_FIELDS, "n_tokens", "requests", "decode_share", "decode_kv_share", "context_tokens",
                  "context_blocks", "nsb", "nsb_per_n", "nsb_shared")),
        "target_reuse": w.meta.get("target_reuse"),
        **m.take(("selected_blocks_per_query", *FANIN_KEYS,
                  *(f"union_ratio_p{p}" for p in UNION_TILES),
                  # what a kernel of P-token tiles executes: a request's shorter tiles counted as P tokens
                  *(f"executed_union_ratio_p{p}" for p in UNION_TILES + MMA_TILES),
                  "selected_tokens", "selected_tokens_per_query", "useful_flops",
                  "dense_kv_blocks", "dense_keys", "visible_keys", "sparsity_ratio")),
    }
    if "share" in w.meta:
        out.update(share=w.meta["share"], share_group=w.meta["share_group"],
                   target_union_ratio=w.meta["target_union_ratio"])
    if "drift" in w.meta:
        from .serving import neighbour_jaccard
        out.update(drift=w.meta["drift"], neighbour_jaccard=neighbour_jaccard(w.selection, w.q_request),
                   target_neighbour_jaccard=w.meta.get("target_neighbour_jaccard"),
                   target_union_ratio=w.meta.get("target_union_ratio"))
    if "case_id" in w.meta:
        out["case_id"] = w.meta["case_id"]
        out["weight"] = w.meta.get("weight", 0.0)
    if device_profile is not None:
        out.update(predicted_times(w, out["nsb"], m["selected_entries"], out["useful_flops"], device_profile,
                                   out[f"executed_union_ratio_p{UNION_TILES[0]}"], out["nsb_shared"]))
    return out


def predicted_times(w: Workload, nsb: int, valid_entries: int, flops: float, device_profile,
                    union: float | None = None, nsb_shared: int | None = None) -> dict:
    """Predicted time and binding resource per schedule; q-packed (tiles of UNION_TILES[0] tokens) only
    where the selection has a union_ratio."""
    from ..roofline.devices import load_device
    from ..roofline.model import ModelShape, crossover, packed_crossover_by_dtype, predict
    dev = load_device(device_profile) if isinstance(device_profile, str) else device_profile
    s, n = w.shape, w.n_tokens
    shape = ModelShape.of(s, dtype=w.dtype)
    out = {"device": dev.name}
    per_query = valid_entries / (n * s.hkv) if n else 0.0
    for sched in SCHEDULES:
        if sched == Schedule.Q_PACKED and union is None:
            continue
        p = predict(sched, shape, n, nsb, dev, selected_per_query=per_query, flops=flops,
                    union_ratio=union if sched == Schedule.Q_PACKED else None, tile_tokens=UNION_TILES[0],
                    shared_nsb=nsb_shared)
        out[f"pred_{sched}_s"] = p.time_s
        out[f"pred_{sched}_binding"] = p.binding
    cross = crossover(shape, dev)
    out["crossover_nsb_per_n"] = cross if math.isfinite(cross) else None
    if n:
        packed = packed_crossover_by_dtype(dev, n, nsb / n, UNION_TILES[0], dtypes=(w.dtype,), shape=s)[w.dtype]
        out["packed_crossover_union_ratio"] = (None if packed is None else
                                               float(UNION_TILES[0]) if math.isinf(packed) else packed)
    return out


def stat_rows(st: dict) -> list[tuple[str, str]]:
    """(label with unit, formatted value) rows of workload_stats for a table."""
    def num(x, fmt=",.0f"):
        return "-" if x is None else format(x, fmt)
    rows = [
        ("generator", st["generator"] + (f" ({st['case_id']}, weight {st['weight']:g})" if "case_id" in st else "")),
        ("shape (Hq / Hkv / D / block tokens / top-k)",
         f"{st['hq']} / {st['hkv']} / {st['head_dim']} / {st['block']} / {st['topk']}"),
        ("dtype, causal", f"{st['dtype']}, {'causal' if st['causal'] else 'non-causal'}"),
        ("N (query tokens)", num(st["n_tokens"])),
        ("requests", num(st["requests"])),
        ("decode share: of the tokens / of the selected pairs", " / ".join(
            num(st.get(k), ".3g") for k in ("decode_share", "decode_kv_share"))),
        ("context (tokens, longest request)", num(st["context_tokens"])),
        (f"context (blocks of {st['block']} tokens)", num(st["context_blocks"])),
        ("nsb (distinct selected (KV head, block) pairs)", num(st["nsb"])),
        ("of them selected by more than one query (re-read)", num(st.get("nsb_shared"))),
        ("reuse nsb/N (achieved)", num(st["nsb_per_n"], ".4g")),
        ("reuse nsb/N (target)", num(st["target_reuse"], ".4g")),
        ("selected blocks per (query, KV head)", num(st["selected_blocks_per_query"], ".3g")),
        ("fan-in (queries per selected pair): mean / p50 / p90 / p99 / max",
         " / ".join(num(st[f"fanin_{k}"], ".4g") for k in ("mean", "p50", "p90", "p99", "max"))),
        *([(f"co-selection: share / union_ratio at P = {st['share_group']} (target)",
             f"{st['share']:g} / {st['target_union_ratio']:.3f}")] if "share" in st else []),
        ("union_ratio at P = 8 / 16 tokens (1: a tile's tokens select alike)",
         " / ".join(num(st.get(f"union_ratio_p{p}"), ".3f") for p in UNION_TILES)),
        *([("drift p: neighbour Jaccard / union_ratio at P = 8, measured (closed form)",
            f"{st['drift']:g}: {num(st['neighbour_jaccard'], '.3f')} ({num(st['target_neighbour_jaccard'], '.3f')})"
            f" / {num(st['union_ratio_p8'], '.3f')} ({num(st['target_union_ratio'], '.3f')})")]
          if st.get("drift") is not None else []),
        ("visible selected key tokens per (query, KV head)", num(st["selected_tokens_per_query"], ".5g")),
        ("sparsity ratio (visible context keys / selected keys)", num(st.get("sparsity_ratio"), ".3g")),
        ("useful work (GFLOP)", num(st["useful_flops"] / 1e9, ",.2f")),
    ]
    if "crossover_nsb_per_n" in st:
        rows.append((f"predicted crossover nsb/N on {st['device']} (KV-outer faster below)",
                     num(st["crossover_nsb_per_n"], ".4g") if st["crossover_nsb_per_n"] is not None else "none"))
    if "packed_crossover_union_ratio" in st:
        rows.append((f"union_ratio (P = {UNION_TILES[0]}) below which q-packed beats KV-outer at this reuse "
                     f"({st['dtype']})",
                     num(st["packed_crossover_union_ratio"], ".3g") if st["packed_crossover_union_ratio"]
                     is not None else "none"))
    return rows


def prediction_rows(st: dict) -> list[tuple[str, str, str]]:
    """(schedule, predicted time in microseconds, binding resource) rows, when predictions are present."""
    return [(s, f"{st[f'pred_{s}_s'] * 1e6:,.1f}", st[f"pred_{s}_binding"]) for s in SCHEDULES if f"pred_{s}_s" in st]
