"""One worker of `sweep --gpus` (harness/running/pool.py): `python -m msa_bench.harness.running.worker`, pinned to its
GPU by the CUDA_VISIBLE_DEVICES its parent set.

It reads its configuration (run folder, the request's grid options, the grid digest, its name) as the
first line of stdin, resolves the same grid, then runs each unit id it is dealt, one JSON line in,
JSON lines out: {"ready"}, {"state"}, {"done": uid, "status", "seconds"}; notes ride along. stdout is
the protocol alone: anything else a library prints goes to stderr, which the parent logs. It keeps
the last point's workload for the next unit of the same point, and ends when stdin closes.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

UNIT_LOG_HOOK = "MSA_BENCH_UNIT_LOG"        # test hook: append "<worker> <unit>" to this file as a unit starts
KILL_HOOK = "MSA_BENCH_KILL_WORKER"         # test hook: a unit id (any worker that runs it) or "once:<path>" (the
                                            # first worker to start a unit, which claims <path>) SIGKILLs itself mid-unit


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(msg: dict) -> None:
        proto.write(json.dumps(msg, default=str) + "\n")

    config = json.loads(sys.stdin.readline())
    import torch

    from .request import SweepRequest, resolve
    from .runner import Runner, build_workload, free_device_memory, label
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    notes: list[str] = []
    grid = resolve(SweepRequest(**config["request"]), device, notes)
    if grid.grid_sha != config["grid_sha"]:
        print(f"worker {config['worker']}: this grid ({grid.grid_sha[:12]}) is not the run's "
              f"({config['grid_sha'][:12]})", file=sys.stderr)
        return 3
    units = grid.units()
    name = config["worker"]
    runner = Runner(Path(config["run_dir"]), device, grid.timing, False, notes, where={"worker": name})
    send({"ready": name, "notes": notes})
    kill = os.environ.get(KILL_HOOK, "")
    held_key, workload, wl_stats, why = None, None, {}, None
    nth = 0
    for line in iter(sys.stdin.readline, ""):
        uid = json.loads(line)["unit"]
        point, backend = units[uid]
        start = time.monotonic()
        if os.environ.get(UNIT_LOG_HOOK):
            with open(os.environ[UNIT_LOG_HOOK], "a") as log:
                log.write(f"{name} {uid}\n")
        if point.key() != held_key:
            workload = None
            if device.type == "cuda":
                free_device_memory()
            send({"state": f"{label(point)} · building workload"})
            workload, wl_stats, why = build_workload(point, device)
            held_key, nth = point.key(), 0
        send({"state": f"{label(point)} · {backend}"})
        if kill == uid or (kill.startswith("once:") and _claim(kill.removeprefix("once:"))):
            os.kill(os.getpid(), signal.SIGKILL)
        status = runner.run_unit(point, backend, workload, wl_stats, why, nth)
        nth += 1
        send({"done": uid, "status": status["status"], "seconds": time.monotonic() - start, "notes": notes})
    return 0


def _claim(path: str) -> bool:
    """True for the one process that creates `path` (KILL_HOOK "once:"): the workers race for it."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


if __name__ == "__main__":
    sys.exit(main())
