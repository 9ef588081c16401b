"""Scenario files (TOML) -> a validated grid of points -> workloads.

A scenario file (scenarios/*.toml) holds:

    description = "one line"                     # required
    backends = ["kv-outer", "flashinfer"]        # required, non-empty
    [shape]                                      # optional: hq, hkv, head_dim, block, topk (AttnShape defaults)
    [timing]                                     # optional: reps, warmup, cold_l2, cv_target
    [[grid]]                                     # one or more grids (a single [grid] table works too)
    generator = "synthetic"                      # "synthetic" | "indexer" | "real-prefill" | "decode" | "mixed"
                                                 #   | "drift" | "trace", or a list
    tokens = 16384                               # N query tokens (synthetic, indexer); prefill chunk (mixed, drift)
    context = [131072, 262144]                   # context tokens (synthetic, indexer); the largest (decode, mixed),
                                                 #   the chunk's (mixed, drift)
    requests = [16, 256]                         # decode requests          (decode, mixed; see serving.py)
    query_tokens = 1                             # tokens per decode request, 1 to 4 (decode, mixed)
    context_min = 8192                           # decode contexts drawn in [context_min, context] (decode, mixed)
    chunks = 1                                   # prefill chunks in the step (mixed)
    drift = [0.03, 0.15]                         # per-token replacement probability (drift; decode, mixed)
    reuse = [0.25, 1.0]                          # target nsb / N          (synthetic)
    skew = 0.0                                   # Zipf exponent           (synthetic)
    share = [0.0, 0.5, 1.0]                      # fraction of the top-k a token group shares (synthetic;
    share_group = 8                              #   see coselection.py), tokens per group (default 8)
    causal = false                               # chunked prefill at the context's end (synthetic, indexer)
    cases = ["prefill_..."] or "representative"  # MSA prefill case ids   (real-prefill)
    trace = "traces/example.safetensors"         # a selection trace (trace; docs/trace-format.md), relative
                                                 #   to the scenario file; its shape is the points' shape
    calls = "0-7,12"                             # the trace's calls to run (trace; default: all), or a list of ids
    dtypes = ["bf16", "fp8"]
    seed = 0

Every axis takes a value or a list; the grid is their product. Any problem (unknown key, wrong
type, impossible shape or target, empty grid) is a UserError naming the file, the key and why.
"""
from __future__ import annotations

import itertools
import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path

from ..errors import UserError
from ..roofline.dtypes import DType
from ..roofline.shape import SHAPE_FIELDS, ShapeError
from .coselection import DEFAULT_GROUP
from .serving import GENERATORS as SERVING
from .workload import AttnShape, Workload, WorkloadError, check_fits, footprint_bytes, size_problem

GENERATORS = ("synthetic", "real-prefill", "indexer", *SERVING, "trace")
TOP_KEYS = {"description", "backends", "shape", "timing", "grid"}
TIMING_KEYS = {"reps": int, "warmup": int, "cold_l2": bool, "cv_target": float}   # see timing.TimingConfig
SHAPE_KEYS = SHAPE_FIELDS                 # the [shape] table's keys
# axis -> (element type, generators it applies to, default)
AXES = {
    "generator": (str, GENERATORS, None),
    "tokens": (int, ("synthetic", "indexer", "mixed", "drift"), None),
    "context": (int, ("synthetic", "indexer", *SERVING), None),
    "reuse": (float, ("synthetic",), None),
    "skew": (float, ("synthetic",), [0.0]),
    "share": (float, ("synthetic",), [None]),
    "share_group": (int, ("synthetic",), None),
    "causal": (bool, ("synthetic", "indexer"), [False]),
    "cases": (str, ("real-prefill",), None),
    "requests": (int, ("decode", "mixed"), None),
    "query_tokens": (int, ("decode", "mixed"), [1]),
    "context_min": (int, ("decode", "mixed"), [None]),
    "chunks": (int, ("mixed",), [1]),
    "drift": (float, SERVING, [None]),
    "trace": (str, ("trace",), None),
    "calls": (str, ("trace",), [None]),
    "dtypes": (str, GENERATORS, [DType.BF16]),
    "seed": (int, GENERATORS, [0]),
}
REQUIRED = {"synthetic": ("tokens", "context", "reuse"), "indexer": ("tokens", "context"), "real-prefill": ("cases",),
            "decode": ("context", "requests"), "mixed": ("tokens", "context", "requests"),
            "drift": ("tokens", "context", "drift"), "trace": ("trace",)}


