"""The backend contract shared by every schedule.

A backend is planned once per workload (`plan()`: all host work, all allocation, no timing) and
returns a Plan: named stages that run in order on the current CUDA stream with no device-to-host
synchronization, writing the module output. The harness times each stage alone and the whole module.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import BackendUnavailable  # noqa: F401  (re-exported: backends raise it)
from ..scenarios.workload import Workload

@dataclass
class Plan:
    backend: str
    stages: dict[str, Callable[[], None]]          # ordered: run() calls them in this order
    output: torch.Tensor                           # [N, Hq, D] bf16 (fp32 for fp32 inputs), valid after run()
    lse: torch.Tensor | None = None                # [N, Hq] fp32 natural-log LSE where the backend provides it
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)   # named intermediates for stage checks
    plan_seconds: float = 0.0                      # host time spent in plan()
    info: dict = field(default_factory=dict)       # path actually taken: kernel names, configs, grid sizes

    def run(self) -> torch.Tensor:
        for stage in self.stages.values():
            stage()
        return self.output


class Backend:
    name: str = ""
    description: str = ""
    dtypes: tuple[str, ...] = ()

    def unavailable_reason(self, dtype: str, device: torch.device | str) -> str | None:
        """None if this backend can run `dtype` on `device`, else one line saying why not."""
        if dtype not in self.dtypes:
            return f"{self.name} does not support dtype {dtype} (supports {', '.join(self.dtypes)})"
        return None

    def workload_unavailable_reason(self, workload: Workload) -> str | None:
        """None if this backend can plan `workload` (its dtype, device and, for a kernel built for one
        shape, its shape), else one line saying why not."""
        return self.unavailable_reason(workload.dtype, workload.device)

    def plan(self, workload: Workload) -> Plan:
        reason = self.workload_unavailable_reason(workload)
        if reason:
            raise BackendUnavailable(reason)
        start = time.perf_counter()
        plan = self._plan(workload)
        plan.plan_seconds = time.perf_counter() - start
        return plan

    def _plan(self, workload: Workload) -> Plan:  # pragma: no cover - abstract
        raise NotImplementedError


_REGISTRY: dict[str, Callable[[], Backend]] = {}


def register(name: str):
    def wrap(factory):
        _REGISTRY[name] = factory
        return factory
    return wrap


OPTION_SEP = "@"     # "kv-outer-cute@v23": a registered backend with one option (its from_option())


def split_name(name: str) -> tuple[str, str | None]:
    """'kv-outer-cute@v23' -> ('kv-outer-cute', 'v23'); a plain name -> (name, None)."""
    base, sep, option = name.partition(OPTION_SEP)
    return base, (option if sep else None)


def get_backend(name: str) -> Backend:
    """The backend registered as `name`, or, for BASE@OPTION, BASE's from_option(OPTION) (e.g. one CuTe
    kernel), named with the whole string so its results rows say which one ran. A last `delayP` part
    of the option (`BASE@delay5`, `BASE@v28+delay5`), on any backend, adds a planted delay of P % of
    the module (kernels/delay.py)."""
    from .delay import DelayedBackend, split_delay
    _load_all()
    base, option = split_name(name)
    try:
        option, delay = split_delay(option)
    except ValueError as exc:
        raise KeyError(str(exc)) from None
    if delay is not None:
        inner = get_backend(base if option is None else f"{base}{OPTION_SEP}{option}")
        backend = DelayedBackend(inner, delay)
        backend.name = name
        return backend
    if base not in _REGISTRY:
        raise KeyError(f"unknown backend {base!r}; choose one of {', '.join(sorted(_REGISTRY))}")
    factory = _REGISTRY[base]
    if option is None:
        return factory()
    from_option = getattr(factory, "from_option", None)
    if from_option is None:
        raise KeyError(f"backend {base!r} takes no {OPTION_SEP}option (got {name!r})")
    try:
        backend = from_option(option)
    except ValueError as exc:
        raise KeyError(str(exc)) from None
    backend.name = name
    return backend


def _load_all():
    # Importing a backend module registers it; a module whose optional dependency is missing still
    # registers and reports itself unavailable instead of failing the import.
    import importlib
    for mod in ("kv_outer.backend", "msa_scatter.backend", "flashinfer_q_outer", "flashinfer_packed", "dense_gather", "dense_masked",
                "cute.backend", "q_packed.backend", "q_packed.cute_backend", "q_packed.hybrid", "auto",
                "reference_backend"):
        try:
            importlib.import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as exc:
            if not exc.name or not exc.name.startswith(__package__):
                raise
