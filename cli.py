"""The `msa-bench` command line: parse, call, print. Logic lives in harness/, kernels/ and roofline/."""
from __future__ import annotations

import sys

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Benchmark and roofline analysis of top-k block-sparse attention: KV-outer (ours), "
         "Q-outer (FlashInfer) and MSA-style scatter, side by side on one GPU.",
)


@app.callback()
def _root() -> None:
    """Benchmark and roofline analysis of top-k block-sparse attention."""


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


# ---- commands are added below, one section per area -------------------------------------------


# ---- workloads and scenarios (selection generators, statistics, shipped scenario files) -------
@app.command()
def workload(
    generator: str = typer.Option("synthetic", help="synthetic (hits a target reuse), real-prefill (an MSA production "
                                                   "prefill case, see --case) or indexer (top-k by query . mean-pooled "
                                                   "keys of structured Q/K; draws the tensors, so it is slower)."),
    reuse: float = typer.Option(0.25, help="Target reuse nsb/N for synthetic: distinct selected (KV head, block) pairs "
                                           "per query token. At most Hkv x context blocks / N and Hkv x topk."),
    tokens: int = typer.Option(16384, help="N query tokens (synthetic, indexer)."),
    context: int = typer.Option(131072, help="Context length in tokens, i.e. context / --block blocks (synthetic, indexer)."),
    skew: float = typer.Option(0.0, help="Zipf exponent of block popularity for synthetic (0: uniform)."),
    share: float = typer.Option(None, help="Co-selection for synthetic: the fraction (0 to 1) of its top-k each group "
                                           "of --share-group consecutive tokens shares; the rest each token draws on "
                                           "its own (sets union_ratio at P = group). Default: not co-selected."),
    share_group: int = typer.Option(8, help="Tokens per co-selection group (with --share)."),
    causal: bool = typer.Option(False, "--causal", help="Chunked causal prefill: the N queries are the context's last N "
                                                        "tokens and each query's own block is its last selected block."),
    case: str = typer.Option(None, "--case", help="MSA prefill case id for real-prefill, e.g. prefill_c17ccf7fbbb5d1ee5648 "
                                                  "(the real-prefill scenario lists the representative ones)."),
    dtype: str = typer.Option("bf16", help="Data type: bf16, fp8 (e4m3), fp16 or fp32."),
    seed: int = typer.Option(0, help="Seed of the selection (synthetic, indexer) and the tensors."),
    device: str = typer.Option("h200", "--device", help="Roofline device profile for predicted times: b200, h100, h200 "
                                                        "or a PROFILE.json from `msa-bench calibrate`."),
    hq: int = typer.Option(64, help="Query heads."),
    hkv: int = typer.Option(4, help="KV heads (must divide --hq)."),
    head_dim: int = typer.Option(128, help="Head dimension D (elements)."),
    block: int = typer.Option(128, help="KV block size in tokens."),
    topk: int = typer.Option(16, help="Blocks each query keeps per KV head."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (achieved reuse under nsb_per_n)."),
):
    """Generate one workload's selection and print its statistics: reuse nsb/N, fan-in of queries per selected
    (KV head, block), co-selection (union_ratio: distinct blocks of a tile of P consecutive tokens over one
    token's, at P = 8 and 16), visible selected tokens, useful FLOPs and the roofline's predicted time per
    schedule."""
    import json
    from .errors import UserError
    from .scenarios.grid import GENERATORS, Point, make_workload
    from .scenarios.stats import prediction_rows, stat_rows, workload_stats
    from .scenarios.workload import DATA_DTYPES, AttnShape

    if generator not in GENERATORS:
        raise UserError(f"--generator must be one of {', '.join(GENERATORS)}, got {generator!r}")
    if dtype not in DATA_DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DATA_DTYPES)}, got {dtype!r}")
    shape = AttnShape(hq=hq, hkv=hkv, head_dim=head_dim, block=block, topk=topk)
    if generator == "real-prefill":
        from .scenarios.prefill_cases import get_case
        if not case:
            raise UserError("--generator real-prefill needs --case CASE_ID (e.g. prefill_c17ccf7fbbb5d1ee5648; "
                            "`msa-bench scenarios` -> real-prefill lists the representative cases)")
        c = get_case(case)
        point = Point("real-prefill", c.total_q, c.max_final_kv, None, 0.0, True, dtype, seed, c.case_id, c.weight, shape)
    else:
        if case:
            raise UserError("--case applies only to --generator real-prefill")
        if share is not None and generator != "synthetic":
            raise UserError("--share applies only to --generator synthetic")
        synthetic = generator == "synthetic"
        point = Point(generator, tokens, context, reuse if synthetic else None, skew, causal, dtype, seed, None, 1.0,
                      shape, share if synthetic else None, share_group if share is not None else None)
    from .roofline.devices import load_device
    profile = load_device(device)
    stats = workload_stats(make_workload(point, with_tensors=False), profile)
    if as_json:
        typer.echo(json.dumps(stats))
        return
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"workload {point.key()}", show_header=True)
    table.add_column("statistic (unit)")
    table.add_column("value", justify="right")
    for label, value in stat_rows(stats):
        table.add_row(label, value)
    pred = Table(title=f"roofline prediction on {stats['device']}")
    for col in ("schedule", "predicted time (us)", "binding resource"):
        pred.add_column(col, justify="right" if col.startswith("pred") else "left")
    for row in prediction_rows(stats):
        pred.add_row(*row)
    console = Console()
    console.print(table)
    console.print(pred)


