"""A run's integrity record: digests taken when results are written, checked whenever they are read.

    RUN/units/<unit>/seal.json     sha256 of each file of the unit folder (status.json, stats.parquet,
                                   samples.parquet), written with the unit
    RUN/run.json  "seal"           sha256 of each other field of run.json, written with it
    units.jsonl.gz  "seal"         a packed unit's record: sha256 of its status and of its stats rows

A result judged by numbers read from the file it sits in can be edited into passing; a digest taken
at write time makes any later edit visible. This module only computes and compares: the writers in
results.py seal what they write, and its readers refuse what changed (results.load_run).
Runs written before the record are unsealed: `msa-bench seal RUN` seals one once (results.seal_run).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

SEAL_FILE = "seal.json"
SEAL_FIELD = "seal"
UNIT_FILES = ("status.json", "stats.parquet", "samples.parquet")
UNSEALED = "unsealed"          # the change a part never sealed reports
SEAL_HINT = "`msa-bench seal RUN` seals a run written before integrity records, once"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _value_digest(value) -> str:
    """A JSON value's digest, independent of key order and layout."""
    return _sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


def _changed(sealed: dict, now: dict, what: str) -> str | None:
    """The first difference between two {name: digest} maps, as "<what> <name> changed|removed|added"."""
    for name in sorted(set(sealed) | set(now)):
        if sealed.get(name) != now.get(name):
            how = "removed" if name not in now else "added" if name not in sealed else "changed"
            return f"{what} {name} {how}"
    return None


def unit_digests(folder: Path) -> dict:
    return {name: _sha256((folder / name).read_bytes()) for name in UNIT_FILES if (folder / name).is_file()}


def seal_unit(folder: Path) -> None:
    """Write the unit folder's seal (a writer calls it after the unit's last file is in place)."""
    tmp = folder / f".{SEAL_FILE}.tmp"
    tmp.write_text(json.dumps(unit_digests(folder), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, folder / SEAL_FILE)


def unit_change(folder: Path, samples_kept: bool = True) -> str | None:
    """What changed in a unit folder since it was sealed: UNSEALED, "file <name> changed|removed|added",
    or None. samples_kept False (the run's raw samples were removed): a missing samples.parquet is no change."""
    path = folder / SEAL_FILE
    if not path.is_file():
        return UNSEALED
    try:
        sealed = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"file {SEAL_FILE} is not JSON"
    if not isinstance(sealed, dict):
        return f"file {SEAL_FILE} holds no digests"
    now = unit_digests(folder)
    if not samples_kept:
        now.setdefault("samples.parquet", sealed.get("samples.parquet"))
    return _changed(sealed, now, "file")


def field_digests(meta: dict) -> dict:
    return {key: _value_digest(value) for key, value in meta.items() if key != SEAL_FIELD}


def sealed_meta(meta: dict) -> dict:
    """run.json's fields (JSON values) with their seal."""
    return _with_seal(meta, field_digests(meta))


def meta_change(meta: dict) -> str | None:
    """What changed in run.json since it was written: UNSEALED, "field <name> changed|removed|added", or None."""
    return _change(meta, field_digests(meta), "field")


def record_digests(record: dict) -> dict:
    return {"status": _value_digest(record.get("status")), "stats": _value_digest(record.get("stats"))}


def sealed_record(record: dict) -> dict:
    """A packed unit's record (JSON values) with its seal."""
    return _with_seal(record, record_digests(record))


def record_change(record: dict) -> str | None:
    """What changed in a packed unit's record since it was packed: UNSEALED, "<status|stats> changed", or None."""
    return _change(record, record_digests(record), "its")


def _with_seal(obj: dict, digests: dict) -> dict:
    return {**{k: v for k, v in obj.items() if k != SEAL_FIELD}, SEAL_FIELD: digests}


def _change(obj: dict, digests: dict, what: str) -> str | None:
    """UNSEALED, what of `obj` changed against its seal, or None."""
    sealed = obj.get(SEAL_FIELD)
    if sealed is None:
        return UNSEALED
    if not isinstance(sealed, dict):
        return f"{what} {SEAL_FIELD} holds no digests"
    return _changed(sealed, digests, what)
