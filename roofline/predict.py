"""The one prediction of a module's time.

`auto` weighs it, the sweep stores its roofline beside every unit, `calibrate` fits fractions against it,
and the report and the replay of committed runs show it. Its inputs are data:
- `stats`: the workload's statistics, scenarios/stats.py's keys (a result row holds them as `wl_` columns;
  `ModelStats` computes the ones asked for from a workload);
- `KernelFacts`: what a backend declares (its schedule, tile, the roofline terms its fraction scales);
- `record`: what a backend's plan of the workload records for the model (`Backend.model_record`, kept in
  plan_info under "model"): the tile its plan runs, its warpgroups' critical walk, the launch terms of a
  KV-stationary schedule, the dense path, the hybrid's split.
A live prediction takes the record a backend computes before planning; a replay takes the one its unit
wrote. The same inputs give the same number: there is no second path. Rows written before the record
existed are upgraded once, where a run is loaded (harness/store/migrate.py).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .devices import DeviceProfile, achieved, has_achieved, has_fixed_costs
from .dtypes import model_dtype
from .model import (ALL_SCHEDULES, DEFAULT_TILE_TOKENS, EAGER, GRAPH, RESOURCES, ModelShape, Prediction,
                    decode_work_share, dense_floor, fixed_cost, fraction_roofline, host_cost, module_time, predict,
                    predict_dense, scaled_time, union_tokens)
from .schedules import DENSE_SCHEDULES, Schedule
from .shape import SHAPE_FIELDS, AttnShape

# every schedule the model predicts a module of (the hybrid as the sum of its parts)
MODELLED = (*ALL_SCHEDULES, Schedule.HYBRID, *DENSE_SCHEDULES)
UNION_ONE = 1.0 + 1e-9


@dataclass(frozen=True)
class KernelFacts:
    """What a backend declares for the model, as data (Backend.facts)."""
    name: str
    schedule: str | None
    stage_names: tuple[str, ...] = ()
    tile_tokens: int = DEFAULT_TILE_TOKENS        # P of a token-packed schedule
    mma_tokens: int | None = None                 # tokens an MMA covers where fewer than the tile
    fraction_terms: tuple[str, ...] = RESOURCES   # the roofline terms its achieved fraction scales
    tile_fractions: tuple[tuple[int, str], ...] = ()   # (tile tokens, fraction name): tiles measured on their own
    union_one_only: bool = False                  # modelled only where a tile's tokens select alike
    unmodelled: str | None = None                 # why the model never predicts it, if so


def stat(stats, key: str):
    """A statistic from workload_stats keys or a result row's `wl_` columns; None where absent or not a
    finite number >= 0."""
    value = stats.get(key) if key in stats else stats.get(f"wl_{key}")
    return value if usable(value) or value == 0 else None


def union_ratio_at(stats, tile: int) -> float | None:
    """The union_ratio a kernel of `tile`-token tiles executes (every tile counted as P tokens), else the
    plain one; None where the statistics do not hold that P."""
    for key in (f"executed_union_ratio_p{tile}", f"union_ratio_p{tile}"):
        value = stat(stats, key)
        if usable(value):
            return float(value)
    return None


def unmodelled_reason(facts: KernelFacts, stats) -> str | None:
    """None where the model predicts `facts`' backend on a workload of `stats`, else why not."""
    if facts.unmodelled:
        return f"{facts.name}: {facts.unmodelled}"
    if facts.schedule not in MODELLED:
        return f"{facts.name}: the model has no schedule '{facts.schedule}'"
    if facts.union_one_only:
        u = stat(stats, f"union_ratio_p{facts.tile_tokens}")
        u = float(u) if usable(u) else None
        if u is None or u > UNION_ONE:
            return (f"{facts.name}: modelled only at union_ratio 1 (per-token masks); this workload's is "
                    f"{'unknown' if u is None else format(u, '.3g')}")
    return None


def weigh_reason(facts: KernelFacts, stats, profile: DeviceProfile, dtype: str, fractions=None,
                 regime: str = GRAPH) -> str | None:
    """None where `auto` weighs `facts`' backend on a workload of `stats` with `profile`, else why not: the
    model predicts it, and the profile measured its fractions (`fractions`: the names its prediction divides
    by, default its own), its fixed costs and, in the EAGER regime, its host cost, or measured none of
    them (1, or 0 s, would flatter it)."""
    reason = unmodelled_reason(facts, stats)
    if reason is not None:
        return reason
    fdtype = model_dtype(dtype)
    missing = [b for b in (fractions or (facts.name,)) if not has_achieved(profile, b, fdtype)]
    if missing:
        return f"{facts.name}: profile {profile.name} has no achieved fraction of {missing[0]}/{fdtype}"
    if not has_fixed_costs(profile, facts.name, fdtype):
        return f"{facts.name}: profile {profile.name} has no fixed costs for it in {fdtype}"
    return host_reason(profile, facts.name, fdtype, regime)


