"""One sweep's units on one device: build a point's workload, plan, time, check, record.

The Runner holds what the units of a sweep share (device, telemetry, timing settings, ncu) and never
raises for a backend's failure: a unit that cannot run is recorded `unavailable`, one whose timing or
check raises or whose output disagrees with the reference is recorded `failed`, its timings discarded.
The single-process sweep and each worker of the pool run their units through it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from ..measure import counters as ncu_counters
from ..measure import provenance
from ..store import results
from ...errors import DoesNotFit, UserError, one_line
from ...roofline.model import fixed_cost
from ...roofline.predict import schedule_roofline
from ...kernels.auto import AUTO_RECORD
from ..store.rows import schedule_of
from ..measure.telemetry import Poller, open_telemetry, point_telemetry
from ..measure.timing import (EAGER_COLUMNS, EAGER_MEDIANS, MODULE, PER_STEP, TimingConfig, summarize,
                              time_plan, timer_for, warm_plan)

CHECK_ROWS = 512                                        # rows checked against the reference on big points
TFLOPS_STAGES = (MODULE, "attention")
COUNTERS_PENDING = "pending"


def scalar_stats(stats: dict) -> dict:
    out = {}
    for key, value in stats.items():
        if isinstance(value, bool):
            out[f"wl_{key}"] = value
        elif isinstance(value, (int, float)) and math.isfinite(float(value)):
            out[f"wl_{key}"] = float(value)
    return out


class Runner:
    """State shared by the units of one sweep (device, telemetry, timing, counters)."""

    def __init__(self, run_dir: Path, device, timing: TimingConfig, want_counters: bool, notes: list[str],
                 where: dict | None = None):
        self.run_dir = run_dir
        self.device = device
        self.timing = timing
        self.timer = timer_for(device.type, timing.timer)
        self.telemetry = open_telemetry(device)
        if not self.telemetry.available:
            notes.append(self.telemetry.reason)
        self.ncu = None
        self.notes = notes
        self.counter_failures = 0
        if want_counters:
            if device.type != "cuda":
                notes.append("--counters needs a CUDA GPU: continuing without hardware counters")
            else:
                self.ncu = ncu_counters.find_ncu()
                if self.ncu is None:
                    notes.append("--counters: ncu not found (PATH, /opt/nvidia/nsight-compute/*/ncu, "
                                 "/usr/local/cuda/bin/ncu): continuing without hardware counters")
        import os
        from ...roofline.devices import PROFILE_ENV, resolve_profile
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        # the profile the sweep resolved (--device passes on as $MSA_BENCH_PROFILE); none on a CPU unless given
        self.profile = resolve_profile(None, gpu).profile if gpu or os.environ.get(PROFILE_ENV) else None
        # every unit's status names the GPU (index, UUID, clocks) and, in a pool, the worker
        self.where = {**provenance.gpu_identity(device, self.telemetry.nvml_handle), **(where or {})}

    def head(self, point, backend: str, wl_stats: dict, nth: int) -> dict:
        """What every unit's status starts with: the point, timer, GPU, workload stats and backend."""
        return {"point_key": point.key(), **point.as_dict(), "timer": self.timer, **self.where, **wl_stats,
                "backend": backend, "schedule": schedule_of(backend) or "none", "nth_on_workload": nth}

    def run_unit(self, point, backend: str, workload, wl_stats: dict, why: dict | None = None,
                 nth: int = 0) -> dict:
        """Run one unit (or record `why`, the status and reason build_workload gave a workload it could not
        build) and write its folder; its status. nth: the units this process ran on the same built workload
        before it (0: the first, which times one plan and drops it before its timed one: see unit())."""
        head = self.head(point, backend, wl_stats, nth)
        if workload is None:
            status, stats, samples = {**head, **why}, [], []
        else:
            status, stats, samples = self.unit(point, backend, workload, wl_stats, head)
        results.write_unit(self.run_dir, results.unit_id(point.key(), backend), status, stats, samples)
        return status

    def run_rounds(self, point, backends: list[str], workload, wl_stats: dict, nth: int = 0) -> list[dict]:
        """The point's units timed together, eager, in timing.rounds interleaved rounds (timing.time_rounds):
        every plan of the point is made and held at once, then each is checked and written as unit() does.
        Their statuses, in the order of `backends`."""
        from ..measure.timing import time_rounds
        heads = {b: self.head(point, b, wl_stats, nth + i) for i, b in enumerate(backends)}
        plans, ended = {}, {}
        for b in backends:
            plan = self._plan(b, workload, heads[b])
            if isinstance(plan, dict):
                ended[b] = (plan, [], [])
            else:
                plans[b] = plan
        if plans:
            timed, telemetry = self._timed(lambda: time_rounds(plans, self.timing, self.device, self._reasons()))
            for b, got in timed.items():
                ended[b] = (self._raised(heads[b], got) if isinstance(got, Exception) else
                            self._finish(point, b, workload, wl_stats, plans[b], got, telemetry, heads[b]))
                plans[b] = None       # the next unit's check runs without this plan's memory
        out = []
        for b in backends:
            status, stats, samples = ended[b]
            results.write_unit(self.run_dir, results.unit_id(point.key(), b), status, stats, samples)
            out.append(status)
        return out

    def unit(self, point, backend_name: str, workload, wl_stats: dict, base: dict) -> tuple[dict, list, list]:
        """Status, tidy stat rows and sample rows of one unit. Never raises for a backend's failure.

        The plan's outputs are poisoned with NaN, it is timed, and the output its last timed run left is
        compared with the float64 reference: the numbers kept are those of a run that was checked, and a
        unit whose output disagrees is recorded as failed with its timings discarded.

        The first unit on a workload (base's nth_on_workload 0) times its plan after a dropped one
        (timing.warm_plan)."""
        plan = self._plan(backend_name, workload, base)
        if isinstance(plan, dict):
            return plan, [], []
        try:
            samples, telemetry = self._timed(lambda: time_plan(plan, self.timing, self.device, self._reasons()))
        except Exception as exc:
            return self._raised(base, exc)
        return self._finish(point, backend_name, workload, wl_stats, plan, samples, telemetry, base)

    def _plan(self, backend_name: str, workload, base: dict):
        """The unit's plan, its outputs poisoned with NaN, or the status of a unit that cannot run here
        (unavailable) or whose planning raised (failed)."""
        from ...kernels.base import get_backend
        from ..measure.check import poison
        backend = get_backend(backend_name)
        try:
            plan = (warm_plan(backend, workload, self.timing, self.device) if base.get("nth_on_workload") == 0
                    else backend.plan(workload))
            poison(plan)
            return plan
        except Exception as exc:        # BackendUnavailable: it cannot run this workload here
            return self._raised(base, exc)[0]

    def _raised(self, base: dict, exc: Exception) -> tuple[dict, list, list]:
        from ...kernels.base import BackendUnavailable
        if isinstance(exc, BackendUnavailable):
            return {**base, "status": results.STATUS_UNAVAILABLE, "reason": str(exc)}, [], []
        return {**base, "status": results.STATUS_FAILED, "reason": f"timing raised {one_line(exc)}"}, [], []

    def _reasons(self):
        return self.telemetry.clock_reasons if self.telemetry.available else None

    def _timed(self, timing):
        """timing()'s result and the telemetry of its span (before, after, polled during)."""
        before = self.telemetry.sample()
        poller = Poller(self.telemetry.sample).start() if self.telemetry.available else None
        try:
            got = timing()
        finally:
            during = poller.stop() if poller else []
        return got, (before, self.telemetry.sample(), during)

    def _finish(self, point, backend_name: str, workload, wl_stats: dict, plan, samples, telemetry, base: dict):
        """Check the output the last timed run left, then the unit's status, stat rows and sample rows."""
        from ..measure.check import compare_output
        status = dict(base)
        rows = None
        if workload.n_tokens > 4 * CHECK_ROWS:
            rows = torch.linspace(0, workload.n_tokens - 1, CHECK_ROWS).round().long().unique()
        try:
            err, tol, _ = compare_output(plan, workload, rows, backend_name)
        except Exception as exc:
            return {**status, "status": results.STATUS_FAILED, "reason": f"check raised {one_line(exc)}"}, [], []
        status.update(max_rel_err=float(err), tol=float(tol))
        if not err <= tol:
            return {**status, "status": results.STATUS_FAILED,
                    "reason": f"output disagrees with the reference (max rel err {err:.3g} > tol {tol:.3g}); "
                              "its timings are discarded"}, [], []
        status.update(point_telemetry(*telemetry))
        ref_clock = self.telemetry.max_sm_clock_mhz()
        if ref_clock:
            status["sm_clock_max_mhz"] = ref_clock
        status.update(plan_info=json.dumps(plan.info, default=str, sort_keys=True))
        info = plan.info
        status["schedule"] = schedule_of(backend_name, info) or "none"
        stage_names = list(plan.stages)
        del plan
        stats, sample_rows = self._timing_rows(point, backend_name, samples, wl_stats)
        stats += self._model_rows(point, backend_name, wl_stats, info, stage_names)
        if self.ncu is not None:
            status["counters"] = COUNTERS_PENDING
        return {**status, "status": results.STATUS_OK, "reason": ""}, stats, sample_rows

    def collect_counters(self, items: list[tuple]) -> None:
        """ncu counters for timed units, [(point, backends)], from one profiled process for all of them.

        Each unit's folder gets the counter rows and `counters: ncu`, or `counters: failed: <why>`.
        """
        try:
            measured = ncu_counters.collect(self.ncu, [(p.as_dict(), bs) for p, bs in items])
        except ncu_counters.CountersError as exc:
            for p, bs in items:
                for b in bs:
                    results.update_unit(self.run_dir, results.unit_id(p.key(), b), {"counters": f"failed: {exc}"}, [])
            self.counter_failures += 1
            if self.counter_failures >= 2:   # e.g. no permission to read counters: stop asking
                self.ncu = None
                self.notes.append(f"hardware counters disabled after two failed ncu runs; last: {exc}")
            return
        self.counter_failures = 0
        for i, (p, bs) in enumerate(items):
            for b in bs:
                uid = results.unit_id(p.key(), b)
                got = measured.get((i, b))
                if not got or "error" in got:
                    why = got["error"] if got else "the unit is missing from the ncu output"
                    results.update_unit(self.run_dir, uid, {"counters": f"failed: {why}"}, [])
                    continue
                rows = [self._row(p, b, stage, k, v) for stage, values in got.items() for k, v in values.items()]
                results.update_unit(self.run_dir, uid, {"counters": "ncu"}, rows,
                                    replace_statistics=ncu_counters.COUNTER_STATISTICS)

    def _schedule(self, backend: str) -> str:
        """The schedule `backend` declares, resolved once per name (every stat row of a unit carries it)."""
        schedules = self.__dict__.setdefault("_schedules", {})
        if backend not in schedules:
            schedules[backend] = schedule_of(backend) or "none"
        return schedules[backend]

    def _row(self, point, backend, stage, statistic, value, timer: str | None = None) -> dict:
        return {"point_key": point.key(), "backend": backend, "schedule": self._schedule(backend),
                "dtype": point.dtype, "stage": stage, "statistic": statistic, "value": float(value),
                "timer": timer or self.timer}

    def _timing_rows(self, point, backend, samples, wl_stats):
        stats, raw = [], []
        flops = wl_stats.get("wl_useful_flops", 0.0)
        for stage, s in samples.items():
            summary = summarize(s.seconds)
            if stage in TFLOPS_STAGES and flops > 0 and summary["median_s"] > 0:
                summary["tflops"] = flops / summary["median_s"] / 1e12
            summary["converged"] = float(s.converged)
            for column in EAGER_COLUMNS:          # eager: the medians of the launch and gap samples
                values = getattr(s, column)
                if values is not None:
                    summary[EAGER_MEDIANS[column]] = float(np.median(values))
            if s.per_step:
                summary[PER_STEP] = 1.0
            stats += [self._row(point, backend, stage, k, v, s.timer) for k, v in summary.items()]
            rows = [{"point_key": point.key(), "backend": backend, "dtype": point.dtype, "stage": stage,
                     "rep": i, "seconds": float(x), "timer": s.timer} for i, x in enumerate(s.seconds)]
            for column in results.CLOCK_COLUMNS + EAGER_COLUMNS:   # GPU or eager stages; host ones leave them NaN
                values = getattr(s, column)
                if values is not None:
                    for row, v in zip(rows, values):
                        row[column] = v
            raw += rows
        return stats, raw

    def _model_rows(self, point, backend, wl_stats, info: dict | None = None,
                    stage_names=()):
        """The roofline's time and bytes (model_time_s: the largest term, no fixed costs) and the fixed costs
        of the stages the plan ran (model_fixed_s; `auto`: its pick's)."""
        schedule = schedule_of(backend, info)
        if self.profile is None or "wl_nsb" not in wl_stats:
            return []
        ran = ((info or {}).get(AUTO_RECORD) or {}).get("backend") or backend
        fixed = [self._row(point, backend, MODULE, "model_fixed_s",
                           fixed_cost(self.profile, ran, stage_names, point.dtype)[0])]
        pred = schedule_roofline(schedule, wl_stats, (info or {}).get("model") or {}, self.profile, point.dtype)
        if pred is None:
            return fixed
        values = {"model_time_s": pred.time_s, "model_hbm_bytes": pred.hbm_bytes,
                  "model_l2_bytes": pred.l2_bytes, "model_flops": pred.flops}
        return fixed + [self._row(point, backend, MODULE, k, v) for k, v in values.items()]


