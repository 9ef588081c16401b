"""Dense masked baseline: what a model runs without sparse kernels.

Each request's queries attend its whole visible context (blocks 0 .. its last query's local block)
with the selection as an additive mask: 0 on the keys of the blocks a query selected and may see,
-inf elsewhere. Same output as the sparse schedules, context / selected keys times their work.

Requests with the same number of query tokens T and dense contexts within PAD_RATIO of each other
form a bucket, padded to its longest context (padding keys are masked). Per bucket three stages:
  gather     K/V of every context block into [Hkv, B, keys, D] (the paged cache is scattered; SDPA
             needs it contiguous), Q into [Hkv, B, G, T, D]; fp8 K/V and Q dequantized to bf16 here
  mask       the additive mask [Hkv, B, T, keys] built from the selection and q_limit on the device
  attention  one SDPA call per (bucket, KV head), then rows that see no key are zeroed (as the reference)
Two layouts of a KV head's G = Hq / Hkv query heads (SDPA's masked kernels take no GQA):
  expand  Q [B, G, T, D], K/V expanded over G (stride 0), the mask broadcast over G
  fold    the G heads folded into the rows: Q [B, 1, G x T, D], K/V [B, 1, keys, D], the mask copied G times
Kernels: cuDNN and the memory-efficient kernel through torch SDPA (FlashAttention takes no mask), math
on the CPU; and FlashInfer's FA2 paged prefill with a custom mask (layout "paged", kernels/dense_paged.py),
which reads the paged cache where it is: no K/V gather, a bit mask. On a GPU `plan()` tries the paged
path (where FlashInfer is installed) and every SDPA (kernel, layout) that fits in memory, keeps those
whose rows agree with the float64 reference, and runs the fastest (plan_info records each one's time):
the paged path wins decode (no gather: 8.1 against 33 ms at 256 requests of 64K, bf16), cuDNN over the
gathered copy wins prefill chunks (2.4 against 4.7 ms at N 2048 over 8K; docs/perf-log.md). @KERNEL
tries one kernel.
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..roofline.dtypes import model_dtype
from ..roofline.schedules import Schedule
from ..scenarios.workload import Workload, free_memory_bytes
from .base import Backend, BackendUnavailable, Plan, register
from .dense_paged import build_paged_stages, paged_sizes
from .options import Choice

KERNELS = ("flashinfer", "cudnn", "efficient", "math")
LAYOUTS = ("paged", "expand", "fold")
PAGED = ("flashinfer", "paged")
SDPA_CANDIDATES = (("cudnn", "fold"), ("efficient", "expand"), ("efficient", "fold"), ("cudnn", "expand"))
CPU_CANDIDATES = (("math", "expand"),)
PAD_RATIO = 1.125          # a bucket's longest dense context over its shortest: padding work wasted at most 12.5 %
CHECK_ROWS = 64            # rows of a candidate compared with the float64 reference in plan()
CHECK_TOL = 1e-2           # bf16 compute on exact bf16 inputs (fp8 data dequantize exactly)
TRIAL_REPS = 3
MEMORY_HEADROOM = 0.9      # of the free memory a plan may take


@dataclass
class Bucket:
    tokens: torch.Tensor   # [B, T] token ids, each row one request's query tokens in order
    rows: int              # T
    blocks: int            # dense context blocks (the longest request's; shorter ones padded)
    slots: torch.Tensor    # [Hkv, B, blocks] page * Hkv + head of each context block (0 on padding)

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]


def dense_buckets(w: Workload) -> list[Bucket]:
    """Requests grouped by query count and dense context length (module docstring)."""
    s = w.shape
    req = w.q_request.long().cpu()
    lim = w.q_limit.long().cpu()
    table = w.page_table.long().cpu()
    per = []
    for r in range(table.shape[0]):
        tok = torch.nonzero(req == r).view(-1)
        if tok.numel():
            per.append((tok.numel(), int(lim[tok].max()) // s.block + 1, r, tok))
    per.sort(key=lambda x: (x[0], x[1], x[2]))
    groups: list[list] = []
    for item in per:
        g = groups[-1] if groups else None
        if g and g[0][0] == item[0] and item[1] <= g[0][1] * PAD_RATIO:
            g.append(item)
        else:
            groups.append([item])
    heads = torch.arange(s.hkv).view(-1, 1, 1)
    out = []
    for g in groups:
        blocks = max(x[1] for x in g)
        reqs = torch.tensor([x[2] for x in g])
        cols = torch.arange(blocks)
        pages = table[reqs][:, :blocks] if table.shape[1] >= blocks else \
            torch.cat([table[reqs], torch.full((len(g), blocks - table.shape[1]), -1)], 1)
        pages = torch.where((pages >= 0) & (cols.view(1, -1) < torch.tensor([x[1] for x in g]).view(-1, 1)), pages, 0)
        out.append(Bucket(torch.stack([x[3] for x in g]), g[0][0], blocks, pages.unsqueeze(0) * s.hkv + heads))
    return out


def dense_sizes(w: Workload, buckets: list[Bucket], layout: str) -> dict:
    """Bytes the plan allocates: gathered K/V (bf16, plus the fp8 bytes gathered first), Q/O, the mask
    (bf16, with its bool temporaries; fold: G copies), and the keys and FLOPs the dense attention executes."""
    s = w.shape
    slots = sum(b.slots.numel() for b in buckets)
    kv = 2 * slots * s.block * s.head_dim * (2 + (1 if w.dtype == "fp8" else 0))
    mask_elems = sum(s.hkv * b.batch * b.rows * b.blocks * s.block for b in buckets)
    mask = mask_elems * (2 + 2 + (2 * s.group if layout == "fold" else 0))
    qo = 4 * w.n_tokens * s.hq * s.head_dim * 2
    keys = sum(b.batch * b.rows * b.blocks * s.block for b in buckets)
    return {"kv_bytes": kv, "mask_bytes": mask, "total_bytes": kv + mask + qo,
            "dense_keys": keys, "executed_flops": 4.0 * s.hq * s.head_dim * keys}


def free_bytes(device) -> int | None:
    """Memory a plan may allocate: the free device memory plus what torch's allocator holds unused
    (a workload's float32 draw leaves its cache there), or the host's available memory."""
    device = torch.device(device)
    free = free_memory_bytes(device)
    if device.type == "cuda" and free is not None:
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free


def _sdpa_backends(kernel: str):
    from torch.nn.attention import SDPBackend
    return [{"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "math": SDPBackend.MATH}[kernel]]


def build_stages(w: Workload, buckets: list[Bucket], kernel: str, layout: str):
    """(stages, output) for one (kernel, layout): gather, mask, attention."""
    from torch.nn.attention import sdpa_kernel
    s = w.shape
    dev, b, d, g, hkv = w.device, s.block, s.head_dim, s.group, s.hkv
    bf16 = torch.bfloat16
    slots = torch.cat([bk.slots.reshape(-1) for bk in buckets]).to(dev)
    n_slots = slots.numel()
    kbuf = torch.empty(n_slots, b * d, dtype=bf16, device=dev)
    vbuf = torch.empty_like(kbuf)
    flat = [c.view(w.num_pages * hkv, b * d) for c in (w.k_cache, w.v_cache)]
    one_byte = w.k_cache.element_size() == 1
    raw = torch.empty(n_slots, b * d, dtype=torch.uint8, device=dev) if one_byte else None
    scales = (float(w.k_scale), float(w.v_scale))
    qbufs, kvs, masks, folds, empties, toks, outs = [], [], [], [], [], [], []
    start = 0
    for bk in buckets:
        n = bk.slots.numel()
        keys = bk.blocks * b
        kvs.append([buf[start:start + n].view(hkv, bk.batch, keys, d) for buf in (kbuf, vbuf)])
        start += n
        qbufs.append(torch.empty(hkv, bk.batch, g, bk.rows, d, dtype=bf16, device=dev))
        outs.append(torch.empty_like(qbufs[-1]))
        masks.append(torch.empty(hkv, bk.batch, bk.rows, keys, dtype=bf16, device=dev))
        folds.append(torch.empty(hkv, bk.batch, g, bk.rows, keys, dtype=bf16, device=dev) if layout == "fold" else None)
        empties.append(torch.empty(hkv, bk.batch, bk.rows, dtype=torch.bool, device=dev))
        toks.append(bk.tokens.to(dev))
    out = torch.empty(w.n_tokens, s.hq, d, dtype=bf16, device=dev)
    key_pos = [torch.arange(bk.blocks * b, device=dev) for bk in buckets]

    def gather():
        for i, (src, dst) in enumerate(zip(flat, (kbuf, vbuf))):
            if one_byte:                                   # fp8 gathered as bytes, converted after
                torch.index_select(src.view(torch.uint8), 0, slots, out=raw)
                dst.copy_(raw.view(src.dtype))
                if scales[i] != 1.0:
                    dst.mul_(scales[i])
            else:
                torch.index_select(src, 0, slots, out=dst)
        q = w.q if w.q.dtype == bf16 else (w.q.to(torch.float32) * w.q_scale).to(bf16)
        for bk, qb, tok in zip(buckets, qbufs, toks):
            qb.copy_(q[tok.view(-1)].view(bk.batch, bk.rows, hkv, g, d).permute(2, 0, 3, 1, 4))

    def mask():
        for bk, m, f, e, tok, pos in zip(buckets, masks, folds, empties, toks, key_pos):
            sel = w.selection[:, tok.view(-1)].long().view(hkv, bk.batch, bk.rows, s.topk)
            sel = torch.where((sel >= 0) & (sel < bk.blocks), sel, bk.blocks)
            chosen = torch.zeros(hkv, bk.batch, bk.rows, bk.blocks + 1, dtype=torch.bool, device=dev)
            chosen.scatter_(3, sel, True)
            # expand + reshape, not repeat_interleave: no output size to read back inside a CUDA graph
            seen = chosen[..., :bk.blocks].unsqueeze(-1).expand(hkv, bk.batch, bk.rows, bk.blocks, b)
            seen = seen.reshape(hkv, bk.batch, bk.rows, bk.blocks * b)
            seen &= pos.view(1, 1, 1, -1) <= w.q_limit[tok].long().view(1, bk.batch, bk.rows, 1)
            torch.any(seen, dim=3, out=e)
            m.zero_().masked_fill_(~seen, float("-inf"))
            if f is not None:
                f.copy_(m.unsqueeze(2).expand_as(f))

    backends = _sdpa_backends(kernel)
    scale = w.sm_scale

    def attention():
        with sdpa_kernel(backends):
            for bk, qb, (kb, vb), m, f, e, ob, tok in zip(buckets, qbufs, kvs, masks, folds, empties, outs, toks):
                bsz, t, keys = bk.batch, bk.rows, bk.blocks * b
                for h in range(hkv):
                    if layout == "fold":
                        o = F.scaled_dot_product_attention(
                            qb[h].view(bsz, 1, g * t, d), kb[h].unsqueeze(1), vb[h].unsqueeze(1),
                            attn_mask=f[h].view(bsz, 1, g * t, keys), scale=scale)
                    else:
                        o = F.scaled_dot_product_attention(
                            qb[h], kb[h].unsqueeze(1).expand(bsz, g, keys, d),
                            vb[h].unsqueeze(1).expand(bsz, g, keys, d),
                            attn_mask=m[h].unsqueeze(1).expand(bsz, g, t, keys), scale=scale)
                    ob[h].copy_(o.view(bsz, g, t, d))
                ob.masked_fill_(~e.view(hkv, bsz, 1, t, 1), 0.0)
                out.index_copy_(0, tok.view(-1), ob.permute(1, 3, 0, 2, 4).reshape(bsz * t, s.hq, d))

    return {"gather": gather, "mask": mask, "attention": attention}, out


def _check_rows(w: Workload, out: torch.Tensor) -> float:
    from ..scenarios.reference import reference_attention, relative_error
    rows = torch.linspace(0, w.n_tokens - 1, min(CHECK_ROWS, w.n_tokens)).round().long().unique().to(w.device)
    return relative_error(out[rows], reference_attention(w, rows)[0])


def _time_module(stages: dict, device) -> float:
    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        for st in stages.values():
            st()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(TRIAL_REPS):
        begin.record()
        for st in stages.values():
            st()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median_high(times)


def _flashinfer_here(device) -> bool:
    from .flashinfer_common import gpu_reason, import_flashinfer
    if gpu_reason("dense-masked", device):
        return False
    try:
        import_flashinfer()
    except BackendUnavailable:
        return False
    return True


@register("dense-masked")
class DenseMasked(Backend):
    description = ("Dense baseline: each request's whole visible context with the selection as a mask: FlashInfer's "
                   "paged FA2 with a custom mask, or torch SDPA (cuDNN, memory-efficient) over a gathered copy")
    schedule = Schedule.DENSE_MASKED      # modelled by predict_dense
    candidate = True                      # auto weighs running dense
    dense = True
    stage_names = ("gather", "mask", "attention")
    options = {"kernel": Choice("kernel", KERNELS), "layout": Choice("layout", LAYOUTS)}     # @KERNEL[-LAYOUT]

    def __init__(self, kernel: str | None = None, layout: str | None = None, name: str = "dense-masked"):
        if layout is not None and kernel is None:
            raise ValueError(f"dense-masked: layout {layout!r} needs a kernel (@KERNEL-LAYOUT)")
        if kernel is not None and layout is not None and (kernel == "flashinfer") != (layout == "paged"):
            raise ValueError(f"dense-masked: kernel {kernel!r} takes no layout {layout!r} (flashinfer runs 'paged', "
                             "the SDPA kernels 'expand' or 'fold')")
        self.kernel, self.layout, self.name = kernel, layout, name
        self.dtypes = ("bf16", "fp8")

    def candidates(self, device) -> list[tuple[str, str]]:
        if self.kernel == "flashinfer":
            return [PAGED]
        if self.kernel is not None:
            return [(self.kernel, lay) for lay in ((self.layout,) if self.layout else ("expand", "fold"))]
        if torch.device(device).type != "cuda":
            return list(CPU_CANDIDATES)
        return [PAGED, *SDPA_CANDIDATES] if _flashinfer_here(device) else list(SDPA_CANDIDATES)

    def build_pending_reason(self, w: Workload) -> str | None:
        # the paged path's FA2 prefill module (bf16 Q and output, K/V in the data's dtype) is not in
        # FlashInfer's prebuilt set: a first plan JIT-builds it (49 s bf16, 23 s fp8 on the H200, 2026-12-03)
        from .flashinfer_common import FA3_SUFFIX, fa2_prefill_module, jit_module_built
        if PAGED not in self.candidates(w.device):
            return None
        module = fa2_prefill_module(w.dtype, w.shape.head_dim)
        if jit_module_built(module, unless=FA3_SUFFIX):
            return None
        return (f"{self.name}: no built FA2 prefill module ({module}) in FlashInfer's JIT cache; a first plan "
                f"JIT-builds it (about a minute); build it ahead with `msa-bench check --backend {self.name} "
                f"--dtype {w.dtype}`")

    def model_record(self, w: Workload, profile=None) -> dict:
        """With the path its bytes are counted on: the paged path's where it is a candidate (the least the
        dense work moves; its MMAs are the same on every path)."""
        return {**super().model_record(w, profile), "paged": self.candidates(w.device)[0] == PAGED}

    def _sizes(self, w: Workload, buckets, layout: str) -> dict:
        return paged_sizes(w) if layout == "paged" else dense_sizes(w, buckets, layout)

    def workload_unavailable_reason(self, w: Workload) -> str | None:
        reason = super().workload_unavailable_reason(w)
        if reason:
            return reason
        cands = self.candidates(w.device)
        buckets = dense_buckets(w) if any(lay != "paged" for _, lay in cands) else []
        free = free_bytes(w.device)
        sizes = [self._sizes(w, buckets, lay) for _, lay in cands]
        need = min(sz["total_bytes"] for sz in sizes)
        if free is not None and need > free * MEMORY_HEADROOM:
            sz = min(sizes, key=lambda x: x["total_bytes"])
            return (f"dense-masked needs {need / 2**30:,.1f} GiB (gathered K/V {sz['kv_bytes'] / 2**30:,.1f} GiB, "
                    f"mask {sz['mask_bytes'] / 2**30:,.1f} GiB), more than the {free * MEMORY_HEADROOM / 2**30:,.1f} "
                    f"GiB it may take on {w.device.type}")
        return None

    def _plan(self, w: Workload) -> Plan:
        cands = self.candidates(w.device)
        buckets = dense_buckets(w) if any(lay != "paged" for _, lay in cands) else []
        tried, best = [], None
        for kernel, layout in cands:
            sizes = self._sizes(w, buckets, layout)
            label = f"{kernel}-{layout}"
            free = free_bytes(w.device)
            if free is not None and sizes["total_bytes"] > free * MEMORY_HEADROOM:
                tried.append(f"{label}: needs {sizes['total_bytes'] / 2**30:,.1f} GiB")
                continue
            try:
                keep, extra = None, {}
                if layout == "paged":
                    stages, out, extra, keep = build_paged_stages(w)
                else:
                    stages, out = build_stages(w, buckets, kernel, layout)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    for st in stages.values():
                        st()
                    if w.device.type == "cuda":
                        torch.cuda.synchronize(w.device)
                    err = _check_rows(w, out)
                    if not err <= CHECK_TOL:
                        tried.append(f"{label}: max rel err {err:.2e} over {CHECK_TOL:g}")
                        continue
                    seconds = _time_module(stages, w.device)
            except (RuntimeError, BackendUnavailable) as exc:
                text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                tried.append(f"{label}: {text[:160]}")
                continue
            tried.append(f"{label}: {seconds * 1e3:.3f} ms")
            if best is None or seconds < best[0]:
                best = (seconds, kernel, layout, stages, out, sizes, extra, keep)
            else:
                del stages, out, keep
        if best is None:
            raise BackendUnavailable(f"dense-masked: no dense kernel ran ({'; '.join(tried)})")
        _, kernel, layout, stages, out, sizes, extra, keep = best
        s = w.shape
        selected = float((w.selection >= 0).sum()) * s.block
        quant = ("fp8 Q dequantized to bf16 (q_scale exact), fp8 K/V dequantized in the kernel, bf16 compute"
                 if w.dtype == "fp8" and layout == "paged" else
                 "fp8 Q/K/V dequantized to bf16 in the gather stage (q_scale, k_scale, v_scale applied there), "
                 "bf16 compute" if w.dtype == "fp8" else "bf16 Q/K/V, bf16 compute")
        info = {"schedule": Schedule.DENSE_MASKED, "kernel": kernel, "layout": layout, "paged": layout == "paged",
                "tried": tried, "gathered_bytes": sizes["kv_bytes"], "mask_bytes": sizes["mask_bytes"],
                "dense_keys": sizes["dense_keys"], "executed_flops": sizes["executed_flops"],
                "sparsity_ratio": sizes["dense_keys"] * s.hkv / selected if selected else None,
                "quantization": quant, **extra}
        if layout == "paged":
            info["mask"] = "bits, 1 on selected visible keys (FlashInfer custom mask, little bit order)"
        else:
            info.update(buckets=len(buckets), sdpa_calls=len(buckets) * s.hkv,
                        bucket_shapes=sorted({(bk.batch, bk.rows, bk.blocks) for bk in buckets}),
                        mask="additive bf16, 0 on selected visible keys, -inf elsewhere (padding included)")
        plan = Plan(backend=self.name, stages=stages, output=out, info=info, step=keep[1] if keep else None)
        plan._wrapper = keep              # FlashInfer's planned state lives as long as the plan
        return plan
