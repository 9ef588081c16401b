"""The recorder's GPU copy path on a CPU: the staging ring (reserve, free oldest first, wrap-around, a full
ring holding record() until the drain frees room, a call larger than the ring), the drain thread (its
errors raised at close, joined after it), and a trace through the ring holding what the plain copy's holds.

The CUDA event and the pinned allocation are stood in for: host memory and an event that a test opens."""
import functools
import json
import struct
import threading
import time

import pytest
import torch

from msa_bench.capture import Recorder, recorder
from msa_bench.capture.recorder import ALIGN, _Stager
from msa_bench.roofline.shape import AttnShape

SHAPE = AttnShape(hq=4, hkv=2, head_dim=16, block=16, topk=4)


class Gate:
    """An event whose synchronize() returns once the test opens it (or raises `error`)."""

    def __init__(self, opened: bool = True, error: Exception | None = None):
        self.open_ = threading.Event()
        self.error = error
        if opened:
            self.open_.set()

    def open(self):
        self.open_.set()

    def synchronize(self):
        assert self.open_.wait(10), "a gate was never opened"
        if self.error is not None:
            raise self.error


class Stand:
    """The stand-ins a _Stager is built with: host memory for pinned, Gates for events (closed when asked)."""

    def __init__(self, closed: bool = False, error: Exception | None = None):
        self.allocs, self.gates, self.closed, self.error = [], [], closed, error

    def alloc(self, nbytes):
        self.allocs.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def mark(self):
        self.gates.append(Gate(opened=not self.closed, error=self.error))
        return self.gates[-1]

    def stager(self, capacity):
        return _Stager(capacity, alloc=self.alloc, mark=self.mark)


def ints(nbytes: int, first: int = 0, dtype=torch.int32) -> torch.Tensor:
    return torch.arange(first, first + nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype)


