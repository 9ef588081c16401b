"""What a run's figures are plotted along: the point field its points vary, read from the unit table.

One helper decides it for every figure and table: real-prefill cases (categorical, by call weight),
batch size for decode-like runs (one query token per request), co-selection u, reuse nsb/N, context,
query tokens, or, when none of these varies, the points themselves side by side. The fields that vary
besides the axis split a run into groups; nothing is joined across groups."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import pandas as pd

from ...scenarios.grid import SHAPE_KEYS, Point

UNION = "wl_union_ratio_p8"    # co-selection of a unit's workload (scenarios.stats.union_ratio at P = 8)
CASE, REQUESTS, UNION_AXIS, REUSE, CONTEXT, TOKENS, POINTS = (
    "case", "requests", "union", "reuse", "context", "tokens", "points")
# point field -> the axis it moves; the first of these listed wins a tie in distinct values
FIELD_AXIS = {"requests": REQUESTS, "batch": REQUESTS, "share": UNION_AXIS, "drift": UNION_AXIS,
              "reuse": REUSE, "context": CONTEXT, "tokens": TOKENS}
# what may vary between points, apart from the dtype (panels) and the seed (replicates of one point):
# the grid's point fields, and the axes' fields a scenario may add
POINT_FIELDS = tuple(dict.fromkeys([*(f.name for f in fields(Point) if f.name not in ("shape", "dtype", "seed",
                                                                                      "weight")),
                                    *SHAPE_KEYS, *FIELD_AXIS]))
# when only fields without an axis of their own vary: the workload statistic that moved most with them
# (relative spread; the first listed wins a tie)
STAT_AXIS = ((UNION, UNION_AXIS), ("x", REUSE), ("wl_context_tokens", CONTEXT), ("wl_n_tokens", TOKENS))
MIN_SPREAD = 1.1               # a statistic varies when its largest value is this much its smallest


@dataclass(frozen=True)
class FigureAxis:
    kind: str            # one of CASE, REQUESTS, UNION_AXIS, REUSE, CONTEXT, TOKENS, POINTS
    column: str | None   # the unit-table column along x; None for the categorical kinds
    fields: tuple        # the point fields the axis stands for (not group fields)
    label: str           # x-axis label, with units

    @property
    def categorical(self) -> bool:
        return self.column is None


AXES = {
    CASE: FigureAxis(CASE, None, ("case_id", "tokens", "context", "reuse"),
                     "real-prefill case, heaviest call weight first"),
    REQUESTS: FigureAxis(REQUESTS, "wl_requests", ("requests", "batch", "tokens", "context", "reuse"),
                         "batch size (requests, one query token each)"),
    UNION_AXIS: FigureAxis(UNION_AXIS, UNION, ("share", "drift"),
                           "co-selection: union_ratio at P = 8 tokens (measured; 1 = a tile selects alike)"),
    REUSE: FigureAxis(REUSE, "x", ("reuse",), "reuse nsb/N (measured)"),
    CONTEXT: FigureAxis(CONTEXT, "wl_context_tokens", ("context",), "context (tokens)"),
    TOKENS: FigureAxis(TOKENS, "wl_n_tokens", ("tokens",), "query tokens N"),
    POINTS: FigureAxis(POINTS, None, (), "point"),
}


def varying_fields(table: pd.DataFrame) -> dict[str, int]:
    """Point fields with more than one value among the table's units -> how many values."""
    out = {}
    for f in POINT_FIELDS:
        if f in table:
            n = table[f].astype(object).where(table[f].notna(), None).map(repr).nunique()
            if n > 1:
                out[f] = n
    return out


def _varying(table: pd.DataFrame) -> dict[str, int]:
    """varying_fields less those another one derives: N = requests x query tokens per request."""
    varying = varying_fields(table)
    if "requests" in varying:
        varying.pop("tokens", None)
    return varying


def _spread(values: pd.Series) -> float:
    v = pd.to_numeric(values, errors="coerce").dropna()
    v = v[v > 0]
    return float(v.max() / v.min()) if len(v) else 1.0


def _decode_like(table: pd.DataFrame) -> bool:
    if not {"wl_requests", "wl_n_tokens"} <= set(table):
        return False
    req, n = table["wl_requests"].astype(float), table["wl_n_tokens"].astype(float)
    return req.nunique() > 1 and bool(np.allclose(n, req))


def figure_axis(table: pd.DataFrame) -> FigureAxis:
    """The axis a run's figures are plotted along, from what varies among its units' points."""
    if table is None or table.empty:
        return AXES[POINTS]
    varying = _varying(table)
    if "case_id" in varying:
        return AXES[CASE]
    order = list(dict.fromkeys(FIELD_AXIS.values()))
    known = [(n, -order.index(FIELD_AXIS[f]), FIELD_AXIS[f]) for f, n in varying.items() if f in FIELD_AXIS]
    if known:                            # the field with the most values (decode: requests; sparsity: context)
        return AXES[max(known)[2]]
    if _decode_like(table):
        return AXES[REQUESTS]
    if varying or _point_count(table) > 1:    # a field with no axis of its own: the statistic it moved most
        spreads = [(_spread(table[column]), -i, kind) for i, (column, kind) in enumerate(STAT_AXIS) if column in table]
        moved = max((s for s in spreads if s[0] >= MIN_SPREAD), default=None)
        if moved:
            return AXES[moved[2]]
    return AXES[POINTS]