def host_reason(profile: DeviceProfile, name: str, dtype: str, regime: str) -> str | None:
    """Why `name` cannot be predicted in `regime`: in the EAGER one, a profile that measured host costs but
    not this launch path's (0 s, or another path's cost, would misprice it); else None."""
    if regime == EAGER and (profile.fixed_costs or {}).get("host") and host_cost(profile, name, dtype) is None:
        return f"{name}: profile {profile.name} has no host cost for it in {dtype}"
    return None


def shape_of(stats, dtype: str, record: dict) -> ModelShape:
    """The model's shape: the workload's attention shape, `dtype`, and the launch terms the record holds."""
    default = AttnShape()
    dims = {k: int(stat(stats, k) if stat(stats, k) is not None else getattr(default, k)) for k in SHAPE_FIELDS}
    launch = record.get("launch") or {}
    return ModelShape(**dims, dtype=dtype, **{k: int(v) for k, v in launch.items()})


def ratios(schedule: str, stats, record: dict) -> tuple[int | None, float | None, float | None]:
    """(P of the tiles whose union the traffic takes, that union_ratio, the executed one) of `schedule`: a
    packed tile's traffic is its tiles' union (the 12-token tile's: the 8-token tiles', which its rule lets
    it load no more than); its MMAs run the walks its record holds, else the union at the tokens an MMA
    covers; Q-outer's re-reads hit the L2 inside its window of tokens."""
    tile = union_tokens(schedule, int(record.get("traffic_tokens") or record.get("tile_tokens") or DEFAULT_TILE_TOKENS))
    union = record.get("union_ratio") or (union_ratio_at(stats, tile) if tile else None)
    executed = record.get("executed_union_ratio")
    if executed is None and union and record.get("mma_tokens") and schedule == Schedule.Q_PACKED:
        executed = union_ratio_at(stats, int(record["mma_tokens"]))
    return tile, (float(union) if usable(union) else None), (float(executed) if usable(executed) else None)


def schedule_roofline(schedule: str, stats, record: dict, profile: DeviceProfile, dtype: str,
                      l2_capacity: bool = True) -> Prediction | None:
    """The roofline of `schedule` on a workload of `stats` in `dtype`, as the plan `record` describes it;
    None where the statistics lack what it needs (q-packed without its union_ratio: its cost is set by
    co-selection, never assumed). l2_capacity False: the bound, compulsory traffic alone (every re-read an
    L2 hit), without the model's estimate of L2-capacity misses."""
    if schedule not in (*ALL_SCHEDULES, *DENSE_SCHEDULES):
        return None
    shape = shape_of(stats, dtype, record)
    n, flops = stat(stats, "n_tokens"), stat(stats, "useful_flops")
    if schedule in DENSE_SCHEDULES:
        # the whole visible context: the floor's work is the keys each query sees, the masked one's every
        # query at its request's last limit
        blocks = stat(stats, "dense_kv_blocks")
        keys = stat(stats, "visible_keys" if schedule == Schedule.DENSE else "dense_keys")
        if not (usable(blocks) and usable(keys) and usable(n)):
            return None
        if schedule == Schedule.DENSE:
            return dense_floor(shape, n, blocks, keys, profile)
        return predict_dense(shape, n, blocks, keys, profile, flops=flops, gathered=not record.get("paged", False))
    nsb = stat(stats, "nsb")
    tile, union, executed = ratios(schedule, stats, record)
    if not usable(n) or nsb is None or (schedule == Schedule.Q_PACKED and union is None):
        return None
    per_query = stat(stats, "selected_blocks_per_query")
    return predict(schedule, shape, n, nsb, profile,
                   selected_per_query=per_query if usable(per_query) else None,
                   flops=flops if usable(flops) else None,
                   union_ratio=union if tile else None, tile_tokens=tile or DEFAULT_TILE_TOKENS,
                   executed_union_ratio=executed, shared_nsb=stat(stats, "nsb_shared"), l2_capacity=l2_capacity)


def fraction_name(facts: KernelFacts, record: dict) -> str:
    """The name a plan's achieved fraction is kept under (roofline.devices.achieved): the backend's, unless
    the tile its plan runs is a kernel measured on its own."""
    return dict(facts.tile_fractions).get(record.get("tile_tokens"), facts.name)


def decode_share_of(stats, prediction: Prediction | None) -> float:
    """The decode share a prediction's fractions blend by (model.decode_work_share)."""
    share = stat(stats, "decode_share") or 0.0
    return decode_work_share(prediction, share, stat(stats, "decode_kv_share")) if prediction else share


@dataclass
class ModulePrediction:
    seconds: float                 # the module: roofline over the achieved fraction, item floor, fixed costs
    used: dict                     # what it used (recorded by `auto`)
    roofline: Prediction | None    # the schedule's roofline (None: the hybrid, a sum of two)
    fraction: str                  # the name its fraction is kept under


