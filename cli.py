"""The `msa-bench` command line: parse, call, print. Logic lives in harness/, kernels/ and roofline/."""
from __future__ import annotations

import sys

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Benchmark and roofline analysis of top-k block-sparse attention: KV-outer, token-packed Q-outer, "
         "their hybrid and the per-workload pick (auto), FlashInfer's Q-outer and packed paths, MSA-style "
         "scatter and a dense cuDNN ceiling, side by side on one GPU against one L2/HBM roofline.",
)


@app.callback()
def _root() -> None:
    """Benchmark and roofline analysis of top-k block-sparse attention."""


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


# ---- commands are added below, one section per area -------------------------------------------


# ---- workloads and scenarios (selection generators, statistics, shipped scenario files) -------
SERVING_HELP = {
    "query_tokens": "Query tokens per decode request, 1 to 4 (decode, mixed). Default 1.",
    "context_min": "Decode contexts are drawn uniformly from [--context-min, --context] tokens (decode, mixed). "
                   "Default: --context (fixed).",
    "chunks": "Prefill chunks of --tokens tokens in the step (mixed). Default 1.",
    "drift": "Probability (0 to 1) that a token replaces each history block of its predecessor's selection "
             "(drift, where it is needed; decode, mixed). Neighbour Jaccard is about (1 - p) / (1 + p). "
             "Default (decode, mixed): every token draws afresh.",
}
TRACE_HELP = ("A selection trace (docs/trace-format.md; scenarios/traces/example.safetensors is a synthetic "
              "one): run its calls instead of a generator's workload, each at the trace's shape.")
CALLS_HELP = "The trace's calls to take, by id: ranges and ids such as 0-7,12. Default: every call."


def _trace_alone(given: dict) -> None:
    """--trace brings its own selections and shape: a generator's option beside it is refused."""
    from .errors import UserError
    for option, value in given.items():
        if value is not None:
            raise UserError(f"{option} does not apply to --trace (the trace holds the selections and their shape)")


DEVICE_HELP = ("Roofline device profile: b200, h100, h200 (that GPU's calibration where one is found, else its "
               "preset) or a PROFILE.json from `msa-bench calibrate`. Default: this GPU's calibration "
               "(results/<gpu>/calibration/profile.json), else its preset with unit fractions (said in one line); "
               "without a GPU, h200.")


