"""Is sparsity worth its kernel: the fastest sparse schedule against each dense backend over context.

The dense backends are those of the schedules that attend each request's whole visible context:
`dense-masked`, the selection as a mask (the same output), and the dense floor, no selection at all (what
the model costs without sparse attention). Per regime (a decode batch of R requests x T tokens, or a
prefill chunk of N tokens), dtype and dense backend, the crossover is the context where the fastest
sparse backend's module time meets the dense one's (log-interpolated between measured contexts,
tables.measured_crossover): above it, sparse wins. The model's crossover comes from the same rows: the
least module time the model predicts for the sparse backends (tables.predicted_module_s, what `auto`
weighs) against its prediction for the dense backend as it ran. `auto` is no sparse schedule here: it may
pick dense.
"""
from __future__ import annotations

import math

import pandas as pd

from ...kernels.base import backend_class, registered_names
from ...roofline.devices import DeviceProfile
from ...roofline.names import base_name
from ...roofline.schedules import DENSE_SCHEDULES
from ..store.results import Run
from .tables import measured_crossover, ok_units, predicted_module_s

# the dense baselines: the backends of the schedules that attend the whole visible context, in their order
DENSE = tuple(sorted((n for n in registered_names() if backend_class(n).schedule in DENSE_SCHEDULES),
                     key=lambda n: (DENSE_SCHEDULES.index(backend_class(n).schedule), n)))
REGIME_FIELDS = ("generator", "requests", "query_tokens", "chunks", "chunk_tokens")


PANELS_PER_ROW = 3         # regimes side by side: wider figures overflow a page
DENSE_MARKERS, DENSE_LINES = ("o", "s"), ("--", ":")          # each dense backend's, in DENSE's order
CROSSOVER_COLORS = ("tab:red", "tab:purple")


def _base(backend: str) -> str:
    return base_name(backend)


def _is_sparse(backend: str) -> bool:
    """A backend that attends the selection: it declares a schedule (`auto`, which may pick dense, and the
    reference do not) and is no dense probe."""
    try:
        cls = backend_class(backend)
    except KeyError:
        return False
    return cls.schedule is not None and not cls.dense


def regime_label(row) -> str:
    """'decode 16 x 1', 'prefill chunk N 2048' (a drift chunk), 'mixed 1 x 8192 + 512 x 1'."""
    def num(key):
        v = row.get(key)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)
    gen = row.get("generator")
    if gen == "decode":
        return f"decode {num('requests')} x {num('query_tokens')}"
    if gen == "drift":
        return f"prefill chunk N {num('chunk_tokens')}"
    if gen == "mixed":
        return f"mixed {num('chunks')} x {num('chunk_tokens')} + {num('requests')} x {num('query_tokens')}"
    return f"{gen} N {num('tokens')}"


def _is_dense(backend: str) -> bool:
    return _base(backend) in DENSE


def dense_units(run: Run) -> pd.DataFrame:
    """OK units of runs that hold a dense backend and vary the context per regime, with a `regime` column;
    empty otherwise."""
    t = ok_units(run)
    if t.empty or "module.median_s" not in t or not t["backend"].map(_is_dense).any():
        return pd.DataFrame()
    t = t.copy()
    t["regime"] = [regime_label(r) for r in t.to_dict("records")]
    keep = t.groupby("regime")["context"].transform("nunique") > 1
    return t[keep]


def _sparse(g: pd.DataFrame) -> pd.DataFrame:
    return g[g["backend"].map(_is_sparse)]


def _ratio_at(g: pd.DataFrame, context: float | None) -> float | None:
    """The sparsity ratio at a (possibly interpolated) context: it is proportional to the context."""
    if context is None or "wl_sparsity_ratio" not in g:
        return None
    per = (g["wl_sparsity_ratio"] / g["context"]).median()
    return float(per * context) if math.isfinite(per) else None


def _whole(context: float | None) -> int | None:
    """A crossover context in whole tokens, None where there is none."""
    return None if context is None else round(context)


