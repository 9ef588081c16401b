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

Against a baseline set of K runs (harness/gate/baseline.py) the threshold is the slowdown the gate is built
to catch. A time regresses if its new median is slower than the slowest of the K run medians by more
than SET_FLAG x the threshold (outside the run-to-run spread by that margin), AND distinguishable
from the K runs' pooled samples as above. The set measures the noise between runs, so the flag can
sit between that noise and the slowdown to catch: on the H200 protocol (results/h200/gate)
clock-normalized run medians of one commit stayed within about 1 % of the set's spread, while a flag
at the threshold itself would miss about half of the slowdowns of exactly that size. Measuring from
the slowest run, not the median, covers a stage that lands in one of two modes from run to run
(kv-outer-cute's bf16 attention on real prefill, 5 % apart) once the set has seen both.
Improvements mirror it. Status and counters are judged against the set's first run.

Eager runs (sweep --timer eager) carry the host launch probe of every sample (harness/measure/timing.py): a
module launched from Python takes at most h times as long on a host h times slower, so a regression no
larger than the unit's probe ratio (times the flag) on a host that is measurably slower (the probe judged
as a time is) is not the code's: its verdict is HOST, and the gate exits 2 (it cannot tell) unless a real
regression exits 1 first. An improvement the host explains is noise.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
from scipy.stats import mannwhitneyu

from ...errors import UserError
from .baseline import DEFAULT_FLOOR, clocked_samples, has_clock
from ..store.results import SAMPLES_REMOVED, STATUS_FAILED, STATUS_OK, STATUS_UNAVAILABLE, Run, samples_kept
from ..measure.timing import EAGER, GPU_TIMERS, MODULE, l2_flush_of, timer_mode

TIMED_STAGES = ("module", "attention")
SET_FLAG = 0.5             # against a baseline set: flag at this fraction of the threshold (docstring)
COUNTER_STATISTICS = ("hbm_bytes", "l2_bytes")
KEY = ["point_key", "backend", "dtype", "stage"]

REGRESSION, IMPROVEMENT, UNCHANGED, NOISE = "regression", "improvement", "unchanged", "within noise"
NOT_JUDGED = "not judged"
HOST = "slower host"        # eager: a regression within what the host's slowdown explains (docstring)
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
    spread: float | None = None   # baseline set: slowest / fastest of the K run medians
    band: tuple[float, float] | None = None   # the ratios new/base that pass on size (time, counters)


@dataclass(frozen=True)
class Setup:
    """What a comparison was judged under, as the report formats state it."""
    threshold: float
    counter_tolerance: float
    alpha: float
    clock: str             # the mode judged: raw where a run has no clocks, whatever was asked
    floor: float
    baseline_runs: int

    @property
    def flag(self) -> float:
        """How far outside the baseline a median must move to be flagged (a fraction)."""
        return self.threshold * (SET_FLAG if self.baseline_runs > 1 else 1.0)


@dataclass
class Comparison:
    findings: list[Finding]
    warnings: list[str] = field(default_factory=list)
    timings_judged: bool = True
    setup: Setup | None = None

    def of(self, verdict: str) -> list[Finding]:
        return [f for f in self.findings if f.verdict == verdict]

    @property
    def regressed(self) -> bool:
        return bool(self.of(REGRESSION))


def _checked(samples) -> np.ndarray:
    a = np.asarray(samples, dtype=float)
    if not (len(a) and np.isfinite(a).all() and (a > 0).all()):
        raise UserError("timing samples must be finite, positive seconds (and at least one per run)")
    return a


def _distinguishable(base: np.ndarray, new: np.ndarray, slower: bool, alpha: float) -> tuple[bool, float | None]:
    """(one-sided Mann-Whitney U p < alpha or disjoint IQRs, in the given direction; the p-value)."""
    p = None
    if len(base) >= 2 and len(new) >= 2:
        p = float(mannwhitneyu(new, base, alternative="greater" if slower else "less").pvalue)
    b25, b75 = np.percentile(base, [25, 75])
    n25, n75 = np.percentile(new, [25, 75])
    disjoint = n25 > b75 if slower else n75 < b25
    return (p is not None and p < alpha) or disjoint, p


def _verdict(ratio: float, threshold: float, real: bool) -> str:
    slower = ratio > 1
    big = ratio > 1 + threshold if slower else ratio < 1 / (1 + threshold)
    if big and real:
        return REGRESSION if slower else IMPROVEMENT
    return NOISE if big else UNCHANGED


def judge_samples(base: np.ndarray, new: np.ndarray, threshold: float,
                  alpha: float = 0.05) -> tuple[str, float, float | None]:
    """(verdict, median ratio new/base, p-value of the one-sided test in the direction of the change)."""
    base, new = _checked(base), _checked(new)
    ratio = float(np.median(new)) / float(np.median(base))
    real, p = _distinguishable(base, new, ratio > 1, alpha)
    return _verdict(ratio, threshold, real), ratio, p


