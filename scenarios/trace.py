"""Selection traces: a model's own top-k selections, captured call by call, in one safetensors file.

The format is described for users in docs/trace-format.md; this module is its one reader and writer.

    metadata "format"     = "msa-bench-trace"
             "version"    = "1"
             "shape"      = JSON {"hq", "hkv", "head_dim", "block", "topk"}
             "provenance" = JSON object, free-form (model, engine, prompt set, ...)
             "index"      = JSON list, one entry per call: {"call", "layer", "step", "weight", "tokens",
                            "requests", "context", "pages", "page_table"}
    tensors  call.<call:06d>.selection   int32 [Hkv, N, topk]   logical block ids, -1 padding
             call.<call:06d>.q_request   int32 [N]              request of each query token, 0 to R - 1
             call.<call:06d>.q_position  int32 [N]              its position within its request
             call.<call:06d>.context     int32 [R]              each request's context length (tokens)
             call.<call:06d>.page_table  int32 [R, W]           optional: block -> page of the engine's cache

Every call is causal, as a serving engine's prefill and decode are: a query sees the keys at positions up to
its own. safetensors reads one tensor without the others (safe_open), so a call is read on its own.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ..errors import UserError
from ..roofline.shape import SHAPE_FIELDS, AttnShape, ShapeError

FORMAT = "msa-bench-trace"
VERSION = 1
FIELDS = ("selection", "q_request", "q_position", "context")
OPTIONAL = ("page_table",)
INDEX_KEYS = ("call", "layer", "step", "weight", "tokens", "requests", "context", "pages", "page_table")


class TraceError(UserError, ValueError):
    """A trace that cannot be read or used; the message is one line naming the file."""


def tensor_name(call: int, field: str) -> str:
    return f"call.{call:06d}.{field}"


@dataclass(frozen=True)
class CallEntry:
    """One call of a trace's index: enough to plan a sweep without reading its tensors."""
    call: int
    layer: int
    step: int | None
    weight: float           # engine calls this record stands for (1 / the sampling rate)
    tokens: int
    requests: int
    context: int            # the longest request's context, tokens
    pages: int              # pages of the workload built from it
    page_table: bool


@dataclass(frozen=True)
class TraceInfo:
    path: str
    shape: AttnShape
    provenance: dict
    calls: tuple[CallEntry, ...]

    @property
    def name(self) -> str:
        return Path(self.path).name.removesuffix(".safetensors")

    def entry(self, call: int) -> CallEntry:
        for e in self.calls:
            if e.call == call:
                return e
        raise TraceError(f"{self.path}: no call {call} (it holds {describe_ids([e.call for e in self.calls])})")


@dataclass
class TraceCall:
    entry: CallEntry
    selection: torch.Tensor      # [Hkv, N, topk] int32
    q_request: torch.Tensor      # [N] int32
    q_position: torch.Tensor     # [N] int32
    context: torch.Tensor        # [R] int32
    page_table: torch.Tensor | None


# ---- writing -------------------------------------------------------------------------------------