@app.command()
def workload(
    generator: str = typer.Option("synthetic", help="synthetic (hits a target reuse), real-prefill (an MSA production "
                                                   "prefill case, see --case), indexer (top-k by query . mean-pooled "
                                                   "keys of structured Q/K; draws the tensors, so it is slower), "
                                                   "decode (--requests of --query-tokens each), mixed (--chunks "
                                                   "prefill chunks of --tokens plus --requests decode requests) or "
                                                   "drift (a causal chunk of --tokens, --drift p)."),
    reuse: float = typer.Option(None, help="Target reuse nsb/N for synthetic: distinct selected (KV head, block) pairs "
                                           "per query token. At most Hkv x context blocks / N and Hkv x topk. "
                                           "Default 0.25.", show_default=False),
    tokens: int = typer.Option(None, help="N query tokens (synthetic, indexer), or the prefill chunk's (mixed, "
                                          "drift). Default 16384.", show_default=False),
    context: int = typer.Option(None, help="Context length in tokens, i.e. context / --block blocks (synthetic, "
                                           "indexer, the chunk's for mixed and drift, the longest for decode). "
                                           "Default 131072.", show_default=False),
    requests: int = typer.Option(None, help="Decode requests (decode, mixed; needed there).", show_default=False),
    query_tokens: int = typer.Option(None, help=SERVING_HELP["query_tokens"], show_default=False),
    context_min: int = typer.Option(None, help=SERVING_HELP["context_min"], show_default=False),
    chunks: int = typer.Option(None, help=SERVING_HELP["chunks"], show_default=False),
    drift: float = typer.Option(None, help=SERVING_HELP["drift"], show_default=False),
    skew: float = typer.Option(None, help="Zipf exponent of block popularity for synthetic (0: uniform). Default 0.",
                               show_default=False),
    causal: bool = typer.Option(None, "--causal/--no-causal", help="Chunked causal prefill (synthetic, indexer): the N "
                                "queries are the context's last N tokens and each query's own block is its last "
                                "selected block. Default: not causal.", show_default=False),
    share: float = typer.Option(None, help="Co-selection for synthetic: the fraction (0 to 1) of its top-k each group "
                                           "of --share-group consecutive tokens shares; the rest each token draws on "
                                           "its own (sets union_ratio at P = group). Default: not co-selected.",
                                show_default=False),
    share_group: int = typer.Option(None, help="Tokens per co-selection group (with --share). Default 8.",
                                    show_default=False),
    case: str = typer.Option(None, "--case", help="MSA prefill case id for real-prefill, e.g. prefill_c17ccf7fbbb5d1ee5648 "
                                                  "(`msa-bench scenarios --cases` lists them)."),
    dtype: str = typer.Option("bf16", help="Data type: bf16, fp8 (e4m3), fp16 or fp32."),
    seed: int = typer.Option(None, help="Seed of the selection (synthetic, indexer) and the tensors, in [0, 2^63). "
                                        "Default 0.", show_default=False),
    device: str = typer.Option(None, "--device", help=DEVICE_HELP, show_default=False),
    hq: int = typer.Option(64, help="Query heads."),
    hkv: int = typer.Option(4, help="KV heads (must divide --hq)."),
    head_dim: int = typer.Option(128, help="Head dimension D (elements)."),
    block: int = typer.Option(128, help="KV block size in tokens."),
    topk: int = typer.Option(16, help="Blocks each query keeps per KV head."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (achieved reuse under nsb_per_n; with "
                                 "--trace: the trace's shape, provenance and distributions, and each call's "
                                 "statistics under calls)."),
    trace: str = typer.Option(None, "--trace", help=TRACE_HELP + " Prints, per layer and over the trace, the "
                              "distributions (p10 / p50 / p90) of nsb/N, union_ratio at 8 and 16 tokens, neighbour "
                              "Jaccard and fan-in, then each call's predicted schedule and nearest synthetic point.",
                              show_default=False),
    calls: str = typer.Option(None, "--calls", help=CALLS_HELP, show_default=False),
):
    """Generate one workload's selection and print its statistics: reuse nsb/N, fan-in of queries per selected
    (KV head, block), co-selection (union_ratio: distinct blocks of a tile of P consecutive tokens over one
    token's, at P = 8 and 16), visible selected tokens, useful FLOPs and the roofline's predicted time per
    schedule. An option the generator does not use is refused, as in a scenario file. With --trace: the
    statistics of a captured trace's calls instead."""
    import json
    from .scenarios.grid import check_point_fits, make_workload, point_from_options
    from .scenarios.stats import prediction_rows, stat_rows, workload_stats
    from .scenarios.workload import AttnShape
    from .roofline.devices import resolve_profile

    if trace is not None or calls is not None:
        _trace_alone({"--generator": None if generator == "synthetic" else generator, "--reuse": reuse,
                      "--tokens": tokens, "--context": context, "--requests": requests,
                      "--query-tokens": query_tokens, "--context-min": context_min, "--chunks": chunks,
                      "--drift": drift, "--skew": skew, "--causal": causal, "--share": share,
                      "--share-group": share_group, "--case": case, "--seed": seed,
                      **{f"--{k.replace('_', '-')}": v for k, v in dict(hq=hq, hkv=hkv, head_dim=head_dim,
                                                                           block=block, topk=topk).items()
                         if v != getattr(AttnShape(), k)}})
        return _workload_trace(trace, calls, dtype, device, as_json)

    shape = AttnShape(hq=hq, hkv=hkv, head_dim=head_dim, block=block, topk=topk)
    point = point_from_options(generator, shape, dtype, tokens=tokens, context=context, reuse=reuse, skew=skew,
                               causal=causal, cases=case, seed=seed,
                               share=share, share_group=share_group, requests=requests, query_tokens=query_tokens,
                               context_min=context_min, chunks=chunks, drift=drift)
    choice = resolve_profile(device)
    choice.say(lambda line: typer.echo(line, err=True))
    profile = choice.required("msa-bench workload")
    check_point_fits(point, "cpu", with_tensors=False, partials=False)
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


def _workload_trace(trace: str | None, calls: str | None, dtype: str, device: str | None, as_json: bool) -> None:
    from .errors import UserError
    from .roofline.devices import resolve_profile
    from .roofline.dtypes import DType
    from .scenarios.trace import read_index, select_calls
    from .scenarios.trace_stats import call_stats, place, trace_json, trace_lines
    if trace is None:
        raise UserError("--calls needs --trace FILE")
    dtype = DType.parse(dtype)
    info = read_index(trace)
    entries = select_calls(info, calls)
    choice = resolve_profile(device)
    profile = choice.required("msa-bench workload")
    stats = [call_stats(info, e, dtype, profile) for e in entries]      # a bad call: its one line alone
    choice.say(lambda line: typer.echo(line, err=True))
    place(stats, info.shape, dtype)
    if as_json:
        import json
        typer.echo(json.dumps(trace_json(info, stats, profile.name, dtype)))
        return
    for line in trace_lines(info, stats, profile.name, dtype):
        typer.echo(line)


@app.command()
def scenarios(
    cases: bool = typer.Option(False, "--cases", help="List the real-prefill case ids instead (for "
                                                       "`msa-bench workload --generator real-prefill --case ID`)."),
):
    """List the shipped scenarios (grids of workloads: tokens, context in tokens, reuse = nsb/N, dtypes) with
    their one-line descriptions. Run one with `msa-bench sweep --scenario NAME`. --cases lists the shipped
    MSA prefill cases: id, query tokens, final context tokens, call weight."""
    from rich.console import Console
    from rich.table import Table
    from .scenarios.grid import list_scenarios, load_scenario
    from .errors import UserError

    if cases:
        from .scenarios.prefill_cases import load_cases
        table = Table(title="real-prefill cases (representative ones are in the real-prefill scenario)")
        for col in ("case id", "query tokens", "context tokens", "weight"):
            table.add_column(col, justify="left" if col == "case id" else "right")
        for c in sorted(load_cases().values(), key=lambda c: (-c.weight, c.total_q)):
            table.add_row(c.case_id, f"{c.total_q:,}", f"{c.max_final_kv:,}", f"{c.weight:g}")
        Console().print(table)
        return
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
                                         "where Triton's interpreter gets bf16 wrong).", show_default=False),
    generator: str = typer.Option("synthetic", help="Workload generator: synthetic, indexer, real-prefill (with "
                                                    "--case), decode, mixed or drift, as `msa-bench workload` takes "
                                                    "them."),
    tokens: int = typer.Option(None, help="N query tokens (default: 40 on CPU, 4096 on a GPU).", show_default=False),
    context: int = typer.Option(None, help="Context length in tokens (default: 256 on CPU, 32768 on a GPU).",
                                 show_default=False),
    reuse: float = typer.Option(None, help="Target nsb/N (distinct selected (KV head, block) pairs per token; default 0.5 CPU, 0.25 GPU).",
                                show_default=False),
    causal: bool = typer.Option(None, "--causal/--no-causal", help="Chunked causal prefill: each query's own block is "
                                "its last selected block. Default: not causal.", show_default=False),
    share: float = typer.Option(None, help="Co-selection for synthetic: the fraction (0 to 1) of its top-k each group "
                                           "of --share-group consecutive tokens shares. Default: not co-selected.",
                                show_default=False),
    share_group: int = typer.Option(None, help="Tokens per co-selection group (with --share). Default 8.",
                                    show_default=False),
    case: str = typer.Option(None, "--case", help="MSA prefill case id for real-prefill (`msa-bench scenarios --cases` "
                                                  "lists them)."),
    requests: int = typer.Option(None, help="Synthetic: K requests instead of one (its tokens and context split "
                                            "over them, each on its own context length) on a scattered page table, "
                                            "with -1 padding, a hot block and, not causal, tokens that select "
                                            "nothing. Decode, mixed: the decode requests.",
                                 show_default=False),
    query_tokens: int = typer.Option(None, help=SERVING_HELP["query_tokens"], show_default=False),
    context_min: int = typer.Option(None, help=SERVING_HELP["context_min"], show_default=False),
    chunks: int = typer.Option(None, help=SERVING_HELP["chunks"], show_default=False),
    drift: float = typer.Option(None, help=SERVING_HELP["drift"], show_default=False),
    seed: int = typer.Option(None, help="Seed of the selection and the tensors. Default 0.", show_default=False),
    hq: int = typer.Option(None, help="Query heads (default: 8 on CPU, 64 on a GPU).", show_default=False),
    hkv: int = typer.Option(None, help="KV heads (default: 2 on CPU, 4 on a GPU).", show_default=False),
    head_dim: int = typer.Option(None, help="Head dimension (default: 32 on CPU, 128 on a GPU).", show_default=False),
    block: int = typer.Option(None, help="KV block size in tokens (default: 16 on CPU, 128 on a GPU).", show_default=False),
    topk: int = typer.Option(None, help="Blocks kept per query and KV head (default: 4 on CPU, 16 on a GPU).",
                              show_default=False),
    device: str = typer.Option(None, "--device", help="Profile `auto` plans with. " + DEVICE_HELP,
                               show_default=False),
    trace: str = typer.Option(None, "--trace", help=TRACE_HELP + " Checks each call in turn; exit 1 if one "
                              "fails.", show_default=False),
    calls: str = typer.Option(None, "--calls", help=CALLS_HELP, show_default=False),
):
    """Run one backend on one workload (synthetic by default; indexer, a real-prefill case, or K requests of
    edge cases), compare with the float64 reference (sampled rows when N > 512) and print per-stage checks;
    the maximum relative error is printed last. Exit 0 only within tolerance (fp32 1e-5, fp16/bf16 1e-2, fp8
    5e-2). An option the generator does not use is refused. Without a GPU the Triton kernels run in the CPU
    interpreter."""
    from .harness.measure.check import CPU_SHAPE, check_fits_here, check_point, describe, plan_lines, run_check
    from .scenarios.grid import SERVING
    from .errors import UserError
    from .roofline.dtypes import DType
    from .scenarios.workload import AttnShape

    import os
    import torch
    from .roofline.devices import PRESETS, PROFILE_ENV, resolve_profile
    on_gpu = torch.cuda.is_available()
    if device:
        resolve_profile(device, None)               # a bad --device is refused before anything runs
        os.environ[PROFILE_ENV] = device.lower() if device.lower() in PRESETS else os.path.abspath(device)
    dtype = DType.parse(dtype or ("bf16" if on_gpu else "fp16"))
    if trace is not None or calls is not None:
        _trace_alone({"--generator": None if generator == "synthetic" else generator, "--tokens": tokens,
                      "--context": context, "--reuse": reuse, "--causal": causal, "--share": share,
                      "--share-group": share_group, "--case": case, "--requests": requests,
                      "--query-tokens": query_tokens, "--context-min": context_min, "--chunks": chunks,
                      "--drift": drift, "--hq": hq, "--hkv": hkv, "--head-dim": head_dim, "--block": block,
                      "--topk": topk})
        return _check_trace(backend, trace, calls, dtype, seed or 0)
    for name, value in (("tokens", tokens), ("context", context), ("hq", hq), ("hkv", hkv), ("head-dim", head_dim),
                        ("block", block), ("topk", topk)):
        if value is not None and value <= 0:
            raise UserError(f"--{name} must be positive, got {value}")
    base = AttnShape() if on_gpu else CPU_SHAPE
    shape = AttnShape(hq=hq or base.hq, hkv=hkv or base.hkv, head_dim=head_dim or base.head_dim,
                      block=block or base.block, topk=topk or base.topk)
    point = check_point(generator, shape, dtype, requests, on_gpu, tokens=tokens, context=context, reuse=reuse,
                        causal=causal, cases=case, seed=seed, query_tokens=query_tokens, context_min=context_min,
                        chunks=chunks, drift=drift, share=share, share_group=share_group)
    if point.generator in SERVING:           # --requests counted the decode requests of the point itself
        requests = None
    check_fits_here(point, requests, "cuda" if on_gpu else "cpu")
    w, (err, tol, details) = run_check(backend, point, requests)
    s = w.shape
    typer.echo(f"{backend} {dtype} on {w.device}: N={w.n_tokens} Hq={s.hq} Hkv={s.hkv} D={s.head_dim} "
               f"block={s.block} topk={s.topk} {describe(point, requests)}; compared {details['rows']} rows")
    typer.echo("plan:")
    for line in plan_lines(details["info"]):
        typer.echo(line)
    from .kernels.auto import AUTO_RECORD, auto_line
    if AUTO_RECORD in details["info"]:
        typer.echo(auto_line(details["info"]))
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


