"""The one byte/FLOP model of the schedules, per memory level.

HBM traffic is deduplicated (each tensor crosses HBM once); L2 traffic counts every re-read.
Roofline time = max(HBM bytes / HBM bandwidth, L2 bytes / L2 bandwidth, executed FLOPs / MMA peak).
A backend's module time (`module_time`) is that over the fraction of it the kernel reaches, never less
than the time its largest work item takes alone (`item_floor`: a packed tile's blocks walked by one SM,
which binds where too few tiles fill the GPU), plus the fixed costs of the stages its plan runs
(`fixed_cost`: what a stage costs whatever its size). `msa-bench calibrate` measures the last two; a
stage never measured costs its kernel launches.

Schedules: Q-outer (each query token alone: its blocks re-read per token), KV-outer (each block loaded
once, per-block partials merged by a combine), the MSA-style scatter (KV-outer with a slot store), and
the token-packed Q-outer `q-packed` (tiles of P consecutive tokens walk the union of their blocks with
one online softmax: no partials, no combine, but every token of a tile computes over every union
block, masked or not). q-packed's cost depends on co-selection, union_ratio (scenarios/stats.py): the
union blocks summed over tiles are union_ratio x (query, KV head, block) triples / P, and the FLOPs it
executes are the useful ones x union_ratio.

Beyond the pure bandwidth roofline (the design study's), `l2_capacity=True` adds the caveat the
study states in words: a gathered operand whose working set exceeds the L2 misses with probability
1 - effective L2 / working set (uniform random reuse under LRU, see `_miss_rate`), and those misses
are HBM traffic too.
The crossover the study publishes is the capacity-free one (`crossover`); `crossover_at` gives the
capacity-aware one for a given N.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .devices import DeviceProfile
from .names import base_name, host_keys
from .dtypes import DType
from .schedules import Schedule
from .shape import SHAPE_FIELDS, AttnShape

SCHEDULES = (Schedule.Q_OUTER, Schedule.KV_OUTER, Schedule.MSA_SCATTER)   # bytes and FLOPs independent of co-selection
ALL_SCHEDULES = (*SCHEDULES, Schedule.Q_PACKED)          # q-packed needs union_ratio; dense-masked: predict_dense
# the selection's schedules above take its statistics (nsb, selected blocks); the dense floor takes the
# context's (dense_floor): a table of the selection's schedules never holds it
TRAFFIC_SCHEDULES = (*ALL_SCHEDULES, Schedule.DENSE)
DEFAULT_TILE_TOKENS = 8                                    # P of q-packed unless a plan records its own
# Q-outer's L2 reuse window: re-reads among this many consecutive tokens of a request hit the L2 (they run
# at about the same time); their union at most (16 x Hkv x topk blocks: 64 MiB bf16) is about the L2, so
# only re-reads across windows can miss. The union_ratio at this P measures it (scenarios/stats.py).
Q_OUTER_WINDOW = 16


def union_tokens(schedule: str, tile_tokens: int = DEFAULT_TILE_TOKENS) -> int | None:
    """The P whose union_ratio a schedule's bytes take (traffic): q-packed's tile, Q-outer's L2 window;
    None for the schedules co-selection does not change."""
    return {Schedule.Q_PACKED: tile_tokens, Schedule.Q_OUTER: Q_OUTER_WINDOW}.get(schedule)
MASK_BITS = 1                  # q-packed: membership of each tile token in each union block
INDEX_BYTES = 4
STAT_BYTES = 4


@dataclass(frozen=True)
class ModelShape(AttnShape):
    """The attention shape with what the model also needs: data types and the launch's gathering terms."""
    dtype: DType = DType.BF16           # Q/K/V data
    partial_dtype: DType = DType.BF16   # partial O written by the KV-outer attention stage
    out_dtype: DType = DType.BF16
    # KV heads whose queries the KV-stationary attention stage gathers at the same time: 1 when work
    # is issued in tile order (CTAs move through the head-major work list together), hkv when each
    # persistent CTA owns a contiguous slice of it (then every head's slice is live at once).
    q_live_heads: int = 1
    # Query ranges per KV head in the scheduler's grouped tile order (kv_outer config q_ranges): the
    # queries live at once are one range of the live heads'.
    q_ranges: int = 1

    def __post_init__(self):
        super().__post_init__()
        for name in ("dtype", "partial_dtype", "out_dtype"):
            object.__setattr__(self, name, DType.parse(getattr(self, name), name))

    @classmethod
    def of(cls, shape: AttnShape, **terms) -> "ModelShape":
        """`shape` with the model's terms (dtype, partial_dtype, ...) given in `terms`, the others default."""
        return cls(**{name: getattr(shape, name) for name in SHAPE_FIELDS}, **terms)

    @property
    def data_bytes(self) -> int:
        return self.dtype.bytes

    @property
    def kv_block_bytes(self) -> int:
        """K plus V of one (KV head, block)."""
        return 2 * self.block * self.head_dim * self.data_bytes


