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
from ..roofline.model import RESOURCES
from ..roofline.predict import KernelFacts
from ..roofline.schedules import Schedule
from ..scenarios.workload import Workload
from .options import Option, parse_options

@dataclass
class Plan:
    backend: str
    stages: dict[str, Callable[[], None]]          # ordered: run() calls them in this order
    output: torch.Tensor                           # [N, Hq, D] bf16 (fp32 for fp32 inputs), valid after run()
    lse: torch.Tensor | None = None                # [N, Hq] fp32 natural-log LSE where the backend provides it
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)   # named intermediates for stage checks
    plan_seconds: float = 0.0                      # host time spent in plan()
    info: dict = field(default_factory=dict)       # path actually taken: kernel names, configs, grid sizes
    model_record: dict | None = None               # what the model needs of it, where the plan knows it first
    # the host work of planning a serving engine repeats every step before it launches the stages (the
    # step's selection changes what it computes; FlashInfer's plan()), rerun as is: the eager timer times it
    step: Callable[[], None] | None = None
    full_context: bool = False                     # output attends every visible key (Backend.full_context)
    # one host call that runs every stage in order (a C++ dispatch's program: what an engine calls, the torch
    # op), where the plan has one; run() and the eager timer's module call use it, stages stay timed alone
    module: Callable[[], None] | None = None

    def run(self) -> torch.Tensor:
        if self.module is not None:
            self.module()
            return self.output
        for stage in self.stages.values():
            stage()
        return self.output


class Backend:
    name: str = ""
    description: str = ""
    dtypes: tuple[str, ...] = ()
    schedule: Schedule | None = None         # the roofline model's schedule it runs (roofline/schedules.py)
    candidate: bool = False                  # `auto` weighs it where the model predicts it
    stage_names: tuple[str, ...] = ()        # the stages its plans run, in order (their fixed costs)
    tile_tokens: int = 8                     # P of a token-packed schedule
    mma_tokens: int | None = None            # tokens an MMA covers where fewer than the tile (model.predict)
    # the roofline terms its achieved fraction scales (model.scaled_time); a term left out runs at the
    # device's rate, and such a backend has one fraction for prefill and decode (fit_decode_achieved)
    fraction_terms: tuple[str, ...] = RESOURCES
    options: dict[str, Option] = {}          # constructor flags NAME@WORD+WORD sets (kernels/options.py)

    @classmethod
    def from_option(cls, option: str) -> "Backend":
        """This backend with the flags `option` sets (NAME@OPTION); ValueError, one line, on a bad one."""
        return cls(**parse_options(cls.name, cls.options, option))

    # ---- what the model needs of it, as data (roofline/predict.py) ----
    tile_fractions: tuple[tuple[int, str], ...] = ()    # (tile tokens, fraction name): tiles measured on their own
    union_one_only: bool = False             # modelled only where a tile's tokens select alike
    unmodelled: str | None = None            # why the model never predicts it
    dense: bool = False                      # attends each request's whole visible context, not the selection
    # its output is attention over every key a query may see, the selection ignored (not only its cost):
    # the float64 check takes the reference over that context (scenarios.workload.full_context)
    full_context: bool = False

    @property
    def facts(self) -> KernelFacts:
        return KernelFacts(name=self.name, schedule=self.schedule, stage_names=tuple(self.stage_names),
                           tile_tokens=self.tile_tokens, mma_tokens=self.mma_tokens,
                           fraction_terms=tuple(self.fraction_terms), tile_fractions=tuple(self.tile_fractions),
                           union_one_only=self.union_one_only, unmodelled=self.unmodelled)

    def model_record(self, w: Workload, profile=None) -> dict:
        """What a plan of `w` records for the model (plan.info["model"]), known before planning: the tile
        it runs, its MMAs' tokens, the stages it runs; backends whose plans differ add theirs."""
        record = {"tile_tokens": self.tile_tokens, "stages": list(self.stages_for(w))}
        if self.mma_tokens:
            record["mma_tokens"] = self.mma_tokens
        return record

    def achieved_names(self, w: Workload) -> tuple[str, ...]:
        """The backends whose achieved fractions this backend's prediction divides by."""
        return (self.name,)

    def stages_for(self, w: Workload) -> tuple[str, ...]:
        """The stages a plan of `w` runs (their fixed costs): all of stage_names unless a backend skips one."""
        return self.stage_names

    def unavailable_reason(self, dtype: str, device: torch.device | str) -> str | None:
        """None if this backend can run `dtype` on `device`, else one line saying why not."""
        if dtype not in self.dtypes:
            return f"{self.name} does not support dtype {dtype} (supports {', '.join(self.dtypes)})"
        return None

    def workload_unavailable_reason(self, workload: Workload) -> str | None:
        """None if this backend can plan `workload` (its dtype, device and, for a kernel built for one
        shape, its shape), else one line saying why not."""
        return self.unavailable_reason(workload.dtype, workload.device)

    def build_pending_reason(self, workload: Workload) -> str | None:
        """None if planning `workload` builds nothing first, else one line: what a first plan would build
        (a JIT-compiled kernel, minutes) and how to build it ahead. A timed step that must stay short
        skips such a backend."""
        return None

    def stage_checks(self, plan: Plan, workload: Workload, rows: torch.Tensor, tol: float) -> dict[str, tuple[bool, str]]:
        """{stage: (ok, one line)}: each stage's own output, after a run of `plan`, checked on query `rows`
        (`msa-bench check`); a backend with such checks overrides this."""
        return {}

    def plan(self, workload: Workload) -> Plan:
        reason = self.workload_unavailable_reason(workload)
        if reason:
            raise BackendUnavailable(reason)
        start = time.perf_counter()
        plan = self._plan(workload)
        plan.plan_seconds = time.perf_counter() - start
        plan.full_context = plan.full_context or self.full_context
        plan.info.setdefault("model", plan.model_record if plan.model_record is not None
                             else self.model_record(workload))
        return plan

    def _plan(self, workload: Workload) -> Plan:  # pragma: no cover - abstract
        raise NotImplementedError