def _check_trace(backend: str, trace: str | None, calls: str | None, dtype: str, seed: int) -> None:
    """check on every chosen call of a trace: one line each, the largest error last."""
    import torch
    from .errors import UserError
    from .harness.measure.check import check_fits_here, run_check, tolerance
    from .scenarios.grid import trace_point
    from .scenarios.trace import read_index, select_calls
    from .scenarios.trace_workload import check_calls
    if trace is None:
        raise UserError("--calls needs --trace FILE")
    info = read_index(trace)
    entries = select_calls(info, calls)
    check_calls(info, entries)
    points = [trace_point(info, e, dtype, seed) for e in entries]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for p in points:
        check_fits_here(p, None, device)
    s, worst, failed = info.shape, 0.0, []
    typer.echo(f"{backend} {dtype} on {device}: trace {info.path}, {len(points)} call(s), Hq={s.hq} Hkv={s.hkv} "
               f"D={s.head_dim} block={s.block} topk={s.topk}")
    for p in points:
        w, (err, tol, details) = run_check(backend, p)
        bad = [stage for stage, (ok, _) in details.get("stage_checks", {}).items() if not ok]
        ok = err <= tol and not bad
        worst = max(worst, err)
        if not ok:
            failed.append(p.call)
        typer.echo(f"  call {p.call:>4} layer {p.layer:>3}: N={w.n_tokens} requests={w.page_table.shape[0]} "
                   f"compared {details['rows']} rows, rel err {err:.3e}"
                   + ("" if ok else " FAIL" + (f" ({', '.join(bad)})" if bad else "")))
    tol = tolerance(dtype)
    typer.echo(f"max relative error {worst:.3e} (tol {tol:g}): "
               + ("PASS" if not failed else f"FAIL (calls {', '.join(map(str, failed))})"))
    if failed:
        raise typer.Exit(1)