@dataclass
class Prediction:
    schedule: str
    time_s: float
    binding: str                  # "hbm" | "l2" | "mma"
    hbm_bytes: float
    l2_bytes: float
    flops: float
    hbm_s: float
    l2_s: float
    mma_s: float
    hbm_terms: dict = field(default_factory=dict)
    l2_terms: dict = field(default_factory=dict)
    executed_flops: float | None = None   # what the MMAs run (q-packed: flops x union_ratio); flops is useful work


RESOURCES = ("hbm", "l2", "mma")


def fraction_roofline(p: Prediction, terms=RESOURCES) -> float:
    """The roofline of the terms a backend's achieved fraction scales (Backend.fraction_terms): what the
    fraction is fitted against."""
    return max(getattr(p, f"{t}_s") for t in terms)


def scaled_time(p: Prediction, fraction: float, terms=RESOURCES) -> float:
    """The roofline time a backend reaches: each term in `terms` over its achieved fraction, the others at
    the device's rate (p.time_s / fraction where `terms` holds all three)."""
    return max(getattr(p, f"{t}_s") / (fraction if t in terms else 1.0) for t in RESOURCES)


def fixed_cost(device: DeviceProfile, backend: str, stages, dtype: str | None = None) -> tuple[float, dict]:
    """(seconds, per stage) a module of `backend` (BASE@OPTION counts as BASE) running `stages` costs
    whatever its size: each stage's calibrated cost ("backend/stage/dtype", else "backend/stage"), at
    least its launches x the launch cost; 0 for a stage the profile has not measured."""
    fc = device.fixed_costs or {}
    launch, table = float(fc.get("launch_s", 0.0)), fc.get("stages") or {}
    base = base_name(backend)
    per = {}
    for stage in stages:
        got = table.get(f"{base}/{stage}/{dtype}") or table.get(f"{base}/{stage}") or {}
        per[stage] = max(float(got.get("s", 0.0)), got.get("launches", 0) * launch)
    return sum(per.values()), per


def item_floor(device: DeviceProfile, backend: str, dtype: str | None, blocks: float | None) -> float:
    """Seconds one work item of `blocks` K/V blocks takes on one SM ("items" of the calibration: s +
    blocks x block_s); 0 where the backend has no such item or the profile has not measured it."""
    if blocks is None:
        return 0.0
    got = ((device.fixed_costs or {}).get("items") or {}).get(f"{base_name(backend)}/{dtype}")
    return float(got["s"]) + blocks * float(got["block_s"]) if got else 0.0


# how the module is launched: replayed from a CUDA graph (the device's time), or stage by stage from Python
GRAPH, EAGER = "graph", "eager"
REGIMES = (GRAPH, EAGER)


def host_cost(device: DeviceProfile, backend: str, dtype: str | None) -> tuple[float, float] | None:
    """(host seconds per stage launch, host seconds of the plan's per-step work) `backend` pays run eagerly,
    as calibrated ("host": "backend/dtype"): its own entry where calibrate measured one, else BASE's, or for
    a name launched another way (BASE@op, BASE@graph: names.LAUNCH_WORDS) that launch path's alone; None
    where the profile has not measured it."""
    got = _host_entry(device, backend, dtype)
    return (float(got["s"]), float(got.get("step_s", 0.0))) if got else None


