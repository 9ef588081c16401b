"""The recorder: a model's top-k selections, call by call, into a selection trace (docs/trace-format.md).

Put one `record(...)` right after the indexer's top-k in any PyTorch engine (docs/capture.md):

    rec = Recorder("trace.safetensors", shape, every=8, layers={0, 30, 61}, max_bytes=256 << 20,
                   provenance={"model": ..., "engine": ..., "prompts": ...})
    ...
    rec.step()                                    # once per engine step (forward pass)
    if rec.wants(layer):                          # cheap: skip building the extra tensors when not
        rec.record(layer, topk_ids, positions, requests, context)
    ...
    rec.close()                                   # writes the file

Off (`Recorder(None, ...)`, or `Recorder.from_env` without MSA_BENCH_TRACE set), `wants` is False and
`record` returns at once. On a GPU each tensor is copied into pinned host memory with non_blocking on the
current stream and an event marks it done: the engine never waits for the copy. Finished copies are taken
at the next step and at close.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..roofline.shape import SHAPE_FIELDS, AttnShape
from ..scenarios.trace import index_entry, write_trace

ENV = "MSA_BENCH_TRACE"          # from_env: the trace path; unset or empty: recording off


@dataclass
class _Pending:
    entry: dict
    tensors: dict          # field -> host int32 tensor (pinned when copied from a GPU)
    event: object | None   # torch.cuda.Event marking the copies done, or None (copied already)


class Recorder:
    """Records sampled top-k calls and writes them as one trace at close.

    every: record only steps 0, every, 2 * every, ... (step() counts them); layers: only these layer ids
    (None: all); max_bytes: stop recording once the tensors held would pass this many bytes (later calls are
    counted in `dropped`)."""

    def __init__(self, path, shape, *, every: int = 1, layers=None, max_bytes: int = 256 << 20,
                 provenance: dict | None = None):
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.path = None if path in (None, "") else os.fspath(path)
        self.on = self.path is not None
        self.shape = shape if isinstance(shape, AttnShape) else AttnShape(**{k: shape[k] for k in SHAPE_FIELDS})
        self.every, self.max_bytes = every, max_bytes
        self.layers = None if layers is None else frozenset(int(x) for x in layers)
        self.provenance = dict(provenance or {})
        self.steps = 0              # step() calls so far; the current step is steps - 1 (0 before any)
        self.bytes = 0
        self.dropped = 0            # calls sampled but not recorded: over max_bytes
        self._calls: list[_Pending] = []

    @classmethod
    def from_env(cls, shape, **options) -> "Recorder":
        """Recording to $MSA_BENCH_TRACE when it is set, else off."""
        return cls(os.environ.get(ENV) or None, shape, **options)

    # ---- in the engine's forward pass -------------------------------------------------------------

    def step(self) -> None:
        """Count one engine step (one forward pass over every layer)."""
        if self.on:
            self.steps += 1
            self._collect(wait=False)

    @property
    def _step(self) -> int:
        return max(self.steps - 1, 0)

    def wants(self, layer: int) -> bool:
        """Whether record() would keep a call of `layer` now: recording on, a sampled step, a chosen layer,
        room left under max_bytes."""
        return (self.on and self._step % self.every == 0 and (self.layers is None or layer in self.layers)
                and self.bytes < self.max_bytes)

    def record(self, layer: int, selection: torch.Tensor, positions: torch.Tensor, requests=None, context=None,
               page_table=None, heads_first: bool = True) -> bool:
        """Keep one top-k call; True when kept.

        selection: block ids [Hkv, N, topk] (heads_first) or [N, Hkv, topk], -1 (or any negative) padding;
        positions: [N] each query token's position in its request; requests: [N] its request, 0 to R - 1
        (None: one request); context: [R] each request's context length in tokens (None: its last query
        position + 1, worked out at close); page_table: [R, blocks] the engine's block -> page map, optional.
        """
        if not self.on or not self.wants(layer):
            return False
        sel = selection if heads_first else selection.transpose(0, 1)
        s = self.shape
        if sel.dim() != 3 or sel.shape[0] != s.hkv or sel.shape[2] != s.topk:
            raise ValueError(f"selection {list(selection.shape)} is not [Hkv {s.hkv}, N, top-k {s.topk}]"
                             f"{'' if heads_first else ' transposed'}")
        if requests is None:
            requests = torch.zeros(sel.shape[1], dtype=torch.int32, device=positions.device)
        fields = {"selection": sel, "q_request": requests, "q_position": positions}
        if context is not None:      # else derived on the host at close: its size would need a device sync here
            fields["context"] = torch.as_tensor(context)
        if page_table is not None:
            fields["page_table"] = torch.as_tensor(page_table)
        size = sum(t.numel() * 4 for t in fields.values())
        if self.bytes + size > self.max_bytes:
            self.dropped += 1
            self.bytes = self.max_bytes          # full: wants() is False from now on
            return False
        self.bytes += size
        host, event = self._to_host(fields)
        entry = {"call": len(self._calls), "layer": int(layer), "step": self._step, "weight": float(self.every)}
        self._calls.append(_Pending(entry, host, event))
        return True

    def _to_host(self, fields: dict) -> tuple[dict, object | None]:
        cuda = any(t.is_cuda for t in fields.values())
        host = {}
        for name, t in fields.items():
            if t.is_cuda:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
            else:                                 # the engine may reuse its buffer: a copy of its own
                buf = t.to(torch.int32, copy=True)
            host[name] = buf
        if not cuda:
            return host, None
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _collect(self, wait: bool) -> None:
        """Drop the events of copies that finished (all of them, waiting, when `wait`)."""
        for p in self._calls:
            if p.event is not None and (wait or p.event.query()):
                if wait:
                    p.event.synchronize()
                p.event = None

    # ---- after the run ----------------------------------------------------------------------------

    @property
    def calls(self) -> int:
        return len(self._calls)

    def close(self):
        """Write the trace (when recording and anything was kept); returns its path, else None."""
        if not self.on or not self._calls:
            return None
        self._collect(wait=True)
        b = self.shape.block
        calls = []
        for p in self._calls:
            t = {name: x.to(torch.int32) for name, x in p.tensors.items()}
            t["selection"] = t["selection"].clamp(min=-1)     # any negative id is padding
            if "context" not in t:
                req, pos = t["q_request"].long(), t["q_position"].long()
                t["context"] = torch.zeros(int(req.max()) + 1, dtype=torch.int64).scatter_reduce(
                    0, req, pos + 1, "amax").to(torch.int32)
            entry = {**p.entry, **index_entry(p.entry["call"], p.entry["layer"], p.entry["step"], p.entry["weight"],
                                              t["selection"], t["context"], b, t.get("page_table"))}
            calls.append((entry, t))
        provenance = {**self.provenance, "recorder": {"every": self.every, "max_bytes": self.max_bytes,
                                                      "layers": None if self.layers is None else sorted(self.layers),
                                                      "steps": self.steps, "dropped": self.dropped}}
        path = write_trace(self.path, self.shape, calls, provenance)
        self._calls = []
        return path

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
