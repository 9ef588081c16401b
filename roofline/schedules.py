"""The schedules the roofline model knows: the one vocabulary of schedule names.

A member compares equal to its name ("kv-outer") and formats as it, so result files, plan_info and
tables keep the plain strings.
"""
from __future__ import annotations

from enum import StrEnum


class Schedule(StrEnum):
    Q_OUTER = "q-outer"               # each query token alone: its blocks re-read per token
    KV_OUTER = "kv-outer"             # each block loaded once, per-block partials merged by a combine
    MSA_SCATTER = "msa-scatter"       # KV-outer with a slot store
    Q_PACKED = "q-packed"             # token-packed Q-outer: tiles of P tokens walk their blocks' union
    HYBRID = "hybrid"                 # packed tiles plus a KV-outer residual: the sum of the two parts
    DENSE_MASKED = "dense-masked"     # dense attention over the visible context, the selection as a mask
    DENSE = "dense"                   # dense attention over every visible key, no selection: the dense floor


# the schedules that attend each request's whole visible context (the baselines sparsity must beat)
DENSE_SCHEDULES = (Schedule.DENSE_MASKED, Schedule.DENSE)


def is_schedule(name) -> bool:
    """Whether `name` (a member or a plain string) names a schedule."""
    return name in _NAMES


_NAMES = frozenset(Schedule)
