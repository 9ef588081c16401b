"""Production prefill shapes (MiniMax MSA, data/MSA-PREFILL-DATA.md) as causal chunked-prefill workloads.

A case is a batch of requests; request i has prefix_lens[i] cached tokens and query_lens[i] new
query tokens at positions prefix_lens[i] + q_idx. Its selection follows the rule of the MSA
kernels' benchmarks: each query keeps min(local, topk - 1) distinct history blocks spread evenly
over its complete history blocks [0, local), then its local block last, -1 padding after. The
even spread is shifted by a jitter per (KV head, request) drawn from the case id, and the history
entries are rotated per query so they are not sorted (backends must not rely on order). Everything
is deterministic from the case id; the tensor seed only changes Q/K/V.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

import torch

from ..errors import UserError
from .selection import append_local, assemble, local_blocks, scattered_page_table
from .workload import AttnShape, Workload

SHAPES_FILE = "msa_prefill_case_shapes_batch1.jsonl"
SELECTION_FILE = "msa_prefill_benchmark_cases_v1.jsonl"
_JITTER_DENOM = 1 << 20   # integer jitter keeps the spread exact (no float rounding at block edges)


@dataclass(frozen=True)
class PrefillCase:
    case_id: str
    query_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    tags: tuple[str, ...] = ()
    representative_weight: int | None = None
    stratum: str | None = None
    count: int = 1

    @property
    def batch_size(self) -> int:
        return len(self.query_lens)

    @property
    def final_kv_lens(self) -> tuple[int, ...]:
        return tuple(p + q for p, q in zip(self.prefix_lens, self.query_lens))

    @property
    def total_q(self) -> int:
        return sum(self.query_lens)

    @property
    def max_final_kv(self) -> int:
        return max(self.final_kv_lens)

    @property
    def is_representative(self) -> bool:
        return "representative" in self.tags

    @property
    def weight(self) -> float:
        """Call weight for production-weighted aggregates: representative_weight, else 0 (diagnostic case)."""
        return float(self.representative_weight or 0)

    @property
    def seed(self) -> int:
        return int.from_bytes(hashlib.sha256(self.case_id.encode()).digest()[:8], "little") & ((1 << 63) - 1)

    def shape_id(self) -> str:
        """The upstream case id rule: SHA-256 prefix of the canonical shape JSON."""
        canonical = json.dumps({"batch_size": self.batch_size, "prefix_lens": list(self.prefix_lens),
                                "query_lens": list(self.query_lens)}, separators=(",", ":"), sort_keys=True)
        return "prefill_" + hashlib.sha256(canonical.encode()).hexdigest()[:20]


def _read_jsonl(name: str) -> list[dict]:
    text = resources.files("msa_bench.scenarios.data").joinpath(name).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@cache
def benchmark_selection() -> tuple[dict, ...]:
    """The 128 entries of the MSA benchmark selection (tags, weights, summary metrics; no lengths)."""
    return tuple(_read_jsonl(SELECTION_FILE))


@cache
def load_cases() -> dict[str, PrefillCase]:
    """The cases whose per-request lengths are shipped, by case id (ids verified against their shapes)."""
    cases = {}
    for row in _read_jsonl(SHAPES_FILE):
        case = PrefillCase(case_id=row["case_id"], query_lens=tuple(row["query_lens"]),
                           prefix_lens=tuple(row["prefix_lens"]), tags=tuple(row.get("tags", ())),
                           representative_weight=row.get("representative_weight"), stratum=row.get("stratum"),
                           count=int(row.get("count", 1)))
        if case.shape_id() != case.case_id or tuple(row["final_kv_lens"]) != case.final_kv_lens:
            raise UserError(f"data/{SHAPES_FILE}: case {case.case_id} does not match its lengths (corrupt data)")
        cases[case.case_id] = case
    return cases


def get_case(case_id: str) -> PrefillCase:
    cases = load_cases()
    if case_id in cases:
        return cases[case_id]
    entry = next((e for e in benchmark_selection() if e["case_id"] == case_id), None)
    if entry is not None:
        raise UserError(f"prefill case {case_id} (batch {entry['batch_size']}) is in the benchmark selection "
                        f"but its per-request lengths are not shipped (only batch-1 cases are)")
    raise UserError(f"unknown prefill case {case_id!r}; `msa-bench scenarios --cases` lists the {len(cases)} "
                    "shipped case ids")


def representative_cases(max_total_q: int | None = None, max_final_kv: int | None = None) -> list[PrefillCase]:
    """Shipped representative cases, optionally bounded in size, in selection order."""
    out = []
    for c in load_cases().values():
        if not c.is_representative:
            continue
        if max_total_q is not None and c.total_q > max_total_q:
            continue
        if max_final_kv is not None and c.max_final_kv > max_final_kv:
            continue
        out.append(c)
    return out


def prefill_selection(case: PrefillCase, shape: AttnShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(selection [Hkv, N, topk] int32, q_request [N] int32, q_limit [N] int32) for a case."""
    ql = torch.tensor(case.query_lens, dtype=torch.long)
    req = torch.repeat_interleave(torch.arange(case.batch_size), ql)                    # [N]
    starts = torch.cumsum(ql, 0) - ql
    q_idx = torch.arange(case.total_q) - starts[req]
    q_limit = torch.tensor(case.prefix_lens, dtype=torch.long)[req] + q_idx
    local = local_blocks(q_limit, shape.block)                                          # [N]
    hist = shape.topk - 1
    count = local.clamp(max=hist)                                                       # history entries
    safe = count.clamp(min=1)
    gen = torch.Generator().manual_seed(case.seed)
    jitter = torch.randint(_JITTER_DENOM, (shape.hkv, case.batch_size), generator=gen)[:, req]   # [Hkv, N]
    head = torch.arange(shape.hkv).view(-1, 1, 1)
    slot = torch.arange(hist).view(1, 1, -1)
    rotated = torch.remainder(slot + head + q_idx.view(1, -1, 1), safe.view(1, -1, 1))
    # evenly spaced over [0, local): spacing local / count >= 1 keeps them distinct and below local
    blocks = torch.div((rotated * _JITTER_DENOM + jitter.unsqueeze(-1)) * local.view(1, -1, 1),
                       safe.view(1, -1, 1) * _JITTER_DENOM, rounding_mode="floor")
    sel = append_local(blocks, count, local, shape.topk)
    return sel, req.to(torch.int32), q_limit.to(torch.int32)


def prefill_workload(case: PrefillCase, shape: AttnShape, dtype: str, seed: int = 0, device="cpu",
                     with_tensors: bool = True) -> Workload:
    sel, q_request, q_limit = prefill_selection(case, shape)
    gen = torch.Generator().manual_seed(case.seed + 1)
    table, num_pages = scattered_page_table(list(case.final_kv_lens), shape.block, gen)
    meta = {"generator": "real-prefill", "case_id": case.case_id, "weight": case.weight, "tags": list(case.tags),
            "seed": seed, "kv_lens": list(case.final_kv_lens)}
    return assemble(shape, dtype, sel, table, q_request, q_limit, num_pages, True, seed, device, with_tensors,
                    meta=meta)