def host_measured(device: DeviceProfile, backend: str, dtype: str | None) -> bool:
    """Whether the profile holds `backend`'s own host entry (not its base's)."""
    return f"{backend}/{dtype}" in ((device.fixed_costs or {}).get("host") or {})


def _host_entry(device: DeviceProfile, backend: str, dtype: str | None) -> dict | None:
    table = (device.fixed_costs or {}).get("host") or {}
    return next((table[k] for k in (f"{n}/{dtype}" for n in host_keys(backend)) if k in table), None)


def stage_launches(device: DeviceProfile, backend: str, dtype: str | None, stages) -> list[float]:
    """Host seconds each of `stages` takes to launch from Python: its own where the calibration measured
    it ("host" entry's "stages"), else the backend's per-launch cost; 0 where the profile has none."""
    got = _host_entry(device, backend, dtype) or {}
    own = got.get("stages") or {}
    return [float(own.get(stage, got.get("s", 0.0))) for stage in stages]


def host_scale(device: DeviceProfile, backend: str, dtype: str | None, probe_s: float | None) -> float:
    """How much slower than at calibration the host is, for `backend`'s host costs: the host launch probe
    now (`probe_s`, seconds per launch) over the one its costs were measured with; 1 where either is
    unknown. A launch from Python is host work, so it takes as much longer as the host's own probe does."""
    cal = (_host_entry(device, backend, dtype) or {}).get("probe_s")
    return probe_s / cal if probe_s and cal else 1.0


def module_time(device: DeviceProfile, backend: str, dtype: str | None, scaled_s: float, stages,
                item_blocks: float | None = None, regime: str = GRAPH,
                host_probe_s: float | None = None) -> tuple[float, dict]:
    """(seconds, its parts) of a backend's module: `scaled_s` (the roofline over the achieved fraction),
    floored by its largest item's time alone, plus its stages' fixed costs. EAGER: the host's per-step
    planning first, then the stages launched one by one (the profile's host cost per launch each), each
    stage's device time starting no sooner than its launch has returned (eager_wall); 0 s of host where
    the profile has none; host costs scaled to the host's speed where `host_probe_s` gives it (host_scale)."""
    fixed, per_stage = fixed_cost(device, backend, stages, dtype)
    floor = item_floor(device, backend, dtype, item_blocks)
    work = max(scaled_s, floor)
    seconds, parts = work + fixed, {"fixed_s": fixed, "item_floor_s": floor}
    if regime != EAGER:
        return seconds, parts
    scale = host_scale(device, backend, dtype, host_probe_s)
    per_launch, step = host_cost(device, backend, dtype) or (0.0, 0.0)
    launches = stage_launches(device, backend, dtype, per_stage) if per_stage else [per_launch]
    per_launch, step = per_launch * scale, step * scale
    wall = eager_wall([x * scale for x in launches], stage_device_s(per_stage, work))
    return step + wall, {**parts, "device_s": seconds, "host_launch_s": per_launch, "plan_step_s": step,
                         "host_scale": scale}


# the stage that carries a module's work (its K/V bytes and FLOPs); the others' device time is their fixed
# cost. Every backend has one (kernels' stage_names); where none is named the last stage carries it
WORK_STAGE = "attention"


def stage_device_s(per_stage: dict, work_s: float) -> list[float]:
    """Each stage's device seconds in launch order: its fixed cost, and the module's work on WORK_STAGE
    (else on the last stage; a module of no named stage is one stage of all its work)."""
    if not per_stage:
        return [work_s]
    names = list(per_stage)
    at = names.index(WORK_STAGE) if WORK_STAGE in names else len(names) - 1
    return [s + (work_s if i == at else 0.0) for i, s in enumerate(per_stage.values())]


