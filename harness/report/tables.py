"""The tables of a run: one row per unit, throughput, stages, bytes against the model, crossovers,
the real-prefill call-weighted aggregate and the roofline's picks. Reuse is the measured nsb/N."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from ...roofline.devices import DeviceProfile, has_fixed_costs
from ...roofline.dtypes import model_dtype
from ...kernels.auto import AUTO_RECORD, AutoBackend
from ...kernels.base import get_backend, split_name
from ..measure.timing import EAGER_MEDIANS, MODULE, timer_mode
from ...kernels.q_packed.hybrid import HybridBackend
from ...roofline.model import crossover, crossover_at, is_decode
from ...roofline.predict import (fraction_fit, predict_module, schedule_roofline, shape_of, unmodelled_reason,
                                 usable, weigh_reason)
from ...roofline.schedules import Schedule
from ...roofline.shape import AttnShape
from .axes import UNION, group_label, varying_fields
from ..store.rows import (_info, launch_labels, ok_units, plan_config, quantization, ran_stages, row_facts, row_record,
                          schedule_of, unit_table)
from ..store.results import STATUS_OK, Run

STAGE_ORDER = ("index_map", "schedule", "attention", "combine")
AUTO, HYBRID = AutoBackend.name, HybridBackend.name
SHAPE_DEFAULTS = asdict(AttnShape())


# ---- tables -------------------------------------------------------------------------------------

def attention_shape(row) -> dict:
    out = {}
    for k, default in SHAPE_DEFAULTS.items():
        value = next((row[c] for c in (k, f"wl_{k}") if c in row and pd.notna(row[c])), default)
        out[k] = int(value)
    return out


def row_model_shape(row):
    """The model's shape for a unit row: its attention shape, dtype and launch terms."""
    return shape_of(row, row["dtype"], row_record(row))


def _predict_row(row, schedule: str, device: DeviceProfile, l2_capacity: bool = True):
    """The roofline of `schedule` for a unit row: its workload's statistics (wl_ columns) and its plan's record."""
    return schedule_roofline(schedule, row, row_record(row), device, row["dtype"], l2_capacity)


def status_table(run: Run) -> pd.DataFrame:
    st = run.status
    if st.empty:
        return pd.DataFrame(columns=["backend", "status", "units"])
    return st.groupby(["backend", "status"]).size().rename("units").reset_index()


def hbm_rate(t: pd.DataFrame, device: DeviceProfile | None) -> tuple[pd.Series, pd.Series]:
    """(GB/s, fraction of the HBM roofline) per unit row: the model's HBM bytes over the measured module
    median, the rate a memory-bound point (decode) is judged by; NaN where the unit has no model bytes."""
    if "module.model_hbm_bytes" not in t or "module.median_s" not in t:
        nan = pd.Series(np.nan, index=t.index)
        return nan, nan
    rate = t["module.model_hbm_bytes"] / t["module.median_s"]
    frac = rate / device.hbm_bytes_per_s if device is not None else pd.Series(np.nan, index=t.index)
    return rate / 1e9, frac


def throughput_table(run: Run, device: DeviceProfile | None = None) -> pd.DataFrame:
    t = ok_units(run)
    if t.empty:
        return t
    shown = [f for f in varying_fields(t) if f != "reuse"]       # the measured nsb/N stands for it
    cols = {"backend": "backend", "dtype": "dtype", **{f: f for f in shown}, "x": "nsb/N",
            UNION: "union_ratio P8", "wl_n_tokens": "N", "module.median_s": "module_s", "module.cv": "cv",
            "module.tflops": "TFLOP/s", "GB/s": "GB/s", "HBM frac": "HBM frac", "max_rel_err": "max rel err",
            "attention.tflops": "attention TFLOP/s", "module.converged": "CV converged", "throttled": "throttled"}
    t = t.copy()
    t["GB/s"], t["HBM frac"] = hbm_rate(t, device)
    t = t.drop(columns=[c for c in ("GB/s", "HBM frac") if t[c].isna().all()])     # no model bytes or profile
    out = t[[c for c in cols if c in t]].rename(columns=cols)
    if "CV converged" in out:
        out["CV converged"] = out["CV converged"].fillna(0).astype(bool)
    if "plan_info" in t:                          # what each unit quantized, next to its measured error
        stated = pd.Series([quantization(p) for p in t["plan_info"]], index=t.index)
        if (stated != "").any():
            at = list(out.columns).index("max rel err") + 1 if "max rel err" in out else len(out.columns)
            out.insert(at, "quantization", stated)
    if "plan_info" in t:                          # the tile order and CuTe kernel each unit ran
        labels = pd.DataFrame([launch_labels(p) if isinstance(p, (str, dict)) else {} for p in t["plan_info"]],
                              index=t.index)
        for col in ("kernel", "tile order"):
            if col in labels and labels[col].notna().any():
                out.insert(2, col, labels[col].fillna(""))
    order = [c for c in ("dtype", "backend", *shown, "nsb/N", "union_ratio P8") if c in out]
    return out.sort_values(order).reset_index(drop=True)