def call_pages(context: list[int], block: int, page_table: torch.Tensor | None) -> int:
    """Pages of the workload a call becomes: the distinct pages its requests' blocks use (a recorded page
    table's sharing kept), else one per block of every request."""
    blocks = [-(-c // block) for c in context]
    if page_table is None:
        return sum(max(1, b) for b in blocks)
    used = torch.cat([page_table[r, :b].long() for r, b in enumerate(blocks)])
    return int(torch.unique(used[used >= 0]).numel()) or 1


def index_entry(call: int, layer: int, step: int | None, weight: float, selection: torch.Tensor,
                context: torch.Tensor, block: int, page_table: torch.Tensor | None) -> dict:
    ctx = [int(c) for c in context.tolist()]
    return {"call": call, "layer": layer, "step": step, "weight": weight, "tokens": int(selection.shape[1]),
            "requests": len(ctx), "context": max(ctx, default=0), "pages": call_pages(ctx, block, page_table),
            "page_table": page_table is not None}


def write_trace(path, shape: AttnShape, calls: list[tuple[dict, dict]], provenance: dict | None = None) -> Path:
    """Write (index entry, {field: host int32 tensor}) pairs as one trace file; returns its path."""
    from safetensors.torch import save_file
    tensors, index = {}, []
    for entry, fields in calls:
        index.append(entry)
        for field, t in fields.items():
            if t is not None:
                tensors[tensor_name(entry["call"], field)] = t.to(torch.int32).contiguous()
    meta = {"format": FORMAT, "version": str(VERSION),
            "shape": json.dumps({k: getattr(shape, k) for k in SHAPE_FIELDS}),
            "provenance": json.dumps(provenance or {}), "index": json.dumps(index, separators=(",", ":"))}
    path = Path(path)
    save_file(tensors, str(path), metadata=meta)
    return path


# ---- reading -------------------------------------------------------------------------------------

def _open(path):
    from safetensors import safe_open
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace {path} does not exist" if not p.exists() else f"trace {path} is not a file")
    try:
        return safe_open(str(p), "pt")
    except Exception as exc:       # safetensors raises its own error type for a damaged header
        raise TraceError(f"{path}: not a safetensors file ({' '.join(str(exc).split())})") from None


def _json(path, meta: dict, key: str, kind):
    if key not in meta:
        raise TraceError(f"{path}: metadata has no {key!r} (docs/trace-format.md)")
    try:
        value = json.loads(meta[key])
    except ValueError:
        raise TraceError(f"{path}: metadata {key!r} is not JSON") from None
    if not isinstance(value, kind):
        raise TraceError(f"{path}: metadata {key!r} must be a JSON {kind.__name__}")
    return value


def _entry(path, raw, shape: AttnShape) -> CallEntry:
    if not isinstance(raw, dict) or set(raw) != set(INDEX_KEYS):
        raise TraceError(f"{path}: an index entry must hold exactly {', '.join(INDEX_KEYS)}, got {raw!r}"[:300])
    ints = ("call", "layer", "tokens", "requests", "context", "pages")
    bad = [k for k in ints if not isinstance(raw[k], int) or isinstance(raw[k], bool) or raw[k] < 0]
    if bad or not (raw["step"] is None or isinstance(raw["step"], int)) or not isinstance(raw["page_table"], bool) \
            or not isinstance(raw["weight"], (int, float)) or not math.isfinite(raw["weight"]) or raw["weight"] <= 0:
        raise TraceError(f"{path}: index entry of call {raw.get('call')!r}: {bad[0] if bad else 'step, weight or page_table'} "
                         "has a wrong type or value")
    if raw["tokens"] == 0 or raw["requests"] == 0:
        raise TraceError(f"{path}: call {raw['call']} holds no query tokens or no requests")
    return CallEntry(raw["call"], raw["layer"], raw["step"], float(raw["weight"]), raw["tokens"], raw["requests"],
                     raw["context"], raw["pages"], raw["page_table"])


def read_index(path) -> TraceInfo:
    """The trace's shape, provenance and index, without reading any call's tensors. Read and checked once
    per version of the file: a sweep asks for it at every point (its pages, its shape)."""
    try:
        st = Path(path).stat()
    except OSError:
        return _read_index(path)             # _open says why, in one line
    return _cached_index(str(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=16)
def _cached_index(path: str, mtime_ns: int, size: int) -> TraceInfo:
    return _read_index(path)


def _read_index(path) -> TraceInfo:
    with _open(path) as f:
        meta = f.metadata() or {}
        names = set(f.keys())
    if meta.get("format") != FORMAT:
        raise TraceError(f"{path}: not a selection trace (metadata format is {meta.get('format')!r}, "
                         f"expected {FORMAT!r})")
    if meta.get("version") != str(VERSION):
        raise TraceError(f"{path}: trace format version {meta.get('version')!r}; this msa-bench reads version {VERSION}")
    raw_shape = _json(path, meta, "shape", dict)
    try:
        shape = AttnShape(**{k: int(raw_shape[k]) for k in SHAPE_FIELDS})
    except (KeyError, TypeError, ValueError, ShapeError) as exc:
        raise TraceError(f"{path}: metadata shape {raw_shape} is not an attention shape ({exc})") from None
    entries = [_entry(path, raw, shape) for raw in _json(path, meta, "index", list)]
    if not entries:
        raise TraceError(f"{path}: the trace holds no calls")
    ids = [e.call for e in entries]
    if len(set(ids)) != len(ids):
        raise TraceError(f"{path}: the index lists a call twice")
    for e in entries:
        need = FIELDS + (OPTIONAL if e.page_table else ())
        missing = [f for f in need if tensor_name(e.call, f) not in names]
        if missing:
            raise TraceError(f"{path}: call {e.call} has no tensor {tensor_name(e.call, missing[0])}")
    return TraceInfo(str(path), shape, _json(path, meta, "provenance", dict), tuple(entries))


def read_call(info: TraceInfo, call: int) -> TraceCall:
    """One call's tensors (only its own are read), checked against the shape and the index."""
    e = info.entry(call)
    with _open(info.path) as f:
        got = {field: f.get_tensor(tensor_name(call, field))
               for field in FIELDS + (OPTIONAL if e.page_table else ())}
    where = f"{info.path}: call {call}"
    for field, t in got.items():
        if t.dtype != torch.int32:
            raise TraceError(f"{where}: {field} is {t.dtype}, the format stores int32")
    s, sel = info.shape, got["selection"]
    want = (s.hkv, e.tokens, s.topk)
    if tuple(sel.shape) != want:
        raise TraceError(f"{where}: selection is {list(sel.shape)}, the trace's shape and index say "
                         f"[Hkv {s.hkv}, N {e.tokens}, top-k {s.topk}]")
    for field, dims in (("q_request", (e.tokens,)), ("q_position", (e.tokens,)), ("context", (e.requests,))):
        if tuple(got[field].shape) != dims:
            raise TraceError(f"{where}: {field} is {list(got[field].shape)}, expected {list(dims)}")
    table = got.get("page_table")
    if table is not None and (table.dim() != 2 or table.shape[0] != e.requests):
        raise TraceError(f"{where}: page_table is {list(table.shape)}, expected [{e.requests} requests, blocks]")
    return TraceCall(e, sel, got["q_request"], got["q_position"], got["context"], table)


def describe_ids(ids: list[int]) -> str:
    """Call ids as ranges: 0-7, 9, 12-13."""
    ids, out = sorted(ids), []
    for i in ids:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def select_calls(info: TraceInfo, spec: str | None) -> list[CallEntry]:
    """The calls a spec names ("0-7,12"; None: all), in the trace's order; an unknown id is a TraceError."""
    if spec is None:
        return list(info.calls)
    wanted = set()
    for part in spec.split(","):
        a, _, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b) if b else int(a)
        except ValueError:
            raise TraceError(f"calls {spec!r}: expected call ids and ranges such as 0-7,12") from None
        if hi < lo:
            raise TraceError(f"calls {spec!r}: range {part.strip()} runs backwards")
        wanted.update(range(lo, hi + 1))
    have = {e.call for e in info.calls}
    missing = sorted(wanted - have)
    if missing:
        raise TraceError(f"{info.path}: no call {missing[0]} (it holds {describe_ids(sorted(have))})")
    return [e for e in info.calls if e.call in wanted]
