"""Errors whose message is meant for the user: the CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """Bad input or an impossible request; str(exc) is a single line for the user."""


class NoGPUError(UserError):
    """A GPU-only command was run on a machine without a CUDA device."""


class DoesNotFit(UserError):
    """A workload larger than the memory free on the device it was asked of: a point sized for a larger GPU,
    which a sweep records unavailable, as it does a backend this host lacks."""


def require_cuda(what: str) -> None:
    import torch
    if not torch.cuda.is_available():
        raise NoGPUError(f"{what} needs a CUDA GPU and none is visible on this machine")


class BackendUnavailable(RuntimeError):
    """The backend cannot run here (no GPU, package missing, dtype unsupported); message says why."""


def one_line(exc: BaseException) -> str:
    """An exception as "Type: first line of its message", for a results file or a log line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