# ---- roofline ---------------------------------------------------------------------------------
@app.command()
def roofline(
    device: str = typer.Option(None, help=DEVICE_HELP, show_default=False),
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
    from .roofline.dtypes import DType
    from .roofline.model import ModelShape
    from .roofline.summary import roofline_summary

    for name, value in (("hq", hq), ("hkv", hkv), ("head-dim", head_dim), ("block", block), ("topk", topk), ("tokens", tokens)):
        if value <= 0:
            raise UserError(f"--{name} must be positive, got {value}")
    if hq % hkv:
        raise UserError(f"--hq ({hq}) must be a multiple of --hkv ({hkv})")
    dtype = DType.parse(dtype, "--dtype", (DType.FP8, DType.BF16))
    partial_dtype = DType.parse(partial_dtype, "--partial-dtype", (DType.BF16, DType.FP8))
    from .roofline.devices import resolve_profile
    choice = resolve_profile(device)
    choice.say(lambda line: typer.echo(line, err=True))
    prof = choice.required("msa-bench roofline")
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
    dispatch: bool = typer.Option(True, help="Build the C++ dispatch library (kv-outer-cute@op; needs nvcc)."),
    q_packed: str = typer.Option("default", help="q-packed-cute libraries to build: default (each dtype's default "
                                                 "options), all (every option set: plain, pp, sa, pp+sa), none."),
):
    """Compile the CuTe DSL attention stages for every configuration the sweep can ask for (no GPU needed):
    each kv-outer kernel of kernels/cute/manifest.KERNELS in each of its dtypes, and the q-packed-cute
    configurations, one shared library per configuration, with manifest.json (configs, DSL/CUDA/C++
    versions, arch, source hash); and the C++ dispatch library beside them (build/dispatch). Carry the
    build directory to the GPU host; the backends load it."""
    from pathlib import Path
    from .errors import UserError
    from .roofline.dtypes import DType
    from .kernels.cute.manifest import (DEFAULT_BUILD_DIR, DTYPES, KERNELS, Q_PACKED_SETS, SUPPORTED_ARCHS,
                                        library_configs, q_packed_configs)

    if arch not in SUPPORTED_ARCHS:
        raise UserError(f"--arch must be one of {', '.join(SUPPORTED_ARCHS)}, got {arch!r}")
    dtype = [DType.parse(d, "--dtype", DTYPES) for d in dtype]
    bad = [k for k in kernel if k not in KERNELS]
    if bad:
        raise UserError(f"--kernel must be one of {', '.join(KERNELS)}, got {bad[0]!r}")
    if q_packed not in Q_PACKED_SETS:
        raise UserError(f"--q-packed must be one of {', '.join(Q_PACKED_SETS)}, got {q_packed!r}")
    dtypes = tuple(dtype) or DTYPES
    configs = (library_configs(dtypes, tuple(kernel) or None) if kv_outer else []) + q_packed_configs(q_packed, dtypes)
    if configs:
        from .kernels.cute.build import build_all
        summary = build_all(configs, Path(out) if out else DEFAULT_BUILD_DIR, arch, log=typer.echo)
        typer.echo(f"wrote {summary['manifest']} ({len(summary['libraries'])} libraries, {summary['seconds']} s)")
    if dispatch:
        import time
        from .kernels.dispatch.build import build
        start = time.perf_counter()
        path = build(Path(out).parent / "dispatch" if out else None)
        typer.echo(f"wrote {path} ({time.perf_counter() - start:.0f} s)")


# ---- harness: sweep, report, compare, merge ----------------------------------------------------
def _split(text: str | None, name: str, kind=str) -> list | None:
    """'0.25,1,4' -> [0.25, 1.0, 4.0]; None stays None."""
    if text is None:
        return None
    from .errors import UserError
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        raise UserError(f"--{name} is empty")
    if not all(items):
        raise UserError(f"--{name} has an empty item in {text!r}")
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise UserError(f"--{name} must be a comma-separated list of {kind.__name__} values, got {text!r}") from None


CPU_SCENARIO, CPU_SCENARIO_TIME = "smoke", "under a minute on 2 cores"


def _gpu_scenario_on_cpu(scenario: str | None, cpu_ok: bool) -> None:
    """A shipped scenario other than smoke, without a GPU: refused before anything runs, or with --cpu-ok
    run after a warning. A scenario file is the user's own sizing and runs as given."""
    import torch
    from .errors import UserError
    from .scenarios.grid import shipped_names
    if scenario in (None, CPU_SCENARIO) or scenario not in shipped_names() or torch.cuda.is_available():
        return
    smoke = f"`msa-bench sweep --scenario {CPU_SCENARIO}` ({CPU_SCENARIO_TIME})"
    if not cpu_ok:
        raise UserError(f"scenario {scenario!r} is sized for a GPU and would run for hours on this machine, which "
                        f"has none: run {smoke}, or pass --cpu-ok to run it anyway")
    typer.echo(f"warning: no GPU here: {scenario!r} will run for hours in Triton's interpreter; {smoke} shows "
               "the pipeline working", err=True)