def group_fields(table: pd.DataFrame, axis: FigureAxis | None = None) -> list[str]:
    """The varying point fields that are not the axis: one group (figure or line set) per combination.
    The categorical axes show every point side by side and need no groups."""
    axis = axis or figure_axis(table)
    if axis.categorical:
        return []
    return [f for f in _varying(table) if f not in axis.fields]


def groups(table: pd.DataFrame, axis: FigureAxis | None = None):
    """(group dict, sub-table) per combination of group_fields."""
    fields_ = group_fields(table, axis)
    if not fields_:
        yield {}, table
        return
    keys = table[fields_].astype(object).where(table[fields_].notna(), None)
    for values, g in table.groupby([keys[f].map(repr) for f in fields_], sort=False):
        first = g.iloc[0]
        yield {f: first[f] for f in fields_}, g


def given_fields(group: dict) -> dict:
    """The group's fields that have a value (a field some points leave unset, such as drift, is dropped)."""
    return {k: v for k, v in group.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}


def _plain_value(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v


def group_label(group: dict) -> str:
    """'tokens 2048, context 4M'; 'all points' for no group."""
    return ", ".join(f"{k} {short_number(v) if k.startswith('context') else _plain_value(v)}"
                     for k, v in given_fields(group).items()) or "all points"


def slug(group: dict, extra: str = "") -> str:
    text = "_".join(f"{k}{_plain_value(v)}" for k, v in given_fields(group).items()) or "all"
    text = f"{extra}_{text}" if extra else text
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


def point_id(table: pd.DataFrame) -> pd.Series:
    """A point's identity apart from its dtype: the same id in both dtypes' rows (its key without the
    dtype part, or its point fields where a table has no keys)."""
    if {"point_key", "dtype"} <= set(table):
        return pd.Series(["/".join(p for p in str(k).split("/") if p != d)
                          for k, d in zip(table["point_key"], table["dtype"])], index=table.index)
    cols = [f for f in POINT_FIELDS if f in table]
    if not cols:
        return pd.Series(table.index.astype(str), index=table.index)
    return table[cols].astype(object).where(table[cols].notna(), None).apply(lambda r: repr(tuple(r)), axis=1)


def _point_count(table: pd.DataFrame) -> int:
    return point_id(table).nunique()


def point_order(table: pd.DataFrame, axis: FigureAxis | None = None) -> list[str]:
    """Point ids in the axis's order, the same for every dtype: groups in turn, then the axis value
    (cases: heaviest call weight first, then query tokens)."""
    axis = axis or figure_axis(table)
    if table.empty:
        return []
    t = table.assign(_pid=point_id(table))
    if axis.kind == CASE:
        keys = [c for c in ("weight", "wl_n_tokens") if c in t]
        per = t.groupby("_pid")[keys].median() if keys else pd.DataFrame(index=t["_pid"].unique())
        return list(per.sort_values(keys, ascending=[False] * len(keys)).index) if keys else list(per.index)
    fields_ = group_fields(t, axis)
    value = axis.column if axis.column in t else None
    per = t.groupby("_pid").agg({**{f: "first" for f in fields_}, **({value: "median"} if value else {})})
    sort = [*fields_, *([value] if value else [])]
    if not sort:
        return sorted(per.index)
    return list(per.sort_values(sort, kind="stable", key=lambda s: s.map(_sortable)).index)


def _sortable(v):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return (0, "")
    if isinstance(v, (bool, np.bool_)):
        return (1, int(v))
    if isinstance(v, (int, float, np.number)):
        return (1, float(v))
    return (2, str(v))


def short_number(v: float) -> str:
    """At most four characters where it can: 171 -> 171, 9844 -> 9844, 16384 -> 16K, 55339 -> 54K,
    131072 -> 128K, 4194304 -> 4M."""
    v = float(v)
    if v < 10000:
        return f"{v:.4g}"
    for size, unit in ((1 << 20, "M"), (1 << 10, "K")):
        if v >= size:
            return f"{v / size:.3g}{unit}" if v / size < 10 else f"{round(v / size)}{unit}"
    return f"{v:.4g}"


def ratio_label(v: float) -> str:
    """nsb/N as a tick: 1/32, 1/4, 0.3, 1, 24."""
    v = float(v)
    if 0 < v < 1 and abs(1 / v - round(1 / v)) < 1e-6:
        return f"1/{round(1 / v)}"
    return f"{v:.2g}"


def short(field: str, value) -> str:
    """A point field's value as a short tick line: N16K, T128K, z1, causal / not causal, or the value."""
    if field == "causal":
        return "causal" if value else "not causal"
    prefix = {"tokens": "N", "context": "T", "skew": "z", "requests": "B", "share": "s", "query_tokens": "q",
              "context_min": "T>=", "drift": "p"}.get(field, f"{field} ")
    if not isinstance(value, (int, float, np.number)) or isinstance(value, bool):
        return str(value)
    return f"{prefix}{short_number(value) if field in ('tokens', 'context', 'context_min') else format(float(value), 'g')}"
