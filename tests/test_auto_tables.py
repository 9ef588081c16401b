"""The report's view of `auto` and of the model on the committed H200 runs: GB/s and the HBM fraction per
unit, auto against the fastest backend per point, today's model's pick replayed, predicted vs measured."""
from pathlib import Path

import numpy as np
import pytest

from msa_bench.harness.calibration.fit import fit_achieved
from msa_bench.harness.report import tables
from msa_bench.harness.store.results import load_run
from msa_bench.roofline.devices import load_device

RESULTS = Path(__file__).resolve().parents[1] / "results" / "h200"
H200 = load_device("h200")      # the preset with its committed calibration


@pytest.fixture(scope="module")
def default_run():
    return load_run(RESULTS / "baseline")


def test_throughput_states_gb_per_s_and_the_hbm_fraction(default_run):
    t = tables.throughput_table(default_run, H200)
    row = t.iloc[0]
    src = tables.ok_units(default_run)
    src = src[(src["backend"] == row["backend"]) & (src["dtype"] == row["dtype"]) & (src["x"] == row["nsb/N"])].iloc[0]
    assert row["GB/s"] == pytest.approx(src["module.model_hbm_bytes"] / src["module.median_s"] / 1e9)
    assert row["HBM frac"] == pytest.approx(row["GB/s"] * 1e9 / H200.hbm_bytes_per_s)
    # every unit's fraction is in range, but for auto's hybrid picks: no one closed form, no model bytes
    hybrid_pick = (t["backend"] == "auto") & t["HBM frac"].isna()
    assert (t["HBM frac"].between(0, 1.2) | hybrid_pick).all()
    assert "HBM frac" not in tables.throughput_table(default_run)              # no profile: no fraction
    cols = list(t.columns)
    assert cols.index("GB/s") == cols.index("TFLOP/s") + 1


def test_auto_against_the_fastest_names_the_fastest_other_backend(default_run):
    av = tables.auto_vs_fastest(default_run)
    t = tables.ok_units(default_run)
    assert len(av) == t[t["backend"] == "auto"].groupby(["point_key", "dtype"]).ngroups == 10
    for _, r in av.iterrows():
        assert r["auto/fastest"] == pytest.approx(r["auto_s"] / r["fastest_s"]) and r["fastest"] != "auto"
    s = tables.auto_summary(av)
    assert s["points"] == 10 and s["worst"] == pytest.approx(av["auto/fastest"].max())
    assert s["count_within"] == int((av["auto/fastest"] <= 1.05).sum()) == round(s["share_within"] * 10)


def test_fidelity_holds_in_sample_and_counts_units():
    run = load_run(RESULTS / "co-selection")
    fid = tables.fidelity_table(run, H200).set_index(["backend", "dtype"])
    for key in (("kv-outer-cute", "bf16"), ("kv-outer-cute", "fp8"), ("q-packed-cute", "bf16")):
        assert fid.loc[key, "within 25%"] == fid.loc[key, "units"] == 7          # where the fractions were fitted
    assert fid.loc[("flashinfer-packed", "bf16"), "within 25%"] < 7            # its masks: not modelled off u 1
    assert tables.fidelity_table(run, None).empty


def test_the_replayed_pick_follows_autos_candidate_rules():
    run = load_run(RESULTS / "real-prefill")
    mp = tables.model_pick_table(run, H200)
    assert len(mp) == 32 and not mp["model pick"].isin(["dense-gather", "reference"]).any()
    assert np.all(mp["pick/fastest"] >= 1.0)


def test_the_replay_uses_the_profiles_fixed_costs_not_the_ones_the_run_recorded():
    """results/h200/drift recorded its units' fixed costs (model_fixed_s, from the profile of its day):
    the replay takes those of the profile it is given instead."""
    from dataclasses import replace
    run = load_run(RESULTS / "drift")
    t = tables.ok_units(run)
    row = t[(t["backend"] == "kv-outer-cute") & (t["dtype"] == "fp8")].iloc[0]
    assert row["module.model_fixed_s"] > 1e-5
    stages = {f"{b}/attention": {"s": 1e-9} for b in set(t["backend"])}      # every backend has some
    cheap = replace(H200, fixed_costs={"stages": stages})
    packed = {f"{b}/schedule": {"s": 1e-2} for b in ("q-packed-cute", "hybrid")}
    costly = replace(H200, fixed_costs={"stages": {**stages, **packed, "kv-outer-cute/index_map": {"s": 1e-2}}})
    assert tables.predicted_module_s(row, costly) == pytest.approx(tables.predicted_module_s(row, cheap) + 1e-2, rel=1e-4)
    assert set(tables.model_pick_table(run, H200)["model pick"]) & {"q-packed-cute", "hybrid"}
    assert not set(tables.model_pick_table(run, costly)["model pick"]) & {"q-packed-cute", "hybrid", "kv-outer-cute"}