@app.command()
def sweep(
    scenario: str = typer.Option(None, help="Scenario name (see `msa-bench scenarios`) or a TOML file. Default: "
                                            "`default` on a GPU, `smoke` on a CPU."),
    reuse: str = typer.Option(None, help="Override reuse nsb/N, comma-separated (e.g. 0.25,1,4)."),
    tokens: str = typer.Option(None, help="Override query tokens N, comma-separated."),
    context: str = typer.Option(None, help="Override context length in tokens, comma-separated."),
    skew: str = typer.Option(None, help="Override selection skew (Zipf exponent, 0 = uniform), comma-separated."),
    dtype: str = typer.Option(None, help="Override data dtypes, comma-separated: bf16, fp8, fp16, fp32."),
    backend: str = typer.Option(None, help="Override backends, comma-separated (e.g. kv-outer,flashinfer,msa-scatter). kv-outer-cute@KERNEL runs that CuTe kernel (e.g. kv-outer-cute@v23) in every dtype instead of each dtype's default; @KERNEL+ORDER (or @ORDER) also sets the scheduler's tile order: phases (CTAs walk one KV head at a time), S:p (S query ranges per head, dealt in phases) or S:k (dealt in chunks of k tiles). Any backend takes a planted delay as the option's last part: NAME@delay5 or NAME@v28+delay5 adds a stage costing 5 % of the module (a known regression for the gate)."),
    causal: bool = typer.Option(None, "--causal/--no-causal", help="Override causal (chunked prefill) or not."),
    generator: str = typer.Option(None, help="Override the selection generator."),
    share: str = typer.Option(None, help="Override co-selection (synthetic), comma-separated: the fraction (0 to 1) of "
                                         "its top-k each group of --share-group tokens shares."),
    share_group: str = typer.Option(None, help="Override tokens per co-selection group (with --share), "
                                               "comma-separated. Default 8."),
    out: str = typer.Option(None, help="Run folder (default results/runs/<scenario>-<UTC time>; with --resume: the "
                                       "latest unfinished run of the same options there)."),
    resume: bool = typer.Option(False, help="Continue an interrupted run (--out, or the latest unfinished one), "
                                            "skipping finished (point, backend) units and redoing damaged ones."),
    shard: str = typer.Option(None, help="Run slice i/n of the points (0-based i), e.g. 0/4; join with `msa-bench merge`."),
    counters: bool = typer.Option(False, help="Also collect ncu counters per stage (DRAM and L2 bytes, tensor-pipe "
                                              "instructions, kernel time); needs a GPU and ncu."),
    reps: int = typer.Option(None, help="Timed repetitions per stage (GPU: at least this many CUDA-graph replays; "
                                        "CPU: host-timed module runs). Default: the scenario's timing.reps, "
                                        "else 20 on a GPU, 5 on a CPU.", show_default=False),
    cpu_ok: bool = typer.Option(False, "--cpu-ok", help="Run a shipped GPU scenario on a machine without a GPU "
                                                        "anyway (hours in Triton's interpreter)."),
    timer: str = typer.Option("graph", help="graph: each stage and the module replayed from a CUDA graph (the "
                                            "device's time). eager: the module as an engine without graphs runs "
                                            "it, the stages launched from Python: seconds of host wall-clock from "
                                            "the first launch to completion, each stage's launch (host) and gap "
                                            "(device idle before it) beside its device time, and the plan's "
                                            "per-step host work as stage plan_step. The run records the timer; "
                                            "compare never mixes timers."),
    rounds: int = typer.Option(None, help="With --timer eager: a point's units take their samples in this many "
                                          "interleaved rounds (each round every backend takes its share, in an "
                                          "order rotated each round), so that all of them are timed across the "
                                          "same stretch of host time; every plan of a point is held at once. "
                                          "Default: the scenario's timing.rounds, else 1 (each unit alone, in "
                                          "turn).", show_default=False),
    gpus: str = typer.Option(None, help="One worker process per GPU, dealt units from one queue into one run folder: "
                                        "all, N (the first N) or a list of indices (0,2; one GPU: 3,). Indices as "
                                        "CUDA numbers them under CUDA_VISIBLE_DEVICES. GPUs of different models are "
                                        "refused. Without a GPU, N CPU workers. Default: this process, one GPU.",
                             show_default=False),
    device: str = typer.Option(None, "--device", help="Profile `auto` plans with and the run's model columns use "
                               "(recorded in run.json). " + DEVICE_HELP, show_default=False),
    trace: str = typer.Option(None, "--trace", help=TRACE_HELP + " The scenario gives the backends, dtypes and "
                              "timing; the trace gives the points.", show_default=False),
    calls: str = typer.Option(None, "--calls", help=CALLS_HELP, show_default=False),
):
    """Time each stage and the whole module per point and backend (CUDA-graph replay, or launched from Python
    with --timer eager; cold L2; seconds), with NVML telemetry and optional ncu counters, and check the
    output of the timed runs against the float64 reference (a unit that disagrees fails; its timings are
    discarded). Each finished (point, backend) is written at once; on Ctrl-C or SIGTERM the folder and the command that resumes it are printed.
    Exit 0 when every unit ran or is unavailable here, 1 when a unit failed (listed) or every --gpus worker
    died, 2 on bad input or a point that cannot fit in memory (refused before anything runs), 130 when
    interrupted (Ctrl-C), 143 when terminated (SIGTERM, as `timeout` and job schedulers send)."""
    from .harness.running.sweep import SweepInterrupted, SweepRequest, run_sweep
    _gpu_scenario_on_cpu(scenario, cpu_ok)
    req = SweepRequest(scenario=scenario, reuse=_split(reuse, "reuse", float), tokens=_split(tokens, "tokens", int),
                       context=_split(context, "context", int), skew=_split(skew, "skew", float),
                       dtypes=_split(dtype, "dtype"), backends=_split(backend, "backend"), causal=causal,
                       generator=generator, share=_split(share, "share", float),
                       share_group=_split(share_group, "share-group", int), trace=trace, calls=calls, out=out,
                       resume=resume, shard=shard, counters=counters, reps=reps,
                       timer=None if timer == "graph" else timer, rounds=rounds, gpus=gpus, device=device,
                       argv=list(sys.argv))
    try:
        summary = run_sweep(req)
    except SweepInterrupted as exc:
        typer.echo(f"{exc}\nresume with: {exc.resume}", err=True)
        raise typer.Exit(exc.exit_code)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(summary.counts.items())) or "no units"
    typer.echo(f"run folder: {summary.run_dir}  ({counts}"
               + (f"; {summary.skipped} were already done" if summary.skipped else "") + ")")
    for (name, reason), n in sorted(summary.unavailable.items()):
        typer.echo(f"  unavailable here ({n} unit{'s' if n > 1 else ''}): {reason}")
    for key, name, reason in summary.failures[:20]:
        typer.echo(f"  FAILED: {name} at {key}: {reason}")
    if len(summary.failures) > 20:
        typer.echo(f"  ... and {len(summary.failures) - 20} more failed (status.json of each unit)")
    for note in summary.late_notes:
        typer.echo(f"note: {note}")
    typer.echo(f"next: msa-bench report {summary.run_dir}")
    if summary.failures:
        typer.echo(f"error: {len(summary.failures)} unit(s) failed", err=True)
        raise typer.Exit(1)


@app.command()
def report(
    run: str = typer.Argument(..., help="Run folder written by `msa-bench sweep` or `msa-bench merge`."),
    out: str = typer.Option(None, help="Output folder for the PNGs and summary.md (default RUN/report)."),
    device: str = typer.Option(None, help="Roofline device profile (b200, h100, h200 or a JSON); default: the "
                                          "profile the run recorded (run.json provenance), else its GPU's "
                                          "calibration or preset, none for a CPU run."),
    figures: bool = typer.Option(True, help="Draw the PNGs; --no-figures writes summary.md's tables alone."),
    beside: str = typer.Option(None, help="A run of the same points timed by the other timer on the same GPU "
                                          "(sweep --timer graph | eager): summary.md sets each unit's module "
                                          "time under both side by side (microseconds: graph, eager, "
                                          "eager/graph).", show_default=False),
):
    """Plots (TFLOP/s vs reuse with roofline curves and crossovers, stacked per-stage latency, measured vs
    model bytes) and a Markdown summary of a run. A run that is not complete is reported from the units it
    has (exit 0), with a warning that says how many are missing and the command that resumes it."""
    from .harness.report.summary import write_report
    from .roofline.devices import resolve_profile
    path = write_report(run, out, resolve_profile(device, None).profile if device else None,
                        warn=lambda line: typer.echo(f"warning: {line}", err=True), figures=figures, beside=beside)
    typer.echo(f"wrote {path}")