def predict_module(facts: KernelFacts, stats, record: dict, profile: DeviceProfile, dtype: str,
                   stages=None, regime: str = GRAPH, host_probe_s: float | None = None) -> ModulePrediction | None:
    """The module time of `facts`' backend on a workload of `stats` in `dtype` as `record` describes its plan,
    on `profile`; `stages`: the stages it runs (default: the record's, else every declared one); `regime`:
    GRAPH (replayed from a CUDA graph) or EAGER (launched from Python: the profile's host cost per stage
    launch and per-step planning, model.module_time; scaled to the host's speed where `host_probe_s`, the
    host launch probe's seconds, gives it). None where the model does not predict it, or, EAGER, where the
    profile measured host costs but not this launch path's (host_reason)."""
    fdtype = model_dtype(dtype)
    if unmodelled_reason(facts, stats) is not None or host_reason(profile, facts.name, fdtype, regime):
        return None
    stages = tuple(stages if stages is not None else record.get("stages") or facts.stage_names)
    p, name = None, facts.name
    if facts.schedule == Schedule.HYBRID:
        if not record.get("split"):
            return None
        scaled, used = hybrid_time(record["split"], profile, fdtype)
    else:
        p = schedule_roofline(facts.schedule, stats, record, profile, dtype)
        if p is None:
            return None
        name = fraction_name(facts, record)
        frac = achieved(profile, name, fdtype, decode_share_of(stats, p))
        scaled = scaled_time(p, frac, facts.fraction_terms)
        used = {"roofline_s": p.time_s, "achieved": frac, "binding": p.binding}
        _, union, executed = ratios(facts.schedule, stats, record)
        used.update({k: v for k, v in (("union_ratio", union), ("executed_union_ratio", executed)) if v is not None})
    total, parts = module_time(profile, facts.name, fdtype, scaled, stages, item_blocks(facts, stats), regime,
                               host_probe_s)
    return ModulePrediction(total, {**used, **parts}, p, name)


def item_blocks(facts: KernelFacts, stats) -> float | None:
    """K/V blocks of a backend's typical work item (one SM's share that cannot be split), None where its
    items are too small to matter: a packed tile walks its union, topk x union_ratio blocks."""
    if facts.schedule != Schedule.Q_PACKED:
        return None
    u, topk = stat(stats, f"union_ratio_p{facts.tile_tokens}"), stat(stats, "topk")
    return float(topk) * float(u) if usable(u) and usable(topk) else None


def fraction_fit(facts: KernelFacts, stats, record: dict, profile: DeviceProfile, dtype: str,
                 measured_s: float, stages) -> tuple[str, float] | None:
    """(fraction name, the fraction of its roofline a module measured at `measured_s` reached once its fixed
    costs are taken off): a profile's `achieved` is their median. None where the model does not predict
    it or its fixed costs exceed the measurement."""
    if facts.schedule == Schedule.HYBRID or unmodelled_reason(facts, stats) is not None:
        return None
    p = schedule_roofline(facts.schedule, stats, record, profile, dtype)
    if p is None:
        return None
    fixed = fixed_cost(profile, facts.name, stages, model_dtype(dtype))[0]
    if measured_s <= fixed:
        return None
    return fraction_name(facts, record), fraction_roofline(p, facts.fraction_terms) / (measured_s - fixed)


def host_note(profile: DeviceProfile, regime: str) -> str | None:
    """The one line the EAGER regime says on a profile that measured no host cost (it prices launches at 0 s)."""
    if regime != EAGER or (profile.fixed_costs or {}).get("host"):
        return None
    return (f"profile {profile.name} has no host cost per launch (msa-bench calibrate measures it): the eager "
            "regime prices launches and per-step planning at 0 s")


# ---- the hybrid: the packed part plus the residual's KV-outer part ------------------------------

def hybrid_time(split: dict, profile: DeviceProfile, dtype: str) -> tuple[float, dict]:
    """(seconds, parts) of the hybrid's two parts, each over its kernel's achieved fraction at its own decode
    share. A part holds its own statistics and record (its roofline predicted here) or, in records written
    before those were kept (harness/store/migrate.py), the time it was predicted at and the fraction that was
    divided by."""
    total, used = 0.0, {}
    for part in ("packed", "kv_outer"):
        got = (split.get("parts") or {}).get(part)
        if not got:
            continue
        frac = achieved(profile, got["fraction"], dtype, got["decode_share"])
        if "predicted_s" in got:
            ran = got.get("divided_by") or achieved(profile, got["divided_by_name"], dtype, got["decode_share"])
            seconds = float(got["predicted_s"]) * float(ran) / frac
        else:
            p = schedule_roofline(got["schedule"], got["stats"], got["record"], profile, got["dtype"])
            seconds = scaled_time(p, frac, tuple(got["fraction_terms"]))
            used[f"{part}_binding"] = p.binding
        used.update({f"{part}_s": seconds, f"{part}_achieved": frac, f"{part}_decode_share": got["decode_share"]})
        total += seconds
    return total, {**used, **{k: split[k] for k in ("tile_tokens", "min_share", "packed_entry_share", "packed",
                                                     "kv_outer") if k in split}}


def usable(v) -> bool:
    """A positive, finite real number (numpy scalars too; not a bool): a statistic the model can use."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0
