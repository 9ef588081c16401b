"""Dense ceiling on real prefill: gather each query block's shared blocks contiguous, then dense SDPA.

A query block is a query tile of `block` tokens (scenarios/tiling.py): under causality the aligned
128-token query block (the first and last of a request may be shorter), else `block` consecutive tokens
from the request's first.
Where every token of a query block selected the same blocks (per KV head), those blocks' K/V are
gathered into one contiguous buffer per (query block, KV head), logical order with the local block
last, and one dense attention covers the block: Q is the [n, Hq, T, D] view of the query block's
rows, K/V [n, Hkv, keys, D] (GQA), for runs of consecutive query blocks of the same shape.

Masks: blocks before the last are whole to every token; the last is seen either to the same length
by all (non-causal, or a history block) or as a causal staircase (token i of T sees `end - (T-1-i)`
keys of its own block). So no general mask is needed:
  flash   FlashAttention-2 through SDPA: keys cut at the last visible one, non-causal or
          bottom-right causal (torch.nn.attention.bias.causal_lower_right, FA2's own causal rule).
  cudnn   cuDNN through SDPA: whole blocks and an additive 0 / -inf bias [T, keys] broadcast over
          the batch where the last block is partial (cuDNN's causal flag is top-left aligned).
  auto    the first of cudnn, flash that runs here (tried in plan; the lead measures both).
The fast path is a run of full query blocks (T = block) with the same number of blocks: one SDPA
call. Query blocks with fewer history blocks (early in a request) or partial query blocks form runs
of their own. Tokens that see no block for a head get zeros (as the reference).

Unavailable, with one line saying how many query blocks break the rule, wherever tokens of a query
block select different blocks, or see them other than as above. fp8: K/V are dequantized to bf16 in
the gather stage (k_scale, v_scale applied there), Q is bf16 (q * q_scale, in plan), compute bf16.
"""
from __future__ import annotations

import weakref

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..roofline.schedules import Schedule
from ..scenarios.workload import Workload
from .base import Backend, BackendUnavailable, Plan, register
from .flashinfer_common import bf16_query, gpu_reason
from ..scenarios.tiling import tile_keys
from .options import Choice
from .packed_tiles import pack_tiles, visible_selection

KERNELS = ("auto", "cudnn", "flash")
AUTO_ORDER = ("cudnn", "flash")
FULL, CAUSAL = "full", "causal"


# ---- planning (pure torch: runs on the CPU for tests) -----------------------------------------------

@dataclass(frozen=True)
class HeadShape:
    """How one KV head of a query block attends: blocks, kind of the last block, keys up to the last visible."""
    blocks: int
    kind: str          # full (every token sees the same keys) | causal (bottom-right staircase)
    keys: int          # (blocks - 1) * block + keys the last token sees of the last block


@dataclass
class Run:
    """Consecutive query blocks of one shape: tokens [start, start + groups * rows)."""
    start: int
    groups: int
    rows: int
    heads: tuple[HeadShape, ...]
    slot: int = 0                  # first gather slot (one slot = one block of K or V)
    width: int = 0                 # blocks per (query block, head) in the gather buffer

    @property
    def uniform(self) -> bool:
        return len(set(self.heads)) == 1


@dataclass
class DensePlan:
    runs: list[Run]
    slots: torch.Tensor            # [S] page * Hkv + head for every gathered block, run-major
    groups: int
    full_groups: int               # query blocks of `block` tokens with their full top-k (the fast path)
    info: dict = field(default_factory=dict)