@app.command()
def compare(
    baseline: str = typer.Argument(..., help="Baseline run folder, or a baseline set: a folder whose "
                                             "sub-folders are K runs of one scenario and grid."),
    new: str = typer.Argument(..., help="New run folder."),
    max_regression: str = typer.Option("5%", help="Against one baseline run: the slowdown of the median beyond "
                                                  "which a distinguishable point regresses. Against a baseline "
                                                  "set: the slowdown the gate must catch; it flags at half of it "
                                                  "(5% or 0.05)."),
    counter_tolerance: str = typer.Option("2%", help="Relative change of bytes moved (ncu) tolerated."),
    clock: str = typer.Option("both", help="both (default): a change counts only if raw and normalize both "
                                          "see it (a stage bound by memory does not follow the clock, one "
                                          "bound by the SMs does); normalize: times at the GPU's max SM "
                                          "clock (per-sample clock x seconds / max); raw: measured times "
                                          "(every mode is raw where a run has no clocks); floor: drop "
                                          "samples clocked below --floor x their stage's highest sampled "
                                          "clock."),
    floor: float = typer.Option(0.97, help="--clock floor: the fraction of the stage's highest sampled clock "
                                           "below which a sample is dropped."),
    show_all: bool = typer.Option(False, "--all", help="List every compared point, not only the changes."),
    fmt: str = typer.Option("text", "--format", help="text: the terminal table; json: a document for tools "
                                                     "(schema in docs/harness.md); markdown: a pull-request "
                                                     "comment (verdict, regressions, improvements, noise band)."),
    output: str = typer.Option(None, help="Write the --format document to this file (stdout then shows the "
                                          "text table); json and markdown also on exit 2, saying why. The "
                                          "exit code stays the gate's. Default: stdout.", show_default=False),
    report_url: str = typer.Option(None, help="Link to the new run's figures in the markdown and JSON (e.g. "
                                              "the CI artifact). Default: NEW/report/ where `msa-bench report` wrote "
                                              "it, else the command that writes it.",
                                   show_default=False),
):
    """Regression gate. Exit 1 if any point is slower by more than --max-regression AND distinguishable from
    the baseline's raw samples (Mann-Whitney U p < 0.05 or disjoint IQRs), or moves more bytes, or now
    fails. Against a baseline set it flags at half --max-regression and must also be slower than the
    slowest of the K baseline run medians (the run-to-run spread, column `spread`). Exit 2 on unusable
    input: a missing or damaged run or unit, a set of mismatched grids, or a baseline unit the new run
    lacks or did not time. Exit 3 on an internal error. 0 otherwise. Host (CPU) timings are listed,
    never judged: on CPU runs only a unit that now fails is a regression. Times in microseconds."""
    import shutil
    from pathlib import Path

    from rich.console import Console

    from .errors import UserError
    from .harness.gate.baseline import CLOCK_MODES, load_baseline
    from .harness.gate.compare import compare_runs, parse_threshold
    from .harness.gate.compare_formats import FORMATS, exit_code, print_text, render, subject
    from .harness.store.results import load_run
    threshold = parse_threshold(max_regression)
    tol = parse_threshold(counter_tolerance, "--counter-tolerance")
    if clock not in CLOCK_MODES:
        raise UserError(f"--clock must be one of {', '.join(CLOCK_MODES)}, got {clock!r}")
    if not 0 < floor <= 1:
        raise UserError(f"--floor must be a fraction in (0, 1], got {floor}")
    if fmt not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")

    def emit(document: str) -> None:
        if output:
            Path(output).write_text(document)
        else:
            typer.echo(document, nl=False)
    try:
        bases = load_baseline(baseline)
        new_run = load_run(new)
        result = compare_runs(bases, new_run, threshold, tol, clock=clock, floor=floor)
    except UserError as exc:
        if fmt != "text":        # CI posts the document: it says why the gate could not judge
            emit(render(fmt, None, subject(baseline, new, report_url=report_url), error=str(exc)))
        raise
    sub = subject(baseline, new, new_run, report_url)
    if fmt == "text" or output:      # the table for a person: the terminal, or the CI log beside the file
        width = shutil.get_terminal_size((80, 24)).columns     # COLUMNS, else the terminal, else 80 (pipes, logs)
        print_text(result, sub, Console(width=width, soft_wrap=False), show_all)
    if fmt != "text" or output:
        emit(render(fmt, result, sub, show_all=show_all))
    raise typer.Exit(exit_code(result))


gate_app = typer.Typer(no_args_is_help=True, help="The regression gate's baseline set (docs/harness.md, "
                                                    "\"The gate\").")
app.add_typer(gate_app, name="gate")


@gate_app.command("baseline")
def gate_baseline(
    out: str = typer.Option(..., help="Set folder: the runs go to OUT/run-01 .. run-K, each sweep's log beside "
                                      "it. A complete run there is kept and an unfinished one resumed.",
                            show_default=False),
    runs: int = typer.Option(5, help="Separate sweeps (processes) in the set, 2 or more; 3 at least to judge "
                                     "by, 5 in the committed set."),
    scenario: str = typer.Option("gate-prefill", help="Scenario of the sweeps (name or TOML file)."),
    backend: str = typer.Option(None, help="Override backends, comma-separated, as `sweep --backend`. Default: "
                                           "the scenario's.", show_default=False),
    max_regression: str = typer.Option("5%", help="The slowdown the gate must catch, as `compare "
                                                  "--max-regression` (5% or 0.05)."),
    clock: str = typer.Option("both", help="Clock mode of the check, as `compare --clock`."),
):
    """Make a baseline set for `msa-bench compare` and check that it passes against itself.

    --runs separate `msa-bench sweep` runs, then each run judged against the others as `compare` judges a
    new run against the set. Exit 0 when
    every run passes against the rest; 1 when one regresses (the set cannot tell a change from its own
    noise: make it again, on a quieter GPU or with more runs); 2 on bad input or a sweep that did not
    finish (its log is named; the same command resumes)."""
    import shutil
    from dataclasses import replace

    from rich.console import Console

    from .errors import UserError
    from .harness.gate.baseline import CLOCK_MODES, sweep_set
    from .harness.gate.compare import REGRESSION, parse_threshold
    from .harness.gate.compare_formats import exit_code, print_text, subject
    from .harness.gate.gate_power import self_check
    from .harness.store.results import load_run
    threshold = parse_threshold(max_regression)
    if clock not in CLOCK_MODES:
        raise UserError(f"--clock must be one of {', '.join(CLOCK_MODES)}, got {clock!r}")
    if runs < 2:
        raise UserError(f"--runs must be 2 or more (each run is judged against the others), got {runs}")
    if not out.strip():
        raise UserError("--out is empty: name the set folder")
    sweep_args = ["--scenario", scenario] + (["--backend", backend] if backend else [])
    dirs = sweep_set(out, runs, sweep_args, say=typer.echo)
    loaded = [load_run(d) for d in dirs]
    results = self_check(loaded, threshold, clock)
    console = Console(width=shutil.get_terminal_size((80, 24)).columns, soft_wrap=False)
    for w in dict.fromkeys(w for r in results for w in r.warnings):
        typer.echo(f"warning: {w}")
    for d, r in zip(dirs, results):
        typer.echo(f"{d.name} against the other {runs - 1}: {len(r.findings)} compared, "
                   f"{len(r.of(REGRESSION))} regression(s)")
        if r.regressed:
            print_text(replace(r, warnings=[]), subject(f"the other runs of {out}", str(d)), console)
    failed = [d.name for d, r in zip(dirs, results) if exit_code(r)]
    if failed:
        typer.echo(f"error: {', '.join(failed)} regress against the rest of the set: it cannot tell a change from "
                   "its own noise; make it again (a quieter GPU, more runs)", err=True)
        raise typer.Exit(1)
    typer.echo(f"baseline set {out}: {runs} runs, each passes against the others")
    typer.echo(f"next: msa-bench compare {out} NEW")


