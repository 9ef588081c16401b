"""The tables of a run: one row per unit, throughput, stages, bytes against the model, crossovers,
the real-prefill call-weighted aggregate and the roofline's picks. Reuse is the measured nsb/N."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..roofline.devices import DeviceProfile
from ..roofline.model import PACKED, crossover, crossover_at
from .prediction import launch_labels, model_shape, plan_config, predict_stats, quantization, schedule_of
from .results import STATUS_OK, Run

STAGE_ORDER = ("index_map", "schedule", "attention", "combine")
GROUP_FIELDS = ("generator", "tokens", "context", "skew", "causal")
MAX_GROUP_VALUES = 6           # a field with more distinct values varies along x, not per figure
KV_OUTER, Q_OUTER = "kv-outer", "q-outer"
UNION = "wl_union_ratio_p8"    # co-selection of a unit's workload (scenarios.stats.union_ratio at P = 8)
SHAPE_DEFAULTS = {"hq": 64, "hkv": 4, "head_dim": 128, "block": 128, "topk": 16}


# ---- tables -------------------------------------------------------------------------------------

def unit_table(run: Run) -> pd.DataFrame:
    """One row per unit: status columns, nsb/N (`x`), and wide `<stage>.<statistic>` columns."""
    st = run.status.copy()
    if st.empty:
        return st
    if "wl_nsb_per_n" in st:
        st["x"] = st["wl_nsb_per_n"]
    elif {"wl_nsb", "wl_n_tokens"} <= set(st):
        st["x"] = st["wl_nsb"] / st["wl_n_tokens"]
    else:
        st["x"] = st.get("reuse", np.nan)
    if {"plan_info", "schedule", "backend"} <= set(st):      # `auto` units: the schedule their plan chose
        st["schedule"] = [s if s != "none" else (schedule_of(b, p) or "none")
                          for s, b, p in zip(st["schedule"], st["backend"], st["plan_info"])]
    if run.stats.empty:
        return st
    wide = run.stats.pivot_table(index=["point_key", "backend"], columns=["stage", "statistic"],
                                 values="value", aggfunc="first")
    wide.columns = [f"{a}.{b}" for a, b in wide.columns]
    return st.merge(wide.reset_index(), on=["point_key", "backend"], how="left")


def ok_units(run: Run) -> pd.DataFrame:
    t = unit_table(run)
    return t[t["status"] == STATUS_OK] if not t.empty else t


def attention_shape(row) -> dict:
    out = {}
    for k, default in SHAPE_DEFAULTS.items():
        value = next((row[c] for c in (k, f"wl_{k}") if c in row and pd.notna(row[c])), default)
        out[k] = int(value)
    return out


def row_model_shape(row):
    """The model's shape for a unit row: its attention shape, dtype and launch configuration."""
    return model_shape(**attention_shape(row), dtype=row["dtype"], config=plan_config(row.get("plan_info")))


def _predict_row(row, schedule: str, device: DeviceProfile):
    """The roofline for a unit row: its workload's statistics (wl_ columns, union_ratio included) and, for
    q-packed, the tile size its plan records."""
    return predict_stats(schedule, row_model_shape(row), row, device, row.get("plan_info"))


def group_fields(table: pd.DataFrame) -> list[str]:
    return [f for f in GROUP_FIELDS if f in table and 1 < table[f].nunique(dropna=False) <= MAX_GROUP_VALUES]


def groups(table: pd.DataFrame):
    fields = group_fields(table)
    if not fields:
        yield {}, table
        return
    for values, g in table.groupby(fields, dropna=False, sort=True):
        values = values if isinstance(values, tuple) else (values,)
        yield dict(zip(fields, values)), g


def group_label(group: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in group.items()) or "all points"


def slug(group: dict, extra: str = "") -> str:
    text = "_".join(f"{k}{v}" for k, v in group.items()) or "all"
    text = f"{extra}_{text}" if extra else text
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


def status_table(run: Run) -> pd.DataFrame:
    st = run.status
    if st.empty:
        return pd.DataFrame(columns=["backend", "status", "units"])
    return st.groupby(["backend", "status"]).size().rename("units").reset_index()


def throughput_table(run: Run) -> pd.DataFrame:
    t = ok_units(run)
    if t.empty:
        return t
    cols = {"backend": "backend", "dtype": "dtype", **{f: f for f in group_fields(t)}, "x": "nsb/N",
            UNION: "union_ratio P8", "wl_n_tokens": "N", "module.median_s": "module_s", "module.cv": "cv",
            "module.tflops": "TFLOP/s", "max_rel_err": "max rel err", "attention.tflops": "attention TFLOP/s",
            "module.converged": "CV converged", "throttled": "throttled"}
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
    order = [c for c in ("dtype", "backend", *group_fields(t), "nsb/N", "union_ratio P8") if c in out]
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


def stage_table(run: Run) -> pd.DataFrame:
    """Median latency per stage (seconds), one row per unit."""
    t = ok_units(run)
    if t.empty:
        return t
    groups = group_fields(t)
    cols = ["backend", "dtype", *groups, "x"] + [f"{s}.median_s" for s in (*STAGE_ORDER, "module", "plan")
                                                 if f"{s}.median_s" in t]
    return (t[cols].rename(columns={"x": "nsb/N"}).sort_values(["dtype", "backend", *groups, "nsb/N"])
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
    kv_backend: str
    q_backend: str
    measured: float | None          # nsb/N where the two meet (log-interpolated), None if they never do
    measured_note: str
    predicted: float | None         # capacity-aware, at the group's N (what the curves show)
    predicted_capacity_free: float | None


def measured_crossover(x: np.ndarray, kv_s: np.ndarray, q_s: np.ndarray) -> tuple[float | None, str]:
    """Where KV-outer stops being faster, on the log nsb/N axis. Inputs: nsb/N and module latencies."""
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
    if (d < 0).all():
        return None, f"KV-outer faster over the whole measured range (nsb/N {x[0]:.3g} to {x[-1]:.3g})"
    return None, f"Q-outer faster over the whole measured range (nsb/N {x[0]:.3g} to {x[-1]:.3g})"


def _finite_or_none(v: float) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None


def crossovers(run: Run, device: DeviceProfile | None) -> list[Crossover]:
    t = ok_units(run)
    out = []
    if t.empty or "module.median_s" not in t:
        return out
    for group, g in groups(t):
        for dtype, gd in g.groupby("dtype"):
            kv = sorted(gd.loc[gd["schedule"] == KV_OUTER, "backend"].unique())
            qo = sorted(gd.loc[gd["schedule"] == Q_OUTER, "backend"].unique())
            for kb in kv:
                for qb in qo:
                    a = gd[gd["backend"] == kb].groupby("x")["module.median_s"].median()
                    b = gd[gd["backend"] == qb].groupby("x")["module.median_s"].median()
                    common = a.index.intersection(b.index)
                    value, note = measured_crossover(common.to_numpy(float), a[common].to_numpy(float),
                                                     b[common].to_numpy(float))
                    pred = free = None
                    if device is not None:
                        row = gd[gd["backend"] == kb].iloc[0]
                        shape = row_model_shape(row)
                        free = _finite_or_none(crossover(shape, device))
                        pred = _finite_or_none(crossover_at(shape, device, float(gd["wl_n_tokens"].median())))
                    out.append(Crossover(group_label(group), dtype, kb, qb, value, note, pred, free))
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


PICK_SCHEDULES = (KV_OUTER, Q_OUTER, PACKED)


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