def test_fit_achieved_takes_the_fixed_costs_off_and_leaves_out_what_the_model_does_not_predict():
    from dataclasses import replace
    run = load_run(RESULTS / "co-selection")
    bare = replace(H200, achieved={})
    fit = fit_achieved(run, bare).set_index(["backend", "dtype"])
    assert fit.loc[("flashinfer-packed", "bf16"), "units"] == 1                   # its union_ratio 1 point only
    assert ("auto", "bf16") not in fit.index and fit.loc[("kv-outer-cute", "fp8"), "units"] == 7
    for (b, d), r in fit.iterrows():                                              # the committed calibration
        assert H200.achieved[f"{b}/{d}"] == pytest.approx(r["achieved"], abs=1e-4)
    free = fit_achieved(run, replace(bare, fixed_costs={})).set_index(["backend", "dtype"])
    assert (free["achieved"] < fit["achieved"]).all()                             # fixed costs taken off: higher


def test_the_replayed_hybrid_divides_each_part_by_todays_fraction():
    """A schema-1 record's parts (harness/store/migrate.py): each part's recorded time over the fraction it was
    divided by, times that over today's at its own share, plus today's fixed costs of the stages it ran."""
    import json
    from dataclasses import replace
    from msa_bench.harness.store.migrate import upgrade
    from msa_bench.kernels.base import get_backend
    from msa_bench.roofline.predict import predict_module
    dev = replace(H200, achieved={"q-packed-cute/bf16": 0.5, "kv-outer-cute/bf16": 0.8},
                  fixed_costs={"stages": {"hybrid/attention": {"s": 1e-5}, "hybrid/combine": {"s": 3e-5}},
                               "decode_achieved": {"kv-outer-cute/bf16": 0.4}})
    hybrid = {"packed": "q-packed-cute", "kv_outer": "kv-outer-cute", "packed_s": 1e-3, "kv_outer_s": 2e-3,
              "packed_achieved": 1.0, "kv_outer_achieved": 0.5, "packed_decode_share": 0.0,
              "kv_outer_decode_share": 1.0}
    facts = get_backend("hybrid").facts

    def replay(used, device, stages=None):
        info = {"schedule": "hybrid", "auto": {"predicted_s": {"hybrid": 3e-3}, "used": used}}
        up = json.loads(upgrade({"backend": "auto", "dtype": "bf16", "plan_info": json.dumps(info)}, 1)["plan_info"])
        record = up["auto"]["used"]["hybrid"]["record"]
        return predict_module(facts, {"wl_decode_share": 0.5}, record, device, "bf16", stages).seconds

    assert replay({"hybrid": hybrid}, dev) == pytest.approx(1e-3 * 1.0 / 0.5 + 2e-3 * 0.5 / 0.4 + 4e-5)
    # `@fused` ran no combine stage: its fixed cost is not charged
    fused = replay({"hybrid": hybrid}, dev, ("schedule", "attention"))
    assert fused == pytest.approx(1e-3 * 1.0 / 0.5 + 2e-3 * 0.5 / 0.4 + 1e-5)
    # a record without its parts' fractions: the fraction the candidate itself recorded
    parts = {k: v for k, v in hybrid.items() if not k.endswith("_achieved")}
    old = {"hybrid": parts, "q-packed-cute": {"achieved": 1.0}, "kv-outer-cute": {"achieved": 0.5}}
    assert replay(old, dev) == pytest.approx(1e-3 / 0.5 + 2e-3 * 0.5 / 0.4 + 4e-5)
    # a packed part of 12-token tiles: the wide kernel's own fraction
    wide = replace(dev, achieved={**dev.achieved, "q-packed-cute@p12/bf16": 0.8})
    assert replay({"hybrid": {**hybrid, "tile_tokens": 12}}, wide) == pytest.approx(1e-3 / 0.8 + 2e-3 * 0.5 / 0.4 + 4e-5)
    assert replay({"hybrid": hybrid}, wide) == pytest.approx(1e-3 / 0.5 + 2e-3 * 0.5 / 0.4 + 4e-5)