def single_band(threshold: float) -> tuple[float, float]:
    """Against one run: the median ratios new/base that pass on size (judge_samples' rule)."""
    return 1 / (1 + threshold), 1 + threshold


def set_band(medians: Sequence[float], threshold: float) -> tuple[float, float]:
    """Against K runs: the median ratios new / (median of the K medians) that pass on size, from the
    fastest run's median less the flag to the slowest run's plus it (judge_set's rule)."""
    center, margin = float(np.median(medians)), 1 + threshold * SET_FLAG
    return min(medians) / margin / center, max(medians) * margin / center


def judge_set(bases: Sequence[np.ndarray], new: np.ndarray, threshold: float,
              alpha: float = 0.05) -> tuple[str, float, float | None, float]:
    """Against K baseline runs' samples: (verdict, new median / median of the K medians, p-value against
    the pooled samples, spread = slowest / fastest baseline median)."""
    bases, new = [_checked(b) for b in bases], _checked(new)
    medians = [float(np.median(b)) for b in bases]
    mn = float(np.median(new))
    ratio = mn / float(np.median(medians))
    hi, lo = max(medians), min(medians)
    # how far outside the baseline's run-to-run spread: past its slowest (or fastest) run; 1 inside it
    beyond = mn / hi if mn > hi else mn / lo if mn < lo else 1.0
    real, p = _distinguishable(np.concatenate(bases), new, beyond > 1 or (beyond == 1 and ratio > 1), alpha)
    verdict = _verdict(beyond, threshold * SET_FLAG, real)
    if beyond == 1 and abs(np.log(ratio)) > np.log1p(threshold):
        verdict = NOISE                     # far from the set's median, yet inside its spread
    return verdict, ratio, p, hi / lo


def _samples_by_key(s) -> dict:
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
    scenarios = base.meta.get("scenario"), new.meta.get("scenario")
    if lacking and scenarios[0] != scenarios[1]:
        return (f"the runs are of different scenarios (baseline {scenarios[0]!r}, new {scenarios[1]!r}): compare "
                f"a run against a baseline of its own scenario (the new run lacks {len(lacking)} unit(s) of the "
                "baseline)")
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


def _time_findings(bases: list[Run], new: Run, clock: str, floor: float, threshold: float, alpha: float,
                   judged: bool) -> tuple[list[Finding], int]:
    """(one time finding per (point, backend, dtype, stage) timed in every baseline run and the new run,
    the samples taken under `clock`, in key order; the samples the floor dropped)."""
    clocked = [clocked_samples(r, clock, floor) for r in (*bases, new)]
    per_base = [_samples_by_key(s) for s, _ in clocked[:-1]]
    ns = _samples_by_key(clocked[-1][0])
    bs = {k: v for k, v in per_base[0].items() if all(k in d for d in per_base[1:])}
    ok_new = set(new.status.loc[new.status["status"] == STATUS_OK, ["point_key", "backend"]].itertuples(
        index=False, name=None)) if not new.status.empty else set()
    unsampled = [f"{k[1]} at {k[0]}, stage {k[3]}" for k in sorted(bs.keys() - ns.keys()) if (k[0], k[1]) in ok_new]
    if unsampled:
        raise UserError(f"the new run has no samples for {len(unsampled)} timed stage(s) of the baseline: "
                        f"{'; '.join(unsampled[:3])}")
    findings = []
    for key in sorted(bs.keys() & ns.keys()):
        if len(bases) == 1:
            (verdict, ratio, p), spread = judge_samples(bs[key], ns[key], threshold, alpha), None
            center, band = float(np.median(bs[key])), single_band(threshold)
        else:
            runs = [d[key] for d in per_base]
            verdict, ratio, p, spread = judge_set(runs, ns[key], threshold, alpha)
            medians = [float(np.median(r)) for r in runs]
            center, band = float(np.median(medians)), set_band(medians, threshold)
        findings.append(Finding(*key, "time", center, float(np.median(ns[key])), ratio, p,
                                verdict if judged else NOT_JUDGED, spread=spread, band=band))
    return findings, sum(n for _, n in clocked)


def _both(raw: Finding, norm: Finding) -> Finding:
    """--clock both: normalize's finding, flagged only where raw times flag the same (a stage whose time
    follows the clock, and one whose time does not, both see the change)."""
    agree = raw.verdict == norm.verdict or norm.verdict in (UNCHANGED, NOT_JUDGED)
    return norm if agree else replace(norm, verdict=NOISE)


def _host_probes(run: Run) -> dict | None:
    """(point, backend, dtype) -> the module samples' host launch probes; None where the run has none (a
    graph run, or an eager run made before the probe was recorded)."""
    s = run.samples
    if s.empty or "host_probe_s" not in s.columns:
        return None
    s = s[(s["stage"] == MODULE) & s["host_probe_s"].notna()]
    return {key: g["host_probe_s"].to_numpy(dtype=float) for key, g in s.groupby(KEY[:3], sort=True)} or None


