"""What the recorder costs an engine's forward pass, per top-k call: off, sampled out, and recording.

Off must cost next to nothing: the benchmark fails (exit 1) when one call of `wants` + `record` with
recording off takes more than OFF_BOUND_S on average. Recording on a GPU is timed two ways: the host time of
one `record` with room in the recorder's pinned staging ring (each call after `flush`: the non_blocking
copies and an event, what an engine pays when its calls come further apart than the drain takes), and
calls back to back, where the ring fills and each call waits for the drain thread (the rate the recorder
can sustain), next to a synchronous .cpu() copy of the same selection; on a CPU the copy is a plain clone.

    python scripts/capture-overhead.py [--tokens 16384] [--repeat 2000]
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from msa_bench.capture import Recorder
from msa_bench.roofline.shape import AttnShape

OFF_BOUND_S = 2e-6


def per_call(fn, calls: int, sync=None) -> float:
    fn()
    if sync:
        sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if sync:
        sync()
    return (time.perf_counter() - start) / calls


def median_call(fn, calls: int, settle) -> float:
    """The median host time of one fn() call, each made after settle() has returned."""
    times = []
    for _ in range(calls + 1):
        settle()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="query tokens N of each call (default 16384)")
    ap.add_argument("--repeat", type=int, default=2000, help="calls timed per case (default 2000)")
    args = ap.parse_args()
    shape = AttnShape()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sel = torch.randint(0, 1000, (shape.hkv, args.tokens, shape.topk), dtype=torch.int32, device=device)
    pos = torch.arange(args.tokens, dtype=torch.int32, device=device) + 128000
    sync = torch.cuda.synchronize if device == "cuda" else None

    off = Recorder(None, shape)
    t_off = per_call(lambda: off.wants(0) and off.record(0, sel, pos), args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.safetensors"
        skipped = Recorder(out, shape, layers={1})
        t_skip = per_call(lambda: skipped.wants(0) and skipped.record(0, sel, pos), args.repeat)
        n_on = max(1, min(args.repeat, 50))
        on = Recorder(out, shape, max_bytes=1 << 40)
        with_room = median_call(lambda: on.record(0, sel, pos), n_on, on.flush)
        on.flush()
        back_to_back = per_call(lambda: on.record(0, sel, pos), n_on, on.flush)
        t_sync = per_call(lambda: sel.cpu() if device == "cuda" else sel.clone(), n_on, sync)
    mb = (sel.numel() + pos.numel()) * 4 / 1e6
    print(f"device {device}, N {args.tokens} ({mb:.1f} MB recorded a call)")
    print(f"  off:                    {t_off * 1e6:8.3f} us a call (bound {OFF_BOUND_S * 1e6:g} us)")
    print(f"  on, layer not taken:    {t_skip * 1e6:8.3f} us a call")
    print(f"  on, room in the ring:   {with_room * 1e6:8.1f} us a call on the host (median)")
    print(f"  on, back to back:       {back_to_back * 1e6:8.1f} us a call ({mb / back_to_back / 1e3:.2f} GB/s "
          f"sustained); " + ("a synchronous .cpu(): " if device == "cuda" else "a plain .clone(): ")
          + f"{t_sync * 1e6:.1f} us")
    if t_off > OFF_BOUND_S:
        print(f"error: off costs {t_off * 1e6:.3f} us a call, over {OFF_BOUND_S * 1e6:g} us", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
