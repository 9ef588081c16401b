"""Hardware counters per stage through Nsight Compute (ncu).

For one (point, backend), one ncu run per stage profiles a small child process
(`python -m msa_bench.harness.counters --point JSON --backend NAME`) that builds the workload, plans,
runs the plan once unprofiled (compilation, JIT), then runs each stage once inside an NVTX push/pop
range named after it. `--nvtx --nvtx-include "<stage>/"` keeps only the kernels of that stage, so
attribution never depends on kernel names. Per stage we sum, over its kernels: DRAM bytes read and
written, L2 (lts) bytes, tensor-pipe warp instructions (GMMA and HMMA, sm_90) and kernel time.
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys

from .errors import UserError

METRICS = {
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "lts__t_bytes.sum": "l2_bytes",
    "sm__inst_executed_pipe_tensor_op_gmma.sum": "tensor_inst_gmma",
    "sm__inst_executed_pipe_tensor_op_hmma.sum": "tensor_inst_hmma",
    "gpu__time_duration.sum": "kernel_time_s",
}
COUNTER_STATISTICS = ("dram_read_bytes", "dram_write_bytes", "hbm_bytes", "l2_bytes", "tensor_inst_gmma",
                      "tensor_inst_hmma", "kernel_time_s", "n_kernels")

_SI = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_TIME = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3,
         "second": 1.0, "s": 1.0}


class CountersError(RuntimeError):
    """ncu ran but gave no usable counters; the message is one line."""


def find_ncu() -> str | None:
    """ncu on PATH, else the usual install places; None if there is none."""
    found = shutil.which("ncu")
    if found:
        return found
    candidates = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)
    candidates += ["/usr/local/cuda/bin/ncu"]
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    if text in ("", "n/a", "N/A"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _unit_factor(unit: str, metric: str) -> float:
    """Factor to base units (bytes, seconds, counts) for ncu's unit strings (SI prefixes, base 1000)."""
    unit = unit.strip()
    if metric == "gpu__time_duration.sum":
        if unit not in _TIME:
            raise CountersError(f"unexpected time unit {unit!r} for {metric}")
        return _TIME[unit]
    for suffix in ("byte", "B"):
        if unit.endswith(suffix):
            prefix = unit[: -len(suffix)].upper()
            if prefix in _SI:
                return _SI[prefix]
    return 1.0  # instruction counts: "inst", "" or a plain number


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels from ncu `--csv` output (details page: one row per kernel and metric).

    Returns one dict per profiled kernel launch in launch order: {"id", "kernel", <statistic>: value}
    with values in base units, statistic names as in METRICS. Lines before the CSV header (==PROF==
    messages, program output) are skipped.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    needed = {"ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"}
    if not needed <= set(reader.fieldnames or ()):
        raise CountersError(f"ncu CSV lacks columns {sorted(needed - set(reader.fieldnames or ()))}")
    kernels: dict[str, dict] = {}
    for row in reader:
        if row.get("ID") is None or row["ID"].startswith("=="):
            continue
        metric = row["Metric Name"]
        if metric not in METRICS:
            continue
        value = _number(row["Metric Value"])
        if value is None:
            continue
        k = kernels.setdefault(row["ID"], {"id": row["ID"], "kernel": row["Kernel Name"]})
        k[METRICS[metric]] = value * _unit_factor(row["Metric Unit"], metric)
    return list(kernels.values())


def sum_kernels(kernels: list[dict]) -> dict[str, float]:
    """Per-stage totals of the parsed kernels."""
    totals = {name: 0.0 for name in COUNTER_STATISTICS}
    for k in kernels:
        for name in METRICS.values():
            totals[name] += k.get(name, 0.0)
    totals["hbm_bytes"] = totals["dram_read_bytes"] + totals["dram_write_bytes"]
    totals["n_kernels"] = float(len(kernels))
    return totals


def ncu_command(ncu: str, stage: str, point_json: str, backend: str) -> list[str]:
    return [ncu, "--clock-control", "none", "--csv", "--page", "details", "--print-units", "base",
            "--target-processes", "all", "--nvtx", "--nvtx-include", f"{stage}/",
            "--metrics", ",".join(METRICS),
            sys.executable, "-m", "msa_bench.harness.counters", "--point", point_json, "--backend", backend]


def collect(ncu: str, point_json: str, backend: str, stages: list[str], timeout_s: float = 1800) -> dict:
    """{stage: totals} for each stage plus "module" (sum over stages). Raises CountersError."""
    result = {}
    for stage in stages:
        cmd = ncu_command(ncu, stage, point_json, backend)
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise CountersError(f"ncu timed out after {timeout_s:.0f} s on stage {stage}") from None
        if out.returncode != 0:
            tail = (out.stderr.strip() or out.stdout.strip()).splitlines()[-1:] or ["no output"]
            raise CountersError(f"ncu failed on stage {stage} (exit {out.returncode}): {tail[0]}")
        result[stage] = sum_kernels(parse_ncu_csv(out.stdout))
    module = {name: sum(result[s][name] for s in stages) for name in COUNTER_STATISTICS}
    result["module"] = module
    return result


def point_from_dict(d: dict):
    """Rebuild a scenarios.Point from its as_dict() columns (what the sweep passes to the child)."""
    from dataclasses import fields

    from .scenarios import SHAPE_KEYS, Point
    from .workload import AttnShape
    names = [f.name for f in fields(Point) if f.name != "shape"]
    missing = [n for n in names + list(SHAPE_KEYS) if n not in d]
    if missing:
        raise UserError(f"--point lacks {', '.join(missing)}")
    return Point(**{n: d[n] for n in names}, shape=AttnShape(**{k: int(d[k]) for k in SHAPE_KEYS}))


def _child(point_json: str, backend_name: str) -> None:
    """The profiled process: everything outside the stage ranges is filtered out by ncu."""
    import torch

    from ..kernels.base import get_backend
    from .scenarios import make_workload

    if not torch.cuda.is_available():
        raise UserError("counters need a CUDA GPU")
    point = point_from_dict(json.loads(point_json))
    workload = make_workload(point, torch.device("cuda"))
    plan = get_backend(backend_name).plan(workload)
    plan.run()
    torch.cuda.synchronize()
    for name, stage in plan.stages.items():
        torch.cuda.nvtx.range_push(name)
        stage()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", required=True, help="the point as JSON (Point.as_dict())")
    parser.add_argument("--backend", required=True)
    args = parser.parse_args(argv)
    try:
        _child(args.point, args.backend)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
