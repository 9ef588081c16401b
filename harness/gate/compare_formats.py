"""The gate's verdict for people and for tools: one Comparison (compare.py) rendered as a terminal table,
a JSON document or a pull-request comment in markdown. Nothing here judges; every verdict, ratio and pass
band comes from the Comparison.

The JSON document (SCHEMA_VERSION; docs/harness.md, "The gate in CI", lists its keys) has the same keys
whatever the verdict, an error included, so a tool reads one shape. Its conventions follow nvbench's and
asv's compare scripts: one row per compared measurement with both medians, their ratio new/base and a
status, a summary count per status, and an exit code that is the verdict.
"""
from __future__ import annotations

import io
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from .compare import HOST, IMPROVEMENT, NOISE, NOT_JUDGED, REGRESSION, UNCHANGED, Comparison, Finding
from ..store.results import Run

FORMATS = ("text", "json", "markdown")
SCHEMA_VERSION = 1
EXIT_PASS, EXIT_REGRESSION, EXIT_UNUSABLE = 0, 1, 2
VERDICTS = {EXIT_PASS: "pass", EXIT_REGRESSION: "regression", EXIT_UNUSABLE: "error"}
STATUSES = (REGRESSION, HOST, IMPROVEMENT, NOISE, UNCHANGED, NOT_JUDGED)
UNITS = {"time": "s", "hbm_bytes": "bytes", "l2_bytes": "bytes"}


@dataclass(frozen=True)
class Subject:
    """What was compared, as the user named it."""
    baseline: str
    new: str
    report_url: str | None = None
    scenario: str | None = None
    device: str | None = None
    commit: str | None = None


def subject(baseline: str, new: str, new_run: Run | None = None, report_url: str | None = None) -> Subject:
    """`report_url` defaults to the new run's report/ where `msa-bench report` wrote one (a relative path
    when `new` is)."""
    report = Path(new) / "report"
    report_url = report_url or (f"{report}/" if (report / "summary.md").is_file() else None)
    if new_run is None:
        return Subject(baseline, new, report_url)
    prov = new_run.meta.get("provenance") or {}
    return Subject(baseline, new, report_url, new_run.meta.get("scenario"), new_run.device_name,
                   prov.get("git_commit"))


def exit_code(result: Comparison) -> int:
    """1 on a regression; else 2 where a slower host hides what the gate would judge (compare.HOST); else 0."""
    return EXIT_REGRESSION if result.regressed else EXIT_UNUSABLE if result.of(HOST) else EXIT_PASS


