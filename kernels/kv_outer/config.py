"""Launch configuration of the KV-stationary stages, with the defaults the GPU tuning picked (TUNED, per
data dtype), and what a configuration means for the roofline model (launch_terms).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from . import TILE_Q


@dataclass(frozen=True)
class KVOuterConfig:
    tile_q: int = TILE_Q            # query tokens per tile (rows = tile_q * G)
    num_ctas: int | None = None     # persistent attention grid; None: SM count x ctas_per_sm (4 on CPU)
    ctas_per_sm: int = 1
    attn_num_warps: int = 8
    attn_num_stages: int = 2
    attn_chunk: int = 0             # 0: persistent CTAs over the scheduler's cta_range; k > 0: work
                                    # items of k tiles in tile order, one program each (KV-head-coherent
                                    # L2 use of Q)
    q_ranges: int = 1               # tile order: group tiles by (KV head, one of q_ranges ranges of query
                                    # tokens) so a group's Q rows fit L2 (scheduler.py); 1: key order
    order_chunk: int = 0            # persistent CTAs: deal the grouped order round-robin in chunks of
                                    # this many tiles so they walk the groups together; 0: contiguous slices
    order_phases: bool = False      # persistent CTAs: each takes an equal contiguous part of every group,
                                    # its parts end to end, so they walk the groups together with K/V
                                    # runs kept whole (scheduler.py); with q_ranges 1: one KV head at a time
    combine_pairs: int = 4          # (query, KV head) pairs per combine program
    combine_num_warps: int = 4

    def with_(self, **changes) -> "KVOuterConfig":
        return replace(self, **changes)


# The fastest launches measured on the H200 at the perf point (docs/perf-log.md, "Triton stages"): bf16
# 286 TFLOP/s (64-row tiles in 64-tile chunks, 2 CTAs/SM by registers), fp8 444 TFLOP/s (persistent,
# 2 CTAs/SM).
TUNED: dict[str, KVOuterConfig] = {
    "bf16": KVOuterConfig(tile_q=4, attn_num_warps=4, attn_num_stages=3, attn_chunk=64),
    "fp16": KVOuterConfig(tile_q=4, attn_num_warps=4, attn_num_stages=3, attn_chunk=64),  # bf16's (same MMA rate), not measured
    "fp8": KVOuterConfig(ctas_per_sm=2, attn_num_warps=4, attn_num_stages=4),
    "fp32": KVOuterConfig(attn_num_warps=4),
}

CPU_NUM_CTAS = 4


def default_config(dtype: str, group: int | None = None) -> KVOuterConfig:
    """The tuned configuration; for a GQA group too small for its tile (tile_q x group < 16 MMA rows),
    the tile takes just enough query tokens (the tuning was done at the study's group of 16)."""
    cfg = TUNED.get(dtype, KVOuterConfig())
    if group and cfg.tile_q * group < 16:
        cfg = cfg.with_(tile_q=max(1, 16 // group))
    return cfg


def resolve_num_ctas(config: KVOuterConfig, device) -> int:
    import torch
    if config.num_ctas:
        return config.num_ctas
    dev = torch.device(device)
    if dev.type != "cuda":
        return CPU_NUM_CTAS
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    return sms * config.ctas_per_sm


def tile_order(text: str) -> dict:
    """The scheduler's tile order in the benchmarks' notation, as config fields: "S:k" = q_ranges S dealt
    in chunks of k tiles (k 0: contiguous slices), "S:p" = q_ranges S dealt in phases, "phases" = "1:p",
    "S" = "S:0". Raises ValueError with the notation on anything else."""
    ranges, _, deal = ("1:p" if text == "phases" else text).partition(":")
    try:
        s = int(ranges)
        k = 0 if deal == "p" else int(deal or 0)
    except ValueError:
        s = k = -1
    if s < 1 or k < 0:
        raise ValueError(f"tile order {text!r} is not S:k, S:p or phases (S >= 1 query ranges, k >= 0 tiles per chunk)")
    return dict(q_ranges=s, order_chunk=k, order_phases=deal == "p")


# The CuTe stage's default tile order: one query range's Q rows of one KV head stay within a quarter of
# the H200's 60 MiB L2. Measured at N 16384 (docs/perf-log.md, "Tile orders"): the CuTe attention stage
# +8-10 % with 2 or 4 ranges dealt in phases, module +2-3 %; in real prefill the cases with N <= 1649
# (a head's Q 3-7 MiB) lost 6-20 % of the module to the grouped schedule's extra ~35 us, hence key order
# there. A key's K/V block is loaded once per range its queries fall in, so with few queries per
# selected block the reloads outweigh the Q hits: at N 8192 bf16 with 2 ranges against key order,
# attention +9 % and +8 % at a mean fan-in (queries per selected (KV head, block)) of 1024 and 256,
# level at 64, -4 % at 32 and -15 % at 16 (every bf16 unit with 2 ranges against key order; the runs are
# at commit 9821365, results/h200/default-cute-grouped and default-cute-v22); hence GROUP_MIN_FANIN.
GROUP_Q_BYTES = 16 << 20
GROUP_MIN_FANIN = 128


def grouped_tile_order(n_tokens: int, group: int, head_dim: int, elem_bytes: int, fanin_mean: float) -> dict:
    """Key order when one KV head's Q rows (n_tokens x group x head_dim) fit GROUP_Q_BYTES or the selected
    blocks average fewer than GROUP_MIN_FANIN queries; otherwise the fewest power-of-two query ranges
    that make each range fit, dealt to the CTAs in phases."""
    head_q = n_tokens * group * head_dim * elem_bytes
    ranges = 1
    while head_q > ranges * GROUP_Q_BYTES and fanin_mean >= GROUP_MIN_FANIN:
        ranges *= 2
    return dict(q_ranges=1, order_chunk=0, order_phases=False) if ranges == 1 else \
        dict(q_ranges=ranges, order_chunk=0, order_phases=True)


TILE_ORDER_NOTATION = ("the order the KV-outer scheduler deals its (KV head, block) tiles in: S:k, S query ranges "
                       "per KV head dealt to the CTAs in chunks of k tiles (1:0 is key order, contiguous "
                       "slices); S:p, dealt in phases")


def tile_order_label(config: dict) -> str:
    """A launch configuration's tile order in tile_order's notation ("1:0" key order, "2:p", "4:8")."""
    s = int(config.get("q_ranges") or 1)
    return f"{s}:p" if config.get("order_phases") else f"{s}:{int(config.get('order_chunk') or 0)}"


# ---- what a launch configuration means for the roofline model -----------------------------------

def q_live_heads(hkv: int, dtype: str, config: dict | None = None) -> int:
    """How many KV heads' queries a KV-stationary attention launch gathers at once (ModelShape).

    From the plan's launch configuration when known (a unit's plan_info), else from the tuned default
    for the dtype: chunks issued one program each in tile order walk the head-major list together (1),
    and so do persistent CTAs dealt the grouped order in chunks (order_chunk > 0) or in phases
    (order_phases); persistent CTAs over contiguous slices have every head live at once (hkv).
    """
    return 1 if _walk_together(dtype, config) else int(hkv)


def q_ranges(dtype: str, config: dict | None = None) -> int:
    """Query ranges per head of the grouped tile order; they shrink the live queries only when the
    CTAs walk the groups together (chunked launches, or a dealt persistent order)."""
    if not _walk_together(dtype, config):
        return 1
    return max(1, int(_config(dtype, config).get("q_ranges") or 1))


def _walk_together(dtype: str, config: dict | None) -> bool:
    config = _config(dtype, config)
    chunked = int(config.get("attn_chunk") or 0) > 0
    dealt = int(config.get("order_chunk") or 0) > 0 or bool(config.get("order_phases"))   # resolved: persistent only
    return chunked or dealt


def _config(dtype: str, config: dict | None) -> dict:
    if config is None:
        config = default_config(dtype).__dict__
    return config


def launch_terms(hkv: int, dtype: str, config: dict | None = None) -> dict:
    """What a KV-stationary launch configuration means for the roofline (ModelShape's launch terms)."""
    return {"q_live_heads": q_live_heads(int(hkv), dtype, config), "q_ranges": q_ranges(dtype, config)}