@app.command()
def scenarios():
    """List the shipped scenarios (grids of workloads: tokens, context in tokens, reuse = nsb/N, dtypes) with
    their one-line descriptions. Run one with `msa-bench sweep --scenario NAME`."""
    from rich.console import Console
    from rich.table import Table
    from .scenarios.grid import list_scenarios, load_scenario
    from .errors import UserError

    table = Table(title="shipped scenarios")
    for col in ("name", "points (workload x dtype)", "description"):
        table.add_column(col, justify="right" if col.startswith("points") else "left")
    for name, desc in list_scenarios():
        try:
            count = str(len(load_scenario(name).points))
        except UserError as exc:
            count, desc = "invalid", str(exc)
        table.add_row(name, count, desc)
    Console().print(table)


# ---- check (kv-outer / msa-scatter correctness against the float64 reference) ------------------
@app.command()
def check(
    backend: str = typer.Option("kv-outer", help="Backend to check: kv-outer, msa-scatter, flashinfer, reference, ..."),
    dtype: str = typer.Option(None, help="Data type: bf16, fp8 (e4m3), fp16 or fp32 (default: bf16 on a GPU, fp16 on CPU, "
                                         "where Triton's interpreter gets bf16 wrong)."),
    tokens: int = typer.Option(0, help="N query tokens (default: 40 on CPU, 4096 on a GPU)."),
    context: int = typer.Option(0, help="Context length in tokens (default: 256 on CPU, 32768 on a GPU)."),
    reuse: float = typer.Option(None, help="Target nsb/N (distinct selected (KV head, block) pairs per token; default 0.5 CPU, 0.25 GPU)."),
    causal: bool = typer.Option(False, help="Chunked causal prefill: each query's own block is its last selected block."),
    seed: int = typer.Option(0, help="Seed of the selection and the tensors."),
    hq: int = typer.Option(0, help="Query heads (default: 8 on CPU, 64 on a GPU)."),
    hkv: int = typer.Option(0, help="KV heads (default: 2 on CPU, 4 on a GPU)."),
    head_dim: int = typer.Option(0, help="Head dimension (default: 32 on CPU, 128 on a GPU)."),
    block: int = typer.Option(0, help="KV block size in tokens (default: 16 on CPU, 128 on a GPU)."),
    topk: int = typer.Option(0, help="Blocks kept per query and KV head (default: 4 on CPU, 16 on a GPU)."),
):
    """Run one backend on a synthetic workload, compare with the float64 reference (sampled rows when N > 512)
    and print per-stage checks; the maximum relative error is printed last. Exit 0 only within tolerance
    (fp32 1e-5, fp16/bf16 1e-2, fp8 5e-2). Without a GPU the Triton kernels run in the CPU interpreter."""
    from .harness.check import CPU_SHAPE, default_request, run_check
    from .errors import UserError
    from .scenarios.workload import DATA_DTYPES, AttnShape

    import torch
    dtype = dtype or ("bf16" if torch.cuda.is_available() else "fp16")
    if dtype not in DATA_DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DATA_DTYPES)}, got {dtype!r}")
    for name, value in (("tokens", tokens), ("context", context), ("hq", hq), ("hkv", hkv), ("head-dim", head_dim),
                        ("block", block), ("topk", topk)):
        if value < 0:
            raise UserError(f"--{name} must be positive, got {value}")
    base = AttnShape() if torch.cuda.is_available() else CPU_SHAPE
    shape = AttnShape(hq=hq or base.hq, hkv=hkv or base.hkv, head_dim=head_dim or base.head_dim,
                      block=block or base.block, topk=topk or base.topk)
    req = default_request(backend, dtype, tokens or None, context or None, reuse, causal, seed, shape)
    w, (err, tol, details) = run_check(req)
    s = w.shape
    typer.echo(f"{backend} {dtype} on {w.device}: N={w.n_tokens} Hq={s.hq} Hkv={s.hkv} D={s.head_dim} "
               f"block={s.block} topk={s.topk} context={req.context} reuse={req.reuse:g}"
               f"{' causal' if causal else ''}; compared {details['rows']} rows")
    typer.echo(f"plan: {details['info']}")
    failed = False
    for stage, (ok, msg) in details.get("stage_checks", {}).items():
        failed |= not ok
        typer.echo(f"  {stage:<10} {'ok  ' if ok else 'FAIL'} {msg}")
    if "lse_rel_err" in details:
        typer.echo(f"  output rel err {details['out_rel_err']:.3e}, lse rel err {details['lse_rel_err']:.3e}")
    ok = err <= tol and not failed
    typer.echo(f"max relative error {err:.3e} (tol {tol:g}): {'PASS' if ok else 'FAIL'}")
    if not ok:
        raise typer.Exit(1)


