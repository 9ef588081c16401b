"""One prediction path: what `auto` predicts live for a workload is what the replay predicts from the unit row
a sweep writes for it (its `wl_` statistics and its plan's record), and no second module prediction exists."""
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from msa_bench.harness.report import tables
from msa_bench.harness.measure.check import CPU_SHAPE  # noqa: F401  (sets TRITON_INTERPRET before the kernels load)
from msa_bench.harness.running.runner import scalar_stats
from msa_bench.kernels.base import get_backend
from msa_bench.roofline.devices import PRESETS
from msa_bench.roofline.predict import predict_module
from msa_bench.scenarios.serving import serving_workload
from msa_bench.roofline.shape import AttnShape
from msa_bench.scenarios.stats import ModelStats, workload_stats

ROOT = Path(__file__).resolve().parents[1]
SHAPE = AttnShape(hq=8, hkv=2, head_dim=32, block=16, topk=4)
PROFILE = replace(PRESETS["h200"], achieved={"kv-outer/bf16": 0.6, "q-packed/bf16": 0.4, "msa-scatter/bf16": 0.5},
                  fixed_costs={"launch_s": 2e-6, "decode_achieved": {"kv-outer/bf16": 0.3, "q-packed/bf16": 0.2},
                               "items": {"q-packed/bf16": {"s": 1e-6, "block_s": 1e-7}}})
# the CPU's backends of every modelled schedule; the hybrid's parts on Triton
BACKENDS = ["kv-outer", "msa-scatter", "q-packed", "q-packed@p16", "hybrid@p8+triton+m2"]


def _workloads():
    yield serving_workload(SHAPE, "fp16", "drift", 48, 1024, drift=0.2, seed=1, device="cpu", with_tensors=False)
    yield serving_workload(SHAPE, "fp16", "mixed", tokens=32, context=512, context_min=256, requests=6, chunks=1,
                           drift=0.1, device="cpu", with_tensors=False)
    yield serving_workload(SHAPE, "fp16", "decode", None, context=1024, requests=8, device="cpu", with_tensors=False)


@pytest.mark.parametrize("name", BACKENDS)
def test_the_replay_of_a_unit_row_is_the_live_prediction(name):
    backend = get_backend(name)
    for w in _workloads():
        live = predict_module(backend.facts, ModelStats(w), backend.model_record(w, PROFILE), PROFILE, w.dtype)
        assert live is not None and math.isfinite(live.seconds), name
        # the row a sweep writes: its workload statistics, and the record its plan keeps in plan_info (JSON)
        record = json.loads(json.dumps(backend.model_record(w, PROFILE), default=str))
        row = {"backend": name, "dtype": w.dtype, **scalar_stats(workload_stats(w)),
               "plan_info": json.dumps({"model": record})}
        replayed = predict_module(backend.facts, row, tables.row_record(row), PROFILE, row["dtype"])
        assert replayed.seconds == live.seconds, (name, w.meta.get("generator"))
        assert replayed.used == live.used


def test_auto_records_each_candidates_record_and_the_replay_repredicts_the_hybrid_from_it(monkeypatch):
    from msa_bench.kernels import auto
    monkeypatch.setattr(auto, "candidate_names", lambda: ["kv-outer", "q-packed", "hybrid"])
    w = next(_workloads())
    cands, _ = get_backend("auto").candidates(w, PROFILE)
    _, seconds, used = cands["hybrid"]
    record = json.loads(json.dumps(used["record"], default=str))
    again = predict_module(get_backend("hybrid").facts, scalar_stats(workload_stats(w)), record, PROFILE, w.dtype)
    assert again.seconds == seconds


def test_one_function_predicts_a_module():
    """No second module prediction: module_time is called only by roofline/predict.py."""
    callers = [p for p in ROOT.rglob("*.py") if "tests" not in p.parts and not any(x.startswith(".") for x in p.parts)
               and re.search(r"\bmodule_time\(", p.read_text()) and p.name not in ("model.py", "predict.py")]
    assert callers == []