_REGISTRY: dict[str, type[Backend]] = {}
_LEFT_OUT: dict[str, str] = {}           # module -> the dependency it misses
_discovered = False


def register(name: str):
    """Class decorator: the backend class registered as `name` (its `name`). Discovery finds it by the
    decorator alone: a module of this package that holds `@register(` is imported (_discover)."""
    def wrap(cls: type[Backend]) -> type[Backend]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def registered_names() -> list[str]:
    """Every registered backend name, sorted."""
    _discover()
    return sorted(_REGISTRY)


def backend_class(name: str) -> type[Backend]:
    """The class registered as `name`'s base (BASE@OPTION counts as BASE); KeyError, with the names
    there are, for an unknown one."""
    _discover()
    base = split_name(name)[0]
    if base not in _REGISTRY:
        left_out = "".join(f"; {m} left out (no module {d!r})" for m, d in sorted(_LEFT_OUT.items()))
        raise KeyError(f"unknown backend {base!r}; choose one of {', '.join(sorted(_REGISTRY))}{left_out}")
    return _REGISTRY[base]


def declared_schedule(name: str) -> Schedule | None:
    """The schedule backend `name` (BASE@OPTION: BASE's) declares; None for one that declares none or is
    not registered here."""
    try:
        return backend_class(name).schedule
    except KeyError:
        return None


from ..roofline.names import OPTION_SEP, split_name  # noqa: E402,F401  (the one grammar of names, re-exported)


def get_backend(name: str) -> Backend:
    """The backend registered as `name`, or, for BASE@OPTION, BASE's from_option(OPTION) (e.g. one CuTe
    kernel; kernels/options.py), named with the whole string so its results rows say which one ran. A
    last `delayP` word of the option (`BASE@delay5`, `BASE@v28+delay5`), on any backend, adds a planted
    delay of P % of the module (kernels/delay.py)."""
    from .delay import DelayedBackend, split_delay
    base, option = split_name(name)
    try:
        option, delay = split_delay(option)
    except ValueError as exc:
        raise KeyError(f"backend {name!r}: {exc}") from None
    if delay is not None:
        inner = get_backend(base if option is None else f"{base}{OPTION_SEP}{option}")
        backend = DelayedBackend(inner, delay)
        backend.name = name
        return backend
    cls = backend_class(base)
    if option is None:
        return cls()
    try:
        backend = cls.from_option(option)
    except ValueError as exc:
        raise KeyError(str(exc)) from None
    backend.name = name
    return backend


def _discover() -> None:
    """Import, once, every module of this package that registers a backend: walking the package (sorted
    by module name) and importing only the modules whose source holds `@register(`, so the CuTe DSL
    kernel sources (and the DSL itself) are not imported. A module whose dependency outside this package
    is missing is left out (an unknown name's error says so): a backend imports an optional dependency
    where it uses it and reports itself unavailable without it, as FlashInfer's do."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    import importlib
    import pkgutil
    from pathlib import Path
    package = importlib.import_module(__package__)
    for info in pkgutil.walk_packages(package.__path__, f"{__package__}."):
        source = Path(info.module_finder.path) / f"{info.name.rpartition('.')[2]}.py"
        if info.ispkg or not source.is_file() or "@register(" not in source.read_text():
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if not exc.name or exc.name.startswith(__package__):
                raise
            _LEFT_OUT[info.name] = exc.name
