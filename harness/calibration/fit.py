"""The prefill fractions of a device profile, fitted on a run: per backend and dtype, the fraction of today's
roofline the module reaches once its fixed costs are taken off, as the median over the run's selection
generators of the median over each generator's prefill units. Each kind of selection weighs the same: a
tile's fraction differs between synthetic co-selection and real-prefill selections, and a plain median over
more units of one kind fits that kind alone (docs/perf-log.md, 2026-12-07)."""
from __future__ import annotations

import pandas as pd

from ...kernels.auto import AutoBackend
from ...roofline.devices import DeviceProfile
from ...roofline.dtypes import model_dtype
from ...roofline.model import is_decode
from ...roofline.predict import fraction_fit
from ..store.results import Run
from ..store.rows import ok_units, ran_stages, row_facts, row_record

AUTO = AutoBackend.name


def fit_achieved(run: Run, device: DeviceProfile) -> pd.DataFrame:
    """Per backend and dtype, over the run's prefill units the model predicts: the fraction of today's
    roofline the module reaches once its fixed costs (`device`'s) are taken off, roofline / (measured -
    fixed); median and range. The median is what a device profile's `achieved` holds."""
    t = ok_units(run)
    rows = []
    for _, r in t.iterrows() if not t.empty and "module.median_s" in t else ():
        if r["backend"] == AUTO or is_decode(r.get("wl_n_tokens", 0), r.get("wl_requests", 0)):
            continue
        facts = row_facts(r)
        got = facts and fraction_fit(facts, r, row_record(r), device, r["dtype"], r["module.median_s"],
                                     ran_stages(facts, r))
        if got:
            rows.append({"backend": got[0], "dtype": model_dtype(r["dtype"]), "f": got[1],
                         "generator": str(r.get("generator") or "")})
    if not rows:
        return pd.DataFrame(columns=["backend", "dtype", "units", "achieved", "min", "max"])
    t = pd.DataFrame(rows)
    f = t.groupby(["backend", "dtype"])["f"]
    achieved = t.groupby(["backend", "dtype", "generator"])["f"].median().groupby(["backend", "dtype"]).median()
    return pd.DataFrame({"units": f.size(), "achieved": achieved, "min": f.min(), "max": f.max()}).reset_index()