def accuracy_table(run: Run) -> pd.DataFrame:
    """Per backend and dtype: what the backend states it quantizes (plan.info "quantization"), and the
    measured max relative error of its checked units against the float64 reference (worst and median)
    next to the tolerance; fp8 backends that quantize different operands are compared like for like."""
    st = run.status
    if st.empty or "max_rel_err" not in st:
        return pd.DataFrame()
    st = st[st["max_rel_err"].notna()].copy()
    if st.empty:
        return pd.DataFrame()
    st["quantization"] = [quantization(p) for p in st["plan_info"]] if "plan_info" in st else ""
    rows = []
    for (backend, dtype), g in st.groupby(["backend", "dtype"]):
        stated = sorted(set(g["quantization"]) - {""})
        err = g["max_rel_err"].astype(float)
        rows.append({"backend": backend, "dtype": dtype, "quantization": "; ".join(stated) or "(not stated)",
                     "checked units": len(g), "max rel err (worst)": err.max(), "max rel err (median)": err.median(),
                     "tol": float(g["tol"].max()) if "tol" in g else float("nan")})
    return pd.DataFrame(rows).sort_values(["dtype", "backend"]).reset_index(drop=True)


def achieved_table(run: Run) -> pd.DataFrame:
    """Per backend and dtype: the fraction of its roofline time the module reaches, model_time_s over the
    measured median (1 = at the roofline), median and range over the units that have a model time. These
    are the figures a device profile's `achieved` table holds for `auto` and the hybrid threshold."""
    t = ok_units(run)
    if t.empty or "module.model_time_s" not in t or "module.median_s" not in t:
        return pd.DataFrame()
    t = t[t["module.model_time_s"].notna() & (t["module.median_s"] > 0)]
    if t.empty:
        return pd.DataFrame()
    frac = t["module.model_time_s"] / t["module.median_s"]
    rows = [{"backend": b, "dtype": d, "units": len(g), "achieved (median)": float(g.median()),
             "min": float(g.min()), "max": float(g.max())}
            for (b, d), g in frac.groupby([t["backend"], t["dtype"]])]
    return pd.DataFrame(rows).sort_values(["dtype", "backend"]).reset_index(drop=True)


def auto_vs_fastest(run: Run) -> pd.DataFrame:
    """Per point and dtype where `auto` ran: its module time against the fastest other backend measured,
    and what it picked. ratio = auto / fastest (1 = auto is the fastest)."""
    t = ok_units(run)
    if t.empty or "module.median_s" not in t or not is_auto(t["backend"]).any():
        return pd.DataFrame()
    rows = []
    for (key, dtype), g in t.groupby(["point_key", "dtype"], sort=True):
        autos, rest = g[is_auto(g["backend"])], g[~is_auto(g["backend"])]
        if autos.empty or rest.empty:
            continue
        best = rest.loc[rest["module.median_s"].idxmin()]
        for _, a in autos.iterrows():            # `auto` and `auto@eager` each against the fastest
            picked = auto_record(a).get("picked", "")
            rows.append({"dtype": dtype, "N": a.get("wl_n_tokens"), "nsb/N": a.get("x"),
                         "union_ratio P8": a.get(UNION), **({AUTO: a["backend"]} if len(autos) > 1 else {}),
                         "auto picked": picked, "auto_s": a["module.median_s"], "fastest": best["backend"],
                         "fastest_s": best["module.median_s"],
                         "auto/fastest": a["module.median_s"] / best["module.median_s"]})
    return pd.DataFrame(rows)


def is_auto_name(backend: str) -> bool:
    """Whether `backend` is `auto`, of any option (`auto@eager`)."""
    return split_name(backend)[0] == AUTO


