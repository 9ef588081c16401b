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


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


# ---- commands are added below, one section per area -------------------------------------------


def main() -> None:
    """Console entry point: user errors become one line on stderr and a non-zero exit."""
    from .harness.errors import UserError
    from .kernels.base import BackendUnavailable
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
        import click
        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, click.exceptions.Abort):
            sys.exit(1)
        typer.echo(f"error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
