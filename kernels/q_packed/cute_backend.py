"""q-packed-cute: q-packed's schedule stage (schedule.py, Triton on the GPU) with the attention stage as the
CuTe DSL sm_90a kernel kernels/cute/q_packed_sm90.py, prebuilt (`msa-bench build-kernels`) and launched with
ctypes on the current stream (graph capturable). Where every token tile holds one token (decode) the plan
has no schedule stage: the kernel reads each token's selected pages itself (its direct path), and where
those tiles outnumber the SMs a default plan runs each dtype's pairs library, two tokens per tile.

Options, joined by '+': `pp` (the two consumer warpgroups take turns issuing their MMAs) and `sa` (block
j + 1's S issued with block j's P V); `q-packed-cute@pp+sa` is FA3's schedule, `@plain` neither; `p8` or
`p12` the tokens a tile (p12: three consumer warpgroups, neither pp nor sa; decode keeps its own). Without
an option each dtype takes the set measured fastest (DEFAULT_OPTIONS), or where its warpgroups skip blocks
(neighbours drift) the set measured fastest there (SKIP_OPTIONS); a default plan runs
12-token tiles on three consumer warpgroups where they pay (wide_schedule). Built for P 8 and 12,
G 16, D 128, block 128 in bf16 and fp8.
"""
from __future__ import annotations

import torch

from ..base import Backend, Plan, register
from ..triton_common import partial_dtype, triton_unavailable_reason
from ...roofline.schedules import Schedule
from ...scenarios.workload import Workload
from ..cute.manifest import (DEFAULT_OPTIONS, DTYPES, OPTION_FLAGS, P_SHIFT, SKIP_OPTIONS, SKIP_RATIO,
                             SUPPORTED_ARCHS, WIDE_MAX_RATIO, WIDE_MIN_TILES_PER_SM, WIDE_TILE_TOKENS, WIDE_TOKENS,
                             QPackedConfig,
                             device_arch, fp8_v_key_order, wide_config)
from ..dispatch import DISPATCH, GRAPH, checked
from ..options import Choice, Number

TILE_TOKENS = 8


def cute_shape_reason(w: Workload, name: str) -> str | None:
    s = w.shape
    if (s.group, s.head_dim, s.block) != (16, 128, 128):
        return (f"{name} is built for G 16, D 128, block 128 (8 tokens x 16 heads = 128 rows), "
                f"got G {s.group}, D {s.head_dim}, block {s.block}")
    return None


