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

    def run(self) -> torch.Tensor:
        for stage in self.stages.values():
            stage()
        return self.output


class ModelInputs:
    """What the roofline needs of a workload, computed once for every backend `auto` weighs."""

    def __init__(self, w: Workload):
        from ..scenarios.stats import selected_pairs, useful_flops, workload_decode_kv_share, workload_decode_share
        s, n = w.shape, w.n_tokens
        self.w = w
        self.selected = float((w.selection >= 0).sum())
        self.per_query = self.selected / (n * s.hkv) if n else 0.0
        fanin = selected_pairs(w)[1]
        self.nsb = float(fanin.numel())
        self.nsb_shared = float((fanin > 1).sum())             # model.traffic's re-read working set
        self.flops = useful_flops(w)
        self.decode = workload_decode_share(w)                  # achieved(): the decode shares it blends by
        self.decode_kv = workload_decode_kv_share(w, fanin.numel())     # (model.decode_work_share)
        self._union: dict[tuple, float] = {}

    def decode_for(self, prediction) -> float:
        """The decode share `prediction`'s fractions blend by (model.decode_work_share)."""
        from ..roofline.model import decode_work_share
        return decode_work_share(prediction, self.decode, self.decode_kv)

    def union_ratio(self, tile: int, padded: bool = False) -> float:
        """The workload's union_ratio at tiles of `tile` tokens (1 where nothing is selected); padded: with
        every tile counted as `tile` tokens, what a token-packed kernel executes (scenarios/stats.py)."""
        if (tile, padded) not in self._union:
            from ..scenarios.stats import workload_union_ratio
            self._union[(tile, padded)] = workload_union_ratio(self.w, tile, padded) or 1.0
        return self._union[(tile, padded)]


def model_dtype(dtype: str) -> str:
    """The dtype a profile's achieved fractions are keyed by: fp16 and fp32 count as bf16."""
    return dtype if dtype in ("bf16", "fp8") else "bf16"


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

    def model_shape(self, w: Workload):
        from ..roofline.model import ModelShape
        return ModelShape.of(w.shape, dtype=w.dtype)

    def model_unfit_reason(self, w: Workload, inputs: ModelInputs) -> str | None:
        """None where the model predicts this backend on `w`, else why not."""
        return self.unmodelled_reason(lambda: inputs.union_ratio(self.tile_tokens))

    def unmodelled_reason(self, union_ratio) -> str | None:
        """The rule behind model_unfit_reason, for a workload or a result row: None where the model predicts
        this backend at the workload's union_ratio (at its tile_tokens; `union_ratio()` gives it, None if
        unknown), else why not."""
        from ..roofline.model import ALL_SCHEDULES
        if self.schedule not in ALL_SCHEDULES:
            return f"{self.name}: the model has no schedule '{self.schedule}'"
        return None

    def achieved_names(self, w: Workload) -> tuple[str, ...]:
        """The backends whose achieved fractions this backend's prediction divides by."""
        return (self.name,)

    def fraction_name(self, info: dict) -> str:
        """The name the achieved fraction of a plan that recorded `info` (its plan.info) is kept under
        (roofline.devices.achieved): this backend's, unless a plan runs a kernel measured on its own."""
        return self.name

    def roofline(self, w: Workload, inputs: ModelInputs, profile, executed: float | None = None,
                 fraction: str | None = None) -> tuple[float, dict]:
        """(seconds, what the prediction used): the roofline time of this backend's schedule on `w` over
        the fraction of it the backend reaches on this device (on decode work, the decode one). Fixed costs
        are not in it. `executed` (the executed union ratio its plan walks) and `fraction` (the name its
        fraction is kept under) where the plan knows better than the workload's statistics."""
        from ..roofline.devices import achieved
        from ..roofline.model import predict, scaled_time, union_tokens
        # a packed tile runs P x G rows per union block however few tokens it holds (decode: one); Q-outer's
        # re-reads hit the L2 inside its window of tokens
        tile = union_tokens(self.schedule, self.tile_tokens)
        union = inputs.union_ratio(tile, padded=True) if tile else None
        if executed is None:
            executed = inputs.union_ratio(self.mma_tokens, padded=True) if union and self.mma_tokens else None
        p = predict(self.schedule, self.model_shape(w), w.n_tokens, inputs.nsb, profile, inputs.per_query,
                    inputs.flops, union_ratio=union, tile_tokens=tile or self.tile_tokens,
                    executed_union_ratio=executed, shared_nsb=inputs.nsb_shared)
        frac = achieved(profile, fraction or self.name, model_dtype(w.dtype), inputs.decode_for(p))
        used = {"roofline_s": p.time_s, "achieved": frac, "binding": p.binding}
        if union is not None:
            used["union_ratio"] = union
        if executed is not None:
            used["executed_union_ratio"] = executed
        return scaled_time(p, frac, self.fraction_terms), used

    def item_blocks(self, w: Workload, inputs: ModelInputs) -> float | None:
        """K/V blocks of this backend's typical work item (one SM's share that cannot be split), None where
        its items are too small to matter: a packed tile walks its union, topk x union_ratio blocks."""
        return w.shape.topk * inputs.union_ratio(self.tile_tokens) if self.schedule == Schedule.Q_PACKED else None

    def predict_module(self, w: Workload, inputs: ModelInputs, profile) -> tuple[float, dict]:
        """(seconds, what the prediction used): roofline.model.module_time of this backend's roofline."""
        from ..roofline.model import module_time
        t, used = self.roofline(w, inputs, profile)
        total, parts = module_time(profile, self.name, model_dtype(w.dtype), t, self.stages_for(w),
                                   self.item_blocks(w, inputs))
        return total, {**used, **parts}

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


OPTION_SEP = "@"     # "kv-outer-cute@v23": a registered backend with the flags its option words set


def split_name(name: str) -> tuple[str, str | None]:
    """'kv-outer-cute@v23' -> ('kv-outer-cute', 'v23'); a plain name -> (name, None)."""
    base, sep, option = name.partition(OPTION_SEP)
    return base, (option if sep else None)


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
