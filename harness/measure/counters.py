"""Hardware counters per stage through Nsight Compute (ncu).

One ncu run per chunk of points profiles a child process (`python -m msa_bench.harness.measure.counters --spec
FILE --manifest FILE`) that, point after point, builds the workload once and, per backend, plans, runs
the plan once unprofiled (compilation, JIT), then runs each stage once inside an NVTX push/pop range
`msa-counters`. `--nvtx-include msa-counters/` keeps only those kernels, so the warm-up, the
workload build and the plan are never profiled. Before each stage the child launches a one-block-per-
index marker kernel (`msa_counters_marker`, grid = stage index + 1) inside the same range: in ncu's
launch-ordered output every kernel after marker i and before marker i+1 belongs to stage i of the
manifest the child writes. Attribution therefore never depends on kernel names or on how many kernels
a stage launches, and one process start (torch import, CUDA context, Triton and FlashInfer modules)
serves every point and backend of the chunk: the start, not the profiling, was most of the cost.

Per stage we sum, over its kernels: DRAM bytes read and written, L2 (lts) bytes, the L2 sectors that
came from the SMs (srcunit_tex) and from the other L2 partition (srcunit_ltcfabric), tensor-pipe warp
instructions (GMMA and HMMA, sm_90) and kernel time.
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from ...errors import UserError, one_line

RANGE = "msa-counters"
MARKER = "msa_counters_marker"
SECTOR_BYTES = 32
METRICS = {
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "lts__t_bytes.sum": "l2_bytes",
    "sm__inst_executed_pipe_tensor_op_gmma.sum": "tensor_inst_gmma",
    "sm__inst_executed_pipe_tensor_op_hmma.sum": "tensor_inst_hmma",
    "gpu__time_duration.sum": "kernel_time_s",
}
# The L2 traffic by source; if this ncu does not know them, counters are taken without them.
OPTIONAL_METRICS = {
    "lts__t_sectors_srcunit_tex.sum": "l2_sm_sectors",
    "lts__t_sectors_srcunit_ltcfabric.sum": "l2_fabric_sectors",
}
ALL_METRICS = {**METRICS, **OPTIONAL_METRICS}
COUNTER_STATISTICS = ("dram_read_bytes", "dram_write_bytes", "hbm_bytes", "l2_bytes", "l2_sm_bytes",
                      "l2_fabric_bytes", "tensor_inst_gmma", "tensor_inst_hmma", "kernel_time_s", "n_kernels")

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
    return 1.0  # instruction and sector counts: "inst", "sector", "" or a plain number


def _grid_blocks(text: str | None) -> int | None:
    """Blocks in a launch from ncu's "(x, y, z)" Grid Size, None if absent or unreadable."""
    nums = re.findall(r"\d+", text or "")
    if len(nums) != 3:
        return None
    x, y, z = (int(n) for n in nums)
    return x * y * z


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels from ncu `--csv` output (details page: one row per kernel and metric).

    Returns one dict per profiled kernel launch in launch order: {"id", "kernel", "grid_blocks",
    <statistic>: value} with values in base units, statistic names as in ALL_METRICS. Lines before the
    CSV header (==PROF== messages, program output) are skipped.
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
        k = kernels.setdefault(row["ID"], {"id": row["ID"], "kernel": row["Kernel Name"],
                                           "grid_blocks": _grid_blocks(row.get("Grid Size"))})
        metric = row["Metric Name"]
        if metric not in ALL_METRICS:
            continue
        value = _number(row["Metric Value"])
        if value is None:
            continue
        k[ALL_METRICS[metric]] = value * _unit_factor(row["Metric Unit"], metric)
    return sorted(kernels.values(), key=lambda k: int(k["id"]) if k["id"].isdigit() else k["id"])