def is_auto(backends: pd.Series) -> pd.Series:
    """Which units are `auto`'s, of any option (`auto@eager`)."""
    return backends.map(is_auto_name)


def auto_record(row) -> dict:
    """What an `auto` unit's plan recorded of its choice (picked, predicted_s, used); {} for any other."""
    return _info(row.get("plan_info")).get(AUTO_RECORD) or {}


def auto_summary(table: pd.DataFrame, within: float = 0.05) -> dict:
    """How often `auto` is within `within` of the fastest, and its worst ratio."""
    if table.empty:
        return {}
    r = table["auto/fastest"]
    near = r <= 1 + within
    return {"points": len(r), "within": within, "count_within": int(near.sum()), "share_within": float(near.mean()),
            "worst": float(r.max()), "median": float(r.median())}


def row_roofline(row, device: DeviceProfile, l2_capacity: bool = True):
    """The roofline of a unit row's schedule at `device`'s ceilings (no fraction, no fixed cost); None for
    `auto` units, a backend the model does not predict, and rows that lack what it needs. l2_capacity
    False: the bound (compulsory traffic, schedule_roofline)."""
    facts = row_facts(row)
    if facts is None or unmodelled_reason(facts, row) is not None:
        return None
    return _predict_row(row, facts.schedule, device, l2_capacity)


def unit_bound(row, device: DeviceProfile, l2_capacity: bool = False):
    """The bound a unit's measured time cannot beat: its schedule's roofline with compulsory traffic alone
    (l2_capacity True: with the model's L2-capacity misses); an `auto` unit's is its pick's, whose plan it
    ran and recorded. None where the model has no roofline for it (the hybrid's is a sum of two)."""
    if is_auto_name(row["backend"]):
        picked = auto_record(row).get("picked")
        if not picked:
            return None
        row = row.copy()
        row["backend"] = picked
    return row_roofline(row, device, l2_capacity)


def regime_of(row) -> str:
    """The regime a unit row was timed in (its timer's: graph replay or eager launches), which its
    prediction takes."""
    timer = row.get("timer")
    return timer_mode(timer if isinstance(timer, str) else "")


def host_probe_of(row) -> float | None:
    """An eager unit's host launch probe (its module samples' median), the host's speed when it ran; None
    for a graph unit or one made before the probe was recorded."""
    v = row.get(f"{MODULE}.{EAGER_MEDIANS['host_probe_s']}")
    return float(v) if usable(v) else None


def predicted_module_s(row, device: DeviceProfile) -> float:
    """The model's module time for a unit row (roofline.predict.predict_module of its workload's statistics
    and its plan's record, `device`'s fractions and the fixed costs of the stages the unit ran); `auto` units
    carry their pick's prediction; an eager unit's is the eager regime's. NaN where the model does not predict
    the unit."""
    if is_auto_name(row["backend"]):
        a = auto_record(row)
        return float((a.get("predicted_s") or {}).get(a.get("picked"), np.nan))
    facts = row_facts(row)
    got = predict_module(facts, row, row_record(row), device, row["dtype"], ran_stages(facts, row),
                         regime_of(row), host_probe_of(row)) if facts else None
    return float("nan") if got is None else got.seconds


def model_pick_table(run: Run, device: DeviceProfile | None) -> pd.DataFrame:
    """Per point and dtype: the backend the model predicts fastest among those measured there that `auto`
    would weigh (roofline.predict.weigh_reason; the hybrid's prediction from an `auto` unit's record, where
    one ran), against the fastest measured. Replays the pick of today's model on a run made with any `auto`,
    or none."""
    from ...kernels.auto import weighed_names
    t = ok_units(run)
    if device is None or t.empty or "module.median_s" not in t:
        return pd.DataFrame()
    rows = []
    for (key, dtype), g in t.groupby(["point_key", "dtype"], sort=True):
        measured = g[~is_auto(g["backend"])].set_index("backend")["module.median_s"]
        if len(measured) < 2:
            continue
        names = set(weighed_names(device, dtype, regime_of(g.iloc[0])))
        pred = {r["backend"]: predicted_module_s(r, device) for _, r in g.iterrows()
                if r["backend"] in names and weigh_reason(row_facts(r), r, device, dtype) is None}
        hybrid = get_backend(HYBRID)
        for _, a in g[is_auto(g["backend"])].iterrows():
            record = ((auto_record(a).get("used") or {}).get(HYBRID) or {}).get("record")
            if record and HYBRID in measured.index and has_fixed_costs(device, HYBRID, model_dtype(dtype)):
                got = predict_module(hybrid.facts, a, record, device, dtype,
                                     ran_stages(hybrid.facts, g[g["backend"] == HYBRID].iloc[0]), regime_of(a))
                if got is not None:
                    pred[HYBRID] = got.seconds
        pred = {b: v for b, v in pred.items() if math.isfinite(v)}
        if not pred:
            continue
        pick = min(pred, key=pred.get)
        fastest = measured.idxmin()
        rows.append({"dtype": dtype, "N": g["wl_n_tokens"].iloc[0] if "wl_n_tokens" in g else np.nan,
                     "nsb/N": g["x"].iloc[0], "union_ratio P8": g[UNION].iloc[0] if UNION in g else np.nan,
                     "model pick": pick, "fastest": fastest, "pick/fastest": measured[pick] / measured[fastest]})
    return pd.DataFrame(rows)


