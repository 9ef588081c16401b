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
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (key crossover_nsb_per_n holds the crossover)."),
):
    """Predicted KV-outer vs Q-outer crossover (in nsb/N: distinct selected (KV head, block) pairs per query
    token), per-query-token bytes per schedule and memory level, and the binding resource (hbm, l2 or mma)
    at a few reuse points. Bandwidths in TB/s, bytes per query token, times in microseconds."""
    import json
    from .harness.errors import UserError
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
    from .roofline.render import print_roofline
    print_roofline(summary)


# ---- cute (ahead-of-time CuTe DSL kernels) -----------------------------------------------------
@app.command("build-kernels")
def build_kernels(
    arch: str = typer.Option("sm_90a", help="Target GPU architecture (the CuTe attention stage supports sm_90a)."),
    out: str = typer.Option("", help="Output directory for the libraries and manifest.json (default: build/cute in the checkout)."),
    dtype: list[str] = typer.Option([], help="Data dtype(s) to build: bf16, fp8 (repeatable; default: all)."),
):
    """Compile the CuTe DSL attention stage for every configuration the sweep can ask for (no GPU needed),
    link one shared library per configuration and write manifest.json (config, DSL/CUDA versions, arch,
    source hash). Carry the directory to the GPU host; backend kv-outer-cute loads it there."""
    from pathlib import Path
    from .harness.errors import UserError
    from .kernels.cute.manifest import DEFAULT_BUILD_DIR, DTYPES, SUPPORTED_ARCHS, sweep_configs

    if arch not in SUPPORTED_ARCHS:
        raise UserError(f"--arch must be one of {', '.join(SUPPORTED_ARCHS)}, got {arch!r}")
    bad = [d for d in dtype if d not in DTYPES]
    if bad:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {bad[0]!r}")
    from .kernels.cute.build import build_all
    summary = build_all(sweep_configs(tuple(dtype) or DTYPES), Path(out) if out else DEFAULT_BUILD_DIR, arch,
                        log=typer.echo)
    typer.echo(f"wrote {summary['manifest']} ({len(summary['libraries'])} libraries, {summary['seconds']} s)")


def main() -> None:
    """Console entry point: user errors become one line on stderr and a non-zero exit."""
    from .harness.errors import BackendUnavailable, UserError
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
