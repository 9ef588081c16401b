"""SIGTERM, as `timeout`, job schedulers and `scancel` send it, stops a sweep the way Ctrl-C does."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

EXIT_SIGINT, EXIT_SIGTERM = 130, 143                    # 128 + the signal's number, as shells report it


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an interrupt so the sweep stops the same way as on Ctrl-C."""
    exit_code = EXIT_SIGTERM

    def __str__(self) -> str:
        return "terminated (SIGTERM)"


@contextmanager
def sigterm_interrupts():
    """SIGTERM raises Terminated in the main thread for the duration (elsewhere it is left alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise Terminated()
    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