def sum_kernels(kernels: list[dict]) -> dict[str, float]:
    """Per-stage totals of the parsed kernels."""
    totals = {name: 0.0 for name in COUNTER_STATISTICS}
    for k in kernels:
        for name in METRICS.values():
            totals[name] += k.get(name, 0.0)
        totals["l2_sm_bytes"] += k.get("l2_sm_sectors", 0.0) * SECTOR_BYTES
        totals["l2_fabric_bytes"] += k.get("l2_fabric_sectors", 0.0) * SECTOR_BYTES
    totals["hbm_bytes"] = totals["dram_read_bytes"] + totals["dram_write_bytes"]
    totals["n_kernels"] = float(len(kernels))
    has_sources = any("l2_sm_sectors" in k for k in kernels)
    if not has_sources:        # not collected: absent, not zero
        del totals["l2_sm_bytes"], totals["l2_fabric_bytes"]
    return totals


def split_by_markers(kernels: list[dict], entries: list[list]) -> dict[tuple, list[dict]]:
    """Kernels of each manifest entry (e.g. point, backend, stage): those between its marker and the next."""
    out: dict[tuple, list[dict]] = {tuple(e): [] for e in entries}
    current = None
    seen = 0
    for k in kernels:
        if MARKER in k["kernel"]:
            if seen >= len(entries):
                raise CountersError(f"ncu saw more stage markers than the child launched ({len(entries)})")
            if k.get("grid_blocks") not in (None, seen + 1):
                raise CountersError(f"stage marker {seen} came back with grid {k['grid_blocks']}: "
                                    "ncu dropped or reordered kernels")
            current = tuple(entries[seen])
            seen += 1
        elif current is None:
            raise CountersError(f"ncu profiled kernel {k['kernel']!r} before the first stage marker")
        else:
            out[current].append(k)
    if seen != len(entries):
        raise CountersError(f"ncu returned {seen} of {len(entries)} stage markers (kernel replay failed?)")
    return out


def ncu_command(ncu: str, spec: str, manifest: str, optional: bool = True) -> list[str]:
    metrics = ALL_METRICS if optional else METRICS
    return [ncu, "--clock-control", "none", "--csv", "--page", "details", "--print-units", "base",
            "--target-processes", "all", "--nvtx", "--nvtx-include", f"{RANGE}/",
            "--metrics", ",".join(metrics),
            sys.executable, "-m", "msa_bench.harness.measure.counters", "--spec", spec, "--manifest", manifest]


_optional_ok = True     # cleared once this ncu refuses the optional metrics


def _run_ncu(cmd: list[str], timeout_s: float):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise CountersError(f"ncu timed out after {timeout_s:.0f} s") from None


def _last_line(out) -> str:
    lines = [ln for ln in (out.stderr.strip() or out.stdout.strip()).splitlines()
             if ln.strip() and not ln.startswith('"')]
    errors = [ln for ln in lines if "ERROR" in ln or ln.startswith("error:")]
    return (errors or lines or ["no output"])[-1]


def collect(ncu: str, items: list[tuple[dict, list[str]]], timeout_s: float | None = None) -> dict:
    """Counters for several (point, backends) items from one ncu process.

    Returns {(item index, backend): {stage: totals, "module": sum over stages}}, or {"error": reason}
    for a backend the child could not plan (or a point it could not build). Raises CountersError when
    ncu gives nothing usable.
    """
    global _optional_ok
    timeout_s = timeout_s or 300 + 120 * len(items)
    with tempfile.TemporaryDirectory(prefix="msa-counters-") as tmp:
        spec, manifest_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "manifest.json")
        with open(spec, "w") as f:
            json.dump([{"point": p, "backends": list(b)} for p, b in items], f)
        out = _run_ncu(ncu_command(ncu, spec, manifest_path, _optional_ok), timeout_s)
        if out.returncode != 0 and _optional_ok and any(m in (out.stdout + out.stderr) for m in OPTIONAL_METRICS):
            _optional_ok = False
            out = _run_ncu(ncu_command(ncu, spec, manifest_path, False), timeout_s)
        if out.returncode != 0:
            raise CountersError(f"ncu failed (exit {out.returncode}): {_last_line(out)}")
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
        except (OSError, json.JSONDecodeError):
            raise CountersError(f"the profiled child wrote no stage manifest: {_last_line(out)}") from None
    by_stage = split_by_markers(parse_ncu_csv(out.stdout), manifest["entries"])
    result: dict[tuple, dict] = {}
    for i, backend, why in manifest.get("errors", []):
        result[(i, backend)] = {"error": why}
    for (i, backend, stage), kernels in by_stage.items():
        result.setdefault((i, backend), {})[stage] = sum_kernels(kernels)
    for stages in result.values():
        if "error" in stages:
            continue
        names = set().union(*(s.keys() for s in stages.values()))
        stages["module"] = {n: sum(s.get(n, 0.0) for s in stages.values()) for n in COUNTER_STATISTICS
                            if n in names}
    return result