@app.command()
def merge(
    out: str = typer.Argument(..., help="New run folder to write."),
    shards: list[str] = typer.Argument(..., help="Run folders of `sweep --shard i/n`."),
    force: bool = typer.Option(False, help="Merge shards of different scenarios, grids, GPUs or timers anyway, and "
                                           "folders that hold the same unit (the first folder's copy is kept)."),
):
    """Join shard run folders into one run folder. Refuses mixed scenarios or GPUs, damaged units, and a unit
    held by two folders, unless --force (then the first folder's copy of such a unit is kept, and said)."""
    from .harness.store.results import merge_runs
    summary = merge_runs(out, shards, force=force)
    typer.echo(f"merged {len(shards)} folder(s) into {out}: {summary['units']} units"
               + (f", {len(summary['missing'])} unit(s) of the grid still missing" if summary["missing"] else ""))
    if summary["duplicates"]:
        kept = sorted({a for _, a, _ in summary["duplicates"]})
        typer.echo(f"  {len(summary['duplicates'])} unit(s) were in more than one folder: kept the copies from "
                   f"{', '.join(kept)}, dropped the others")


@app.command()
def seal(
    runs: list[str] = typer.Argument(..., help="Run folders written before integrity records."),
):
    """Seal a run written before integrity records, once: check it as every reader does, then record the
    sha256 of each unit's files and of run.json's fields. Readers refuse an unsealed run, and any part that
    changed after it was sealed (an edit is refused here too, never resealed)."""
    from .harness.store.results import seal_run
    for run in runs:
        parts = seal_run(run)
        typer.echo(f"{run}: " + (f"sealed {parts} part(s)" if parts else "sealed already"))


@app.command()
def slurm(
    scenario: str = typer.Argument(..., help="Scenario name (see `msa-bench scenarios`) or a TOML file."),
    array: int = typer.Option(4, help="Shards: array tasks, each a `sweep --shard i/N` on its own GPU (or node)."),
    out: str = typer.Option(None, help="Run root on the cluster's shared file system: RUN/shards/<i>, RUN/merged, "
                                       "RUN/logs. Default: results/runs/<scenario>-slurm.", show_default=False),
    backend: str = typer.Option(None, help="Override backends, comma-separated, as `sweep --backend`."),
    dtype: str = typer.Option(None, help="Override data dtypes, comma-separated, as `sweep --dtype`."),
    gpus_per_shard: int = typer.Option(1, help="GPUs per array task; above 1 each task runs `sweep --gpus all` "
                                               "over its allocation."),
    baseline: str = typer.Option(None, help="Baseline run folder: the merge job ends with `msa-bench compare "
                                            "BASELINE RUN/merged` (the gate). Default: no gate.", show_default=False),
    script: str = typer.Option(None, help="Write the script to this file (default: print it)."),
):
    """Write an sbatch script that runs one sweep across hosts as a Slurm job array: `bash SCRIPT` submits
    ARRAY tasks (`sbatch --array=0-(ARRAY-1)`), each `msa-bench sweep --shard
    $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT`, and a merge job that waits for them and runs merge,
    report and, with --baseline, the gate. docs/harness.md has the walk-through."""
    from pathlib import Path
    from .errors import UserError
    from .harness.running.request import validate_backends
    from .harness.running.slurm import sbatch_script
    from .scenarios.grid import load_scenario, with_overrides

    if array < 1 or gpus_per_shard < 1:
        raise UserError("--array and --gpus-per-shard must be at least 1")
    backends, dtypes = _split(backend, "backend"), _split(dtype, "dtype")
    sc = load_scenario(scenario)
    overrides = {k: v for k, v in dict(backends=backends, dtypes=dtypes).items() if v is not None}
    grid = with_overrides(sc, **overrides) if overrides else sc
    validate_backends(grid.backends)          # as the sweep refuses them: here, not in every array task
    points = len(grid.points)
    if array > points:
        raise UserError(f"--array {array}: scenario {sc.name!r} has {points} point(s); a shard holds whole points")
    sweep_args = (["--backend", ",".join(backends)] if backends else []) + (["--dtype", ",".join(dtypes)] if dtypes else [])
    text = sbatch_script(scenario, array, out or f"results/runs/{sc.name}-slurm", sweep_args, gpus_per_shard, baseline)
    if script is None:
        typer.echo(text, nl=False)
        return
    Path(script).write_text(text)
    Path(script).chmod(0o755)
    typer.echo(f"wrote {script}; submit with: bash {script}")


