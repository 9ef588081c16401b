"""A backend's name as result files and profiles key it: BASE, or BASE@OPTION for a registered backend with
the constructor flags its option words set (kernels/options.py). This is the one place that knows the
separator and the joiners of option words; a profile's fractions and fixed costs fall back from BASE@OPTION
to BASE, its host costs too unless an option word changes how the module is launched (LAUNCH_WORDS)."""
from __future__ import annotations

import re

OPTION_SEP = "@"
JOINERS = "+@-"                  # between option words: NAME@WORD+WORD (kernels/options.py)
_SPLIT = re.compile(f"[{re.escape(JOINERS)}]")
# option words of the C++ dispatch (kernels/dispatch): the same kernels launched another way, so the host
# cost a profile measured for BASE (or BASE@op) is not theirs
LAUNCH_WORDS = ("op", "graph")


def split_name(name: str) -> tuple[str, str | None]:
    """'kv-outer-cute@v23' -> ('kv-outer-cute', 'v23'); a plain name -> (name, None)."""
    base, sep, option = name.partition(OPTION_SEP)
    return base, (option if sep else None)


def base_name(name: str) -> str:
    """'kv-outer-cute@v23' -> 'kv-outer-cute'."""
    return split_name(name)[0]


def option_words(option: str) -> list[str]:
    """'v23+op' -> ['v23', 'op']."""
    return _SPLIT.split(option)


def host_keys(name: str) -> list[str]:
    """The names whose host cost `name` takes, in order: its own, then BASE@WORD for its launch word, else
    BASE ('q-packed-cute@op+p12' -> [itself, 'q-packed-cute@op']; 'kv-outer-cute@v23' -> [itself, BASE])."""
    base, option = split_name(name)
    if option is None:
        return [name]
    launch = [w for w in option_words(option) if w in LAUNCH_WORDS]
    fallback = f"{base}{OPTION_SEP}{launch[0]}" if launch else base
    return [name] if fallback == name else [name, fallback]
