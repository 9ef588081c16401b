"""The tables of a run: one row per unit, throughput, stages, bytes against the model, crossovers,
the real-prefill call-weighted aggregate and the roofline's picks. Reuse is the measured nsb/N."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..roofline.devices import DeviceProfile
from ..roofline.model import crossover, crossover_at
from .prediction import launch_labels, model_shape, plan_config, predict_point
from .results import STATUS_OK, Run

STAGE_ORDER = ("index_map", "schedule", "attention", "combine")
GROUP_FIELDS = ("generator", "tokens", "context", "skew", "causal")
MAX_GROUP_VALUES = 6           # a field with more distinct values varies along x, not per figure
KV_OUTER, Q_OUTER = "kv-outer", "q-outer"
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
    if run.stats.empty:
        return st
    wide = run.stats.pivot_table(index=["point_key", "backend"], columns=["stage", "statistic"],
                                 values="value", aggfunc="first")
    wide.columns = [f"{a}.{b}" for a, b in wide.columns]
    return st.merge(wide.reset_index(), on=["point_key", "backend"], how="left")


def ok_units(run: Run) -> pd.DataFrame:
    t = unit_table(run)
    return t[t["status"] == STATUS_OK] if not t.empty else t


def _shape(row) -> dict:
    out = {}
    for k, default in SHAPE_DEFAULTS.items():
        value = next((row[c] for c in (k, f"wl_{k}") if c in row and pd.notna(row[c])), default)
        out[k] = int(value)
    return out


def row_model_shape(row):
    """The model's shape for a unit row: its attention shape, dtype and launch configuration."""
    return model_shape(**_shape(row), dtype=row["dtype"], config=plan_config(row.get("plan_info")))


def _predict_row(row, schedule: str, device: DeviceProfile):
    shape = row_model_shape(row)
    return predict_point(schedule, shape, row.get("wl_n_tokens", np.nan),
                         row.get("wl_nsb", np.nan), device, flops=row.get("wl_useful_flops"),
                         selected_per_query=row.get("wl_selected_blocks_per_query"))


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
            "wl_n_tokens": "N", "module.median_s": "module_s", "module.cv": "cv", "module.tflops": "TFLOP/s",
            "attention.tflops": "attention TFLOP/s", "module.converged": "CV converged", "throttled": "throttled"}
    out = t[[c for c in cols if c in t]].rename(columns=cols)
    if "CV converged" in out:
        out["CV converged"] = out["CV converged"].fillna(0).astype(bool)
    if "plan_info" in t:                          # the tile order and CuTe kernel each unit ran
        labels = pd.DataFrame([launch_labels(p) if isinstance(p, (str, dict)) else {} for p in t["plan_info"]],
                              index=t.index)
        for col in ("kernel", "tile order"):
            if col in labels and labels[col].notna().any():
                out.insert(2, col, labels[col].fillna(""))
    order = [c for c in ("dtype", "backend", *group_fields(t), "nsb/N") if c in out]
    return out.sort_values(order).reset_index(drop=True)


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


def roofline_picks(run: Run, device: DeviceProfile | None) -> tuple[pd.DataFrame, dict]:
    """Per case: KV-outer or Q-outer, which the roofline predicts faster vs which was measured faster.

    The decision the model exists for is the schedule (KV-outer against Q-outer); the MSA-style scatter
    differs from KV-outer only by a store path whose cost is latency, not bytes, so it is left out here.
    Returns (per-case table, {"cases", "agree_cases", "agree_weight_share"})."""
    t = ok_units(run)
    if device is None or t.empty or "module.median_s" not in t:
        return pd.DataFrame(), {}
    t = t[t["schedule"].isin(["kv-outer", "q-outer"])]
    rows = []
    for (key, dtype), g in t.groupby(["point_key", "dtype"]):
        if g["schedule"].nunique() < 2:
            continue
        predicted = {s: model_time(g[g["schedule"] == s].iloc[0], s, device) for s in g["schedule"].unique()}
        fastest = g.loc[g["module.median_s"].idxmin()]
        pick = min(predicted, key=predicted.get)
        case_id = g["case_id"].iloc[0] if "case_id" in g else None
        rows.append({"case": case_id if isinstance(case_id, str) and case_id else key, "dtype": dtype,
                     "weight": float(g["weight"].iloc[0]) if "weight" in g and pd.notna(g["weight"].iloc[0]) else 1.0,
                     "nsb/N": g["x"].iloc[0], "predicted": pick, "measured fastest": fastest["backend"],
                     "agree": pick == fastest["schedule"]})
    table = pd.DataFrame(rows)
    if table.empty:
        return table, {}
    total_w = table["weight"].sum()
    summary = {"cases": len(table), "agree_cases": int(table["agree"].sum()),
               "agree_weight_share": (float(table.loc[table["agree"], "weight"].sum() / total_w) if total_w
                                      else float("nan"))}
    return table, summary