def put_soon(st: _Stager, fields: dict, into: dict):
    """st.put, failing (not hanging) when it is held for want of room."""
    t = threading.Thread(target=st.put, args=(fields, into), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "put held: no room found"


def until(cond, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def test_room_is_reserved_in_order_freed_oldest_first_and_wraps_around():
    stand = Stand(closed=True)
    st = stand.stager(4 * ALIGN)
    a, b, c = ints(2 * ALIGN, 0), ints(ALIGN, 1000), ints(2 * ALIGN, 2000)
    into = [{}, {}, {}]
    put_soon(st, {"x": a}, into[0])
    put_soon(st, {"x": b}, into[1])
    assert list(st._live) == [(0, 2 * ALIGN), (2 * ALIGN, 3 * ALIGN)]
    a_copy = a.clone()
    a.zero_()                                           # the engine reuses its buffer: the staged copy holds
    stand.gates[0].open()
    until(lambda: len(st._live) == 1)
    assert torch.equal(into[0]["x"], a_copy) and "x" not in into[1]
    put_soon(st, {"x": c}, into[2])                     # no room after b: wraps to the start, over a's bytes
    assert list(st._live) == [(2 * ALIGN, 3 * ALIGN), (0, 2 * ALIGN)]
    d, into_d, done = ints(ALIGN, 3000), {}, threading.Event()
    late = threading.Thread(target=lambda: (st.put({"x": d}, into_d), done.set()))
    late.start()                                        # wrapped, c ends where b starts: no room until b drains
    assert not done.wait(0.2), "put wrote over a call not drained yet"
    stand.gates[1].open()
    assert done.wait(10)
    late.join()
    assert list(st._live) == [(0, 2 * ALIGN), (2 * ALIGN, 3 * ALIGN)]
    for g in stand.gates[2:]:
        g.open()
    st.close()
    assert torch.equal(into[1]["x"], b) and torch.equal(into[2]["x"], c) and torch.equal(into_d["x"], d)
    assert not st._live
    assert stand.allocs == [4 * ALIGN]                  # one ring, reused


def test_fields_are_laid_out_aligned_and_kept_in_any_dtype_and_shape_as_int32():
    stand = Stand(closed=True)
    st = stand.stager(8 * ALIGN)
    sel = torch.arange(24, dtype=torch.int64).view(2, 3, 4).transpose(0, 1)    # not contiguous
    fields = {"selection": sel, "q_position": torch.tensor([5, 6, 7], dtype=torch.int16), "empty": ints(0)}
    into = {}
    put_soon(st, fields, into)
    assert list(st._live) == [(0, 4 * ALIGN)]           # 192 bytes, 6 rounded up to 64, 0: 4 * 64
    stand.gates[0].open()
    st.close()
    for name, t in fields.items():
        assert into[name].dtype == torch.int32 and torch.equal(into[name], t.to(torch.int32)), name


def test_a_full_ring_holds_record_until_the_drain_frees_room():
    stand = Stand(closed=True)
    st = stand.stager(3 * ALIGN)
    into = [{} for _ in range(4)]
    for i in range(3):
        put_soon(st, {"x": ints(ALIGN, 100 * i)}, into[i])
    done = threading.Event()
    late = threading.Thread(target=lambda: (st.put({"x": ints(ALIGN, 300)}, into[3]), done.set()))
    late.start()
    assert not done.wait(0.2), "put went on with the ring full"
    stand.gates[1].open()                               # a later call done first frees nothing: oldest first
    assert not done.wait(0.2)
    stand.gates[0].open()
    assert done.wait(10), "put still held after the oldest call was drained"
    late.join()
    assert st._live[-1] == (0, ALIGN)                   # into the first call's room
    for g in stand.gates[2:]:
        g.open()
    st.close()
    assert [d["x"].tolist()[:2] for d in into] == [[0, 1], [100, 101], [200, 201], [300, 301]]


def test_a_call_larger_than_the_ring_gets_its_own_buffer():
    stand = Stand()
    st = stand.stager(2 * ALIGN)
    big, small = ints(3 * ALIGN, 7), ints(ALIGN, 9)
    into = [{}, {}]
    put_soon(st, {"x": big}, into[0])
    put_soon(st, {"x": small}, into[1])
    st.close()
    assert stand.allocs == [2 * ALIGN, 3 * ALIGN]       # the ring, then the big call's buffer
    assert torch.equal(into[0]["x"], big) and torch.equal(into[1]["x"], small)


def test_flush_returns_once_every_call_so_far_is_on_the_host():
    stand = Stand(closed=True)
    st = stand.stager(2 * ALIGN)
    into = [{}, {}]
    put_soon(st, {"x": ints(ALIGN, 5)}, into[0])
    put_soon(st, {"x": ints(3 * ALIGN, 6)}, into[1])      # its own buffer, not in the ring: flushed all the same
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (st.flush(), done.set()), daemon=True)
    waiter.start()
    stand.gates[0].open()
    assert not done.wait(0.2), "flush returned with a call still on the device"
    stand.gates[1].open()
    assert done.wait(10)
    assert into[0]["x"][0] == 5 and into[1]["x"][0] == 6
    st.flush()                                          # nothing staged since: returns at once
    st.close()


def test_a_drain_error_is_raised_at_close_and_never_holds_record():
    stand = Stand(error=RuntimeError("copy failed"))
    st = stand.stager(2 * ALIGN)
    for i in range(10):                                 # more than the ring holds: each room is still freed
        put_soon(st, {"x": ints(ALIGN, i)}, {})
    with pytest.raises(RuntimeError, match="copy failed"):
        st.close()
    assert not st._thread.is_alive() and not st._live


def on_the_ring(monkeypatch, stand: Stand):
    """Make a Recorder send its CPU tensors through a _Stager built on `stand`, as it does GPU tensors."""
    monkeypatch.setattr(recorder, "_on_gpu", lambda t: True)
    monkeypatch.setattr(recorder, "_Stager", functools.partial(_Stager, alloc=stand.alloc, mark=stand.mark))


def drain_threads():
    return [t for t in threading.enumerate() if t.name == "msa-bench-recorder-drain"]


def contents(path) -> tuple[dict, bytes]:
    """A safetensors file's header and its data bytes. Its bytes as a whole differ from one write to the next
    (safetensors writes the metadata's keys in hash order), so two traces are compared by these."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def record_some(rec: Recorder):
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        rec.step()
        n = 1 + 5 * step                                # the last calls are larger than a small ring
        pos = torch.arange(200 - n, 200, dtype=torch.int32)
        sel = torch.randint(-3, 12, (n, SHAPE.hkv, SHAPE.topk), generator=gen)       # int64, token-major
        req = (torch.arange(n) % 2).int()
        rec.record(0, sel, pos, req, heads_first=False)
        rec.record(1, sel.transpose(0, 1).int(), pos, context=[200, 199], page_table=torch.arange(26).view(2, 13))
        sel.fill_(-1)                                   # the engine writes over its buffers
        pos.zero_()


def test_a_trace_through_the_ring_is_the_plain_copy_s(tmp_path, monkeypatch):
    with Recorder(tmp_path / "plain.safetensors", SHAPE) as rec:
        record_some(rec)
    stand = Stand()
    on_the_ring(monkeypatch, stand)
    monkeypatch.setattr(recorder, "STAGING_BYTES", 1 << 16)
    rec = Recorder(tmp_path / "ring.safetensors", SHAPE)
    record_some(rec)
    assert rec.calls == 12 and len(drain_threads()) == 1 and stand.allocs == [1 << 16]
    rec.close()
    assert not drain_threads()
    assert contents(tmp_path / "ring.safetensors") == contents(tmp_path / "plain.safetensors")


def test_a_small_ring_wraps_and_falls_back_and_still_writes_the_same_trace(tmp_path, monkeypatch):
    with Recorder(tmp_path / "plain.safetensors", SHAPE) as rec:
        record_some(rec)
    stand = Stand()
    on_the_ring(monkeypatch, stand)
    monkeypatch.setattr(recorder, "STAGING_BYTES", 1024)
    with Recorder(tmp_path / "ring.safetensors", SHAPE) as rec:
        record_some(rec)
    assert stand.allocs[0] == 1024 and any(n > 1024 for n in stand.allocs[1:]) and not drain_threads()
    assert contents(tmp_path / "ring.safetensors") == contents(tmp_path / "plain.safetensors")


def test_the_recorder_raises_a_drain_error_at_close_and_writes_nothing(tmp_path, monkeypatch):
    on_the_ring(monkeypatch, Stand(error=RuntimeError("device fault")))
    rec = Recorder(tmp_path / "t.safetensors", SHAPE)
    record_some(rec)
    with pytest.raises(RuntimeError, match="device fault"):
        rec.close()
    assert not drain_threads() and rec.calls == 0 and not (tmp_path / "t.safetensors").exists()
    assert rec.close() is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_ring_s_trace_is_a_synchronous_copy_s(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder, "STAGING_BYTES", 4096)      # small: the ring wraps and fills, large calls pass it
    gen = torch.Generator().manual_seed(0)
    calls = []
    for n in (1, 7, 30, 3, 60, 2, 9, 1, 100, 5, 17):
        sel = torch.randint(-2, 18, (SHAPE.hkv, n, SHAPE.topk), generator=gen).cuda()
        calls.append((sel, torch.arange(300 - n, 300, dtype=torch.int32, device="cuda")))
    with Recorder(tmp_path / "sync.safetensors", SHAPE) as rec:
        for sel, pos in calls:
            rec.record(0, sel.cpu(), pos.cpu())
    rec = Recorder(tmp_path / "gpu.safetensors", SHAPE)
    for sel, pos in calls:
        assert rec.record(0, sel, pos)
        sel.fill_(-1)                                 # the engine's next kernels write over its buffers
        pos.zero_()
    assert rec._stager._ring.is_pinned() and rec._stager.capacity == 4096
    last = rec._calls[-1].tensors
    until(lambda: all(t is not None for t in last.values()))
    assert not any(t.is_pinned() for t in last.values())    # drained into ordinary host memory
    rec.close()
    assert not drain_threads()
    assert contents(tmp_path / "gpu.safetensors") == contents(tmp_path / "sync.safetensors")