def eager_wall(launches: list[float], device_s: list[float]) -> float:
    """Seconds from the first launch to the last stage's end where the stages are launched from the host in
    turn (`launches`: each one's host seconds) and the device runs them in order, stage i starting when both
    its launch has returned and stage i - 1 has ended: the longest of, for each i, the launches up to stage
    i's and the device time of stage i and every later one."""
    return max(sum(launches[:i + 1]) + sum(device_s[i:]) for i in range(len(device_s)))


# query tokens per request, at most, of decode work (plain, speculative, multi-token): the decode generator's
# bound and the line between the decode and prefill achieved fractions
DECODE_TOKENS = 4


def is_decode(n_tokens: float, requests: float) -> bool:
    """Whether a workload is decode work: on average at most DECODE_TOKENS query tokens per request."""
    return requests > 0 and n_tokens / requests <= DECODE_TOKENS


def decode_share(tokens_per_request) -> float:
    """The share of a step's query tokens that are decode work: in requests of at most DECODE_TOKENS
    tokens (1 for a decode batch, 0 for a prefill chunk, between for a chunked-prefill step)."""
    counts = [int(c) for c in tokens_per_request if c > 0]
    total = sum(counts)
    return sum(c for c in counts if c <= DECODE_TOKENS) / total if total else 0.0


REREAD_TERMS = ("kv_l2_miss_reread", "kv_range_reread")      # HBM bytes only tokens that share blocks cause


def decode_work_share(p: Prediction, token_share: float, kv_share: float | None = None) -> float:
    """The decode share `achieved()` blends a step's fractions by: where HBM binds, the decode tokens' share
    of its bytes (of the distinct K/V blocks kv_share, a decode token's own and read once; none of the
    re-reads; of every per-token term, partials and Q and O, token_share); where L2 or the MMAs bind, of
    its tokens (their FLOPs). kv_share None (rows written before that statistic): the token share."""
    total = sum(p.hbm_terms.values())
    if p.binding != "hbm" or kv_share is None or total <= 0:
        return token_share
    part = {"kv_read": kv_share, **{t: 0.0 for t in REREAD_TERMS}}
    return sum(b * part.get(term, token_share) for term, b in p.hbm_terms.items()) / total


def binding_of(times: dict) -> str:
    """The resource ("hbm", "l2" or "mma") whose time is the roofline's; ties to the first."""
    return max(times, key=times.get)


def useful_flops(shape: ModelShape, n_tokens: float, selected_per_query: float | None = None) -> float:
    """4 x Hq x D x selected key tokens per query, summed over queries (QK^T and PV, 2 flop per MAC)."""
    sel = shape.topk if selected_per_query is None else selected_per_query
    return 4.0 * shape.hq * shape.head_dim * sel * shape.block * n_tokens


def _miss_rate(working_set: float, device: DeviceProfile | None, share: float = 1.0) -> float:
    """Miss probability of a uniformly re-read operand under LRU: 1 - effective capacity / working set.

    Effective capacity is half the L2 (Hopper's L2 is two partitions and a line read by SMs of both
    halves is held in both) times the operand's share of the bytes flowing into L2 (streamed
    partial-O writes evict it too). Both factors were fitted to nothing: they come from the L2's
    organisation and the schedule's byte mix, and `ncu` checks them (results/h200/README.md). A probe of
    random 32 KiB block re-reads found an H100's whole L2 holding them; the model with that capacity
    picked worse out of sample (docs/perf-log.md, 2026-12-07), so half stays.
    """
    if device is None or working_set <= 0:
        return 0.0
    return max(0.0, 1.0 - 0.5 * device.l2_bytes * share / working_set)


