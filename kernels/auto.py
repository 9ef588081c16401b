"""`auto`: plan each workload with the backend the model predicts fastest.

Candidates: every registered backend that declares itself one (`Backend.candidate`) and runs a schedule the
model knows (`Backend.schedule`: roofline/model.py's schedules, or the hybrid split), so a new backend joins
by declaring both. A candidate is skipped, with the reason kept, where it cannot run the workload here, where
the model does not fit it (flashinfer-packed off union_ratio 1), or where the device profile measured other
backends' achieved fractions or fixed costs and not its own (1, or 0 s, would flatter it). Each prediction is the candidate's roofline
time over its achieved fraction, plus the fixed costs of its stages (`DeviceProfile.fixed_costs`). The plan
records every prediction, the skipped candidates and the pick under "auto", the schedule under "schedule".
`auto@eager` predicts for the eager regime (the module launched from Python, as `sweep --timer eager` times
it): each candidate also pays the profile's host cost per stage launch and its per-step planning
(roofline/model.module_time), scaled to the host's speed at plan time (the host launch probe now over the one
the costs were measured with); a profile that measured none says so in one line and prices them at 0 s.
There a candidate that can be launched from C++ (`NAME@op`, and `NAME@graph`, one graph launch a module:
kernels/dispatch) is weighed those ways too where calibrate measured their host cost, and the cheapest is
planned.
"""
from __future__ import annotations

import statistics

import torch

from ..roofline.devices import device_profile
from ..roofline.dtypes import model_dtype
from ..roofline.model import EAGER, GRAPH, REGIMES, host_measured
from ..roofline.predict import host_note, predict_module, weigh_reason
from ..scenarios.stats import ModelStats
from ..scenarios.workload import Workload
from .clock import host_launch_probe
from .dispatch import op_variants
from .base import Backend, BackendUnavailable, Plan, get_backend, register, registered_names
from .options import Choice


AUTO_RECORD = "auto"        # plan_info's key of the pick, every candidate's prediction and the skipped ones


def candidate_names() -> list[str]:
    """Registered backends that declare themselves `auto` candidates (whether or not they run here)."""
    out = []
    for name in registered_names():
        if name == "auto":
            continue
        b = get_backend(name)
        if b.candidate and b.schedule is not None:
            out.append(name)
    return out


def weighed_names(profile, dtype: str, regime: str = GRAPH) -> list[str]:
    """The backends `auto` weighs for `dtype` in `regime`: the candidates, and in the eager regime each one's
    C++ dispatch (NAME@op, NAME@graph) where the profile measured that launch path's host cost."""
    names = candidate_names()
    if regime == EAGER:
        names += [n for n in op_variants(names) if host_measured(profile, n, model_dtype(dtype))]
    return names


HOST_PROBES = 5


def host_speed(device) -> float:
    """The host launch probe's seconds per launch now (median of HOST_PROBES bursts): the eager regime prices
    host costs at the host's present speed, which on a shared host moves (kernels/clock.py)."""
    buf = torch.ones(1, device=device)
    got = statistics.median(host_launch_probe(buf) for _ in range(HOST_PROBES))
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)
    return got


@register("auto")
class AutoBackend(Backend):
    name = "auto"
    description = "the backend the model (roofline over achieved fraction, plus fixed costs) predicts fastest"
    dtypes = ("bf16", "fp8", "fp16", "fp32")
    options = {"regime": Choice("regime", REGIMES)}

    def __init__(self, regime: str = GRAPH):
        self.regime = regime

    def unavailable_reason(self, dtype, device):
        reason = super().unavailable_reason(dtype, device)
        if reason is None:
            reasons = [get_backend(n).unavailable_reason(dtype, device) for n in candidate_names()]
            if reasons and all(reasons):
                reason = f"{self.name}: no candidate runs here ({reasons[0]})"
        return reason

    def candidates(self, w: Workload, profile=None, host_probe_s: float | None = None
                   ) -> tuple[dict[str, tuple[Backend, float, dict]], dict[str, str]]:
        """({name: (backend, predicted seconds, what the prediction used)}, {skipped name: why}); eager host
        costs at the host's speed `host_probe_s` (the host launch probe's seconds) where given."""
        profile = profile or device_profile(w.device)
        stats = ModelStats(w)
        out, skipped = {}, {}
        for name in weighed_names(profile, w.dtype, self.regime):
            backend = get_backend(name)
            why = backend.workload_unavailable_reason(w) or weigh_reason(backend.facts, stats, profile, w.dtype,
                                                                         backend.achieved_names(w), self.regime)
            if why is None:
                try:
                    record = backend.model_record(w, profile)
                    got = predict_module(backend.facts, stats, record, profile, w.dtype, regime=self.regime,
                                         host_probe_s=host_probe_s)
                    if got is not None:
                        out[name] = (backend, got.seconds, {**got.used, "record": record})
                        continue
                    why = f"{name}: the workload's statistics lack what its roofline needs"
                except BackendUnavailable as exc:     # e.g. a launch configuration this shape cannot take
                    why = str(exc)
            skipped[name] = why
        if not out:
            raise BackendUnavailable(f"{self.name}: no candidate runs here"
                                     + (f" ({next(iter(skipped.values()))})" if skipped else ""))
        return out, skipped

    def _plan(self, w: Workload) -> Plan:
        profile = device_profile(w.device)
        probe = host_speed(w.device) if self.regime == EAGER else None
        cands, skipped = self.candidates(w, profile, probe)
        pick = min(cands, key=lambda k: cands[k][1])        # ties: the first by name
        backend = cands[pick][0]
        plan = backend.plan(w)
        plan.info = {**plan.info, "schedule": backend.schedule,
                     AUTO_RECORD: {"picked": pick, "backend": backend.name,
                              "predicted_s": {k: v[1] for k, v in cands.items()},
                              "used": {k: v[2] for k, v in cands.items()}, "skipped": skipped,
                              "regime": self.regime, "note": host_note(profile, self.regime),
                              **({"host_probe_s": probe} if probe else {})}}
        plan.backend = self.name
        return plan

    def stage_checks(self, plan, workload, rows, tol):
        return get_backend(plan.info[AUTO_RECORD]["picked"]).stage_checks(plan, workload, rows, tol)


def auto_line(info: dict) -> str:
    """One line: the pick and every candidate's predicted module time (us), fastest first."""
    a = info.get(AUTO_RECORD) or {}
    pred = a.get("predicted_s") or {}
    ranked = sorted(pred, key=pred.get)
    parts = ", ".join(f"{k} {pred[k] * 1e6:.3g}" for k in ranked)
    line = f"auto picked {a.get('picked')} (predicted us: {parts})"
    if a.get("skipped"):
        line += f"; skipped {len(a['skipped'])}: {', '.join(sorted(a['skipped']))}"
    if a.get("regime", GRAPH) != GRAPH:
        line += f"; regime {a['regime']}" + (f" ({a['note']})" if a.get("note") else "")
    return line


__all__ = ["AutoBackend", "MODELLED", "auto_line", "candidate_names", "weighed_names"]