def crossover_table(run: Run, device: DeviceProfile | None) -> pd.DataFrame:
    """One row per regime, dtype and dense backend: measured and predicted crossover context and sparsity
    ratio, and the dense module time over the fastest sparse one's at the least context (sparsity ratio 1
    where the selection holds the whole context)."""
    t = dense_units(run)
    rows = []
    if t.empty:
        return pd.DataFrame()
    for (regime, dtype), g in t.groupby(["regime", "dtype"], sort=True):
        sparse_units = _sparse(g)
        if sparse_units.empty:
            continue
        sparse = sparse_units.groupby("context")["module.median_s"].min()
        model = None
        for name in DENSE:
            mine = g["backend"].map(_base) == name
            dense = g[mine].groupby("context")["module.median_s"].median()
            if dense.empty:
                continue
            common = sparse.index.intersection(dense.index)
            x = common.to_numpy(float)
            value, note = measured_crossover(x, dense[common].to_numpy(float), sparse[common].to_numpy(float),
                                             names=(name, "sparse"), axis="context")
            top = common.max() if len(common) else None
            fastest = (sparse_units[sparse_units["context"] == top].sort_values("module.median_s")["backend"].iloc[0]
                       if top is not None else "")
            least = common.min() if len(common) else None
            row = {"regime": regime, "dtype": dtype, "dense": name, "fastest sparse (largest context)": fastest,
                   "measured context": _whole(value), "measured ratio": _ratio_at(g, value), "how": note,
                   "dense / sparse at least context": (float(dense[least] / sparse[least]) if least is not None
                                                       else None)}
            if device is not None:
                # the model auto weighs: roofline over achieved fraction plus fixed costs, per backend as it ran
                if model is None:
                    model = g.assign(m=[predicted_module_s(r, device) for _, r in g.iterrows()])
                ms = _sparse(model).groupby("context")["m"].min().reindex(common)
                md = model[mine].groupby("context")["m"].median().reindex(common)
                ok = ms.notna() & md.notna()
                v, _ = (measured_crossover(x[ok.to_numpy()], md[ok].to_numpy(float), ms[ok].to_numpy(float))
                        if ok.any() else (None, ""))
                row["model context"] = _whole(v)
                row["model ratio"] = _ratio_at(g, v)
            rows.append(row)
    return pd.DataFrame(rows)


def _tokens(v: float) -> str:
    return f"{v / 1024:,.1f}K" if v >= 1024 else f"{v:,.0f}"


def crossover_figures(run: Run, device: DeviceProfile | None):
    """One figure per dtype: module time against context (log-log), a panel per regime, every sparse
    backend and every dense one (black), each dense backend's measured crossover (solid line) and the
    model's (dotted)."""
    from .plots import MEASURED_STYLES, _title, plt
    t = dense_units(run)
    if t.empty:
        return []
    table = crossover_table(run, device)
    out = []
    for dtype, gd in t.groupby("dtype", sort=True):
        regimes = sorted(gd["regime"].unique())
        cols = min(PANELS_PER_ROW, len(regimes))
        rows = math.ceil(len(regimes) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.8 * rows), squeeze=False)
        for ax in axes.flat[len(regimes):]:
            ax.set_visible(False)
        backends = sorted(gd["backend"].unique())
        styles = [st for st in MEASURED_STYLES if st[0] != "black"]          # black is the dense backends'
        for ax, regime in zip(axes.flat, regimes):
            g = gd[gd["regime"] == regime]
            for i, b in enumerate(backends):
                gb = g[g["backend"] == b].groupby("context")["module.median_s"].median()
                if gb.empty:
                    continue
                k = DENSE.index(_base(b)) if _is_dense(b) else None
                color, marker = ("black", DENSE_MARKERS[k % len(DENSE_MARKERS)]) if k is not None else \
                    styles[i % len(styles)]
                ax.plot(gb.index, gb.values * 1e3, marker=marker, color=color, lw=2.2 if k is not None else 1.2,
                        ls=DENSE_LINES[k % len(DENSE_LINES)] if k is not None else "-", ms=4, label=b)
            rows_here = table[(table["regime"] == regime) & (table["dtype"] == dtype)] if not table.empty else table
            for _, r in rows_here.iterrows():
                color = CROSSOVER_COLORS[DENSE.index(r["dense"]) % len(CROSSOVER_COLORS)]
                for key, style in (("measured context", "-"), ("model context", ":")):
                    v = r.get(key)
                    if v is not None and pd.notna(v):
                        ax.axvline(v, color=color, ls=style, lw=1.2,
                                   label=f"{key.split()[0]} crossover, {r['dense']} {_tokens(v)}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("module time (ms)")
            ax.set_title(regime, fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
        fig.suptitle(_title(run, f"Sparse schedules against dense attention, {dtype}"), fontsize=10)
        fig.tight_layout()
        out.append((f"dense_crossover_{dtype}.png", fig))
    return out