def _host_rule(bases: list[Run], new: Run, findings: list[Finding], threshold: float, alpha: float,
               flag: float, warnings: list[str]) -> list[Finding]:
    """Eager runs: each time finding the host's own change explains, re-judged (module docstring)."""
    probes = [_host_probes(r) for r in (*bases, new)]
    if any(p is None for p in probes):
        warnings.append("eager runs without the host launch probe (made before it was recorded): their times "
                        "are judged as they are, whatever state the host was in")
        return findings
    host: dict = {}                 # per unit: the probe judged as a time (its stages share it)
    out, slower = [], []
    for f in findings:
        key = (f.point_key, f.backend, f.dtype)
        if f.kind != "time" or f.verdict not in (REGRESSION, IMPROVEMENT) or not all(key in p for p in probes):
            out.append(f)
            continue
        if key not in host:
            host[key] = judge_samples(np.concatenate([p[key] for p in probes[:-1]]), probes[-1][key], threshold,
                                      alpha)
        verdict, h, _ = host[key]
        note = f"host probe {h:.2f}x the baseline's"
        if f.verdict == REGRESSION and verdict == REGRESSION and f.ratio <= h * (1 + flag):
            out.append(replace(f, verdict=HOST, note=note))
            slower.append(h)
        elif f.verdict == IMPROVEMENT and verdict == IMPROVEMENT and f.ratio >= h / (1 + flag):
            out.append(replace(f, verdict=NOISE, note=note))
        else:
            out.append(f)
    if slower:
        warnings.append(f"{len(slower)} eager time(s) slower by no more than their host: its launch probe read "
                        f"{min(slower):.2f}-{max(slower):.2f}x the baseline's there, so the gate cannot tell a "
                        "regression from the host's state; rerun when the host is as fast as the baseline's")
    return out


def compare_runs(base: Run | Sequence[Run], new: Run, threshold: float = 0.05, counter_tolerance: float = 0.02,
                 alpha: float = 0.05, clock: str = "both", floor: float = DEFAULT_FLOOR) -> Comparison:
    """`base`: one run, or the K runs of a baseline set. `clock`: raw | normalize | floor | both (baseline.py)."""
    bases = [base] if isinstance(base, Run) else list(base)
    base = bases[0]
    for b in bases:
        if b.timer != new.timer:
            raise UserError(f"the baseline {b.path} was timed by {b.timer!r}, the new run {new.path} by {new.timer!r}: "
                            "compare runs of one timer (sweep --timer)")
    warnings = []
    for label, a, b in (("device", base.device_name, new.device_name),
                        ("scenario", base.meta.get("scenario"), new.meta.get("scenario")),
                        ("L2 flush", l2_flush_of(base.meta), l2_flush_of(new.meta))):
        if a != b:
            warnings.append(f"different {label}: baseline {a!r}, new {b!r}")
    for b in bases:
        why = _unusable(b, new)
        if why:
            raise UserError(why + (f" (baseline {b.path})" if len(bases) > 1 else ""))
    cpu = [name for name, runs in (("the baseline has", bases), ("the new run has", [new]))
           if any(r.timer not in GPU_TIMERS for r in runs)]
    judged = not cpu
    if not judged:
        warnings.append(CPU_TIMINGS.format(which="both runs have" if len(cpu) == 2 else cpu[0]))
    findings = []
    if clock != "raw" and judged and not all(has_clock(r) for r in (*bases, new)):
        warnings.append(f"--clock {clock}: a run has no per-sample SM clock (made before the probe was "
                        "recorded), so raw times are compared")
        clock = "raw"
    if clock == "both":
        by_mode = [_time_findings(bases, new, m, floor, threshold, alpha, judged)[0] for m in ("raw", "normalize")]
        findings += [_both(f_raw, f_norm) for f_raw, f_norm in zip(*by_mode)]
    else:
        timed, dropped = _time_findings(bases, new, clock, floor, threshold, alpha, judged)
        findings += timed
        if clock == "floor":
            warnings.append(f"--clock floor: dropped {dropped} sample(s) clocked below {floor:.0%} of their "
                            "stage's highest sampled clock")
    setup = Setup(threshold, counter_tolerance, alpha, clock, floor, len(bases))
    if judged and timer_mode(new.timer) == EAGER:
        findings = _host_rule(bases, new, findings, threshold, alpha, setup.flag, warnings)
    bc, nc = _counters_by_key(base), _counters_by_key(new)
    for key in sorted(bc.keys() & nc.keys()):
        b, n = bc[key], nc[key]
        ratio = n / b if b > 0 else (1.0 if n == 0 else float("inf"))
        verdict = (REGRESSION if ratio > 1 + counter_tolerance else
                   IMPROVEMENT if ratio < 1 - counter_tolerance else UNCHANGED)
        findings.append(Finding(*key[:4], key[4], b, n, ratio, None, verdict,
                                band=(1 - counter_tolerance, 1 + counter_tolerance)))
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
    return Comparison(findings, warnings, judged, setup)
