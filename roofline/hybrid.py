"""Where the hybrid schedule splits a tile's union: the fewest tile tokens that must select a block for
the packed kernel to take it.

A union block costs the packed tile the MMAs of all its P x G rows (masked rows still run) and one K/V
read from L2, whichever binds. Left to KV-outer, each token that selected it costs its G rows' MMAs,
its partial written and re-read with (m, l) through HBM, and its Q rows gathered from L2. The block
is packed when at least that many tokens share it; below, KV-outer's per-token cost is smaller.

Where the packed kernel's warpgroups each walk only their own tokens' blocks (`group_tokens` tokens each),
a block costs the rows of the groups whose tokens select it, not the whole tile's. A block near the
threshold (a few neighbouring tokens) spans two groups, whatever the tile size, so it is priced at
two groups' rows: 8 tokens on q-packed-cute's 8- and 12-token tiles alike.
"""
from __future__ import annotations

import math

from .devices import DeviceProfile
from .model import STAT_BYTES, ModelShape


def packed_block_seconds(shape: ModelShape, device: DeviceProfile, tokens_per_tile: int) -> float:
    """One union block of a packed tile: max(MMA of P x G rows, its K/V read from L2)."""
    mma = 4.0 * tokens_per_tile * shape.group * shape.block * shape.head_dim / device.peak_flops(shape.dtype)
    return max(mma, shape.kv_block_bytes / device.l2_bytes_per_s)


def kv_outer_token_seconds(shape: ModelShape, device: DeviceProfile) -> float:
    """One (token, block) pair left to KV-outer: its MMAs, its partial and stats through HBM twice, its Q
    rows gathered from L2."""
    rows = shape.group
    mma = 4.0 * rows * shape.block * shape.head_dim / device.peak_flops(shape.dtype)
    partial = 2 * rows * (shape.head_dim * shape.partial_dtype.bytes + 2 * STAT_BYTES)
    q = rows * shape.head_dim * shape.data_bytes
    return mma + partial / device.hbm_bytes_per_s + q / device.l2_bytes_per_s


def min_shared_tokens(shape: ModelShape, device: DeviceProfile, tokens_per_tile: int,
                      packed_achieved: float = 1.0, kv_outer_achieved: float = 1.0,
                      group_tokens: int | None = None) -> int:
    """Fewest of a tile's P tokens that must select a union block for packing it to be predicted cheaper;
    each side's roofline time divided by the fraction of it its kernel reaches (1: the pure roofline).
    group_tokens: the tokens each warpgroup walks for, where the groups skip blocks none of theirs selects."""
    priced = min(tokens_per_tile, 2 * group_tokens) if group_tokens else tokens_per_tile
    ratio = (packed_block_seconds(shape, device, priced) / packed_achieved) / \
        (kv_outer_token_seconds(shape, device) / kv_outer_achieved)
    return max(1, min(tokens_per_tile, math.ceil(ratio)))
