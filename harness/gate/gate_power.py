"""How well the gate separates noise from a regression, on K+M runs of one grid (scripts/gate-protocol.sh),
and whether a new baseline set passes against itself (self_check, `msa-bench gate baseline`).

Runs 1..K are the baseline set; each later run is judged against it by compare_runs, the function
`msa-bench compare` uses, once per clock mode:
  clean    the backends without a planted delay: every time finding flagged a regression is false;
  planted  each `X@delayP` unit of the new run, relabelled `X`, against the baseline's `X`: its
           module stage flagged a regression is a catch of a P % slowdown. The slowdown the delay
           realized is measured too: its module median over the same run's `X`, under the mode.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import UserError
from ...kernels.base import OPTION_SEP, split_name
from ...kernels.delay import split_delay
import numpy as np

from .baseline import CLOCK_MODES, clocked_samples
from .compare import REGRESSION, Comparison, compare_runs
from ..store.results import Run


def planted(backend: str) -> tuple[str, float] | None:
    """'kv-outer-cute@delay5' -> ('kv-outer-cute', 5.0); 'x@v28+delay5' -> ('x@v28', 5.0); else None."""
    base, option = split_name(backend)
    rest, percent = split_delay(option)
    if percent is None:
        return None
    return (base if rest is None else f"{base}{OPTION_SEP}{rest}"), percent


def subset(run: Run, rename: dict[str, str]) -> Run:
    """The run's units of the backends in `rename`, relabelled to rename[backend]."""
    def pick(df):
        if df.empty:
            return df
        df = df[df["backend"].isin(list(rename))].copy()
        df["backend"] = df["backend"].map(rename)
        return df
    return Run(run.path, run.meta, pick(run.status), pick(run.stats), pick(run.samples), run.missing)


@dataclass
class Power:
    runs_judged: int = 0
    clean_comparisons: int = 0
    false_regressions: int = 0
    caught: dict[float, list[int]] = field(default_factory=dict)    # percent -> [caught, trials]
    realized: dict[float, list[float]] = field(default_factory=dict)  # percent -> planted/clean - 1, per unit


def _module_medians(run: Run, mode: str, floor: float) -> dict:
    s, _ = clocked_samples(run, mode, floor)
    s = s[s["stage"] == "module"]
    return {key: float(np.median(g["seconds"])) for key, g in s.groupby(["point_key", "backend", "dtype"])}


def gate_power(runs: list[Run], k: int, threshold: float = 0.05, modes=CLOCK_MODES,
               floor: float = 0.97) -> dict[str, Power]:
    if not 1 <= k < len(runs):
        raise UserError(f"--baseline-runs must leave at least one run to judge: {k} of {len(runs)} runs")
    bases, out = runs[:k], {m: Power() for m in modes}
    for new in runs[k:]:
        backends = sorted(new.status["backend"].unique())
        clean = {b: b for b in backends if planted(b) is None}
        for mode in modes:
            power = out[mode]
            power.runs_judged += 1
            result = compare_runs([subset(b, clean) for b in bases], subset(new, clean), threshold,
                                  clock=mode, floor=floor)
            times = [f for f in result.findings if f.kind == "time"]
            power.clean_comparisons += len(times)
            power.false_regressions += sum(f.verdict == REGRESSION for f in times)
            medians = _module_medians(new, mode, floor)
            for name in backends:
                target = planted(name)
                if target is None:
                    continue
                base_name, percent = target
                result = compare_runs([subset(b, {base_name: base_name}) for b in bases],
                                      subset(new, {name: base_name}), threshold, clock=mode, floor=floor)
                module = [f for f in result.findings if f.kind == "time" and f.stage == "module"]
                power.realized.setdefault(percent, []).extend(
                    medians[(k, name, d)] / medians[(k, base_name, d)] - 1
                    for (k, b, d) in medians if b == name and (k, base_name, d) in medians)
                tally = power.caught.setdefault(percent, [0, 0])
                tally[0] += sum(f.verdict == REGRESSION for f in module)
                tally[1] += len(module)
    return out


def self_check(runs: list[Run], threshold: float = 0.05, clock: str = "both") -> list[Comparison]:
    """Each run of a baseline set judged against the others, as `compare` judges a new run against the set:
    a set one of whose own runs regresses against the rest cannot tell a change from its own noise."""
    if len(runs) < 2:
        raise UserError(f"a baseline set checks each run against the others: it needs 2 runs at least, has {len(runs)}")
    return [compare_runs(runs[:i] + runs[i + 1:], run, threshold, clock=clock) for i, run in enumerate(runs)]


def power_table(mode: str, power: Power) -> str:
    """One clock mode's result as a markdown table."""
    rows = [("runs judged", str(power.runs_judged)), ("clean comparisons", str(power.clean_comparisons)),
            ("false regressions", str(power.false_regressions))]
    rows += [(f"planted {p:g} % caught/trials", f"{c}/{n}") for p, (c, n) in sorted(power.caught.items())]
    rows += [(f"planted {p:g} %: realized slowdown, median (min-max)",
              f"{np.median(r):.1%} ({min(r):.1%}-{max(r):.1%})") for p, r in sorted(power.realized.items()) if r]
    lines = [f"### --clock {mode}", "", "| | |", "|---|---:|"]
    return "\n".join(lines + [f"| {a} | {b} |" for a, b in rows]) + "\n"