def traffic(schedule: str, shape: ModelShape, n_tokens: float, nsb: float, selected_per_query: float | None = None,
            device: DeviceProfile | None = None, union_ratio: float | None = None,
            tile_tokens: int = DEFAULT_TILE_TOKENS, shared_nsb: float | None = None) -> tuple[dict, dict]:
    """Byte terms (hbm_terms, l2_terms) for one launch. `device` given -> L2-capacity misses included.
    union_ratio at tile_tokens P (padded: every tile counted as P tokens): q-packed's tiles (default 1: a
    tile's tokens select alike); Q-outer's L2 reuse window (P = Q_OUTER_WINDOW; default: no window).
    shared_nsb: the (KV head, block) pairs more than one query token selects (default nsb), the working
    set K/V re-reads compete for: a block read once is never re-read (a chunked-prefill step's decode
    tokens), so it takes no part in the misses."""
    if schedule not in TRAFFIC_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}")
    s = shape
    n = float(n_tokens)
    sel = s.topk if selected_per_query is None else selected_per_query
    d = s.data_bytes
    edges = n * s.hkv * sel                                   # (query, KV head, selected block) triples
    q_bytes = n * s.hq * s.head_dim * d
    out_bytes = n * s.hq * s.head_dim * s.out_dtype.bytes
    kv_unique = nsb * s.kv_block_bytes
    reread_set = (nsb if shared_nsb is None else min(shared_nsb, nsb)) * s.kv_block_bytes
    hbm = {"q_read": q_bytes, "kv_read": kv_unique, "out_write": out_bytes}
    l2 = dict(hbm)

    if schedule == Schedule.DENSE:
        # nsb: every (KV head, context block) pair of the requests, read once where the paged cache holds
        # it (the G heads of a KV head share each load); no selection, index, mask or partials
        return hbm, l2

    if schedule == Schedule.Q_OUTER:
        kv_rereads = edges * s.kv_block_bytes
        l2["kv_read"] = kv_rereads
        # page lists: indices per edge plus indptr / last-page length per request
        index = edges * INDEX_BYTES + n * s.hkv * 3 * INDEX_BYTES
        hbm["index"] = l2["index"] = index
        miss = _miss_rate(reread_set, device)
        if miss:
            # union_ratio at P = the window (Q_OUTER_WINDOW): the blocks each window of P tokens loads;
            # re-reads inside a window hit, the rest miss at the LRU rate. None: no window (every re-read)
            windows = kv_rereads if union_ratio is None else kv_rereads * union_ratio / tile_tokens
            hbm["kv_l2_miss_reread"] = max(0.0, windows - kv_unique) * miss
        return hbm, l2

    if schedule == Schedule.Q_PACKED:
        union = edges * (1.0 if union_ratio is None else union_ratio) / tile_tokens   # (tile, KV head, block)
        kv_tiles = union * s.kv_block_bytes                 # each tile loads each of its union blocks once
        l2["kv_read"] = kv_tiles
        # tile lists: a block id per union entry, a pointer per (tile, KV head), and per union entry a
        # membership mask of the tile's P tokens (the tokens that did not select it are masked out)
        index = union * INDEX_BYTES + n / tile_tokens * s.hkv * INDEX_BYTES + union * tile_tokens * MASK_BITS / 8
        hbm["index"] = l2["index"] = index
        # the tile list is head-major: the CTAs in flight walk one KV head's tiles, so its blocks are the
        # working set the re-reads compete for
        miss = _miss_rate(reread_set / s.hkv, device)
        if miss:
            hbm["kv_l2_miss_reread"] = max(0.0, kv_tiles - kv_unique) * miss
        return hbm, l2

    part_row = s.group * s.head_dim * s.partial_dtype.bytes        # one (query, head, block) partial
    partials = edges * part_row
    stats_per_row = 2 if schedule == Schedule.KV_OUTER else 1                      # (m, l) vs normalized + LSE
    stats = edges * s.group * stats_per_row * STAT_BYTES
    hbm.update(partial_write=partials, partial_read=partials, stats_write=stats, stats_read=stats)
    # selection read; CSR query list written and read; combine index (or slot map) written and read
    index = edges * INDEX_BYTES * 5
    hbm["index"] = index
    if s.q_ranges > 1 and nsb > 0:
        # a grouped tile order loads a block's K/V once per query range its queries fall in, and one
        # KV head's blocks outgrow the L2 between two ranges: f queries spread uniformly hit
        # S (1 - (1 - 1/S)^f) of the S ranges
        hit = s.q_ranges * (1.0 - (1.0 - 1.0 / s.q_ranges) ** (edges / nsb))
        hbm["kv_range_reread"] = kv_unique * (hit - 1.0)
    l2.update(hbm)
    q_gather = edges * s.group * s.head_dim * d                             # each query re-read per block
    l2["q_read"] = q_gather
    # the work list is head-major: the queries of the KV heads live at once form the gather working set
    live = q_bytes * min(max(s.q_live_heads, 1), s.hkv) / s.hkv / max(s.q_ranges, 1)
    miss = _miss_rate(live, device, share=q_gather / (q_gather + partials))
    if miss:
        hbm["q_l2_miss_reread"] = max(0.0, q_gather - q_bytes) * miss
    return hbm, l2