# ---- JSON --------------------------------------------------------------------------------------------
def _number(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _finding_json(f: Finding) -> dict:
    return {"point": f.point_key, "backend": f.backend, "dtype": f.dtype, "stage": f.stage, "what": f.kind,
            "unit": UNITS.get(f.kind), "verdict": f.verdict,
            "baseline": {"value": _number(f.baseline), "run_spread": _number(f.spread)},
            "new": {"value": _number(f.new)}, "ratio": _number(f.ratio), "p_value": _number(f.p_value),
            "pass_band": None if f.band is None else [_number(b) for b in f.band], "note": f.note}


def _run_spread(result: Comparison) -> dict | None:
    """Against a set: the median and largest run-to-run spread of the compared times; None against a run."""
    spreads = [f.spread for f in result.findings if f.kind == "time" and f.spread is not None]
    return {"median": statistics.median(spreads), "max": max(spreads), "n": len(spreads)} if spreads else None


def _noise_json(result: Comparison) -> dict:
    s = result.setup
    spread = _run_spread(result)
    return {"rule": "set" if s.baseline_runs > 1 else "single-run", "flag": s.flag,
            "run_spread": None if spread is None else {k: spread[k] for k in ("median", "max")}}


def as_json(result: Comparison | None, sub: Subject, error: str | None = None) -> dict:
    """The document; `result` None with the `error` that stopped the comparison (exit 2)."""
    code = EXIT_UNUSABLE if result is None else exit_code(result)
    s = result.setup if result is not None else None
    findings = result.findings if result is not None else []
    return {
        "schema_version": SCHEMA_VERSION,
        "verdict": VERDICTS[code],
        "exit_code": code,
        "error": error,
        "baseline": {"path": sub.baseline, "runs": s.baseline_runs if s else None},
        "new": {"path": sub.new, "scenario": sub.scenario, "device": sub.device, "commit": sub.commit},
        "settings": None if s is None else {
            "max_regression": s.threshold, "counter_tolerance": s.counter_tolerance, "alpha": s.alpha,
            "clock": s.clock, "floor": s.floor},
        "timings_judged": None if result is None else result.timings_judged,
        "noise_band": None if result is None else _noise_json(result),
        "counts": {"compared": len(findings), **{v: sum(f.verdict == v for f in findings) for v in STATUSES}},
        "warnings": [] if result is None else list(result.warnings),
        "report_url": sub.report_url,
        "comparisons": [_finding_json(f) for f in findings],
    }


def render_json(result: Comparison | None, sub: Subject, error: str | None = None) -> str:
    return json.dumps(as_json(result, sub, error), indent=2, allow_nan=False) + "\n"


# ---- markdown (a pull-request comment) ---------------------------------------------------------------
def _value(f: Finding, v: float) -> str:
    if not math.isfinite(v):
        return "-"
    return f"{v * 1e6:.2f} µs" if f.kind == "time" else f"{v:.4g}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(findings: list[Finding], with_verdict: bool = False) -> list[str]:
    head = ["backend", "dtype", "stage", "what", "baseline", "new", "new/base", "pass band", "p", "point"]
    align = ["---"] * 4 + ["---:"] * 5 + ["---"]          # numbers right-aligned
    if with_verdict:
        head.insert(0, "verdict")
        align.insert(0, "---")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for f in findings:
        band = "" if f.band is None else f"{f.band[0]:.3f}-{f.band[1]:.3f}"
        row = [f.backend, f.dtype, f.stage, f.kind, _value(f, f.baseline), _value(f, f.new),
               "-" if not math.isfinite(f.ratio) else f"{f.ratio:.3f}", band,
               "" if f.p_value is None else f"{f.p_value:.2g}", f.note or f"`{f.point_key}`"]
        if with_verdict:
            row.insert(0, f.verdict)
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines


def _noise_paragraph(result: Comparison) -> str:
    s = result.setup
    if not result.timings_judged:
        return "Timings are not judged (host timings); only a unit that now fails is a regression."
    test = (f"its samples differ (one-sided Mann-Whitney U p < {s.alpha:g}, or disjoint interquartile "
            "ranges)")
    if s.baseline_runs > 1:
        text = (f"A time is flagged only where its median leaves the pass band (the {s.baseline_runs} baseline "
                f"runs' fastest to slowest median, widened by {s.flag:.1%}: half the {s.threshold:.1%} "
                f"threshold) and {test} from the runs' pooled samples")
    else:
        text = f"A time is flagged only where its median moves by more than {s.threshold:.1%} and {test}"
    if s.clock == "both":
        text += "; raw and clock-normalized times must both flag it"
    spread = _run_spread(result)
    if spread:
        text += (f". The set's run-to-run spread (slowest / fastest run median) over the {spread['n']} "
                 f"compared times: median {spread['median']:.3f}, largest {spread['max']:.3f}")
    return text + f". Bytes moved (ncu) may change by {s.counter_tolerance:.1%}."


def _heading(code: int) -> str:
    return f"## msa-bench gate: {VERDICTS[code]}"


def _figures(sub: Subject) -> str:
    if sub.report_url:
        return f"Figures: [the run's report]({sub.report_url})."
    return f"Figures: `msa-bench report {sub.new}` writes them to `{sub.new.rstrip('/')}/report/`."


def render_markdown(result: Comparison, sub: Subject) -> str:
    code, s = exit_code(result), result.setup
    reg, imp, host = result.of(REGRESSION), result.of(IMPROVEMENT), result.of(HOST)
    runs = f"{s.baseline_runs} baseline runs" if s.baseline_runs > 1 else "one baseline run"
    about = ", ".join(x for x in (sub.scenario, sub.device, sub.commit and f"commit {sub.commit[:12]}") if x)
    lines = [_heading(code), "",
             f"`{sub.new}` ({about}) against `{sub.baseline}` ({runs}): {len(result.findings)} compared, "
             f"**{len(reg)} regression(s)**, {len(imp)} improvement(s)"
             + (f", {len(host)} on a slower host" if host else "") + f"; exit code {code}.", ""]
    for title, found in (("Regressions", reg), ("Improvements", imp)):
        lines += [f"### {title}", ""] + (_table(found) if found else ["None."]) + [""]
    if host:
        lines += ["### Slower on a slower host (not judged)", ""] + _table(host) + [""]
    lines += ["### Noise band", "", _noise_paragraph(result),
              f"Threshold {s.threshold:.1%}, counters {s.counter_tolerance:.1%}, clock `{s.clock}`.", ""]
    if result.warnings:
        lines += ["### Warnings", ""] + [f"- {_cell(w)}" for w in result.warnings] + [""]
    lines += [_figures(sub), "", f"<details><summary>All {len(result.findings)} comparisons</summary>", ""]
    lines += _table(result.findings, with_verdict=True) + ["", "</details>"]
    return "\n".join(lines) + "\n"


def error_markdown(message: str, sub: Subject) -> str:
    return "\n".join([_heading(EXIT_UNUSABLE), "",
                      f"`{sub.new}` could not be judged against `{sub.baseline}` (exit code {EXIT_UNUSABLE}): "
                      "the gate never passes what it did not measure.", "", "```", message, "```", ""])


def render(fmt: str, result: Comparison | None, sub: Subject, error: str | None = None,
           show_all: bool = False) -> str:
    """The document in `fmt` for a result, or (json, markdown) for the error that stopped it."""
    if fmt == "json":
        return render_json(result, sub, error)
    if fmt == "markdown":
        return error_markdown(error, sub) if result is None else render_markdown(result, sub)
    return text(result, sub, show_all)


# ---- text (the terminal) -----------------------------------------------------------------------------
TEXT_WIDTH = 80      # the text table written to a file


def text(result: Comparison, sub: Subject, show_all: bool = False) -> str:
    from rich.console import Console
    console = Console(file=io.StringIO(), width=TEXT_WIDTH, soft_wrap=False, color_system=None)
    print_text(result, sub, console, show_all)
    return console.file.getvalue()


def print_text(result: Comparison, sub: Subject, console, show_all: bool = False) -> None:
    """The terminal table (rich `console`): the changes, or every comparison with `show_all`; at a width
    too narrow for the whole table, one record a line with every value in full."""
    from rich.markup import escape
    from rich.table import Table
    s = result.setup
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}", soft_wrap=True)     # whole lines, text as is
    shown = result.findings if show_all else result.of(REGRESSION) + result.of(HOST) + result.of(IMPROVEMENT)
    sets = s.baseline_runs > 1
    if shown:
        title = f"{sub.new} vs {sub.baseline}" + (f" ({s.baseline_runs} baseline runs)" if sets else "")
        columns = ["verdict", "backend", "dtype", "stage", "what", "baseline", "new", "new/base", "p", "point"]
        if sets:
            columns.insert(8, "spread")
        rows = []
        for f in shown:
            fmt = (lambda v: f"{v * 1e6:.2f} µs") if f.kind == "time" else (lambda v: f"{v:.4g}")
            row = [f.verdict, f.backend, f.dtype, f.stage, f.kind, fmt(f.baseline), fmt(f.new), f"{f.ratio:.3f}",
                   "" if f.p_value is None else f"{f.p_value:.3g}", f.note or f.point_key]
            if sets:
                row.insert(8, "" if f.spread is None else f"{f.spread:.3f}")
            rows.append(row)
        table = Table(title=title)
        for col in columns:
            table.add_column(col, no_wrap=True)
        for row in rows:
            color = {REGRESSION: "red", IMPROVEMENT: "green", HOST: "yellow"}.get(row[0], "")
            table.add_row(f"[{color}]{row[0]}[/]" if color else row[0], *map(escape, row[1:]))
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        if sum(w + 3 for w in widths) + 1 <= console.width:     # cells, their padding and rules: shown whole
            console.print(table)
        else:        # too wide to show whole: one record per finding, every value in full
            console.print(title, soft_wrap=True)
            for row in rows:
                named = dict(zip(columns, row))
                spread = f", spread {named['spread']}" if named.get("spread") else ""
                p = f", p {named['p']}" if named["p"] else ""
                console.print(f"{named['verdict']}: {named['backend']} {named['dtype']} {named['stage']} "
                              f"{named['what']} {named['baseline']} -> {named['new']} (new/base "
                              f"{named['new/base']}{p}{spread}) at {escape(named['point'])}",
                              soft_wrap=True, highlight=False)
    n_reg, n_imp, n_host = len(result.of(REGRESSION)), len(result.of(IMPROVEMENT)), len(result.of(HOST))
    console.print(f"{len(result.findings)} compared: {n_reg} regression(s), {n_imp} improvement(s)"
                  + (f", {n_host} on a slower host" if n_host else "")
                  + f" (threshold {s.threshold:.1%}, counters {s.counter_tolerance:.1%}, clock {s.clock}"
                  + (f", {s.baseline_runs} baseline runs" if sets else "")
                  + ("" if result.timings_judged else "; timings not judged: CPU run") + ")")
