"""The regression gate: a new run against a baseline, point by point.

Timings (stages `module` and `attention`) are matched by point key, backend, dtype and stage and
judged from the raw samples, as asv and nvbench do: a point regresses only if its median is slower by
more than the threshold AND the difference is statistically real (one-sided Mann-Whitney U with
p < alpha, or the interquartile ranges do not overlap). Improvements are judged the same way the
other way round. Bytes moved (ncu counters) are deterministic, so they get their own tight
tolerance. A unit that was ok in the baseline and fails in the new run is a regression.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.stats import mannwhitneyu

from ..errors import UserError
from .results import STATUS_FAILED, STATUS_OK, Run

TIMED_STAGES = ("module", "attention")
COUNTER_STATISTICS = ("hbm_bytes", "l2_bytes")
KEY = ["point_key", "backend", "dtype", "stage"]

REGRESSION, IMPROVEMENT, UNCHANGED, NOISE = "regression", "improvement", "unchanged", "within noise"


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

    def of(self, verdict: str) -> list[Finding]:
        return [f for f in self.findings if f.verdict == verdict]

    @property
    def regressed(self) -> bool:
        return bool(self.of(REGRESSION))


def judge_samples(base: np.ndarray, new: np.ndarray, threshold: float,
                  alpha: float = 0.05) -> tuple[str, float, float | None]:
    """(verdict, median ratio new/base, p-value of the one-sided test in the direction of the change)."""
    mb, mn = float(np.median(base)), float(np.median(new))
    ratio = mn / mb if mb > 0 else float("inf")
    if ratio == 1.0:
        return UNCHANGED, ratio, None
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


def compare_runs(base: Run, new: Run, threshold: float = 0.05, counter_tolerance: float = 0.02,
                 alpha: float = 0.05) -> Comparison:
    warnings = []
    for label, a, b in (("device", base.device_name, new.device_name),
                        ("scenario", base.meta.get("scenario"), new.meta.get("scenario")),
                        ("timer", base.timer, new.timer)):
        if a != b:
            warnings.append(f"different {label}: baseline {a!r}, new {b!r}")
    findings = []
    bs, ns = _samples_by_key(base), _samples_by_key(new)
    for key in sorted(bs.keys() & ns.keys()):
        verdict, ratio, p = judge_samples(bs[key], ns[key], threshold, alpha)
        findings.append(Finding(*key, "time", float(np.median(bs[key])), float(np.median(ns[key])), ratio, p, verdict))
    bc, nc = _counters_by_key(base), _counters_by_key(new)
    for key in sorted(bc.keys() & nc.keys()):
        b, n = bc[key], nc[key]
        ratio = n / b if b > 0 else (1.0 if n == 0 else float("inf"))
        verdict = (REGRESSION if ratio > 1 + counter_tolerance else
                   IMPROVEMENT if ratio < 1 - counter_tolerance else UNCHANGED)
        findings.append(Finding(*key[:4], key[4], b, n, ratio, None, verdict))
    matched_units = 0
    if not base.status.empty and not new.status.empty:
        st_b = base.status.set_index(["point_key", "backend"])
        st_n = new.status.set_index(["point_key", "backend"])
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
            elif sb["status"] == STATUS_OK and sn["status"] != STATUS_OK:
                warnings.append(f"{idx[1]} at {idx[0]}: ok in the baseline, {sn['status']} now "
                                f"({sn.get('reason', '')})")
        only_b = len(st_b.index.difference(st_n.index))
        only_n = len(st_n.index.difference(st_b.index))
        if only_b or only_n:
            warnings.append(f"units only in the baseline: {only_b}, only in the new run: {only_n} (not compared)")
    if not findings and not matched_units:
        raise UserError("nothing to compare: the two runs share no (point, backend)")
    if not any(f.kind == "time" for f in findings):
        warnings.append("no timing samples in common (every common unit failed or was unavailable)")
    return Comparison(findings, warnings)