def fidelity_table(run: Run, device: DeviceProfile | None, within: float = 0.25) -> pd.DataFrame:
    """Per backend and dtype: how many units' predicted module time is within `within` of the measured one,
    and the median and worst predicted/measured."""
    t = ok_units(run)
    if device is None or t.empty or "module.median_s" not in t:
        return pd.DataFrame()
    t = t.copy()
    t["ratio"] = [predicted_module_s(r, device) for _, r in t.iterrows()] / t["module.median_s"]
    t = t[np.isfinite(t["ratio"])]
    if t.empty:
        return pd.DataFrame()
    ok = (t["ratio"] - 1).abs() <= within
    rows = [{"backend": b, "dtype": d, "units": len(g), f"within {within:.0%}": int(ok[g.index].sum()),
             "predicted/measured (median)": float(g["ratio"].median()), "min": float(g["ratio"].min()),
             "max": float(g["ratio"].max())} for (b, d), g in t.groupby(["backend", "dtype"])]
    return pd.DataFrame(rows).sort_values(["dtype", "backend"]).reset_index(drop=True)


def stage_table(run: Run) -> pd.DataFrame:
    """Median latency per stage (seconds), one row per unit."""
    t = ok_units(run)
    if t.empty:
        return t
    shown = [f for f in varying_fields(t) if f != "reuse"]
    cols = ["backend", "dtype", *shown, "x"] + [f"{s}.median_s" for s in (*STAGE_ORDER, "module", "plan")
                                                 if f"{s}.median_s" in t]
    return (t[cols].rename(columns={"x": "nsb/N"}).sort_values(["dtype", "backend", *shown, "nsb/N"])
            .reset_index(drop=True))


# ---- the roofline next to the measurements ------------------------------------------------------

def model_time(row, schedule: str, device: DeviceProfile) -> float:
    pred = _predict_row(row, schedule, device)
    return pred.time_s if pred else float("nan")


def bytes_table(run: Run, device: DeviceProfile | None) -> pd.DataFrame:
    """Measured (ncu) HBM and L2 bytes of the module next to the roofline's, per unit with counters."""
    t = ok_units(run)
    if t.empty or "module.hbm_bytes" not in t:
        return pd.DataFrame()
    t = t[t["module.hbm_bytes"].notna()]
    rows = []
    for _, r in t.iterrows():
        # l2 measured: every access at an L2 slice (lts__t_bytes); l2 from SMs: only what the SMs asked
        # for (srcunit_tex), which is what the model counts; the rest is mostly partition crossing.
        row = {"backend": r["backend"], "dtype": r["dtype"], "nsb/N": r["x"],
               "hbm measured": r["module.hbm_bytes"], "l2 measured": r.get("module.l2_bytes", np.nan),
               "l2 from SMs": r.get("module.l2_sm_bytes", np.nan),
               "l2 cross-partition": r.get("module.l2_fabric_bytes", np.nan)}
        if device is not None and r["schedule"] != "none":
            pred = _predict_row(r, r["schedule"], device)
            if pred:
                row.update({"hbm model": pred.hbm_bytes, "l2 model": pred.l2_bytes,
                            "hbm measured/model": row["hbm measured"] / pred.hbm_bytes,
                            "l2 measured/model": row["l2 measured"] / pred.l2_bytes,
                            "l2 from SMs/model": row["l2 from SMs"] / pred.l2_bytes})
        rows.append(row)
    return pd.DataFrame(rows)


