"""The workload contract every backend consumes: tensors plus a top-k block selection.

Layout (fixed; this docstring is the contract, docs/architecture.md shows where it sits):
  q         [N, Hq, D]                      data dtype (fp8: e4m3 with q_scale)
  k_cache   [num_pages, Hkv, block, D]      head-major paged cache; a
  v_cache   [num_pages, Hkv, block, D]      [num_pages * Hkv, 1, block, D] view folds the head into the page
  selection [Hkv, N, topk] int32            logical block ids of the query's request, valid first, -1 padding,
                                            causal: the query's own (local) block is the last valid entry
  page_table[R, max_blocks] int32           logical block -> physical page, per request
  q_request [N] int32                       request of each query token
  q_limit   [N] int32                       last key position (within its request) the query may see:
                                            its own position when causal, kv_len - 1 otherwise
  pages     [Hkv, N, topk] int32            physical page of each selected block (-1 padding); derived
  page_block[num_pages] int32               logical block index held by each physical page; derived

Keys of logical block b sit at positions b * block + t, t in [0, block).
A key is visible to query q iff its position <= q_limit[q].
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..errors import DoesNotFit, UserError
from ..roofline.dtypes import DType
from ..roofline.shape import AttnShape  # noqa: F401  (re-exported: the shape a workload carries)

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT32_MAX = 2**31 - 1     # key positions, block ids and edge indices are int32 in every backend
SEED_LIMIT = 2**63        # torch generators take 64-bit seeds; generators also use seed + 1


class WorkloadError(UserError, ValueError):
    """A workload that cannot be built as asked; the message is one line for the user."""


def torch_dtype(dtype: DType) -> torch.dtype:
    return {DType.BF16: torch.bfloat16, DType.FP8: torch.float8_e4m3fn,
            DType.FP16: torch.float16, DType.FP32: torch.float32}[dtype]


# ---- sizes a workload can have, checked before anything is allocated -----------------------------

def size_problem(shape: AttnShape, tokens: int, context: int, pages: Callable[[], int],
                 seed: int) -> tuple[str, str] | None:
    """(option, why) for a workload whose indices or seed overflow what the code can hold, else None.
    `pages` counts its physical pages, asked only where its indices fit: a serving step of a billion
    requests is refused by its N before its requests are laid out to count them."""
    entries = shape.hkv * tokens * shape.topk
    if not 0 <= seed < SEED_LIMIT:
        return "seed", f"seed must be in [0, 2^63), got {seed}"
    if context > INT32_MAX - shape.block:
        return "context", f"context {context} tokens overflows int32 key positions (at most {INT32_MAX - shape.block})"
    if entries > INT32_MAX:
        return "tokens", (f"Hkv x N x top-k = {shape.hkv} x {tokens} x {shape.topk} = {entries} selection entries "
                          f"overflow int32 indices (at most {INT32_MAX})")
    elements = max(pages() * shape.hkv * shape.block, tokens * shape.hq) * shape.head_dim
    if elements > 2**62:
        return "head_dim", f"a tensor of {elements} elements overflows 64-bit offsets"
    return None


def footprint_bytes(shape: AttnShape, dtype: str, tokens: int, pages: int, with_tensors: bool = True,
                    partials: bool = True) -> int:
    """A lower bound on the memory a workload needs: the selection and its derived indices (about 40
    bytes per entry with the generators' temporaries), Q/K/V plus the float32 draw of the largest, and
    with `partials` what a KV-outer backend adds (float32 partial outputs for every selected block and
    the output). Used to refuse a point up front rather than fail in the allocator."""
    need = 40 * shape.hkv * tokens * shape.topk
    q = tokens * shape.hq * shape.head_dim
    if with_tensors:
        kv = pages * shape.hkv * shape.block * shape.head_dim
        need += (q + 2 * kv) * DType(dtype).bytes + 4 * max(q, kv)
    if partials:
        need += 4 * q * (shape.topk + 1)
    return need


def free_memory_bytes(device) -> int | None:
    """Memory a workload may take on `device`: free GPU memory, or the host's MemAvailable; None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(need: int, device, what: str) -> None:
    """DoesNotFit (one line) when `need` bytes exceed the memory free on `device`."""
    free = free_memory_bytes(device)
    if free is not None and need > free:
        raise DoesNotFit(f"{what} needs at least {need / 2**30:,.1f} GiB, more than the {free / 2**30:,.1f} GiB "
                            f"free on {torch.device(device).type}")


@dataclass
class Workload:
    shape: AttnShape
    dtype: DType
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    selection: torch.Tensor
    page_table: torch.Tensor
    q_request: torch.Tensor
    q_limit: torch.Tensor
    pages: torch.Tensor
    page_block: torch.Tensor
    causal: bool
    q_scale: float = 1.0
    k_scale: float = 1.0
    v_scale: float = 1.0
    meta: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k_cache.shape[0]

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.shape.head_dim)

    def dequantized(self, dtype=torch.float64):
        """(q, k, v) as `dtype` with their scales applied: the values every backend computes on."""
        return (self.q.to(dtype) * self.q_scale, self.k_cache.to(dtype) * self.k_scale,
                self.v_cache.to(dtype) * self.v_scale)

    def to(self, device) -> "Workload":
        moved = {name: getattr(self, name).to(device) for name in
                 ("q", "k_cache", "v_cache", "selection", "page_table", "q_request", "q_limit",
                  "pages", "page_block")}
        return replace(self, **moved)

    def with_fresh_data(self, seed: int) -> "Workload":
        """Same selection and layout, new random Q/K/V (for L2-cold rotation and fresh-input checks)."""
        q, k, v, scales = draw_tensors(self.shape, self.dtype, self.n_tokens, self.num_pages, seed, self.device)
        return replace(self, q=q, k_cache=k, v_cache=v, q_scale=scales[0], k_scale=scales[1], v_scale=scales[2])


