"""A timestamped log that prints each line and appends it to a file at once (the GPU scripts' logs)."""
from __future__ import annotations

import time
from pathlib import Path


class TeeLog:
    def __init__(self, path: Path):
        self.f = Path(path).open("w")

    def __call__(self, msg: str = ""):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()