def label(point) -> str:
    """A short label of the point for the progress line: what differs between the points of a grid."""
    d = point.as_dict()
    if d["generator"] == "real-prefill":
        return f"{d['case_id']} {d['dtype']}"
    parts = [d["generator"], f"N{d['tokens']}", f"T{d['context']}"]
    if d.get("call") is not None:
        parts[1:1] = [f"#{d['call']}", f"L{d['layer']}"]
    if d.get("reuse") is not None:
        parts.append(f"r{d['reuse']:g}")
    if d.get("skew"):
        parts.append(f"z{d['skew']:g}")
    if d.get("share") is not None:
        parts.append(f"s{d['share']:g}")
    parts += ["causal"] if d.get("causal") else []
    return " ".join(parts + [d["dtype"]])


def build_workload(point, device) -> tuple[object, dict, dict | None]:
    """(workload, its scalar stats, None) or (None, {}, the status and reason of its units, unbuilt()). A
    point whose workload cannot fit in the device's free memory (DoesNotFit) is not built."""
    from ...scenarios.grid import check_point_fits, make_workload
    from ...scenarios.stats import workload_stats
    try:
        check_point_fits(point, device)
    except DoesNotFit as exc:
        return None, {}, unbuilt(exc)
    try:
        workload = make_workload(point, device)
        return workload, scalar_stats(workload_stats(workload)), None
    except Exception as exc:  # recorded by each of its units, and the sweep goes on with the next point
        return None, {}, unbuilt(exc)


def unbuilt(exc: Exception) -> dict:
    """The status and reason of the units of a workload `exc` kept from being built (the words, not the
    error: its traceback would hold the frames of the build): a point too large for this GPU is unavailable
    here, as a backend this host lacks is; any other error failed them."""
    if isinstance(exc, DoesNotFit):
        return {"status": results.STATUS_UNAVAILABLE, "reason": f"does not fit on this device: {exc}"}
    return {"status": results.STATUS_FAILED,
            "reason": f"workload could not be built: {exc if isinstance(exc, UserError) else one_line(exc)}"}


def free_device_memory() -> None:
    """Give the last point's memory back before the next is built: a plan whose stages close over it is a
    reference cycle, which only the collector frees, and a point sized for the device cannot share it
    (on an H100, 38.7 of 79 GiB were still taken when the point after decode's 1024-request fp8 one was
    checked)."""
    import gc
    gc.collect()
    torch.cuda.empty_cache()


def wants_counters(status: dict) -> bool:
    """A timed unit whose counters are not in yet (pending, or failed on an earlier try)."""
    return status.get("status") == results.STATUS_OK and status.get("counters") != "ncu"