@dataclass
class Crossover:
    group: str
    dtype: str
    n_tokens: float
    kv_backend: str                 # KV-outer: the fastest of these backends at each nsb/N
    q_backend: str                  # Q-outer: the fastest of these
    measured: float | None          # nsb/N where the two meet (log-interpolated), None if they never do
    measured_note: str
    predicted: float | None         # capacity-aware, at the group's N (what the curves show)
    predicted_capacity_free: float | None
    reuse_range: tuple = (float("nan"), float("nan"))    # the nsb/N both were measured over

    @property
    def gap(self) -> float | None:
        """measured / predicted - 1: how far the measured crossover lies from the capacity-aware one."""
        if self.measured is None or not self.predicted:
            return None
        return self.measured / self.predicted - 1.0


def measured_crossover(x: np.ndarray, kv_s: np.ndarray, q_s: np.ndarray, names=("KV-outer", "Q-outer"),
                       axis: str = "nsb/N") -> tuple[float | None, str]:
    """Where the first (KV-outer) stops being faster than the second (Q-outer), on the log x axis (nsb/N).
    Inputs: x and the two module latencies."""
    order = np.argsort(x)
    x, d = x[order], np.log(kv_s[order]) - np.log(q_s[order])     # d < 0: KV-outer faster
    if len(x) == 0:
        return None, "no common points"
    for i in range(len(x) - 1):
        if d[i] == 0:
            return float(x[i]), "measured tie"
        if d[i] * d[i + 1] < 0:
            lx0, lx1 = math.log(x[i]), math.log(x[i + 1])
            return float(math.exp(lx0 + (lx1 - lx0) * d[i] / (d[i] - d[i + 1]))), "interpolated"
    if d[-1] == 0:
        return float(x[-1]), "measured tie"
    name = names[0] if (d < 0).all() else names[1]
    return None, f"{name} faster over the whole measured range ({axis} {x[0]:.3g} to {x[-1]:.3g})"


def _finite_or_none(v: float) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


def schedule_backends(table: pd.DataFrame, schedule: str) -> list[str]:
    """Backends that ran `schedule` at every unit (`auto` and the hybrid pick per point: never one)."""
    per = table.groupby("backend")["schedule"].agg(lambda s: set(s))
    return sorted(b for b, s in per.items() if s == {schedule} and not is_auto_name(b))


def reuse_groups(table: pd.DataFrame):
    """(group dict, sub-table) of points that differ in reuse and nothing else (seeds are replicates);
    only groups with at least two reuse values. A run whose points do not vary reuse has none."""
    varying = varying_fields(table)
    if "reuse" not in varying:
        return
    others = [f for f in varying if f != "reuse"]
    keys = [table[f].astype(object).where(table[f].notna(), None).map(repr) for f in others]
    for _, g in (table.groupby(keys, sort=False) if others else [(None, table)]):
        if g["reuse"].nunique() > 1:
            yield {f: g.iloc[0][f] for f in others}, g


def _fastest(table: pd.DataFrame, backends: list[str]) -> pd.Series:
    """Per nsb/N, the smallest module median among `backends`."""
    g = table[table["backend"].isin(backends)]
    return g.groupby(["x", "backend"])["module.median_s"].median().groupby(level="x").min()


def crossovers(run: Run, device: DeviceProfile | None) -> list[Crossover]:
    """KV-outer against Q-outer over points that differ in reuse only, per group and dtype: measured
    (the fastest KV-outer backend against the fastest Q-outer one, log-interpolated) and predicted."""
    t = ok_units(run)
    out = []
    if t.empty or "module.median_s" not in t:
        return out
    for group, g in reuse_groups(t):
        for dtype, gd in g.groupby("dtype"):
            kv, qo = schedule_backends(gd, Schedule.KV_OUTER), schedule_backends(gd, Schedule.Q_OUTER)
            if not kv or not qo:
                continue
            a, b = _fastest(gd, kv), _fastest(gd, qo)
            common = a.index.intersection(b.index)
            value, note = measured_crossover(common.to_numpy(float), a[common].to_numpy(float),
                                             b[common].to_numpy(float))
            n = float(gd["wl_n_tokens"].median())
            pred = free = None
            if device is not None:
                shape = row_model_shape(gd[gd["backend"] == kv[0]].iloc[0])
                free = _finite_or_none(crossover(shape, device))
                pred = _finite_or_none(crossover_at(shape, device, n))
            span = (float(common.min()), float(common.max())) if len(common) else (float("nan"),) * 2
            out.append(Crossover(group_label(group), dtype, n, ", ".join(kv), ", ".join(qo), value, note, pred, free,
                                 span))
    return out