def predict(schedule: str, shape: ModelShape, n_tokens: float, nsb: float, device: DeviceProfile,
            selected_per_query: float | None = None, flops: float | None = None,
            l2_capacity: bool = True, union_ratio: float | None = None,
            tile_tokens: int = DEFAULT_TILE_TOKENS, executed_union_ratio: float | None = None,
            shared_nsb: float | None = None) -> Prediction:
    """`flops`: the useful FLOPs (default: every query sees all its selected keys); q-packed executes
    them x union_ratio (masked positions still cost MMA work), or x executed_union_ratio where its MMAs
    cover fewer tokens than its tile loads K/V for (the union at that many tokens). The roofline time
    alone: `module_time` adds what a backend's kernels cost beyond it."""
    hbm_terms, l2_terms = traffic(schedule, shape, n_tokens, nsb, selected_per_query,
                                  device if l2_capacity else None, union_ratio, tile_tokens, shared_nsb)
    fl = useful_flops(shape, n_tokens, selected_per_query) if flops is None else flops
    ratio = union_ratio if executed_union_ratio is None else executed_union_ratio
    executed = fl * (1.0 if ratio is None else ratio) if schedule == Schedule.Q_PACKED else fl
    hbm_b, l2_b = sum(hbm_terms.values()), sum(l2_terms.values())
    times = {"hbm": hbm_b / device.hbm_bytes_per_s, "l2": l2_b / device.l2_bytes_per_s,
             "mma": executed / device.peak_flops(shape.dtype)}
    binding = binding_of(times)
    return Prediction(schedule=schedule, time_s=times[binding], binding=binding, hbm_bytes=hbm_b,
                      l2_bytes=l2_b, flops=fl, hbm_s=times["hbm"], l2_s=times["l2"], mma_s=times["mma"],
                      hbm_terms=hbm_terms, l2_terms=l2_terms, executed_flops=executed)


def union_ratio_floor(shape: ModelShape, nsb_per_n: float, tile_tokens: int = DEFAULT_TILE_TOKENS,
                      selected_per_query: float | None = None) -> float:
    """The least union_ratio a reuse allows: the nsb distinct blocks must fit in the tiles' union
    lists (nsb <= union_ratio x N x Hkv x selected / P), and union_ratio >= 1."""
    sel = shape.topk if selected_per_query is None else selected_per_query
    return max(1.0, nsb_per_n * tile_tokens / (shape.hkv * sel))


def packed_crossover(shape: ModelShape, device: DeviceProfile, n_tokens: float, nsb_per_n: float,
                     tile_tokens: int = DEFAULT_TILE_TOKENS, rival: str = Schedule.KV_OUTER,
                     l2_capacity: bool = True) -> float | None:
    """The union_ratio below which q-packed is predicted faster than `rival` at this reuse (bisection:
    q-packed's time never falls as union_ratio grows). None when q-packed loses even where the reuse
    allows the least union_ratio; math.inf when it still wins at union_ratio = P (the most a tile has)."""
    nsb = nsb_per_n * n_tokens
    t_rival = predict(rival, shape, n_tokens, nsb, device, l2_capacity=l2_capacity).time_s

    def packed_wins(u: float) -> bool:
        return predict(Schedule.Q_PACKED, shape, n_tokens, nsb, device, l2_capacity=l2_capacity, union_ratio=u,
                       tile_tokens=tile_tokens).time_s < t_rival

    lo, hi = union_ratio_floor(shape, nsb_per_n, tile_tokens), float(tile_tokens)
    if lo > hi or not packed_wins(lo):
        return None
    if packed_wins(hi):
        return math.inf
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if packed_wins(mid) else (lo, mid)
    return hi


