"""Capture a model's top-k selections into a selection trace: `Recorder` (docs/capture.md)."""
from .recorder import ENV, Recorder

__all__ = ["ENV", "Recorder"]