def point_from_dict(d: dict):
    """Rebuild a scenarios.Point from its as_dict() columns (what the sweep passes to the child)."""
    from dataclasses import fields

    from ...scenarios.grid import SHAPE_KEYS, Point
    from ...scenarios.workload import AttnShape
    names = [f.name for f in fields(Point) if f.name != "shape"]
    optional = {f.name for f in fields(Point) if f.default is None}     # axes added later: absent in older rows
    missing = [n for n in names + list(SHAPE_KEYS) if n not in d and n not in optional]
    if missing:
        raise UserError(f"--point lacks {', '.join(missing)}")
    return Point(**{n: d[n] for n in names if n in d}, shape=AttnShape(**{k: int(d[k]) for k in SHAPE_KEYS}))


def _marker_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def msa_counters_marker(flag_ptr):
        pid = tl.program_id(0)
        tl.store(flag_ptr + pid, pid)

    return msa_counters_marker


def _child(spec_path: str, manifest_path: str) -> None:
    """The profiled process: everything outside the `msa-counters` ranges is filtered out by ncu.

    The manifest is rewritten after every stage, so what ran is on record even if a later one dies.
    """
    import torch

    from ...kernels.base import get_backend
    from ...scenarios.grid import make_workload

    if not torch.cuda.is_available():
        raise UserError("counters need a CUDA GPU")
    with open(spec_path) as f:
        spec = json.load(f)
    marker = _marker_kernel()
    flags = torch.zeros(4096, dtype=torch.int32, device="cuda")
    marker[(1,)](flags)                       # compiled and loaded outside the profiled ranges
    torch.cuda.synchronize()
    entries: list[list] = []
    errors: list[list] = []

    def save():
        with open(manifest_path, "w") as f:
            json.dump({"entries": entries, "errors": errors}, f)

    for i, item in enumerate(spec):
        try:
            workload = make_workload(point_from_dict(item["point"]), torch.device("cuda"))
        except Exception as exc:
            errors += [[i, b, f"workload could not be built: {one_line(exc)}"] for b in item["backends"]]
            continue
        for name in item["backends"]:
            try:
                plan = get_backend(name).plan(workload)
                plan.run()
                torch.cuda.synchronize()
            except Exception as exc:          # reported per backend; the others still get counters
                errors.append([i, name, one_line(exc)])
                continue
            for stage_name, stage in plan.stages.items():
                if len(entries) >= flags.numel():
                    raise UserError("too many stages for the marker buffer")
                torch.cuda.nvtx.range_push(RANGE)
                marker[(len(entries) + 1,)](flags)
                stage()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                entries.append([i, name, stage_name])
            del plan
            save()
        del workload
        torch.cuda.empty_cache()
    save()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON file: [{point: Point.as_dict(), backends: [...]}]")
    parser.add_argument("--manifest", required=True, help="where to write the stage order (JSON)")
    args = parser.parse_args(argv)
    try:
        _child(args.spec, args.manifest)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