def _quantize(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, float]:
    if dtype != "fp8":
        return x.to(torch_dtype(dtype)), 1.0
    # A power-of-two scale keeps fp8 * scale exact in bf16, so a bf16-Q backend sees the same values.
    # In place and without abs(): a full-size float32 temporary more would not fit a 1M-token cache on
    # an 80 GB GPU (footprint_bytes counts one).
    lo, hi = torch.aminmax(x)
    amax = max(-lo.item(), hi.item())
    scale = 2.0 ** math.ceil(math.log2(max(amax, 1e-12) / FP8_MAX))
    return x.div_(scale).to(torch.float8_e4m3fn), scale


def draw_tensors(shape: AttnShape, dtype: str, n_tokens: int, num_pages: int, seed: int, device="cpu"):
    """Seeded standard-normal Q, K, V (never zeros), quantized to the data dtype."""
    dtype = DType.parse(dtype, "dtype")
    # Drawn on the target device: host-side drawing of a 1M-token cache takes minutes. The values are
    # seeded per device type (a CPU and a GPU workload with the same seed differ).
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    dims_q = (n_tokens, shape.hq, shape.head_dim)
    dims_kv = (num_pages, shape.hkv, shape.block, shape.head_dim)
    out, scales = [], []
    for dims in (dims_q, dims_kv, dims_kv):
        x = torch.randn(dims, generator=gen, dtype=torch.float32, device=device)
        t, s = _quantize(x, dtype)
        out.append(t)
        scales.append(s)
        del x
    return out[0], out[1], out[2], tuple(scales)


def physical_pages(selection: torch.Tensor, page_table: torch.Tensor, q_request: torch.Tensor) -> torch.Tensor:
    """Translate logical block ids [Hkv, N, topk] to physical pages through each query's request page table."""
    valid = selection >= 0
    req = q_request.long().view(1, -1, 1).expand_as(selection)
    pages = page_table.long()[req, selection.long().clamp(min=0)]
    return torch.where(valid, pages, torch.full_like(pages, -1)).to(torch.int32)


def full_context(w: Workload, rows=None) -> Workload:
    """The workload of query `rows` (all by default) with the selection that lists every block each may see,
    0 to its own in order (its local block last under causality): attention over it is dense attention
    over the visible context, what a backend that ignores the selection computes (Backend.full_context).
    Rows are taken first: a row selects up to its context's blocks, so only the rows checked are built."""
    rows = torch.arange(w.n_tokens, device=w.device) if rows is None else torch.as_tensor(rows, device=w.device).long()
    limit = w.q_limit[rows].long()
    blocks = int(limit.max()) // w.shape.block + 1 if rows.numel() else 1
    ids = torch.arange(blocks, device=w.device).view(1, -1)
    sel = torch.where(ids <= (limit // w.shape.block).view(-1, 1), ids, -1).to(torch.int32)
    sel = sel.unsqueeze(0).expand(w.shape.hkv, -1, -1).contiguous()
    q_request = w.q_request[rows]
    return replace(w, shape=replace(w.shape, topk=blocks), q=w.q[rows], selection=sel, q_request=q_request,
                   q_limit=w.q_limit[rows], pages=physical_pages(sel, w.page_table, q_request))


def build_workload(shape: AttnShape, dtype: str, selection: torch.Tensor, page_table: torch.Tensor,
                   q_request: torch.Tensor, q_limit: torch.Tensor, num_pages: int, causal: bool,
                   seed: int = 0, device="cpu", meta: dict | None = None, tensors=None) -> Workload:
    """Assemble a workload from a selection and its page tables, drawing seeded random tensors
    unless `tensors` = (q, k, v, (q_scale, k_scale, v_scale)) supplies them. Every workload is
    validated here (selection.check_selection and the page table): a contract violation is a
    one-line WorkloadError naming its (head, token, slot), before any backend sees it."""
    from .selection import check_selection
    dtype = DType.parse(dtype, "dtype")
    if selection.dim() != 3 or selection.shape[0] != shape.hkv or selection.shape[2] != shape.topk:
        raise WorkloadError(f"selection shape {tuple(selection.shape)} does not match hkv={shape.hkv}, topk={shape.topk}")
    hkv, n, topk = selection.shape
    if page_table.dim() != 2 or (page_table < -1).any() or (page_table >= num_pages).any():
        raise WorkloadError(f"page_table must be [requests, blocks] of page ids in [0, {num_pages}) or -1")
    check_selection(selection, q_limit, shape.block, causal, q_request=q_request, page_table=page_table)
    pages = physical_pages(selection, page_table, q_request)
    page_block = torch.full((num_pages,), -1, dtype=torch.int32)
    used = page_table >= 0
    blocks = torch.arange(page_table.shape[1], dtype=torch.int32).expand_as(page_table)
    page_block[page_table[used].long()] = blocks[used]
    if tensors is None:
        tensors = draw_tensors(shape, dtype, n, num_pages, seed, device)
    q, k, v, (qs, ks, vs) = tensors
    return Workload(shape=shape, dtype=dtype, q=q.to(device), k_cache=k.to(device), v_cache=v.to(device),
                    selection=selection.to(torch.int32).to(device), page_table=page_table.to(torch.int32).to(device),
                    q_request=q_request.to(torch.int32).to(device), q_limit=q_limit.to(torch.int32).to(device),
                    pages=pages.to(device), page_block=page_block.to(device), causal=causal,
                    q_scale=qs, k_scale=ks, v_scale=vs, meta=dict(meta or {}))
