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
`record` returns at once. On a GPU, `record` reserves room in a pinned staging ring (allocated once, at the
first GPU call, min(max_bytes, STAGING_BYTES) bytes, then reused), issues non_blocking copies into it on the
current stream and records one event: the engine never waits for the copy, only for room when the ring is
full. A daemon thread waits on each call's event, copies its bytes into ordinary host tensors and frees
its room; close() waits for it and writes the file. A call larger than the ring gets a pinned buffer of its
own. CPU tensors are copied at once.
"""
from __future__ import annotations

import os
import queue
import threading
from collections import deque
from dataclasses import dataclass

import torch

from ..roofline.shape import SHAPE_FIELDS, AttnShape
from ..scenarios.trace import index_entry, write_trace

ENV = "MSA_BENCH_TRACE"          # from_env: the trace path; unset or empty: recording off
STAGING_BYTES = 64 << 20         # the pinned staging ring's size at most (it is min(max_bytes, this))
ALIGN = 64                       # each staged tensor starts at a multiple of this many bytes


@dataclass
class _Pending:
    entry: dict
    tensors: dict          # field -> host int32 tensor; a GPU field is None until the drain thread fills it


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _cuda_event():
    event = torch.cuda.Event()
    event.record()
    return event


class _Stager:
    """Device -> host copies through one reused staging ring, drained by a daemon thread.

    alloc(nbytes) gives the (pinned) uint8 staging memory; mark() records and returns an event whose
    synchronize() returns once the copies issued before it are done. Calls are drained in the order they
    were staged, so their room is freed oldest first and the ring's live bytes stay one run, possibly
    wrapped."""

    def __init__(self, capacity: int, alloc=_pinned, mark=_cuda_event):
        self.capacity, self._alloc, self._mark = capacity, alloc, mark
        self._ring = alloc(capacity)
        self._live = deque()            # (start, end) of each staged call not drained yet, oldest first
        self._room = threading.Condition()
        self._queue = queue.SimpleQueue()
        self._staged = self._drained = 0      # calls put, and calls the drain has finished (under _room)
        self._error = None
        self._thread = threading.Thread(target=self._drain, name="msa-bench-recorder-drain", daemon=True)
        self._thread.start()

    def put(self, fields: dict, into: dict) -> None:
        """Copy each tensor of `fields` into `into[name]` as a host int32 tensor, in the background."""
        layout, end = [], 0
        for name, t in fields.items():
            start = -(-end // ALIGN) * ALIGN
            end = start + t.numel() * t.element_size()
            layout.append((name, t, start, end))
        size = max(-(-end // ALIGN) * ALIGN, ALIGN)
        if size > self.capacity:
            region, memory = None, self._alloc(size)
        else:
            region = self._reserve(size)
            memory = self._ring[region[0]:region[1]]
        staged = {}
        try:
            for name, t, a, b in layout:
                staged[name] = memory[a:b].view(t.dtype).view(t.shape)
                staged[name].copy_(t, non_blocking=True)
        finally:                 # queued even when a copy fails: the drain must free its room in turn
            with self._room:
                self._staged += 1
            self._queue.put((staged, into, self._mark(), region))

    def _reserve(self, size: int) -> tuple[int, int]:
        with self._room:
            # The ring is full: the engine thread blocks here until the drain frees the oldest call's room.
            while (start := self._fit(size)) is None:
                self._room.wait()
            self._live.append((start, start + size))
            return start, start + size

    def _fit(self, size: int) -> int | None:
        if not self._live:
            return 0
        tail, head = self._live[0][0], self._live[-1][1]
        if tail < head:                                   # live bytes are [tail, head): room after, then before
            if head + size <= self.capacity:
                return head
            return 0 if size <= tail else None
        return head if head + size <= tail else None      # wrapped: the room is [head, tail)

    def _release(self, region) -> None:
        with self._room:
            if region is not None:
                self._live.popleft()        # drained in staging order: the oldest call's room
            self._drained += 1
            self._room.notify_all()

    def flush(self) -> None:
        """Wait until every call staged so far is on the host."""
        with self._room:
            while self._drained < self._staged:
                self._room.wait()

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            staged, into, event, region = item
            try:
                event.synchronize()
                for name, t in staged.items():
                    into[name] = t.to(torch.int32, copy=True)
            except BaseException as exc:    # kept for close(); the room is freed all the same, or record would hang
                if self._error is None:
                    self._error = exc
            finally:
                self._release(region)

    def close(self) -> None:
        """Wait until every staged call is drained, then stop the thread; raises the first error it met."""
        self._queue.put(None)
        self._thread.join()
        self._ring = None
        if self._error is not None:
            raise self._error


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
        self._stager: _Stager | None = None

    @classmethod
    def from_env(cls, shape, **options) -> "Recorder":
        """Recording to $MSA_BENCH_TRACE when it is set, else off."""
        return cls(os.environ.get(ENV) or None, shape, **options)

    # ---- in the engine's forward pass -------------------------------------------------------------

    def step(self) -> None:
        """Count one engine step (one forward pass over every layer)."""
        if self.on:
            self.steps += 1

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
        entry = {"call": len(self._calls), "layer": int(layer), "step": self._step, "weight": float(self.every)}
        self._calls.append(_Pending(entry, self._to_host(fields)))
        return True

    def _to_host(self, fields: dict) -> dict:
        host = dict.fromkeys(fields)              # the fields' order, whichever copy fills them first
        gpu = {}
        for name, t in fields.items():
            if _on_gpu(t):
                gpu[name] = t
            else:                                 # the engine may reuse its buffer: a copy of its own
                host[name] = t.to(torch.int32, copy=True)
        if gpu:
            if self._stager is None:
                self._stager = _Stager(min(self.max_bytes, STAGING_BYTES))
            self._stager.put(gpu, host)
        return host

    # ---- after the run ----------------------------------------------------------------------------

    @property
    def calls(self) -> int:
        return len(self._calls)

    def flush(self) -> None:
        """Wait until every call recorded so far is in host memory."""
        if self._stager is not None:
            self._stager.flush()

    def close(self):
        """Write the trace (when recording and anything was kept); returns its path, else None."""
        if self._stager is not None:
            stager, self._stager = self._stager, None
            try:
                stager.close()
            except BaseException:
                self._calls = []          # some copies never arrived: no trace to write
                raise
        if not self.on or not self._calls:
            return None
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