def _num(x: float) -> str:
    return format(float(x), ".12g")


@dataclass(frozen=True)
class Point:
    """One workload of the grid, with its dtype."""
    generator: str
    tokens: int
    context: int
    reuse: float | None
    skew: float
    causal: bool
    dtype: DType
    seed: int
    case_id: str | None
    weight: float
    shape: AttnShape
    share: float | None = None        # co-selection axis (synthetic); None: the plain synthetic generator
    share_group: int | None = None
    # serving generators (serving.py): decode requests x query_tokens, mixed chunks x chunk_tokens + decode
    requests: int | None = None
    query_tokens: int | None = None
    context_min: int | None = None
    chunks: int | None = None
    chunk_tokens: int | None = None
    drift: float | None = None
    # trace: the file, the call and its layer (scenarios/trace.py)
    trace: str | None = None
    call: int | None = None
    layer: int | None = None

    def key(self) -> str:
        """Stable, human-readable unique id (matches points across runs; resume)."""
        s = self.shape
        parts = [self.generator]
        if self.generator == "real-prefill":
            parts.append(self.case_id or "")
        elif self.generator == "trace":
            parts += [Path(self.trace).name.removesuffix(".safetensors"), f"call.{self.call:06d}", f"L{self.layer}"]
        elif self.generator in SERVING:
            if self.generator == "mixed":
                parts.append(f"C{self.chunks}x{self.chunk_tokens}")
            elif self.generator == "drift":
                parts.append(f"N{self.tokens}")
            if self.requests:
                parts.append(f"R{self.requests}x{self.query_tokens}")
            low = self.context if self.context_min is None else self.context_min
            parts.append(f"T{self.context}" if low == self.context else f"T{low}-{self.context}")
            if self.drift is not None:
                parts.append(f"drift{_num(self.drift)}")
        else:
            parts += [f"N{self.tokens}", f"T{self.context}"]
            if self.reuse is not None:
                parts.append(f"reuse{_num(self.reuse)}")
            if self.generator == "synthetic":
                parts.append(f"skew{_num(self.skew)}")
                if self.share is not None:
                    parts.append(f"share{_num(self.share)}-G{self.share_group}")
            parts.append("causal" if self.causal else "noncausal")
        parts += [self.dtype, f"seed{self.seed}",
                  f"hq{s.hq}-hkv{s.hkv}-d{s.head_dim}-b{s.block}-top{s.topk}"]
        return "/".join(parts)

    def as_dict(self) -> dict:
        """Flat columns for results tables."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "shape"}
        d.update({name: getattr(self.shape, name) for name in SHAPE_KEYS})
        d["point"] = self.key()
        return d


@dataclass
class Scenario:
    name: str
    description: str
    backends: list[str]
    points: list[Point]
    source: str
    timing: dict = field(default_factory=dict)
    shape: AttnShape = field(default_factory=AttnShape)
    grids: list[dict] = field(default_factory=list, repr=False)   # the axes the points came from
    shape_given: bool = False       # a [shape] table was given (a trace of another shape is then refused)


# ---- validation helpers ------------------------------------------------------------------------

def _type_ok(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def _type_name(kind) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[kind]


def _axis(src: str, where: str, key: str, value) -> list:
    kind = AXES[key][0]
    values = value if isinstance(value, list) else [value]
    if not values:
        raise UserError(f"{src}: {where}.{key} is an empty list (the grid would be empty)")
    for v in values:
        if not _type_ok(v, kind):
            raise UserError(f"{src}: {where}.{key} must be {_type_name(kind)} or a list of them, got {v!r}")
    return [float(v) if kind is float else v for v in values]


def _calls_text(src: str, where: str, value):
    """calls as one spec string: "0-7,12" as given, an id or a list of ids joined."""
    ids = value if isinstance(value, list) else [value]
    if ids and all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
        return ",".join(str(v) for v in ids)
    if isinstance(value, str) and value.strip():
        return value
    raise UserError(f"{src}: {where}.calls must be call ids (a list of integers) or ranges such as \"0-7,12\"")


def _parse_grid(src: str, where: str, table, base: Path | None = None) -> dict:
    if not isinstance(table, dict):
        raise UserError(f"{src}: {where} must be a table")
    for key in table:
        if key not in AXES:
            raise UserError(f"{src}: {where}: unknown key {key!r} (known: {', '.join(AXES)})")
    if "calls" in table:
        table = {**table, "calls": _calls_text(src, where, table["calls"])}
    grid = {key: _axis(src, where, key, value) for key, value in table.items()}
    if "trace" in grid and base is not None:          # a trace's path is relative to its scenario file
        grid["trace"] = [str(base / t) if not Path(t).is_absolute() else t for t in grid["trace"]]
    if "generator" not in grid:
        raise UserError(f"{src}: {where}.generator is missing (one of {', '.join(GENERATORS)})")
    for g in grid["generator"]:
        if g not in GENERATORS:
            raise UserError(f"{src}: {where}.generator: unknown generator {g!r} (known: {', '.join(GENERATORS)})")
    key = inapplicable(grid, grid["generator"])
    if key:
        raise UserError(f"{src}: {where}.{key} does not apply to generator {', '.join(grid['generator'])}")
    return grid


def inapplicable(keys, generators) -> str | None:
    """The first axis in `keys` that none of `generators` uses (a scenario grid and the workload
    command refuse it the same way), else None."""
    return next((key for key in keys if not set(AXES[key][1]) & set(generators)), None)


def _expand(src: str, where: str, grid: dict, shape: AttnShape, shape_given: bool = False) -> list[Point]:
    from .prefill_cases import get_case, representative_cases
    if "dtypes" in grid:
        grid = {**grid, "dtypes": [DType.parse(dt, f"{src}: {where}.dtypes") for dt in grid["dtypes"]]}
    ax = lambda key: grid.get(key, AXES[key][2])
    points = []
    for gen in grid["generator"]:
        for key in REQUIRED[gen]:
            if key not in grid:
                raise UserError(f"{src}: {where}.{key} is missing (needed by generator {gen})")
        if gen == "real-prefill":
            ids = []
            for c in grid["cases"]:
                ids += [x.case_id for x in representative_cases()] if c == "representative" else [c]
            try:
                cases = [get_case(c) for c in ids]
            except UserError as exc:
                raise UserError(f"{src}: {where}.cases: {exc}") from None
            for case, dt, seed in itertools.product(cases, ax("dtypes"), ax("seed")):
                p = Point("real-prefill", case.total_q, case.max_final_kv, None, 0.0, True, dt, seed,
                          case.case_id, case.weight, shape)
                _check_point(src, where, p)
                points.append(p)
            continue
        if gen in SERVING:
            points += _expand_serving(src, where, gen, grid, shape)
            continue
        if gen == "trace":
            points += _expand_trace(src, where, grid, shape, shape_given)
            continue
        reuses = ax("reuse") if gen == "synthetic" else [None]
        skews = ax("skew") if gen == "synthetic" else [0.0]
        if "share_group" in grid and "share" not in grid:
            raise UserError(f"{src}: {where}.share_group needs share (the fraction of the top-k a group shares)")
        shares = ax("share") if gen == "synthetic" else [None]
        share_groups = grid.get("share_group", [DEFAULT_GROUP]) if gen == "synthetic" and "share" in grid else [None]
        for n, t, r, z, sh, sg, causal, dt, seed in itertools.product(
                ax("tokens"), ax("context"), reuses, skews, shares, share_groups, ax("causal"), ax("dtypes"),
                ax("seed")):
            p = Point(gen, n, t, r, z, causal, dt, seed, None, 1.0, shape, sh, sg)
            _check_point(src, where, p)
            points.append(p)
    return points


def _expand_serving(src: str, where: str, gen: str, grid: dict, shape: AttnShape) -> list[Point]:
    ax = lambda key: grid.get(key, AXES[key][2]) if gen in AXES[key][1] else [None]
    points = []
    for n, t, cmin, r, qt, c, dr, dt, seed in itertools.product(
            ax("tokens"), ax("context"), ax("context_min"), ax("requests"), ax("query_tokens"), ax("chunks"),
            ax("drift"), ax("dtypes"), ax("seed")):
        p = serving_point(gen, shape, dt, seed, tokens=n, context=t, context_min=cmin, requests=r,
                          query_tokens=qt, chunks=c, drift=dr)
        _check_point(src, where, p)
        points.append(p)
    return points


def _expand_trace(src: str, where: str, grid: dict, shape: AttnShape, shape_given: bool) -> list[Point]:
    from .trace import TraceError, read_index, select_calls
    from .trace_workload import check_calls
    points = []
    for path in grid["trace"]:
        try:
            info = read_index(path)
            calls = [e for spec in grid.get("calls", [None]) for e in select_calls(info, spec)]
            check_calls(info, calls)            # a bad call is refused here, as a bad point of a generator is
        except TraceError as exc:
            raise UserError(f"{src}: {where}.trace: {exc}") from None
        if shape_given and info.shape != shape:
            raise UserError(f"{src}: {where}.trace: {path} holds shape {_shape_text(info.shape)}, the scenario's "
                            f"[shape] says {_shape_text(shape)}")
        for e, dt, seed in itertools.product(calls, grid.get("dtypes", AXES["dtypes"][2]), grid.get("seed", [0])):
            p = trace_point(info, e, dt, seed)
            _check_point(src, where, p)
            points.append(p)
    return points


def _shape_text(s: AttnShape) -> str:
    return f"Hq {s.hq}, Hkv {s.hkv}, D {s.head_dim}, block {s.block}, top-{s.topk}"


def trace_point(info, entry, dtype: str, seed: int) -> Point:
    """The Point of one trace call (a scenarios.trace.CallEntry of `info`), at its trace's shape."""
    return Point("trace", entry.tokens, entry.context, None, 0.0, True, dtype, seed, None, entry.weight,
                 info.shape, trace=info.path, call=entry.call, layer=entry.layer)


