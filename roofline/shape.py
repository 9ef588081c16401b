"""The attention shape every layer shares: query heads, KV heads, head dim, tokens per KV block, blocks
each query keeps per KV head. Workloads (scenarios/) carry it; the model's shape (model.py) adds data
types and launch terms to it."""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import UserError


class ShapeError(UserError, ValueError):
    """An attention shape that cannot exist; the message is one line for the user."""


@dataclass(frozen=True)
class AttnShape:
    hq: int = 64
    hkv: int = 4
    head_dim: int = 128
    block: int = 128
    topk: int = 16

    def __post_init__(self):
        for name in SHAPE_FIELDS:
            if getattr(self, name) <= 0:
                raise ShapeError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hq % self.hkv:
            raise ShapeError(f"hq ({self.hq}) must be a multiple of hkv ({self.hkv})")

    @property
    def group(self) -> int:
        """Query heads per KV head (the GQA factor)."""
        return self.hq // self.hkv


SHAPE_FIELDS = tuple(f.name for f in fields(AttnShape))