# ---- roofline ---------------------------------------------------------------------------------
@app.command()
def roofline(
    device: str = typer.Option("b200", help="Device profile: b200, h100, h200, or a PROFILE.json from `msa-bench calibrate`."),
    dtype: str = typer.Option("fp8", help="Q/K/V data type: fp8 (e4m3) or bf16."),
    partial_dtype: str = typer.Option("bf16", help="Data type of the KV-outer partial outputs: bf16 or fp8."),
    hq: int = typer.Option(64, help="Query heads."),
    hkv: int = typer.Option(4, help="KV heads (must divide --hq)."),
    head_dim: int = typer.Option(128, help="Head dimension D (elements)."),
    block: int = typer.Option(128, help="KV block size (tokens per block)."),
    topk: int = typer.Option(16, help="Blocks each query keeps per KV head."),
    tokens: int = typer.Option(16384, help="N query tokens, for the per-launch predictions and the L2-capacity-aware crossover."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (key crossover_nsb_per_n holds the "
                                                       "crossover, co_selection the winner table)."),
):
    """Predicted KV-outer vs Q-outer crossover (in nsb/N: distinct selected (KV head, block) pairs per query
    token), per-query-token bytes per schedule and memory level, and the binding resource (hbm, l2 or mma)
    at a few reuse points; then the predicted winner of KV-outer, Q-outer and token-packed Q-outer (q-packed)
    with its useful TFLOP/s over reuse x co-selection (union_ratio at P = 8 tokens), and the union_ratio
    below which q-packed beats KV-outer. Bandwidths in TB/s, bytes per query token, times in microseconds."""
    import json
    from .errors import UserError
    from .roofline.devices import load_device
    from .roofline.model import DTYPE_BYTES, ModelShape
    from .roofline.summary import roofline_summary

    for name, value in (("hq", hq), ("hkv", hkv), ("head-dim", head_dim), ("block", block), ("topk", topk), ("tokens", tokens)):
        if value <= 0:
            raise UserError(f"--{name} must be positive, got {value}")
    if hq % hkv:
        raise UserError(f"--hq ({hq}) must be a multiple of --hkv ({hkv})")
    if dtype not in ("fp8", "bf16"):
        raise UserError(f"--dtype must be fp8 or bf16, got {dtype!r}")
    if partial_dtype not in ("bf16", "fp8") or partial_dtype not in DTYPE_BYTES:
        raise UserError(f"--partial-dtype must be bf16 or fp8, got {partial_dtype!r}")
    prof = load_device(device)
    shape = ModelShape(hq=hq, hkv=hkv, head_dim=head_dim, block=block, topk=topk, dtype=dtype, partial_dtype=partial_dtype)
    summary = roofline_summary(shape, prof, n_tokens=tokens)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    from .roofline.render import print_co_selection, print_roofline
    print_roofline(summary)
    print_co_selection(summary)


# ---- cute (ahead-of-time CuTe DSL kernels) -----------------------------------------------------
@app.command("build-kernels")
def build_kernels(
    arch: str = typer.Option("sm_90a", help="Target GPU architecture (the CuTe attention stage supports sm_90a)."),
    out: str = typer.Option("", help="Output directory for the libraries and manifest.json (default: build/cute in the checkout)."),
    dtype: list[str] = typer.Option([], help="Data dtype(s) to build: bf16, fp8 (repeatable; default: all)."),
    kernel: list[str] = typer.Option([], help="kv-outer-cute kernel(s) to build, e.g. v23 (repeatable; default: all, "
                                              "one library per kernel and dtype)."),
    kv_outer: bool = typer.Option(True, help="Build the kv-outer-cute libraries."),
    q_packed: str = typer.Option("default", help="q-packed-cute libraries to build: default (schedule options off, "
                                                 "and pingpong + s-ahead), all (also each option alone), none."),
):
    """Compile the CuTe DSL attention stages for every configuration the sweep can ask for (no GPU needed):
    each kernel of kernels/cute/manifest.KERNELS in each of its dtypes, and the q-packed-cute configurations,
    one shared library per configuration, with manifest.json and q_packed_manifest.json (configs,
    DSL/CUDA/C++ versions, arch, source hash). Carry the directory to the GPU host; the backends load it."""
    from pathlib import Path
    from .errors import UserError
    from .kernels.cute.manifest import DEFAULT_BUILD_DIR, DTYPES, KERNELS, SUPPORTED_ARCHS, library_configs
    from .kernels.cute.q_packed_library import BUILD_SETS, build_configs

    if arch not in SUPPORTED_ARCHS:
        raise UserError(f"--arch must be one of {', '.join(SUPPORTED_ARCHS)}, got {arch!r}")
    bad = [d for d in dtype if d not in DTYPES]
    if bad:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {bad[0]!r}")
    bad = [k for k in kernel if k not in KERNELS]
    if bad:
        raise UserError(f"--kernel must be one of {', '.join(KERNELS)}, got {bad[0]!r}")
    if q_packed not in BUILD_SETS:
        raise UserError(f"--q-packed must be one of {', '.join(BUILD_SETS)}, got {q_packed!r}")
    dtypes = tuple(dtype) or DTYPES
    where = Path(out) if out else DEFAULT_BUILD_DIR
    if kv_outer:
        from .kernels.cute.build import build_all
        summary = build_all(library_configs(dtypes, tuple(kernel) or None), where, arch, log=typer.echo)
        typer.echo(f"wrote {summary['manifest']} ({len(summary['libraries'])} libraries, {summary['seconds']} s)")
    q_configs = build_configs(q_packed, dtypes)
    if q_configs:
        from .kernels.cute.q_packed_build import build_all as build_q_packed
        summary = build_q_packed(q_configs, where, arch, log=typer.echo)
        typer.echo(f"wrote {summary['manifest']} ({len(summary['libraries'])} libraries, {summary['seconds']} s)")


# ---- harness: sweep, report, compare, merge ----------------------------------------------------
def _split(text: str | None, name: str, kind=str) -> list | None:
    """'0.25,1,4' -> [0.25, 1.0, 4.0]; None stays None."""
    if text is None:
        return None
    from .errors import UserError
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UserError(f"--{name} is empty")
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise UserError(f"--{name} must be a comma-separated list of {kind.__name__} values, got {text!r}") from None


@app.command()
def sweep(
    scenario: str = typer.Option(None, help="Scenario name (see `msa-bench scenarios`) or a TOML file. Default: "
                                            "`default` on a GPU, `smoke` on a CPU."),
    reuse: str = typer.Option(None, help="Override reuse nsb/N, comma-separated (e.g. 0.25,1,4)."),
    tokens: str = typer.Option(None, help="Override query tokens N, comma-separated."),
    context: str = typer.Option(None, help="Override context length in tokens, comma-separated."),
    skew: str = typer.Option(None, help="Override selection skew (Zipf exponent, 0 = uniform), comma-separated."),
    dtype: str = typer.Option(None, help="Override data dtypes, comma-separated: bf16, fp8, fp16, fp32."),
    backend: str = typer.Option(None, help="Override backends, comma-separated (e.g. kv-outer,flashinfer,msa-scatter). kv-outer-cute@KERNEL runs that CuTe kernel (e.g. kv-outer-cute@v23) in every dtype instead of each dtype's default; @KERNEL+ORDER (or @ORDER) also sets the scheduler's tile order: phases (CTAs walk one KV head at a time), S:p (S query ranges per head, dealt in phases) or S:k (dealt in chunks of k tiles)."),
    causal: bool = typer.Option(None, "--causal/--no-causal", help="Override causal (chunked prefill) or not."),
    generator: str = typer.Option(None, help="Override the selection generator."),
    out: str = typer.Option(None, help="Run folder (default results/runs/<scenario>-<UTC time>)."),
    resume: bool = typer.Option(False, help="Continue the run in --out, skipping finished (point, backend) units."),
    shard: str = typer.Option(None, help="Run slice i/n of the points (0-based i), e.g. 0/4; join with `msa-bench merge`."),
    counters: bool = typer.Option(False, help="Also collect ncu counters per stage (DRAM and L2 bytes, tensor-pipe "
                                              "instructions, kernel time); needs a GPU and ncu."),
    reps: int = typer.Option(None, help="Timed repetitions per stage (GPU: at least this many CUDA-graph replays; "
                                        "CPU: host-timed runs)."),
):
    """Check every backend against the reference, then time each stage and the whole module per point
    (CUDA-graph replay, cold L2; seconds), with NVML telemetry and optional ncu counters. Each finished
    (point, backend) is written at once; --resume continues an interrupted run."""
    from .harness.sweep import SweepRequest, run_sweep
    req = SweepRequest(scenario=scenario, reuse=_split(reuse, "reuse", float), tokens=_split(tokens, "tokens", int),
                       context=_split(context, "context", int), skew=_split(skew, "skew", float),
                       dtypes=_split(dtype, "dtype"), backends=_split(backend, "backend"), causal=causal,
                       generator=generator, out=out, resume=resume, shard=shard, counters=counters, reps=reps,
                       argv=list(sys.argv))
    summary = run_sweep(req)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(summary.counts.items())) or "no units"
    typer.echo(f"run folder: {summary.run_dir}  ({counts}"
               + (f"; {summary.skipped} were already done" if summary.skipped else "") + ")")
    for key, name, reason in summary.failures[:20]:
        typer.echo(f"  not timed: {name} at {key}: {reason}")
    if len(summary.failures) > 20:
        typer.echo(f"  ... and {len(summary.failures) - 20} more (see the status table)")
    for note in summary.notes:
        typer.echo(f"note: {note}")
    typer.echo(f"next: msa-bench report {summary.run_dir}")


