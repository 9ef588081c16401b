"""The regression gate: a new run against a baseline, point by point.

Timings (stages `module` and `attention`) are matched by point key, backend, dtype and stage and
judged from the raw samples, as asv and nvbench do: a point regresses only if its median is slower by
more than the threshold AND the difference is statistically real (one-sided Mann-Whitney U with
p < alpha, or the interquartile ranges do not overlap). Improvements are judged the same way the
other way round. Bytes moved (ncu counters) are deterministic, so they get their own tight
tolerance. A unit that was ok in the baseline and fails in the new run is a regression.

The gate never passes what it did not measure: a baseline unit that the new run lacks, or that
was timed in the baseline and not in the new run, makes the comparison unusable (UserError, exit
2), and so does a damaged unit (load_run refuses it). Host (CPU) timings are no performance
signal: when either run has them, timings are listed but not judged, and only a unit that now
fails is a regression.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.stats import mannwhitneyu

from ..errors import UserError
from .results import SAMPLES_REMOVED, STATUS_FAILED, STATUS_OK, STATUS_UNAVAILABLE, Run, samples_kept
from .timing import TIMER_GPU

TIMED_STAGES = ("module", "attention")
COUNTER_STATISTICS = ("hbm_bytes", "l2_bytes")
KEY = ["point_key", "backend", "dtype", "stage"]

REGRESSION, IMPROVEMENT, UNCHANGED, NOISE = "regression", "improvement", "unchanged", "within noise"
NOT_JUDGED = "not judged"
CPU_TIMINGS = ("timings not judged: {which} host (CPU) timings, which are no performance signal; the gate checks "
               "that every unit is present, undamaged and still ok")


def parse_threshold(text: str, what: str = "--max-regression") -> float:
    """'5%' or '0.05' -> 0.05."""
    t = str(text).strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise UserError(f"{what} must look like 5% or 0.05, got {text!r}") from None
    if not t.endswith("%") and value >= 1:
        raise UserError(f"{what} {text!r} is ambiguous: write {t}% for a percentage or a fraction below 1")
    if not 0 < value < 10:
        raise UserError(f"{what} must be a positive fraction, got {text!r}")
    return value


@dataclass
class Finding:
    point_key: str
    backend: str
    dtype: str
    stage: str
    kind: str              # "time" | counter statistic | "status"
    baseline: float
    new: float
    ratio: float           # new / baseline
    p_value: float | None
    verdict: str
    note: str = ""


@dataclass
class Comparison:
    findings: list[Finding]
    warnings: list[str] = field(default_factory=list)
    timings_judged: bool = True

    def of(self, verdict: str) -> list[Finding]:
        return [f for f in self.findings if f.verdict == verdict]

    @property
    def regressed(self) -> bool:
        return bool(self.of(REGRESSION))


def judge_samples(base: np.ndarray, new: np.ndarray, threshold: float,
                  alpha: float = 0.05) -> tuple[str, float, float | None]:
    """(verdict, median ratio new/base, p-value of the one-sided test in the direction of the change)."""
    base, new = np.asarray(base, dtype=float), np.asarray(new, dtype=float)
    if not (len(base) and len(new) and np.isfinite(base).all() and np.isfinite(new).all()
            and (base > 0).all() and (new > 0).all()):
        raise UserError("timing samples must be finite, positive seconds (and at least one per run)")
    mb, mn = float(np.median(base)), float(np.median(new))
    ratio = mn / mb if mb > 0 else float("inf")
    slower = ratio > 1
    p = None
    if len(base) >= 2 and len(new) >= 2:
        p = float(mannwhitneyu(new, base, alternative="greater" if slower else "less").pvalue)
    b25, b75 = np.percentile(base, [25, 75])
    n25, n75 = np.percentile(new, [25, 75])
    disjoint = n25 > b75 if slower else n75 < b25
    real = (p is not None and p < alpha) or disjoint
    big = ratio > 1 + threshold if slower else ratio < 1 / (1 + threshold)
    if big and real:
        return (REGRESSION if slower else IMPROVEMENT), ratio, p
    return (NOISE if big else UNCHANGED), ratio, p


def _samples_by_key(run: Run) -> dict:
    s = run.samples
    if s.empty:
        return {}
    s = s[s["stage"].isin(TIMED_STAGES)]
    return {key: g["seconds"].to_numpy(dtype=float) for key, g in s.groupby(KEY, sort=True)}


def _counters_by_key(run: Run) -> dict:
    s = run.stats
    if s.empty:
        return {}
    s = s[s["statistic"].isin(COUNTER_STATISTICS)]
    return {(*key[:4], key[4]): float(g["value"].iloc[0])
            for key, g in s.groupby(KEY + ["statistic"], sort=True)}


def _units(run: Run):
    return run.status.set_index(["point_key", "backend"]) if not run.status.empty else None


def _unusable(base: Run, new: Run) -> str | None:
    """Why the new run cannot be judged against the baseline: raw samples removed, units it lacks or did
    not time."""
    for label, run in (("baseline", base), ("new run", new)):
        if not samples_kept(run.meta):
            return (f"the {label} {run.path} keeps no raw timing samples ({run.meta[SAMPLES_REMOVED]}); "
                    "the gate judges samples")
    st_b, st_n = _units(base), _units(new)
    if st_b is None:
        return None
    have = st_n.index if st_n is not None else []
    lacking = [f"{b} at {k}" for k, b in st_b.index.difference(have)]
    if lacking:
        return (f"the new run lacks {len(lacking)} unit(s) of the baseline: {'; '.join(lacking[:3])}"
                + (f"; and {len(lacking) - 3} more" if len(lacking) > 3 else "")
                + " (deleted, not run, or a different grid)")
    untimed = [f"{b} at {k} ({st_n.loc[(k, b)].get('reason', '')})" for (k, b) in st_b.index
               if st_b.loc[(k, b), "status"] == STATUS_OK and st_n.loc[(k, b), "status"] == STATUS_UNAVAILABLE]
    if untimed:
        return (f"{len(untimed)} unit(s) timed in the baseline are unavailable in the new run: "
                f"{'; '.join(untimed[:3])}" + (f"; and {len(untimed) - 3} more" if len(untimed) > 3 else ""))
    return None


def compare_runs(base: Run, new: Run, threshold: float = 0.05, counter_tolerance: float = 0.02,
                 alpha: float = 0.05) -> Comparison:
    warnings = []
    for label, a, b in (("device", base.device_name, new.device_name),
                        ("scenario", base.meta.get("scenario"), new.meta.get("scenario")),
                        ("timer", base.timer, new.timer)):
        if a != b:
            warnings.append(f"different {label}: baseline {a!r}, new {b!r}")
    why = _unusable(base, new)
    if why:
        raise UserError(why)
    cpu = [name for name, run in (("the baseline has", base), ("the new run has", new)) if run.timer != TIMER_GPU]
    judged = not cpu
    if not judged:
        warnings.append(CPU_TIMINGS.format(which="both runs have" if len(cpu) == 2 else cpu[0]))
    findings = []
    bs, ns = _samples_by_key(base), _samples_by_key(new)
    ok_new = set(new.status.loc[new.status["status"] == STATUS_OK, ["point_key", "backend"]].itertuples(
        index=False, name=None)) if not new.status.empty else set()
    unsampled = [f"{k[1]} at {k[0]}, stage {k[3]}" for k in sorted(bs.keys() - ns.keys()) if (k[0], k[1]) in ok_new]
    if unsampled:
        raise UserError(f"the new run has no samples for {len(unsampled)} timed stage(s) of the baseline: "
                        f"{'; '.join(unsampled[:3])}")
    for key in sorted(bs.keys() & ns.keys()):
        verdict, ratio, p = judge_samples(bs[key], ns[key], threshold, alpha)
        findings.append(Finding(*key, "time", float(np.median(bs[key])), float(np.median(ns[key])), ratio, p,
                                verdict if judged else NOT_JUDGED))
    bc, nc = _counters_by_key(base), _counters_by_key(new)
    for key in sorted(bc.keys() & nc.keys()):
        b, n = bc[key], nc[key]
        ratio = n / b if b > 0 else (1.0 if n == 0 else float("inf"))
        verdict = (REGRESSION if ratio > 1 + counter_tolerance else
                   IMPROVEMENT if ratio < 1 - counter_tolerance else UNCHANGED)
        findings.append(Finding(*key[:4], key[4], b, n, ratio, None, verdict))
    matched_units = 0
    st_b, st_n = _units(base), _units(new)
    if st_b is not None and st_n is not None:
        common = st_b.index.intersection(st_n.index)
        matched_units = len(common)
        for idx in common:
            sb, sn = st_b.loc[idx], st_n.loc[idx]
            dtype = str(sb.get("dtype", ""))
            if sb["status"] == STATUS_OK and sn["status"] == STATUS_FAILED:
                findings.append(Finding(idx[0], idx[1], dtype, "module", "status", float("nan"), float("nan"),
                                        float("nan"), None, REGRESSION, f"now failed: {sn.get('reason', '')}"))
            elif sb["status"] == STATUS_FAILED and sn["status"] == STATUS_OK:
                findings.append(Finding(idx[0], idx[1], dtype, "module", "status", float("nan"), float("nan"),
                                        float("nan"), None, IMPROVEMENT, "failed in the baseline, ok now"))
        only_n = len(st_n.index.difference(st_b.index))
        if only_n:
            warnings.append(f"units only in the new run: {only_n} (no baseline to compare with)")
    if not findings and not matched_units:
        raise UserError("nothing to compare: the two runs share no (point, backend)")
    if not any(f.kind == "time" for f in findings):
        warnings.append("no timing samples in common (every common unit failed or was unavailable)")
    return Comparison(findings, warnings, judged)