def packed_crossover_by_dtype(device: DeviceProfile, n_tokens: float, nsb_per_n: float,
                              tile_tokens: int = DEFAULT_TILE_TOKENS, dtypes=(DType.BF16, DType.FP8),
                              shape: AttnShape = AttnShape()) -> dict[str, float | None]:
    """The union_ratio below which q-packed beats KV-outer, per data dtype: packed_crossover on the
    model's shape for each dtype (its default KV-outer, partials bf16) at the attention `shape`. The one
    source of this number for the CLI, the report and the README."""
    return {d: packed_crossover(ModelShape.of(shape, dtype=d), device, n_tokens, nsb_per_n, tile_tokens)
            for d in dtypes}


def _lines(schedule: str, shape: ModelShape, device: DeviceProfile) -> list[tuple[float, float]]:
    """Per-query-token time as max over lines a + b * r of reuse r = nsb / N (capacity-free model)."""
    h0, l0 = (sum(t.values()) for t in traffic(schedule, shape, 1.0, 0.0))
    kvb = shape.kv_block_bytes
    l2_slope = 0.0 if schedule == Schedule.Q_OUTER else kvb     # Q-outer's L2 re-reads don't depend on reuse
    mma = useful_flops(shape, 1.0) / device.peak_flops(shape.dtype)
    return [(h0 / device.hbm_bytes_per_s, kvb / device.hbm_bytes_per_s),
            (l0 / device.l2_bytes_per_s, l2_slope / device.l2_bytes_per_s),
            (mma, 0.0)]


def _time_per_token(lines, r):
    return max(a + b * r for a, b in lines)


def crossover(shape: ModelShape, device: DeviceProfile, challenger: str = Schedule.KV_OUTER) -> float:
    """Closed form: the nsb/N below which `challenger` is predicted faster than Q-outer (capacity-free).

    Both times are maxima of lines in r, so the crossover is one of the pairwise line intersections
    (or 0 / infinity): take the largest candidate where the challenger still ties or wins.
    """
    q_lines, c_lines = _lines(Schedule.Q_OUTER, shape, device), _lines(challenger, shape, device)
    if _time_per_token(c_lines, 0.0) >= _time_per_token(q_lines, 0.0):
        return 0.0
    candidates = []
    for a, b in q_lines:
        for c, e in c_lines:
            if e != b:
                r = (a - c) / (e - b)
                if r > 0:
                    candidates.append(r)
    winning = [r for r in candidates
               if _time_per_token(c_lines, r) <= _time_per_token(q_lines, r) * (1 + 1e-12)]
    best = max(winning, default=0.0)
    # If the challenger still wins just past every intersection, it wins for all reuse.
    if _time_per_token(c_lines, best * 2 + 1) < _time_per_token(q_lines, best * 2 + 1):
        return math.inf
    return best


def crossover_numeric(shape: ModelShape, device: DeviceProfile, challenger: str = Schedule.KV_OUTER,
                      n_tokens: float = 16384.0, l2_capacity: bool = False, hi: float | None = None) -> float:
    """Bisection on predict(): the largest nsb/N where the challenger is still no slower than Q-outer."""
    hi = float(shape.topk * shape.hkv) * 4 if hi is None else hi

    def kv_wins(r):
        t_c = predict(challenger, shape, n_tokens, r * n_tokens, device, l2_capacity=l2_capacity).time_s
        t_q = predict(Schedule.Q_OUTER, shape, n_tokens, r * n_tokens, device, l2_capacity=l2_capacity).time_s
        return t_c <= t_q

    if not kv_wins(0.0):
        return 0.0
    if kv_wins(hi):
        return math.inf
    lo = 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if kv_wins(mid) else (lo, mid)
    return lo