@app.command()
def report(
    run: str = typer.Argument(..., help="Run folder written by `msa-bench sweep` or `msa-bench merge`."),
    out: str = typer.Option(None, help="Output folder for the PNGs and summary.md (default RUN/report)."),
    device: str = typer.Option(None, help="Roofline device profile (b200, h100, h200 or a JSON); default: the "
                                          "profile matching the run's GPU, none for a CPU run."),
):
    """Plots (TFLOP/s vs reuse with roofline curves and crossovers, stacked per-stage latency, measured vs
    model bytes) and a Markdown summary of a run."""
    from .harness.report import write_report
    from .roofline.devices import load_device
    path = write_report(run, out, load_device(device) if device else None)
    typer.echo(f"wrote {path}")


@app.command()
def compare(
    baseline: str = typer.Argument(..., help="Baseline run folder."),
    new: str = typer.Argument(..., help="New run folder."),
    max_regression: str = typer.Option("5%", help="Slowdown of the median beyond which a statistically "
                                                  "distinguishable point counts as a regression (5% or 0.05)."),
    counter_tolerance: str = typer.Option("2%", help="Relative change of bytes moved (ncu) tolerated."),
    show_all: bool = typer.Option(False, "--all", help="List every compared point, not only the changes."),
):
    """Regression gate: exit 1 if any point is slower by more than --max-regression AND distinguishable from
    the baseline's raw samples (Mann-Whitney U p < 0.05 or disjoint IQRs), or moves more bytes, or now
    fails; exit 2 on unusable input; 0 otherwise. Improvements are listed too."""
    from rich.console import Console
    from rich.table import Table

    from .harness.compare import IMPROVEMENT, REGRESSION, compare_runs, parse_threshold
    from .harness.results import load_run
    threshold = parse_threshold(max_regression)
    tol = parse_threshold(counter_tolerance, "--counter-tolerance")
    result = compare_runs(load_run(baseline), load_run(new), threshold, tol)
    console = Console(width=None if sys.stdout.isatty() else 220)   # logs and CI: do not truncate rows
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    shown = result.findings if show_all else result.of(REGRESSION) + result.of(IMPROVEMENT)
    if shown:
        table = Table(title=f"{new} vs {baseline}")
        for col in ("verdict", "backend", "dtype", "stage", "what", "baseline", "new", "new/base", "p", "point"):
            table.add_column(col)
        for f in shown:
            color = {"regression": "red", "improvement": "green"}.get(f.verdict, "")
            fmt = (lambda v: f"{v * 1e6:.2f} µs") if f.kind == "time" else (lambda v: f"{v:.4g}")
            table.add_row(f"[{color}]{f.verdict}[/]" if color else f.verdict, f.backend, f.dtype, f.stage, f.kind,
                          fmt(f.baseline), fmt(f.new), f"{f.ratio:.3f}", "" if f.p_value is None else f"{f.p_value:.3g}",
                          f.note or f.point_key)
        console.print(table)
    n_reg, n_imp = len(result.of(REGRESSION)), len(result.of(IMPROVEMENT))
    console.print(f"{len(result.findings)} compared: {n_reg} regression(s), {n_imp} improvement(s) "
                  f"(threshold {threshold:.1%}, counters {tol:.1%})")
    if result.regressed:
        raise typer.Exit(1)