def serving_point(gen: str, shape: AttnShape, dtype: str, seed: int, *, tokens, context, context_min=None,
                  requests=None, query_tokens=None, chunks=None, drift=None) -> Point:
    """The Point of a decode, mixed or drift workload: tokens holds every query token of the call."""
    decode = (requests or 0) * (query_tokens or 1)
    chunk = tokens if gen in ("mixed", "drift") else None
    n_chunks = chunks if gen == "mixed" else (1 if gen == "drift" else None)
    total = (n_chunks or 0) * (chunk or 0) + (decode if gen != "drift" else 0)
    return Point(gen, total, context, None, 0.0, True, dtype, seed, None, 1.0, shape,
                 requests=requests if gen != "drift" else None,
                 query_tokens=(query_tokens or 1) if gen != "drift" else None,
                 context_min=context_min, chunks=n_chunks, chunk_tokens=chunk, drift=drift)


def point_problem(p: Point) -> tuple[str, str] | None:
    """(axis, why) for a point that cannot be built as asked (bad sizes, overflowing indices or seed,
    an infeasible reuse target), else None. Cheap: nothing is allocated."""
    from .selection import check_synthetic
    s = p.shape
    if p.generator == "trace":
        return size_problem(s, p.tokens, p.context, lambda: point_pages(p), p.seed)
    if p.generator in SERVING:
        from .serving import serving_problem
        problem = serving_problem(s, p.generator, p.chunk_tokens, p.context, p.context_min, p.requests,
                                  p.query_tokens, p.chunks, p.drift)
        problem = problem or size_problem(s, p.tokens, p.context, lambda: point_pages(p), p.seed)
        if problem and problem[0] == "tokens":        # the step's N is no option: name the one that made it
            return _step_axis(p), f"{_step_sum(p)}: {problem[1]}"
        return problem
    problems = [
        ("tokens", p.tokens <= 0, f"tokens must be positive, got {p.tokens}"),
        ("context", p.context <= 0, f"context must be positive, got {p.context}"),
        ("skew", p.skew < 0, f"skew (Zipf exponent) must be >= 0, got {_num(p.skew)}"),
        ("context", p.causal and p.context < p.tokens,
         f"causal: context ({p.context} tokens) must hold the {p.tokens} query tokens"),
        ("context", not p.causal and p.context > 0 and -(-p.context // s.block) < s.topk,
         f"context {p.context} holds fewer than top-{s.topk} blocks of {s.block} tokens"),
    ]
    for key, bad, why in problems:
        if bad:
            return key, why
    size = size_problem(s, p.tokens, p.context, lambda: point_pages(p), p.seed)
    if size:
        return size
    if p.generator == "synthetic" and p.share is not None:
        from .coselection import check_coselection
        if p.share_group < 1:             # named on its own: the option to fix is --share-group
            return "share_group", f"tokens per group must be a positive integer, got {p.share_group}"
        try:
            check_coselection(s, p.tokens, p.context, p.reuse, p.share, p.share_group, p.causal)
        except WorkloadError as exc:
            return "share", str(exc)
    elif p.generator == "synthetic" and p.reuse is not None:      # None: no reuse target (msa-bench check --requests)
        try:
            check_synthetic(s, p.tokens, p.context, p.reuse, p.causal)
        except WorkloadError as exc:
            return "reuse", str(exc)
    return None


def _step_parts(p: Point) -> tuple[int, int]:
    """(prefill, decode) query tokens of a serving step: chunks x chunk tokens, requests x query tokens."""
    decode = (p.requests or 0) * (p.query_tokens or 1) if p.generator != "drift" else 0
    return (p.chunks or 0) * (p.chunk_tokens or 0), decode


def _step_axis(p: Point) -> str:
    """The axis behind a serving step's N: the larger factor of its larger part."""
    prefill, decode = _step_parts(p)
    if decode > prefill:
        return "requests"
    return "chunks" if (p.chunks or 0) > (p.chunk_tokens or 0) else "tokens"


def _step_sum(p: Point) -> str:
    prefill, decode = _step_parts(p)
    parts = ([f"{p.chunks} chunk(s) x {p.chunk_tokens} tokens"] if prefill else []) + \
            ([f"{p.requests} request(s) x {p.query_tokens} token(s)"] if decode else [])
    return f"the step's N = {' + '.join(parts)} = {p.tokens}"


def _check_point(src: str, where: str, p: Point) -> None:
    problem = point_problem(p)
    if problem:
        key = problem[0] if problem[0] in AXES or problem[0] == "reuse" else f"shape.{problem[0]}"
        raise UserError(f"{src}: {where}.{key}: {problem[1]}")


def point_pages(p: Point) -> int:
    """Physical pages of the point's paged cache (one per block of every request)."""
    if p.generator == "real-prefill":
        from .prefill_cases import get_case
        return sum(-(-kv // p.shape.block) for kv in get_case(p.case_id).final_kv_lens)
    if p.generator in SERVING:
        return sum(-(-kv // p.shape.block) for kv in serving_kv_lens(p))
    if p.generator == "trace":
        from .trace import read_index
        return read_index(p.trace).entry(p.call).pages
    return max(1, -(-p.context // p.shape.block))


def serving_kv_lens(p: Point) -> list[int]:
    """Every request's context of a serving point (deterministic from its seed)."""
    from .serving import layout
    return layout(p.generator, p.chunk_tokens, p.context, p.context_min, p.requests, p.query_tokens, p.chunks,
                  p.seed)[0]


def point_footprint(p: Point, with_tensors: bool = True, partials: bool = True) -> int:
    """workload.footprint_bytes for a point (the indexer always draws its tensors)."""
    return footprint_bytes(p.shape, p.dtype, p.tokens, point_pages(p), with_tensors or p.generator == "indexer",
                           partials)


def check_point_fits(p: Point, device, with_tensors: bool = True, partials: bool = True) -> None:
    """DoesNotFit (one line) when the point's workload cannot fit in the memory free on `device`."""
    check_fits(point_footprint(p, with_tensors, partials), device, f"point {p.key()}")


def _points(src: str, grids: list[dict], shape: AttnShape, shape_given: bool = False) -> list[Point]:
    if not grids:
        raise UserError(f"{src}: no [grid] table: the grid would be empty")
    points, seen = [], set()
    for i, grid in enumerate(grids):
        where = "grid" if len(grids) == 1 else f"grid[{i}]"
        for p in _expand(src, where, grid, shape, shape_given):
            if p.key() not in seen:
                seen.add(p.key())
                points.append(p)
    if not points:
        raise UserError(f"{src}: the grid is empty")
    return points


def parse_scenario(data: dict, src: str, name: str, base: Path | None = None) -> Scenario:
    """The scenario of a parsed TOML; `base` is the folder a grid's relative trace path starts from."""
    for key in data:
        if key not in TOP_KEYS:
            raise UserError(f"{src}: unknown key {key!r} (known: {', '.join(sorted(TOP_KEYS))})")
    desc = data.get("description")
    if not isinstance(desc, str) or not desc.strip() or "\n" in desc.strip():
        raise UserError(f"{src}: description must be a one-line string")
    backends = data.get("backends")
    if not isinstance(backends, list) or not backends or not all(isinstance(b, str) and b for b in backends):
        raise UserError(f"{src}: backends must be a non-empty list of backend names")
    shape_t = data.get("shape", {})
    if not isinstance(shape_t, dict):
        raise UserError(f"{src}: shape must be a table")
    for key, value in shape_t.items():
        if key not in SHAPE_KEYS:
            raise UserError(f"{src}: shape: unknown key {key!r} (known: {', '.join(SHAPE_KEYS)})")
        if not _type_ok(value, int):
            raise UserError(f"{src}: shape.{key} must be an integer, got {value!r}")
    try:
        shape = AttnShape(**shape_t)
    except ShapeError as exc:
        raise UserError(f"{src}: shape: {exc}") from None
    timing = data.get("timing", {})
    if not isinstance(timing, dict):
        raise UserError(f"{src}: timing must be a table")
    for key, value in timing.items():
        if key not in TIMING_KEYS:
            raise UserError(f"{src}: timing: unknown key {key!r} (known: {', '.join(TIMING_KEYS)})")
        kind = TIMING_KEYS[key]
        if not _type_ok(value, kind) or (kind is not bool and value < (1 if key == "reps" else 0)):
            raise UserError(f"{src}: timing.{key} must be {_type_name(kind)} >= {1 if key == 'reps' else 0}, "
                            f"got {value!r}")
    raw = data.get("grid", [])
    raw = [raw] if isinstance(raw, dict) else raw
    if not isinstance(raw, list):
        raise UserError(f"{src}: grid must be a table or an array of tables")
    grids = [_parse_grid(src, "grid" if len(raw) == 1 else f"grid[{i}]", t, base) for i, t in enumerate(raw)]
    return Scenario(name=name, description=desc.strip(), backends=list(backends),
                    points=_points(src, grids, shape, bool(shape_t)), source=src, timing=dict(timing), shape=shape,
                    grids=grids, shape_given=bool(shape_t))


# ---- files -------------------------------------------------------------------------------------

def _shipped() -> dict[str, object]:
    return {p.name[:-5]: p for p in resources.files("msa_bench.scenarios").iterdir() if p.name.endswith(".toml")}


def _read(path, src: str) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{src}: invalid TOML: {' '.join(str(exc).split())}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{src}: cannot read: {exc}") from None


def shipped_names() -> list[str]:
    return sorted(_shipped())


def list_scenarios() -> list[tuple[str, str]]:
    out = []
    for name, path in sorted(_shipped().items()):
        try:
            desc = str(_read(path, name).get("description", "")).strip()
        except UserError as exc:
            desc = f"(unreadable: {exc})"
        out.append((name, desc))
    return out


def load_scenario(name_or_path: str) -> Scenario:
    """A shipped scenario by name (see list_scenarios) or a .toml file path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise UserError(f"scenario file {name_or_path} does not exist")
        return parse_scenario(_read(path, str(path)), str(path), path.stem, path.resolve().parent)
    shipped = _shipped()
    if name_or_path not in shipped:
        raise UserError(f"unknown scenario {name_or_path!r}; shipped: {', '.join(sorted(shipped))} (or give a .toml path)")
    res = shipped[name_or_path]
    src = f"scenarios/{name_or_path}.toml"
    return parse_scenario(_read(res, src), src, name_or_path, Path(str(res)).parent)


def with_overrides(s: Scenario, *, reuse=None, tokens=None, context=None, skew=None, dtypes=None, backends=None,
                   causal=None, generator=None, share=None, share_group=None) -> Scenario:
    """The scenario with grid axes replaced (lists replace an axis; a scalar is a one-element list).

    An override applies to every grid whose generators use that axis; one that applies to none is an error.
    """
    src = f"{s.source} (with overrides)"
    given = {"reuse": reuse, "tokens": tokens, "context": context, "skew": skew, "dtypes": dtypes,
             "causal": causal, "generator": generator, "share": share, "share_group": share_group}
    given = {k: v for k, v in given.items() if v is not None}
    grids = [dict(g) for g in s.grids]
    if "generator" in given:
        gens = _axis(src, "override", "generator", list(given.pop("generator")) if isinstance(generator, (list, tuple))
                     else given.pop("generator"))
        for g in gens:
            if g not in GENERATORS:
                raise UserError(f"{src}: generator: unknown generator {g!r} (known: {', '.join(GENERATORS)})")
        grids = [{k: v for k, v in g.items() if set(AXES[k][1]) & set(gens)} | {"generator": gens} for g in grids]
    for key, value in given.items():
        values = _axis(src, "override", key, list(value) if isinstance(value, (list, tuple)) else value)
        applied = False
        for g in grids:
            if set(AXES[key][1]) & set(g["generator"]):
                g[key] = values
                applied = True
        if not applied:
            raise UserError(f"{src}: {key} does not apply to this scenario's generators")
    new_backends = s.backends
    if backends is not None:
        new_backends = list(backends) if isinstance(backends, (list, tuple)) else [backends]
        if not new_backends or not all(isinstance(b, str) and b for b in new_backends):
            raise UserError(f"{src}: backends must be a non-empty list of backend names")
    return replace(s, backends=new_backends, points=_points(src, grids, s.shape, s.shape_given), grids=grids,
                   source=s.source)


def with_trace(s: Scenario, trace: str, calls: str | None = None, dtypes=None) -> Scenario:
    """The scenario's backends and timing on a trace's calls (`sweep --trace`): one grid of the trace, at its
    shape, in `dtypes` or the dtypes the scenario's grids use."""
    src = f"{s.source} (with --trace)"
    dts = list(dtypes) if dtypes else list(dict.fromkeys(d for g in s.grids for d in g.get("dtypes", [])))
    grid = _parse_grid(src, "trace", {"generator": "trace", "trace": str(Path(trace).resolve()),
                                      **({"calls": calls} if calls else {}), **({"dtypes": dts} if dts else {})})
    points = _points(src, [grid], s.shape)
    return replace(s, points=points, grids=[grid], shape=points[0].shape, shape_given=False)


# ---- one point from command-line options (msa-bench workload) -----------------------------------

OPTION_OF_AXIS = {"tokens": "--tokens", "context": "--context", "reuse": "--reuse", "skew": "--skew",
                  "causal": "--causal", "cases": "--case", "dtypes": "--dtype", "seed": "--seed",
                  "share": "--share", "share_group": "--share-group", "requests": "--requests",
                  "query_tokens": "--query-tokens", "context_min": "--context-min", "chunks": "--chunks",
                  "drift": "--drift"}
OPTION_DEFAULTS = {"tokens": 16384, "context": 131072, "reuse": 0.25, "skew": 0.0, "causal": False, "seed": 0}


def point_from_options(generator: str, shape: AttnShape, dtype: str, defaults: dict | None = None, **given) -> Point:
    """The point the workload (or check) command's options describe, refused the way a scenario grid is: an
    option its generator does not use, a missing case, or a point that cannot be built is a one-line
    UserError. `given` holds the options set on the command line (tokens, context, reuse, skew, causal, cases,
    seed, share, share_group, and for decode, mixed and drift: requests, query_tokens, context_min, chunks,
    drift); `defaults` the command's own values for options not given (over
    OPTION_DEFAULTS)."""
    if generator not in GENERATORS:
        raise UserError(f"--generator must be one of {', '.join(GENERATORS)}, got {generator!r}")
    dtype = DType.parse(dtype)
    given = {k: v for k, v in given.items() if v is not None}
    key = inapplicable(given, [generator])
    if key:
        raise UserError(f"{OPTION_OF_AXIS[key]} does not apply to --generator {generator}")
    if generator == "trace":
        raise UserError("--generator trace takes its calls from a file: pass --trace FILE (and --calls)")
    defaults = {**OPTION_DEFAULTS, **(defaults or {})}
    value = lambda k: given.get(k, defaults.get(k))
    if "share_group" in given and "share" not in given:
        raise UserError("--share-group needs --share (the fraction of its top-k a group of tokens shares)")
    if generator == "real-prefill":
        from .prefill_cases import get_case
        if "cases" not in given:
            raise UserError("--generator real-prefill needs --case CASE_ID (`msa-bench scenarios --cases` lists them)")
        c = get_case(given["cases"])
        p = Point("real-prefill", c.total_q, c.max_final_kv, None, 0.0, True, dtype, value("seed"), c.case_id,
                  c.weight, shape)
    elif generator in SERVING:
        p = serving_point(generator, shape, dtype, value("seed"),
                          tokens=value("tokens") if generator != "decode" else None, context=value("context"),
                          context_min=given.get("context_min"), requests=given.get("requests"),
                          query_tokens=given.get("query_tokens"),
                          chunks=given.get("chunks", 1) if generator == "mixed" else None, drift=given.get("drift"))
    else:
        share = given.get("share")
        p = Point(generator, value("tokens"), value("context"), value("reuse") if generator == "synthetic" else None,
                  value("skew"), value("causal"), dtype, value("seed"), None, 1.0, shape, share,
                  given.get("share_group", DEFAULT_GROUP) if share is not None else None)
    problem = point_problem(p)
    if problem:
        option = OPTION_OF_AXIS.get(problem[0], f"--{problem[0].replace('_', '-')}")
        raise UserError(f"{option}: {problem[1]}")
    return p


# ---- workloads ---------------------------------------------------------------------------------

def make_workload(point: Point, device="cpu", with_tensors: bool = True) -> Workload:
    """Build the point's workload (selection-only when with_tensors=False, except the indexer, which
    derives its selection from the tensors and so always draws them)."""
    if point.generator == "synthetic" and point.share is not None:
        from .coselection import coselected_workload
        w = coselected_workload(point.shape, point.dtype, point.tokens, point.context, point.reuse, point.share,
                                point.share_group, point.skew, point.causal, point.seed, device, with_tensors)
    elif point.generator == "synthetic":
        from .selection import synthetic_workload
        w = synthetic_workload(point.shape, point.dtype, point.tokens, point.context, point.reuse, point.skew,
                               point.causal, point.seed, device, with_tensors)
    elif point.generator in SERVING:
        from .serving import serving_workload
        w = serving_workload(point.shape, point.dtype, point.generator, point.chunk_tokens, point.context,
                             point.context_min, point.requests, point.query_tokens, point.chunks, point.drift,
                             point.seed, device, with_tensors)
    elif point.generator == "indexer":
        from .indexer import indexer_workload
        w = indexer_workload(point.shape, point.dtype, point.tokens, point.context, point.causal, point.seed, device)
    elif point.generator == "real-prefill":
        from .prefill_cases import get_case, prefill_workload
        w = prefill_workload(get_case(point.case_id), point.shape, point.dtype, point.seed, device, with_tensors)
    elif point.generator == "trace":
        from .trace import read_index
        from .trace_workload import call_workload
        info = read_index(point.trace)
        if info.shape != point.shape:
            raise UserError(f"{point.trace} holds shape {_shape_text(info.shape)}, not the point's "
                            f"{_shape_text(point.shape)}: the file changed since the grid was made")
        w = call_workload(info, point.call, point.dtype, point.seed, device, with_tensors)
    else:
        raise UserError(f"unknown generator {point.generator!r} (known: {', '.join(GENERATORS)})")
    w.meta["point"] = point.key()
    return w