def dense_plan(w: Workload) -> DensePlan:
    """Query blocks, their shared blocks and the runs of equal shape; BackendUnavailable if the rule breaks."""
    s = w.shape
    b = s.block
    pack = pack_tiles(visible_selection(w), tile_keys(w.q_request, w.q_limit, b, w.causal), b)
    t = pack.num_tiles
    full_rows = pack.hits == pack.length.view(1, -1, 1)
    valid = torch.arange(pack.union.shape[-1], device=pack.union.device).view(1, 1, -1) < pack.count.unsqueeze(-1)
    shared = (full_rows | ~valid).all(-1).all(0)                                 # [T]
    if not bool(shared.all()):
        bad = int((~shared).sum())
        raise BackendUnavailable(
            f"dense-gather needs every token of a query block (up to {b} tokens of one request with the same "
            f"q_limit // {b}) to select the same blocks; {bad} of {t} query blocks ({100 * bad / t:.1f}%) do not")
    lane = torch.arange(b, device=pack.start.device)
    tok_ok = lane.view(1, -1) < pack.length.view(-1, 1)
    lim = w.q_limit.long()[(pack.start.view(-1, 1) + lane).clamp(max=w.n_tokens - 1)]             # [T, P]
    last = (pack.count - 1).clamp(min=0)                                                            # [Hkv, T]
    last_blk = pack.union.long().gather(2, last.unsqueeze(-1)).squeeze(-1).clamp(min=0)
    v = (lim.unsqueeze(0) - last_blk.unsqueeze(-1) * b + 1).clamp(0, b)                            # [Hkv, T, P]
    final = (pack.length - 1).clamp(min=0).view(1, -1, 1).expand(s.hkv, -1, 1)
    v_end = v.gather(2, final)
    same = ((v == v[..., :1]) | ~tok_ok).all(-1)
    stair = ((v == v_end - (final - lane.view(1, 1, -1))) | ~tok_ok).all(-1)
    # every block before the last is whole to every token (blocks ascend: checking the one before the last suffices)
    lim_min = torch.where(tok_ok, lim, torch.full_like(lim, torch.iinfo(torch.long).max)).min(1).values
    before = pack.union.long().gather(2, (last - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    body_ok = (pack.count < 2) | ((before + 1) * b - 1 <= lim_min.view(1, -1))
    ok = ((same | stair) & body_ok) | (pack.count == 0)
    if not bool(ok.all()):
        bad = int((~ok.all(0)).sum())
        raise BackendUnavailable(f"dense-gather: {bad} of {t} query blocks see their shared blocks to different "
                                 "extents that are no causal staircase (tokens not at consecutive positions?)")
    kind = torch.where(same, 0, 1)                                                                   # full, causal
    keys = last * b + v_end.squeeze(-1)
    host = [x.cpu().tolist() for x in (pack.start, pack.length, pack.count.T, kind.T, keys.T)]
    runs: list[Run] = []
    for start, rows, counts, kinds, nkeys in zip(*host):
        heads = tuple(HeadShape(c, (FULL, CAUSAL)[k] if c else FULL, n if c else 0)
                      for c, k, n in zip(counts, kinds, nkeys))
        r = runs[-1] if runs else None
        if r and r.rows == rows and r.heads == heads and r.start + r.groups * r.rows == start:
            r.groups += 1
        else:
            runs.append(Run(start, 1, rows, heads))
    # gather slots, run-major then (query block, head, block): each run's buffer views as [n, Hkv, width * block, D]
    union = pack.union.long().clamp(min=0)
    page = w.page_table.long()[w.q_request.long()[pack.start].view(1, -1, 1).expand_as(union), union]
    idx = page * s.hkv + torch.arange(s.hkv, device=page.device).view(-1, 1, 1)                       # [Hkv, T, C]
    pieces, slot, g0 = [], 0, 0
    for r in runs:
        r.width, r.slot = max(max(h.blocks for h in r.heads), 1), slot
        pieces.append(idx[:, g0:g0 + r.groups, :r.width].permute(1, 0, 2).reshape(-1))   # capacity >= width
        slot += r.groups * s.hkv * r.width
        g0 += r.groups
    full = int(((pack.length == b).view(1, -1) & (pack.count == s.topk)).all(0).sum())
    return DensePlan(runs=runs, slots=torch.cat(pieces) if pieces else idx.new_zeros(0), groups=t, full_groups=full)


def _bias(rows: int, blocks: int, block: int, head: HeadShape, dtype, device) -> torch.Tensor:
    """Additive [rows, blocks * block] bias: 0 where token i sees key j, -inf elsewhere."""
    lane = torch.arange(rows, device=device).view(-1, 1)
    limit = head.keys - (rows - 1 - lane) if head.kind == CAUSAL else torch.full_like(lane, head.keys)
    seen = torch.arange(blocks * block, device=device).view(1, -1) < limit
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen, float("-inf"))


def attention_calls(w: Workload, dp: DensePlan, q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor,
                    out: torch.Tensor, bias: bool):
    """The attention stage's SDPA calls, (q, k, v, mask, out) views each, and the output views to zero.
    bias: whole blocks and an additive bias (cuDNN); else keys cut at the last visible one, causal_lower_right."""
    from torch.nn.attention.bias import causal_lower_right
    s = w.shape
    b, g, d = s.block, s.group, s.head_dim
    calls, zero = [], []
    for r in dp.runs:
        tokens = slice(r.start, r.start + r.groups * r.rows)
        qv = q[tokens].view(r.groups, r.rows, s.hq, d).transpose(1, 2)               # [n, Hq, T, D]
        ov = out[tokens].view(r.groups, r.rows, s.hq, d)
        span = slice(r.slot, r.slot + r.groups * s.hkv * r.width)
        kv = [buf[span].view(r.groups, s.hkv, r.width * b, d) for buf in (kbuf, vbuf)]
        parts = [(slice(0, s.hkv), r.heads[0])] if r.uniform else [(slice(h, h + 1), hs) for h, hs in enumerate(r.heads)]
        for heads, hs in parts:
            qheads = slice(heads.start * g, heads.stop * g)
            if hs.blocks == 0:
                zero.append(ov[:, :, qheads])
                continue
            if bias:
                n_keys = hs.blocks * b
                mask = (None if hs.keys == n_keys and hs.kind == FULL
                        else _bias(r.rows, hs.blocks, b, hs, q.dtype, q.device).view(1, 1, r.rows, n_keys))
            else:
                n_keys = hs.keys
                mask = causal_lower_right(r.rows, n_keys) if hs.kind == CAUSAL and r.rows > 1 else None
            k, v = (x[:, heads, :n_keys] for x in kv)
            calls.append((qv[:, qheads], k, v, mask, ov[:, :, qheads]))
    return calls, zero


def _backends(kernel: str):
    from torch.nn.attention import SDPBackend
    return {"cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
            "math": [SDPBackend.MATH], "math-bias": [SDPBackend.MATH]}[kernel]


def build_stages(w: Workload, dp: DensePlan, kernel: str, compute_dtype=torch.bfloat16):
    """(gather, attention, output, buffers, SDPA calls) for `kernel`: cudnn, flash, or for CPU tests math
    (flash's masking) and math-bias (cudnn's)."""
    from torch.nn.attention import sdpa_kernel
    s = w.shape
    dev = w.device
    n_slots = int(dp.slots.numel())
    kbuf = torch.empty(n_slots, s.block, s.head_dim, dtype=compute_dtype, device=dev)
    vbuf = torch.empty_like(kbuf)
    slots = dp.slots.to(dev)
    flat = [c.view(w.num_pages * s.hkv, s.block * s.head_dim) for c in (w.k_cache, w.v_cache)]
    direct = w.k_cache.dtype == compute_dtype
    raw = None if direct else [torch.empty(n_slots, s.block * s.head_dim, dtype=torch.uint8 if c.element_size() == 1
                                           else c.dtype, device=dev) for c in flat]
    scales = (float(w.k_scale), float(w.v_scale))

    def gather():
        for i, (src, dst) in enumerate(zip(flat, (kbuf, vbuf))):
            if direct:
                torch.index_select(src, 0, slots, out=dst.view(n_slots, -1))
                continue
            one_byte = src.element_size() == 1                  # fp8 gathered as bytes, converted after
            torch.index_select(src.view(torch.uint8) if one_byte else src, 0, slots, out=raw[i])
            dst.view(n_slots, -1).copy_(raw[i].view(src.dtype) if one_byte else raw[i])
            if scales[i] != 1.0:
                dst.mul_(scales[i])

    q = bf16_query(w) if compute_dtype == torch.bfloat16 else w.q.to(compute_dtype) * w.q_scale
    out = torch.empty(w.n_tokens, s.hq, s.head_dim, dtype=compute_dtype, device=dev)
    calls, zero = attention_calls(w, dp, q, kbuf, vbuf, out, bias=kernel in ("cudnn", "math-bias"))
    backends = _backends(kernel)
    scale = w.sm_scale

    def attention():
        for view in zero:
            view.zero_()
        with sdpa_kernel(backends):
            for qv, k, v, mask, ov in calls:
                o = F.scaled_dot_product_attention(qv, k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=qv.shape[1] != k.shape[1])
                ov.copy_(o.transpose(1, 2))

    return gather, attention, out, {"k_gathered": kbuf, "v_gathered": vbuf}, len(calls)


@register("dense-gather")
class DenseGather(Backend):
    description = ("Dense ceiling: each query block's shared blocks gathered contiguous per KV head, then dense "
                   "SDPA (needs every token of a query block to select the same blocks)")
    schedule = Schedule.Q_PACKED          # a tile of a query block's tokens over their shared blocks; not a candidate
    dense = True                          # a dense kernel over the gathered blocks: the ceiling, not a sparse schedule
    options = {"kernel": Choice("kernel", KERNELS, refuses=".+")}        # the SDPA kernel

    def __init__(self, kernel: str = "auto", name: str = "dense-gather"):
        if kernel not in KERNELS:
            raise ValueError(f"dense-gather has no kernel {kernel!r} (choose {', '.join(KERNELS)})")
        self.kernel, self.name = kernel, name
        self.dtypes = ("bf16", "fp8")

    def unavailable_reason(self, dtype: str, device) -> str | None:
        return gpu_reason(self.name, device, "torch SDPA's CUDA kernels") or super().unavailable_reason(dtype, device)

    def workload_unavailable_reason(self, w: Workload) -> str | None:
        reason = super().workload_unavailable_reason(w)
        if reason is None:
            try:
                self._dense_plan(w)                 # the shared-blocks rule, before anyone plans
            except BackendUnavailable as exc:
                return str(exc)
        return reason

    # the schedule is q-packed's, but the gather copy (bf16 K/V written and read) and one SDPA call per
    # run of query blocks are not in its model: 0.15-0.5 of the time measured on real-prefill
    unmodelled = "a probe; its gather copy and per-run SDPA calls are not modelled"

    def _dense_plan(self, w: Workload) -> DensePlan:
        """dense_plan(w), packed once for the reason check and the plan that follows it (weakly held)."""
        cached = getattr(self, "_packed", None)
        if cached is not None and cached[0]() is w:
            return cached[1]
        dp = dense_plan(w)
        self._packed = (weakref.ref(w), dp)
        return dp

    def _plan(self, w: Workload) -> Plan:
        dp = self._dense_plan(w)
        errors = []
        for kernel in (AUTO_ORDER if self.kernel == "auto" else (self.kernel,)):
            gather, attention, out, buffers, n_calls = build_stages(w, dp, kernel)
            try:
                gather()
                attention()                     # builds cuDNN graphs / picks kernels before capture
                torch.cuda.synchronize(w.device)
            except RuntimeError as exc:
                errors.append(f"{kernel}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}")
                del gather, attention, out, buffers
                continue
            break
        else:
            raise BackendUnavailable(f"dense-gather: no SDPA kernel ran ({'; '.join(errors)})")
        fp8 = w.dtype == "fp8"
        quant = ("fp8 K/V dequantized to bf16 in the gather stage (k_scale, v_scale applied there), bf16 Q "
                 "(q * q_scale, in plan), bf16 compute") if fp8 else "bf16 Q/K/V, bf16 compute"
        masks = ("whole blocks; additive 0/-inf bias [T, keys] where the last block is partial" if kernel == "cudnn"
                 else "keys cut at the last visible one; bottom-right causal (FA2's causal rule) on the local block")
        info = {"sdpa_kernel": kernel, "kernel_option": self.kernel, "tried": errors, "query_blocks": dp.groups,
                "full_query_blocks": dp.full_groups, "runs": len(dp.runs), "sdpa_calls": n_calls,
                "run_shapes": sorted({(r.rows, r.heads[0].blocks) for r in dp.runs}),
                "gathered_blocks": int(dp.slots.numel()),
                "gathered_bytes": 2 * int(dp.slots.numel()) * w.shape.block * w.shape.head_dim * 2, "mask": masks, "quantization": quant,
                "fast_path": "runs of full query blocks with the same block count: one SDPA call each"}
        return Plan(backend=self.name, stages={"gather": gather, "attention": attention}, output=out,
                    buffers=buffers, info=info)
