"""Where a CuTe attention kernel's consumer warps spend their time, from an ncu per-SASS source table.

    python3 benchmarks/ncu_regions.py results/h200/bench/2026-11-29-s5-call2/ncu/source_v18_bf16.csv.gz

Reads the table `benchmarks/cute_ncu.py --source` writes (`ncu --page source --csv --print-source sass`:
two header lines, then one row per SASS instruction with its address, text, warp-state samples, executed
count and per-reason stall samples). Runs on the CPU, no GPU or ncu needed.

The consumer loop is the backward branch whose body holds the most warpgroup MMA instructions (HGMMA
for bf16, QGMMA for fp8). It is cut where
the pipelined consumers (v9 and later) change phase:
- top: the waits for the next tile's Q and K/V, up to the first warpgroup MMA;
- issue: the S(t+1) and P(t) V wgmma groups, up to `WARPGROUP.DEPBAR.LE gsb0, 0x1` (wait for S);
- softmax: from that wait to `WARPGROUP.DEPBAR.LE gsb0, 0x0` (wait for P V);
- store_o: the O conversion, staging and TMA store, up to `UTMACMDFLUSH`;
- after_store: P(t+1) into the operand registers and the loop's bookkeeping.
A kernel without one of the cut points (fp8 P V without register P has no separate issue group) simply
has fewer regions. A consumer that is not pipelined (v23, v28: no wait for all but one group) is cut at
its own points instead: top (Q and K/V waits), S issue, wait S (the one waiting instruction), softmax
(up to P V's first wgmma, so P's conversion included), P V issue, wait P V, store_o, after_store.
Each region's share is of all the kernel's samples; with the producer warpgroup sampled alongside,
the consumer loop holds about two thirds of them.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import re
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
def is_wgmma(text: str) -> bool:
    return re.match(r"[HQI]GMMA", text) is not None          # bf16/fp16, fp8 and integer warpgroup MMA


CUTS = (("issue", is_wgmma),
        ("softmax", lambda t: "WARPGROUP.DEPBAR.LE gsb0, 0x1" in t),
        ("store_o", lambda t: "WARPGROUP.DEPBAR.LE gsb0, 0x0" in t),
        ("after_store", lambda t: "UTMACMDFLUSH" in t))


def read_table(path: Path) -> tuple[list[str], list[list[str]]]:
    raw = gzip.open(path, "rt") if str(path).endswith(".gz") else open(path, newline="")
    with raw as f:
        rows = list(csv.reader(io.StringIO(f.read())))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return rows[header_at], rows[header_at + 1:]


def instructions(header: list[str], rows: list[list[str]]) -> list[dict]:
    col = {h: i for i, h in enumerate(header)}
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in rows:
        text = re.sub(r"^@!?U?P\w+\s+", "", r[col["Source"]].strip())
        out.append({"address": int(r[col["Address"]], 16), "text": text,
                    "samples": int(r[col[SAMPLES]] or 0), "executed": int(r[col[EXECUTED]] or 0),
                    "stalls": {h[len("stall_"):]: int(r[col[h]]) for h in stall_cols if r[col[h]] not in ("", "0")}})
    return out


def consumer_loop(ins: list[dict]) -> list[dict]:
    """The instructions of the backward-branch loop with the most warpgroup MMAs (ties: the longest)."""
    at = {i["address"]: n for n, i in enumerate(ins)}
    best, best_key = None, (-1, -1)
    for n, i in enumerate(ins):
        m = re.match(r"BRA\s+(0x[0-9a-f]+)", i["text"])
        if not m:
            continue
        start = at.get(int(m.group(1), 16))
        if start is not None and start < n:
            body = ins[start:n + 1]
            key = (sum(is_wgmma(b["text"]) for b in body), len(body))
            if key > best_key:
                best, best_key = body, key
    if best is None or best_key[0] == 0:
        raise ValueError("no loop with warpgroup MMA (HGMMA / QGMMA) instructions in this table")
    return best


def _find(loop: list[dict], hit, start: int) -> int | None:
    """Index of the first instruction at or after `start` whose text `hit` accepts."""
    return next((k for k in range(start, len(loop)) if hit(loop[k]["text"])), None)


def _split(loop: list[dict], cuts: list[tuple[str, int]]) -> list[tuple[str, list[dict]]]:
    """The loop cut into named regions, each from its start index to the next one's."""
    return [(name, loop[k:(cuts[j + 1][1] if j + 1 < len(cuts) else len(loop))]) for j, (name, k) in enumerate(cuts)]


def _serial_regions(loop: list[dict]) -> list[tuple[str, list[dict]]] | None:
    """v23's consumer (not pipelined: S, wait, softmax, P V, wait, store), or None for another loop. The
    two waits for a wgmma group are regions of one instruction each, so their samples read apart."""
    wait0 = lambda t: "WARPGROUP.DEPBAR.LE gsb0, 0x0" in t
    if _find(loop, lambda t: "WARPGROUP.DEPBAR.LE gsb0, 0x1" in t, 0) is not None:
        return None
    s_issue = _find(loop, is_wgmma, 0)
    s_wait = _find(loop, wait0, s_issue + 1) if s_issue is not None else None
    pv_issue = _find(loop, is_wgmma, s_wait + 1) if s_wait is not None else None
    pv_wait = _find(loop, wait0, pv_issue + 1) if pv_issue is not None else None
    if pv_wait is None:
        return None
    flush = _find(loop, lambda t: "UTMACMDFLUSH" in t, pv_wait + 1)
    cuts = [("top", 0), ("S issue", s_issue), ("wait S", s_wait), ("softmax", s_wait + 1),
            ("P V issue", pv_issue), ("wait P V", pv_wait), ("store_o", pv_wait + 1)]
    if flush is not None:
        cuts.append(("after_store", flush + 1))
    return _split(loop, cuts)


def regions(loop: list[dict]) -> list[tuple[str, list[dict]]]:
    serial = _serial_regions(loop)
    if serial is not None:
        return serial
    cuts, start = [("top", 0)], 0
    for name, hit in CUTS:
        at = _find(loop, hit, start)
        if at is not None:
            cuts.append((name, at))
            start = at + 1
    if any(name == "after_store" for name, _ in cuts):
        cuts = [(n, k + 1) if n == "after_store" else (n, k) for n, k in cuts]
    return _split(loop, cuts)


def summary(path: Path) -> str:
    header, rows = read_table(path)
    ins = instructions(header, rows)
    total = sum(i["samples"] for i in ins) or 1
    loop = consumer_loop(ins)
    lines = [f"{path}: {total} samples over {len(ins)} SASS instructions; consumer loop "
             f"{len(loop)} instructions, {sum(i['samples'] for i in loop) / total:.1%} of the samples"]
    for name, part in regions(loop):
        s = sum(i["samples"] for i in part)
        reasons = collections.Counter()
        for i in part:
            reasons.update(i["stalls"])
        top = ", ".join(f"{k} {v / max(s, 1):.0%}" for k, v in reasons.most_common(4))
        lines.append(f"  {name:12s} {s / total:6.1%} of samples  {sum(i['executed'] for i in part):>14,} "
                     f"instructions executed  {len(part):4d} static  ({top})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="+", type=Path, help="ncu source tables (.csv or .csv.gz)")
    args = ap.parse_args(argv)
    for path in args.tables:
        try:
            print(summary(path))
        except (OSError, ValueError, StopIteration, KeyError) as exc:
            print(f"error: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