@app.command()
def merge(
    out: str = typer.Argument(..., help="New run folder to write."),
    shards: list[str] = typer.Argument(..., help="Run folders of `sweep --shard i/n`."),
    force: bool = typer.Option(False, help="Merge shards of different scenarios, grids, GPUs or timers anyway."),
):
    """Join shard run folders into one run folder (refuses mixed scenarios or GPUs unless --force)."""
    from .harness.results import merge_runs
    summary = merge_runs(out, shards, force=force)
    typer.echo(f"merged {len(shards)} shard(s) into {out}: {summary['units']} units"
               + (f", {summary['duplicates']} duplicate(s) skipped" if summary["duplicates"] else "")
               + (f", {len(summary['missing'])} unit(s) of the grid still missing" if summary["missing"] else ""))


# ---- calibrate (device ceilings -> profile JSON) ---------------------------------------------------
@app.command()
def calibrate(
    out: str = typer.Option("", help="Output folder for profile.json and the bandwidth plot (default: results/calibration/<gpu>)."),
    quick: bool = typer.Option(False, help="Smaller buffers and fewer repetitions (a smoke test; the profile is less exact)."),
    name: str = typer.Option("", help="Profile name (default: <gpu>-calibrated)."),
):
    """Measure this GPU's HBM read and copy bandwidth, the L2 read plateau (working-set sweep) and the bf16/fp8
    matmul peaks, then write a device profile for `msa-bench roofline --device PROFILE.json` and a PNG of
    bandwidth versus working set. Needs a CUDA GPU; about a minute on an H200."""
    from pathlib import Path
    from .errors import require_cuda
    require_cuda("msa-bench calibrate")
    from .roofline.calibrate import calibrate as run
    import torch
    folder = Path(out) if out else Path("results/calibration") / torch.cuda.get_device_name().lower().replace("nvidia", "").strip().replace(" ", "-")
    result = run(folder, quick=quick, name=name or None, log=typer.echo)
    p = result["profile"]
    typer.echo(f"wrote {result['profile_path']} (hbm {p.hbm_bytes_per_s / 1e12:.2f} TB/s, l2 {p.l2_bytes_per_s / 1e12:.2f} TB/s, "
               f"bf16 {p.mma_flops['bf16'] / 1e12:.0f} / fp8 {p.mma_flops['fp8'] / 1e12:.0f} TFLOP/s) and {result['png_path']} "
               f"in {result['seconds']:.0f} s")


def main() -> None:
    """Console entry point: user errors become one line on stderr and a non-zero exit."""
    from .errors import BackendUnavailable, UserError
    try:
        code = app(standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (UserError, BackendUnavailable) as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # click's own usage errors and anything unexpected: still one line
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # click/typer usage errors
            exc.show()
            sys.exit(exc.exit_code)
        if type(exc).__name__ == "Abort":
            sys.exit(1)
        typer.echo(f"error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
