"""The data types: the one vocabulary of dtype names, their sizes, and the parsing of a user's dtype.

A member compares equal to its name ("bf16") and formats as it, so point keys, result files and
profile keys keep the plain strings.
"""
from __future__ import annotations

from enum import StrEnum

from ..errors import UserError


class DTypeError(UserError, ValueError):
    """A dtype name that is not one of those asked for; the message is one line for the user."""


class DType(StrEnum):
    BF16 = "bf16"
    FP8 = "fp8"       # e4m3
    FP16 = "fp16"
    FP32 = "fp32"

    @property
    def bytes(self) -> int:
        return BYTES[self]

    @classmethod
    def parse(cls, text, what: str = "--dtype", among=None) -> "DType":
        """The member `text` names, if it is one of `among` (default: every dtype); else a DTypeError
        naming `what` (an option, or where in a file) and the dtypes it takes."""
        among = tuple(cls) if among is None else tuple(among)
        if text not in among:
            raise DTypeError(f"{what}: unknown dtype {text!r} (known: {', '.join(among)})")
        return cls(text)


BYTES = {DType.BF16: 2, DType.FP8: 1, DType.FP16: 2, DType.FP32: 4}


def model_dtype(dtype) -> DType:
    """The dtype a profile's achieved fractions and fixed costs are keyed by: fp16 and fp32 count as bf16
    (calibration measures bf16 and fp8 only)."""
    return DType(dtype) if dtype in (DType.BF16, DType.FP8) else DType.BF16