def is_prefill_run(run: Run) -> bool:
    st = run.status
    return (not st.empty and "case_id" in st and st["case_id"].notna().any()
            and (st["case_id"].astype(str) != "").any() and "weight" in st)


def prefill_aggregate(run: Run) -> pd.DataFrame:
    """Call-weighted mean latency and aggregate useful TFLOP/s per backend (SOURCE-README formulas),
    over the cases every backend of that dtype finished, so backends are compared on the same cases."""
    t = ok_units(run)
    if t.empty or "module.median_s" not in t:
        return pd.DataFrame()
    rows = []
    for dtype, gd in t.groupby("dtype"):
        backends = sorted(gd["backend"].unique())
        cases = set.intersection(*(set(gd.loc[gd["backend"] == b, "case_id"]) for b in backends))
        for b in backends:
            g = gd[(gd["backend"] == b) & gd["case_id"].isin(cases)]
            w, lat = g["weight"].astype(float), g["module.median_s"].astype(float)
            flops = g.get("wl_useful_flops", pd.Series(0.0, index=g.index)).astype(float)
            rows.append({"dtype": dtype, "backend": b, "cases": len(g), "call weight": w.sum(),
                         "weighted mean latency_s": (w * lat).sum() / w.sum() if w.sum() else float("nan"),
                         "aggregate TFLOP/s": ((w * flops).sum() / (w * lat).sum() / 1e12 if (w * lat).sum()
                                               else float("nan"))})
    return pd.DataFrame(rows)


PICK_SCHEDULES = (Schedule.KV_OUTER, Schedule.Q_OUTER, Schedule.Q_PACKED)


def roofline_picks(run: Run, device: DeviceProfile | None) -> tuple[pd.DataFrame, dict]:
    """Per case: the schedule (KV-outer, Q-outer or token-packed q-packed) the roofline predicts fastest
    vs the backend measured fastest, over the schedules the case ran.

    The decision the model exists for is the schedule; the MSA-style scatter differs from KV-outer only
    by a store path whose cost is latency, not bytes, so it is left out here. q-packed takes part where
    the unit's workload has a union_ratio. Returns (per-case table, {"cases", "agree_cases",
    "agree_weight_share"})."""
    t = ok_units(run)
    if device is None or t.empty or "module.median_s" not in t:
        return pd.DataFrame(), {}
    t = t[t["schedule"].isin(PICK_SCHEDULES)]
    rows = []
    for (key, dtype), g in t.groupby(["point_key", "dtype"]):
        predicted = {s: model_time(g[g["schedule"] == s].iloc[0], s, device) for s in g["schedule"].unique()}
        predicted = {s: v for s, v in predicted.items() if math.isfinite(v)}
        g = g[g["schedule"].isin(predicted)]
        if len(predicted) < 2:
            continue
        fastest = g.loc[g["module.median_s"].idxmin()]
        pick = min(predicted, key=predicted.get)
        case_id = g["case_id"].iloc[0] if "case_id" in g else None
        rows.append({"case": case_id if isinstance(case_id, str) and case_id else key, "dtype": dtype,
                     "weight": float(g["weight"].iloc[0]) if "weight" in g and pd.notna(g["weight"].iloc[0]) else 1.0,
                     "nsb/N": g["x"].iloc[0],
                     **({"union_ratio P8": g[UNION].iloc[0]} if UNION in g and g[UNION].notna().any() else {}),
                     "predicted": pick, "measured fastest": fastest["backend"],
                     "agree": pick == fastest["schedule"]})
    table = pd.DataFrame(rows)
    if table.empty:
        return table, {}
    total_w = table["weight"].sum()
    summary = {"cases": len(table), "agree_cases": int(table["agree"].sum()),
               "agree_weight_share": (float(table.loc[table["agree"], "weight"].sum() / total_w) if total_w
                                      else float("nan"))}
    return table, summary


