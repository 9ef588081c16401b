"""MSA combine: each (query, KV head) reads its slots [0, valid blocks) contiguously from o_slot /
lse_slot (already normalized by the attention epilogue) and merges them by log-sum-exp."""
from __future__ import annotations

import torch

from .. import triton_common  # noqa: F401
import triton
import triton.language as tl


@triton.jit
def combine_slots_kernel(o_slot_ptr, lse_slot_ptr, pages_ptr, out_ptr, lse_ptr, n_tokens,
                         HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                         TOPK: tl.constexpr, TOPK_P2: tl.constexpr, PAIRS: tl.constexpr):
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    r = tl.arange(0, TOPK_P2)
    for i in tl.static_range(PAIRS):
        pair = tl.program_id(0) * PAIRS + i          # pair = query * HKV + head
        if pair < n_tokens * HKV:
            query = pair // HKV
            head = pair % HKV
            chosen = tl.load(pages_ptr + (head * n_tokens + query) * TOPK + r, mask=r < TOPK, other=-1)
            n_valid = tl.sum((chosen >= 0).to(tl.int32), 0)
            # slot s of (query, head) holds rows (s * N + query) * HQ + head * G + g
            row0 = query.to(tl.int64) * HQ + head * G
            slot_stride = row0 * 0 + n_tokens * HQ          # int64 (n_tokens may be a constexpr 1)
            lse_s = tl.load(lse_slot_ptr + row0 + r[:, None] * slot_stride + g[None, :],
                            mask=(r < n_valid)[:, None], other=float("-inf"))         # [TOPK_P2, G]
            big_m = tl.max(lse_s, 0)
            big_m = tl.where(big_m == float("-inf"), 0.0, big_m)
            big_l = tl.sum(tl.exp(lse_s - big_m[None, :]), 0)
            acc = tl.zeros([G, D], dtype=tl.float32)
            for k in tl.static_range(TOPK):
                ok = (g * 0 + k) < n_valid
                rows = row0 + k * slot_stride + g
                w_k = tl.exp(tl.load(lse_slot_ptr + rows, mask=ok, other=float("-inf")) - big_m)
                o_k = tl.load(o_slot_ptr + rows[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
                acc += w_k[:, None] * o_k.to(tl.float32)
            seen = big_l > 0
            safe_l = tl.where(seen, big_l, 1.0)
            out = tl.where(seen[:, None], acc / safe_l[:, None], 0.0)
            lse = tl.where(seen, big_m + tl.log(safe_l), float("-inf"))
            out_rows = row0 + g
            tl.store(out_ptr + out_rows[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty))
            tl.store(lse_ptr + out_rows, lse)


class SlotCombine:
    def __init__(self, workload, buffers: dict, out: torch.Tensor, lse: torch.Tensor, pairs: int = 4,
                 num_warps: int = 4):
        s = workload.shape
        self.w, self.b, self.out, self.lse = workload, buffers, out, lse
        self.pairs, self.num_warps = pairs, num_warps
        self.consts = dict(HQ=s.hq, HKV=s.hkv, G=s.group, D=s.head_dim, TOPK=s.topk,
                           TOPK_P2=triton.next_power_of_2(s.topk), PAIRS=pairs)

    def __call__(self) -> None:
        w, b = self.w, self.b
        grid = (triton.cdiv(w.n_tokens * w.shape.hkv, self.pairs),)
        combine_slots_kernel[grid](b["o_slot"], b["lse_slot"], w.pages, self.out, self.lse, w.n_tokens,
                                   num_warps=self.num_warps, **self.consts)