def crossover_at(shape: ModelShape, device: DeviceProfile, n_tokens: float, challenger: str = Schedule.KV_OUTER) -> float:
    """The capacity-aware crossover for a given N (Q-outer's working set grows with nsb)."""
    return crossover_numeric(shape, device, challenger, n_tokens=n_tokens, l2_capacity=True,
                             hi=float(shape.topk * shape.hkv))


def dense_floor(shape: ModelShape, n_tokens: float, kv_blocks: float, visible_keys: float,
                device: DeviceProfile) -> Prediction:
    """The dense floor's roofline (Schedule.DENSE): each request's `kv_blocks` context blocks read once per KV
    head, Q and O (traffic), and 4 x Hq x D FLOPs per (query, key it may see): `visible_keys` summed over
    queries, causal counted exactly."""
    return predict(Schedule.DENSE, shape, n_tokens, kv_blocks * shape.hkv, device,
                   flops=4.0 * shape.hq * shape.head_dim * visible_keys, l2_capacity=False)


def dense_traffic(shape: ModelShape, n_tokens: float, kv_blocks: float, dense_keys: float,
                  gathered: bool = True) -> tuple[dict, dict]:
    """Byte terms of the dense masked schedule: every request's whole visible context read once per KV
    head (`kv_blocks`: context blocks summed over requests), and an additive bf16 mask of one entry per
    (KV head, query, key) written and read (`dense_keys`: context keys summed over queries). gathered:
    the paged cache is first copied contiguous in bf16 and the mask is bf16 (torch SDPA,
    kernels/dense_masked.py); False: a paged dense kernel reads the cache where it is, with a bit mask
    (kernels/dense_paged.py). L2 re-reads by the G heads of a KV head are not counted (the same as HBM)."""
    s = shape
    n = float(n_tokens)
    kv_cache = kv_blocks * s.hkv * s.kv_block_bytes
    hbm = {"q_read": n * s.hq * s.head_dim * s.data_bytes, "kv_read": kv_cache,
           "out_write": n * s.hq * s.head_dim * s.out_dtype.bytes}
    if gathered:
        copy = kv_blocks * s.hkv * 2 * s.block * s.head_dim * 2          # bf16 K and V
        hbm.update(kv_gather_write=copy, kv_gather_read=copy)
        mask = dense_keys * s.hkv * 2
    else:
        mask = dense_keys * s.hkv / 8
    hbm.update(mask_write=mask, mask_read=mask)
    return hbm, dict(hbm)


def predict_dense(shape: ModelShape, n_tokens: float, kv_blocks: float, dense_keys: float, device: DeviceProfile,
                  flops: float | None = None, gathered: bool = True) -> Prediction:
    """The dense masked schedule's roofline time: executed FLOPs are 4 x Hq x D per context key per query,
    masked keys included (bf16 MMAs: the compute is bf16 in both dtypes); `flops` the useful ones."""
    hbm_terms, l2_terms = dense_traffic(shape, n_tokens, kv_blocks, dense_keys, gathered)
    executed = 4.0 * shape.hq * shape.head_dim * dense_keys
    hbm_b, l2_b = sum(hbm_terms.values()), sum(l2_terms.values())
    times = {"hbm": hbm_b / device.hbm_bytes_per_s, "l2": l2_b / device.l2_bytes_per_s,
             "mma": executed / device.peak_flops("bf16")}
    binding = binding_of(times)
    return Prediction(schedule=Schedule.DENSE_MASKED, time_s=times[binding], binding=binding, hbm_bytes=hbm_b, l2_bytes=l2_b,
                      flops=executed if flops is None else flops, hbm_s=times["hbm"], l2_s=times["l2"],
                      mma_s=times["mma"], hbm_terms=hbm_terms, l2_terms=l2_terms, executed_flops=executed)
