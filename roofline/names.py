"""A backend's name as result files and profiles key it: BASE, or BASE@OPTION for a registered backend with
the constructor flags its option words set (kernels/options.py). This is the one place that knows the
separator; a profile's fractions and fixed costs fall back from BASE@OPTION to BASE."""
from __future__ import annotations

OPTION_SEP = "@"


def split_name(name: str) -> tuple[str, str | None]:
    """'kv-outer-cute@v23' -> ('kv-outer-cute', 'v23'); a plain name -> (name, None)."""
    base, sep, option = name.partition(OPTION_SEP)
    return base, (option if sep else None)


def base_name(name: str) -> str:
    """'kv-outer-cute@v23' -> 'kv-outer-cute'."""
    return split_name(name)[0]