# ---- calibrate (device ceilings -> profile JSON) ---------------------------------------------------
@app.command()
def calibrate(
    out: str = typer.Option("", help="Output folder for profile.json, the bandwidth plot and the prefill fit's run "
                                     "(default: results/<gpu>/calibration, where every command finds it)."),
    quick: bool = typer.Option(False, help="Smaller buffers, fewer repetitions, two prefill points, bf16 fixed costs "
                                           "(a round trip; the profile is not one to use)."),
    name: str = typer.Option("", help="Profile name (default: <gpu>-calibrated)."),
    fixed_costs_only: bool = typer.Option(False, "--fixed-costs-only", help="Measure only the fixed costs (seconds "
                                          "per kernel launch and per backend stage, host seconds per stage launch "
                                          "run eagerly) into the existing OUT/profile.json."),
    backend: str = typer.Option("", help="Re-measure only these backends (comma-separated `auto` candidates or "
                                "dense baselines, e.g. q-packed-cute,hybrid after a kernel change): their fixed costs "
                                "and prefill fractions, every other entry and the ceilings kept from OUT/profile.json. "
                                "Default: everything."),
):
    """Make this GPU's whole device profile in one pass: [1/4] the ceilings (HBM read stream, L2 read plateau
    from a working-set sweep, bf16/fp8 matmul peaks; the vendor's figures beside them), [2/4] a small built-in
    prefill sweep (scenario `calibrate`, whose points no shipped scenario holds), [3/4] the fixed costs
    (seconds per kernel launch in a CUDA graph, the stages of each candidate and dense baseline (the dense
    floor, which the report predicts and no pick weighs), its fraction of the roofline on decode
    batches, one packed tile's time alone, its host seconds per stage launch and per-step planning timed
    eagerly, which `auto@eager` adds), [4/4] the prefill achieved fractions fitted on that sweep. Writes
    profile.json (with what was fitted on what under "fitted"), a PNG of bandwidth versus working set and the
    sweep's run folder. `sweep`, `auto`, `check`, `report`, `roofline`, `workload` and `compare` then find it
    for this GPU. Needs a CUDA GPU; at most 10 minutes on one (FlashInfer's first JIT build aside)."""
    import json
    from pathlib import Path
    from .errors import UserError, require_cuda
    require_cuda("msa-bench calibrate")
    from .harness.calibration.ceilings import with_fixed_costs, write_profile
    from .roofline.devices import CALIBRATION_DIR, gpu_slug
    import torch
    folder = Path(out) if out else Path(CALIBRATION_DIR.format(slug=gpu_slug(torch.cuda.get_device_name())))
    path = folder / "profile.json"
    only = [b.strip() for b in backend.split(",") if b.strip()] or None
    if only:
        from .harness.calibration.fixed_costs import calibrated_names
        measured = calibrated_names()
        unknown = [b for b in only if b not in measured]
        if unknown:
            raise UserError(f"--backend {unknown[0]!r} is not a backend calibrate measures ({', '.join(measured)})")
    if fixed_costs_only:
        if not path.is_file():
            raise UserError(f"--fixed-costs-only writes into an existing profile and {path} does not exist; "
                            "run `msa-bench calibrate` first or pass --out")
        from .harness.calibration.fixed_costs import calibrate_fixed_costs
        from .roofline.devices import load_device
        profile = load_device(str(path))
        data = json.loads(path.read_text())
        fc = calibrate_fixed_costs(profile, log=typer.echo, only=only)
        write_profile(with_fixed_costs(data, fc, str(path)), path)
        typer.echo(f"wrote the fixed costs into {path} ({len(fc['stages'])} stages, launch "
                   f"{fc['launch_s'] * 1e6:.2f} us) in {fc['seconds']:.0f} s")
    else:
        from .harness.calibration.calibrate import calibrate_profile
        result = calibrate_profile(folder, quick=quick, name=name or None, only=only, log=typer.echo)
        p, fc = result["profile"], result["profile"].fixed_costs
        steps = ", ".join(f"{k} {v:.0f} s" for k, v in result["steps"].items())
        typer.echo(f"wrote {path} in {result['seconds']:.0f} s ({steps}): hbm {p.hbm_bytes_per_s / 1e12:.2f} TB/s "
                   f"read, l2 {p.l2_bytes_per_s / 1e12:.2f} TB/s, bf16 {p.mma_flops['bf16'] / 1e12:.0f} / fp8 "
                   f"{p.mma_flops['fp8'] / 1e12:.0f} TFLOP/s; {len(p.achieved)} prefill fractions fitted on "
                   f"{result['run']}")
        for key, e in sorted(result["fit"]["fractions"].items()):
            typer.echo(f"  {key:<36} {e['value']:8.3f} of its roofline on prefill ({e['units']} units, "
                       f"{e['min']:.3f}-{e['max']:.3f})")
        for key, e in sorted(result["fit"]["kept"].items()):
            what = f"kept {e['value']:.3f}" if e["value"] is not None else "none"
            typer.echo(f"  {key:<36} {what} (not fitted: {e['why']})")
    for key, e in sorted(fc["stages"].items()):
        typer.echo(f"  {key:<36} {e['s'] * 1e6:8.1f} us  ({e['launches']} launches)")
    for key, f in sorted(fc["decode_achieved"].items()):
        typer.echo(f"  {key:<36} {f:8.2f} of its roofline on decode")
    for key, e in sorted(fc["items"].items()):
        typer.echo(f"  {key:<36} one item alone: {e['s'] * 1e6:.1f} us + {e['block_s'] * 1e6:.2f} us a block")


class _TextGiven(typer.core.TyperCommand):
    """A command that refuses a text option or argument given as "" on the command line: most of them
    read an empty value as not given and would quietly use the default (--out "" the default folder)."""

    def invoke(self, ctx):
        from .errors import UserError
        for param in self.params:
            value = ctx.params.get(param.name)
            empty = value == "" or (isinstance(value, (list, tuple)) and "" in value)
            if empty and ctx.get_parameter_source(param.name).name == "COMMANDLINE":
                if param.param_type_name == "option":
                    name = max(param.opts, key=len)
                    raise UserError(f"{name} is empty: give a value, or leave the option out for its default")
                raise UserError(f"{param.name.upper()} is empty: give a value")
        return super().invoke(ctx)


for _command in app.registered_commands:        # every command above, as it is defined
    if _command.cls in (None, typer.core.TyperCommand):
        _command.cls = _TextGiven


EXIT_INTERNAL = 3     # a crash: never a verdict's code (compare: 0 pass, 1 regression, 2 unusable input)


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit 2; a command's negative verdict
    exits 1; an internal error (a bug or a broken installation) exits 3, never a verdict's code."""
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
    except OSError as exc:
        if exc.filename is None:
            _internal_error(exc)
        # a path the user named that cannot be read or written: bad input, not a crash
        where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 else exc.filename
        typer.echo(f"error: cannot use {where}: {exc.strerror or type(exc).__name__}", err=True)
        sys.exit(2)
    except ModuleNotFoundError as exc:
        typer.echo(f"error: internal error: Python package {exc.name!r} is not installed; install the project "
                   "with its dependencies (pip install -e .)", err=True)
        sys.exit(EXIT_INTERNAL)
    except Exception as exc:  # click's own usage errors and anything unexpected: still one line
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # click/typer usage errors
            exc.show()
            sys.exit(exc.exit_code)
        if type(exc).__name__ == "Abort":
            sys.exit(130)
        _internal_error(exc)
    sys.exit(code if isinstance(code, int) else 0)


def _internal_error(exc: BaseException) -> None:
    typer.echo(f"error: internal error: {type(exc).__name__}: {' '.join(str(exc).split())}", err=True)
    sys.exit(EXIT_INTERNAL)


if __name__ == "__main__":
    main()