def fp8_v_operand(v_cache: torch.Tensor) -> torch.Tensor:
    """fp8 V as the kernels read it: d-major ([pages, Hkv, D, block], K-major for the wgmma) with the keys
    permuted within every 16 the way P's registers hold them (manifest.fp8_v_key_order)."""
    v = v_cache.transpose(-1, -2).contiguous()
    order = torch.tensor(fp8_v_key_order(), device=v.device)
    blk = v.shape[-1]
    return v.view(*v.shape[:-1], blk // 16, 16)[..., order].reshape(v.shape).contiguous()


DIRECT_MAX_TOPK = 32            # the direct path holds a token's entries one per lane of a warp
PAIRS_MAX_TOPK = 16             # a pair's two tokens share a warp's lanes


def one_token_tiles(w: Workload) -> bool:
    """Whether every token tile of `w` holds one token (a decode batch) and a warp's lanes can hold a
    token's entries: the plan runs the kernel's direct path and no schedule stage."""
    from .schedule import token_tiles
    if w.shape.topk > DIRECT_MAX_TOPK or w.n_tokens == 0:
        return False
    _, ntok = token_tiles(w.q_request, w.q_limit, TILE_TOKENS, w.causal)
    return int(ntok.max()) == 1


def sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def wide_tiles_fit(w: Workload) -> bool:
    """The wide rule's conditions on the workload's shape (manifest, where each was measured): no request
    of one token (a decode token's tile) and at least WIDE_MIN_TILES_PER_SM 12-token tiles an SM."""
    from .schedule import token_tiles
    if bool((torch.bincount(w.q_request) == 1).any()):
        return False
    tok0, _ = token_tiles(w.q_request, w.q_limit, WIDE_TOKENS, w.causal)
    return tok0.numel() * w.shape.hkv >= WIDE_MIN_TILES_PER_SM * sm_count(w.device)


def pairs_path(w: Workload, one_token: bool | None = None) -> bool:
    """Whether a decode plan of `w` runs the pairs library: two tokens per tile, one per consumer warpgroup,
    where the one-token tiles are more than the SMs. With fewer, pairs would leave SMs idle, and one SM's
    reads at a time bound a pair (decode 16 x 32K-128K: 53.9 us against 30.8 one token a tile, bf16);
    with more, a one-token tile's single softmax chain binds (decode 256 x 8K-32K fp8: 137.9 against
    150.6): docs/perf-log.md, 2026-12-02. one_token: one_token_tiles(w), where the caller has it."""
    one_token = one_token_tiles(w) if one_token is None else one_token
    return w.shape.topk <= PAIRS_MAX_TOPK and one_token and w.shape.hkv * w.n_tokens > sm_count(w.device)


def critical_ratio(schedule, selected: float) -> float:
    """The executed union ratio of a packed plan (its schedule has run) where each tile lasts as long as its
    longest group walk (PackedSchedule.critical_slots), at P rows a union slot, over the `selected`
    entries: 1 at u 1, the mean walk where a tile's groups walk as many blocks (co-selection in groups of
    its size), above it where they walk different ones (neighbours drift). Nothing fitted: it replaced the
    mean walk, held out on drift, indexer, sparsity and mixed steps (docs/perf-log.md, 2026-12-04)."""
    rows = float(schedule.critical_slots().sum()) * schedule.P
    return rows / selected if selected else 1.0


def num_ctas(device, num_tiles: int) -> int:
    """The persistent grid: one CTA per SM (384 threads and 192-224 KiB of shared memory each), no more
    than there are tiles."""
    return max(1, min(sm_count(device), num_tiles))


class QPackedCuteAttention:
    """Stage `attention`: binds a loaded library to the plan's schedule buffers and outputs; calling it
    launches one persistent grid on the current CUDA stream (no host sync, no allocation)."""

    def __init__(self, workload: Workload, schedule, out: torch.Tensor, lse: torch.Tensor, cfg: QPackedConfig,
                 library=None, direct: bool = False, residual: tuple | None = None):
        """residual: the hybrid's KV-outer (combine_index, o_part, m_part, l_part), which a cfg.residual
        library merges into each token's output in its epilogue; None elsewhere (empty placeholders)."""
        from ..cute.loader import resolve_library
        w, s = workload, workload.shape
        self.w, self.sch, self.cfg = w, schedule, cfg
        self.library = library or resolve_library(cfg, w.device)
        # pairs: tile t holds tokens 2t and 2t + 1 (one_token_tiles: token tile t is token t)
        n_token_tiles = (w.n_tokens + 1) // 2 if cfg.pairs else schedule.n_token_tiles
        self.library.load_module()                 # before any capture: module load, smem attribute
        self.v = fp8_v_operand(w.v_cache) if w.dtype == "fp8" else w.v_cache
        b = schedule.buffers
        if (residual is None) == cfg.residual:
            raise ValueError(f"{cfg.name}: residual partials {'missing' if cfg.residual else 'given'}")
        if residual is None:
            residual = (torch.empty(0, dtype=torch.int32, device=w.device),
                        torch.empty(0, s.head_dim, dtype=torch.bfloat16, device=w.device),
                        torch.empty(0, dtype=torch.float32, device=w.device),
                        torch.empty(0, dtype=torch.float32, device=w.device))
        tensors = [w.q, w.k_cache, self.v, b["tile_tok0"], b["tile_ntok"], b["tile_count"], b["tile_page"],
                   b["tile_limit"], b["tile_split"], w.pages, w.selection, w.q_limit, out, lse, *residual]
        self.direct = direct
        self.keep = tensors                        # the pointers stay valid while the stage lives
        self.packed = self.library.pack(tensors, w.device)
        self.num_tiles = s.hkv * n_token_tiles
        self.grid = num_ctas(w.device, self.num_tiles) if self.num_tiles else 0
        self.scalars = (s.hkv, n_token_tiles, schedule.union_cap, self.grid, w.n_tokens, s.topk,
                        int(direct), w.sm_scale * w.q_scale * w.k_scale, w.v_scale)

    def describe(self) -> dict:
        return dict(kernel=self.cfg.name, tile_tokens=self.sch.P, tile_rows=self.sch.P * self.w.shape.group,
                    tiles=self.num_tiles, grid=self.grid, direct=self.direct, **self.cfg.options,
                    p_shift=P_SHIFT[self.w.dtype])

    def __call__(self) -> None:
        if self.num_tiles == 0:
            return
        stream = torch.cuda.current_stream(self.w.device).cuda_stream
        self.library.launch(self.packed, self.scalars, stream)


@register("q-packed-cute")
class QPackedCuteBackend(Backend):
    name = "q-packed-cute"
    description = ("q-packed with the attention stage as a CuTe DSL sm_90a kernel (warp-specialized, TMA K/V, "
                   "online softmax over the tile's union blocks; prebuilt, loaded with ctypes)")
    dtypes = DTYPES
    schedule = Schedule.Q_PACKED
    candidate = True
    stage_names = ("schedule", "attention")
    tile_tokens = TILE_TOKENS
    mma_tokens = TILE_TOKENS // 2        # a consumer warpgroup's 64 rows: it skips what its 4 tokens did not select
    # the 12-token tile is its own kernel (three consumer warpgroups), measured on its own under the option
    # that forces it; the 8-token tile's fraction is the backend's under any option (`@p8` forces it where
    # the rule would take 12 tokens: calibrate fits it on real-prefill selections that way)
    tile_fractions = ((TILE_TOKENS, "q-packed-cute"), (WIDE_TOKENS, f"q-packed-cute@p{WIDE_TOKENS}"))
    # the words are manifest.OPTION_FLAGS's, which name the libraries
    options = {"pingpong": Choice("pingpong consumer warpgroups", {"pp": True, "plain": False}),
               "s_ahead": Choice("S of the next block issued with P V", {"sa": True, "plain": False}),
               "tile_size": Number("tokens a tile", "p", (TILE_TOKENS, WIDE_TOKENS)),
               "dispatch": DISPATCH}

    def __init__(self, pingpong: bool | None = None, s_ahead: bool | None = None, tile_size: int | None = None,
                 dispatch: str | None = None):
        """All None: each dtype's DEFAULT_OPTIONS; naming one flag turns the others off (`@pp` is pingpong
        alone). tile_size: None the rule (wide_schedule), 8 never wide, 12 always (neither flag). dispatch
        "op": the stages replayed from the C++ dispatch library (kernels/q_packed/op.py), "graph": that
        program captured at plan time as one CUDA graph the module launches, None: Python."""
        self.dispatch = checked("q-packed-cute", dispatch)
        flags = (pingpong, s_ahead)
        self.flags = None if all(f is None for f in flags) else tuple(bool(f) for f in flags)
        if tile_size == WIDE_TOKENS and any(f for f in flags):
            raise ValueError(f"q-packed-cute: p{tile_size} runs neither pp nor sa (three consumer warpgroups)")
        self.tile_size = tile_size

    @property
    def wide_forced(self) -> bool:
        """`@p12`: every plan (decode aside) runs the 12-token tiles, whatever the rule says."""
        return self.tile_size == WIDE_TOKENS

    def config_for(self, dtype: str, walked_ratio: float = 1.0) -> QPackedConfig:
        """The library a plan runs: the named flags; else the dtype's SKIP_OPTIONS where its warpgroups walk
        more than SKIP_RATIO times the entries selected (walked_ratio), else its DEFAULT_OPTIONS."""
        if self.flags is not None:
            flags = self.flags
        elif walked_ratio > SKIP_RATIO and dtype in SKIP_OPTIONS:
            flags = SKIP_OPTIONS[dtype]
        else:
            flags = DEFAULT_OPTIONS.get(dtype, (False,) * len(OPTION_FLAGS))
        return QPackedConfig(dtype, *flags, tile_tokens=TILE_TOKENS)

    def configs_for(self, dtype: str) -> list[QPackedConfig]:
        """Every library a plan in `dtype` may run (decode pairs aside)."""
        if self.wide_forced:
            return [wide_config(dtype)]
        wide = [wide_config(dtype)] if self.flags is None and self.tile_size is None and dtype in WIDE_TILE_TOKENS else []
        return list(dict.fromkeys([self.config_for(dtype, r) for r in (1.0, float("inf"))] + wide))

    def wide_schedule(self, w: Workload, schedule, walked: float, selected: float):
        """(the 12-token schedule, run; the entries its warpgroups walk over those selected) that a default plan
        takes instead of its 8-token `schedule` (run; its warpgroups walk `walked`), or None. It takes them
        where their warpgroups walk at most WIDE_MAX_RATIO times the 8-token warpgroups' entries, their
        tiles load no more union blocks than the 8-token tiles do, there are at least WIDE_MIN_TILES_PER_SM
        tiles an SM and no request of one token (a decode token's tile: manifest, where each was measured)."""
        from .schedule import PackedSchedule
        forced = self.wide_forced
        if not forced and (self.flags is not None or self.tile_size is not None or w.dtype not in WIDE_TILE_TOKENS
                           or not selected or not wide_tiles_fit(w)):
            return None
        wide = PackedSchedule(w, WIDE_TILE_TOKENS[w.dtype])
        wide()
        ratio = self.walked_ratio(w, wide, selected)
        loads = int(wide.tile_count.sum()) <= int(schedule.tile_count.sum())
        return (wide, ratio) if forced or (ratio <= WIDE_MAX_RATIO * walked and loads) else None

    def walked_ratio(self, w: Workload, schedule, selected: float) -> float:
        """The entries the tiles' warpgroups walk (the schedule has run) over the `selected` entries they
        hold: 1 where the tokens a warpgroup walks for select the same blocks. Each of a tile's warpgroups
        walks its 4 tokens x the union slots of its group (schedule.group_slots: an 8-token tile's halves,
        a 12-token tile's thirds)."""
        group = self.mma_tokens
        ntok = schedule.tile_ntok.double().repeat(w.shape.hkv)
        walked = sum(float(slots @ (ntok - g * group).clamp(0, group)) for g, slots in enumerate(schedule.group_slots()))
        return walked / selected if selected else 1.0

    def unavailable_reason(self, dtype, device):
        if torch.device(device).type != "cuda" or not torch.cuda.is_available():      # the first thing to fix
            return f"{self.name} runs only on a CUDA GPU ({', '.join(SUPPORTED_ARCHS)})"
        reason = super().unavailable_reason(dtype, device)
        if reason:
            return reason
        if self.wide_forced and dtype not in WIDE_TILE_TOKENS:
            return f"{self.name} runs {', '.join(WIDE_TILE_TOKENS)} only"
        arch = device_arch(device)
        if arch not in SUPPORTED_ARCHS:
            return f"{self.name} is built for {', '.join(SUPPORTED_ARCHS)}; this GPU is {arch}"
        reason = triton_unavailable_reason(device)          # the schedule stage
        if reason:
            return reason
        if self.dispatch:
            from ..dispatch.build import unavailable_reason
            reason = unavailable_reason(self.name)
            if reason:
                return reason
        from ..cute.loader import library_unavailable_reason
        return next(filter(None, (library_unavailable_reason(c, arch) for c in self.configs_for(dtype))), None)

    def workload_unavailable_reason(self, w: Workload) -> str | None:
        return self.unavailable_reason(w.dtype, w.device) or cute_shape_reason(w, self.name)

    def stages_for(self, w: Workload) -> tuple[str, ...]:
        return ("attention",) if one_token_tiles(w) else self.stage_names

    def model_record(self, w: Workload, profile=None) -> dict:
        """The plan's own tiles (`layout`): its MMAs at the critical walk (critical_ratio), its fraction the
        12-token tiles' own where it runs them (wide_schedule); the traffic stays the 8-token tiles', which
        the wide rule lets the 12-token tiles load no more than."""
        if one_token_tiles(w):
            return super().model_record(w, profile)
        schedule, _, critical, _ = self.layout(w)
        return self.record_of(w, schedule.P, critical)

    def record_of(self, w: Workload, tile: int, critical: float | None) -> dict:
        record = {**super().model_record(w), "tile_tokens": tile, "traffic_tokens": TILE_TOKENS}
        if critical is not None:
            record["executed_union_ratio"] = critical
        return record

    def layout(self, w: Workload):
        """(the schedule a plan of `w` runs, run unless every tile holds one token; the entries its
        warpgroups walk over those selected; its critical walk, critical_ratio, None without a schedule
        stage; its library)."""
        from .schedule import PackedSchedule
        schedule = PackedSchedule(w, TILE_TOKENS)
        # every tile one token (decode): the attention stage reads the tokens' pages itself, no schedule stage
        direct = one_token_tiles(w)
        selected = float((w.selection >= 0).sum())
        if not direct:
            schedule()
        walked = 1.0 if direct else self.walked_ratio(w, schedule, selected)
        # a default plan's decode tiles in pairs; named options keep their library (one token a tile)
        pairs = self.flags is None and self.tile_size is None and pairs_path(w, direct)
        cfg = QPackedConfig(w.dtype, pairs=True) if pairs else self.config_for(w.dtype, walked)
        wide = None if direct else self.wide_schedule(w, schedule, walked, selected)
        if wide is not None:
            (schedule, walked), cfg = wide, wide_config(w.dtype)
        return schedule, walked, None if direct else critical_ratio(schedule, selected), cfg

    def _plan(self, w: Workload) -> Plan:
        s, dev = w.shape, w.device
        out = torch.empty(w.n_tokens, s.hq, s.head_dim, dtype=partial_dtype(w.dtype), device=dev)
        lse = torch.empty(w.n_tokens, s.hq, dtype=torch.float32, device=dev)
        direct = one_token_tiles(w)
        schedule, walked, critical, cfg = self.layout(w)
        attention = QPackedCuteAttention(w, schedule, out, lse, cfg, direct=direct)
        info = dict(schedule=Schedule.Q_PACKED, tile_tokens=schedule.P,
                    mma_tokens=self.mma_tokens,
                    tiles=attention.num_tiles,                  # as launched: a pair of decode tokens is one
                    union_capacity=schedule.union_cap,
                    executed_union_ratio=walked,                # each token's warpgroup's
                    critical_union_ratio=critical,
                    attention=attention.describe(),
                    quantization=("e4m3 Q/K/V/P on fp8 MMA (V d-major, keys permuted, copy made in plan)"
                                  if w.dtype == "fp8" else "bf16 Q/K/V and MMA, fp32 softmax"))
        stages = {"attention": attention} if direct else {"schedule": schedule, "attention": attention}
        plan = Plan(backend=self.name, stages=stages, output=out, lse=lse,
                    buffers=dict(schedule.buffers), info=info,
                    model_record=self.record_of(w, schedule.P, critical) if not direct else None)
        if self.dispatch:
            from .op import dispatch
            dispatch(plan, self.dispatch == GRAPH)
        return plan