def test_an_option_with_its_own_fraction_takes_it_and_others_their_backends():
    from dataclasses import replace
    from msa_bench.roofline.devices import achieved
    dev = replace(H200, achieved={"q-packed-cute/fp8": 0.5, "q-packed-cute@p12/fp8": 0.6},
                  fixed_costs={"decode_achieved": {"q-packed-cute/fp8": 0.9}})
    assert achieved(dev, "q-packed-cute@p12", "fp8") == 0.6
    assert achieved(dev, "q-packed-cute@pp+sa", "fp8") == achieved(dev, "q-packed-cute", "fp8") == 0.5
    assert achieved(dev, "q-packed-cute@p12", "fp8", decode=1.0) == 0.9          # decode: the backend's
    assert achieved(dev, "q-packed-cute@p12", "bf16") == 1.0                      # nothing measured


def test_the_wide_tiles_units_fit_and_replay_under_their_own_fraction():
    """Real prefill's q-packed-cute units of 12-token tiles are the wide kernel's (`q-packed-cute@p12`), fitted
    there and committed as fitted; its 8-token units stay q-packed-cute's."""
    from dataclasses import replace
    from msa_bench.harness.store.rows import _info
    from msa_bench.kernels.base import get_backend
    from msa_bench.roofline.predict import fraction_name
    run = load_run(RESULTS / "real-prefill")
    fit = fit_achieved(run, replace(H200, achieved={})).set_index(["backend", "dtype"])
    t = tables.ok_units(run)
    t = t[t["backend"] == "q-packed-cute"]
    wide = [_info(p).get("tile_tokens") == 12 for p in t["plan_info"]]
    for dtype in ("bf16", "fp8"):
        assert fit.loc[("q-packed-cute@p12", dtype), "units"] == sum(w for w, d in zip(wide, t["dtype"]) if d == dtype) > 0
        assert fit.loc[("q-packed-cute", dtype), "units"] == sum(not w for w, d in zip(wide, t["dtype"]) if d == dtype)
        assert H200.achieved[f"q-packed-cute@p12/{dtype}"] == pytest.approx(fit.loc[("q-packed-cute@p12", dtype), "achieved"],
                                                                            abs=1e-4)
    row = t[wide].iloc[0]
    assert fraction_name(get_backend("q-packed-cute").facts, tables.row_record(row)) == "q-packed-cute@p12"
    slow = replace(H200, achieved={**H200.achieved, f"q-packed-cute@p12/{row['dtype']}": 0.01})
    assert tables.predicted_module_s(row, slow) > 10 * tables.predicted_module_s(row, H200)
    assert fraction_name(get_backend("q-packed-cute@pp").facts, {}) == "q-packed-cute@pp"


def test_fit_achieved_weighs_each_selection_generator_the_same():
    """A fraction fitted on two kinds of selection is the median of each kind's median, however many units
    each has: 16 real-prefill units do not outvote 7 co-selection ones, nor the reverse."""
    from dataclasses import replace
    import pandas as pd
    bare = replace(H200, achieved={})
    syn, real = load_run(RESULTS / "co-selection"), load_run(RESULTS / "real-prefill")
    both = replace(syn, status=pd.concat([syn.status, real.status], ignore_index=True),
                   stats=pd.concat([syn.stats, real.stats], ignore_index=True))
    a, b, ab = (fit_achieved(r, bare).set_index(["backend", "dtype"]) for r in (syn, real, both))
    for key in (("kv-outer-cute", "bf16"), ("kv-outer-cute", "fp8"), ("msa-scatter", "bf16")):
        assert ab.loc[key, "units"] == a.loc[key, "units"] + b.loc[key, "units"] and a.loc[key, "units"] != b.loc[key, "units"]
        assert ab.loc[key, "achieved"] == pytest.approx((a.loc[key, "achieved"] + b.loc[key, "achieved"]) / 2)
        assert a.loc[key, "achieved"] != pytest.approx(b.loc[key, "achieved"], rel=1e-3)
