"""Stage 2, schedule: lay every (head, block, query tile) out as one tile sequence and give each
persistent CTA a contiguous range of it.

Deterministic and atomic-free. Tile i of the index map belongs to the key whose tile range holds it
(a searchsorted over tile_ptr). The schedule writes, per position p of the sequence, the key, first
edge and query count of the tile placed there, and where the run of equal keys around p ends (a
K/V load per run). The attention stage walks positions and stores tile p's partials at rows of p.

Two orders:
- key order (q_ranges 1, order_chunk 0): position = index-map tile, and CTA c gets positions
  [c * T // C, (c + 1) * T // C). Every CTA works in its own part of the head-major list, so at any
  moment the Q rows of every KV head are being gathered.
- grouped (q_ranges S > 1 or order_chunk > 0): tiles are sorted (stably) by (KV head, which of S
  equal ranges of query tokens their first query falls in), so that a group's Q rows are 1/(Hkv S) of
  Q, small enough to stay in L2 while the group's tiles gather them 16 times. A key's queries spread
  over all ranges, so its K/V block is loaded once per group it has queries in (up to S times
  instead of once). With order_chunk k > 0 the sorted sequence is dealt round-robin in chunks of
  k tiles (chunk j to CTA j mod C) and each CTA's chunks are laid out contiguously, so the
  persistent CTAs walk the groups together; slices then differ by at most k tiles. Chunked Triton
  launches (one program per chunk, in position order) need the grouping only (order_chunk 0).
  With phases instead, every group is cut into C equal contiguous parts, part c of each group goes to
  CTA c, and each CTA's parts are laid out end to end in group order: the CTAs still walk the groups
  together (a KV head's queries at a time with q_ranges 1), but a part keeps its keys' runs whole, so
  K/V loads grow by at most one per part instead of one per chunk. It needs no sort at q_ranges 1
  (the index map's tiles are head-major already).
  The combine index is rewritten to positions (a buffer of the schedule's own, so running the stage
  twice gives the same result).

Every tile costs one full TILE_Q x G MMA pair whatever its query count, so equal tile counts are
equal work up to the K/V loads at run boundaries.

No order needs a sort: every position follows from the tile pointers in closed form. With one query
range the index map's head-major tiles are the grouped order already; with S ranges a first pass
(range_tiles_kernel) counts each key's tiles per range (a binary search in its ascending query list)
and a prefix sum over those counts, laid out group-major, gives every (group, key) run its first
position. One more pass (schedule_tiles_kernel) places the tiles, deals them and writes the CTA ranges
(and key order's run ends); a grouped order's run ends follow from the placed keys and a last pass
rewrites the combine index. The general torch path (a stable sort by group, then the deal) lays out
every order too, and is the tests' oracle for the closed forms.
"""
from __future__ import annotations

import torch

from .. import triton_common  # noqa: F401  (before triton: the interpreter on a CPU)
from ..triton_scans import scan_min
from ..dispatch.triton_launch import launch
import triton
import triton.language as tl

SCHEDULE_BLOCK = 1024       # tiles per program of schedule_tiles_kernel
RUN_BLOCK = 1024            # positions per program of run_ends_kernel
RANGE_BLOCK = 32            # keys per program of range_tiles_kernel (a latency-bound search: many programs)
REINDEX_BLOCK = 2048        # combine-index entries per program of reindex_kernel


@triton.jit
def _first_tile_at(csr_query, edge0, n_key_tiles, bound, q_ranges, live, TILE_Q: tl.constexpr,
                   SEARCH_STEPS: tl.constexpr):
    """The first of a key's tiles whose first query n has n * S >= bound (its list is ascending)."""
    lo = tl.zeros_like(n_key_tiles)
    hi = n_key_tiles
    for _ in tl.static_range(SEARCH_STEPS):
        active = live & (lo < hi)
        mid = (lo + hi) // 2
        q = tl.load(csr_query + edge0 + mid * TILE_Q, mask=active, other=0).to(tl.int64)
        less = q * q_ranges < bound
        lo = tl.where(active & less, mid + 1, lo)
        hi = tl.where(active & ~less, mid, hi)
    return lo


@triton.jit
def range_tiles_kernel(csr_ptr, tile_ptr, csr_query, below, count, num_keys, num_pages, n_tokens, q_ranges,
                       TILE_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr,
                       RANGES: tl.constexpr):
    """Per key k = (head h, page) and query range r (query n is in range n * S // N):
    below[k, r] = k's tiles whose first query lies in an earlier range (those tiles come first), and
    count[(h * S + r) * num_pages + page] = k's tiles in range r: group-major, so its prefix sum is every
    (group, key) run's first position in the grouped order. A block's (key, range) pairs search at once,
    so the stage is one chain of SEARCH_STEPS loads."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[:, None]          # [BLOCK, 1]
    r = tl.arange(0, RANGES)[None, :]                                     # [1, RANGES]
    key_live = k < num_keys
    live = key_live & (r < q_ranges)
    edge0 = tl.load(csr_ptr + k, mask=key_live, other=0)
    tile0 = tl.load(tile_ptr + k, mask=key_live, other=0)
    n_key_tiles = tl.load(tile_ptr + k + 1, mask=key_live, other=0) - tile0 + tl.zeros([BLOCK, RANGES], tl.int32)
    start = _first_tile_at(csr_query, edge0, n_key_tiles, r.to(tl.int64) * n_tokens, q_ranges, live,
                           TILE_Q, SEARCH_STEPS)
    end = _first_tile_at(csr_query, edge0, n_key_tiles, (r + 1).to(tl.int64) * n_tokens, q_ranges, live,
                         TILE_Q, SEARCH_STEPS)
    tl.store(below + k * q_ranges + r, start, mask=live)
    h = k // num_pages
    tl.store(count + ((h * q_ranges + r) * num_pages + (k - h * num_pages)), end - start, mask=live)


@triton.jit
def phase_table_kernel(group_start, phase_base, cta_range, num_pages, groups, num_ctas, BLOCK_C: tl.constexpr):
    """The phased deal's offsets, one program: every group g is cut into C equal contiguous parts
    [c Z_g // C, (c + 1) Z_g // C) and CTA c holds part c of every group end to end, starting at
    start(c) = sum_g c Z_g // C. A tile at rank r of group g, in part c, lands at phase_base[g, c] + r
    with phase_base[g, c] = start(c) + (CTA c's parts of the groups before g) - c Z_g // C."""
    cc = tl.arange(0, BLOCK_C).to(tl.int64)
    C = num_ctas + tl.zeros([BLOCK_C], tl.int64)
    start = tl.zeros([BLOCK_C], tl.int64)
    for j in range(groups):
        size = (tl.load(group_start + (j + 1) * num_pages) - tl.load(group_start + j * num_pages)).to(tl.int64)
        start += cc * size // C
    tl.store(cta_range + 2 * cc, start.to(tl.int32), mask=cc < C)
    tl.store(cta_range + 2 * cc - 1, start.to(tl.int32), mask=(cc >= 1) & (cc <= C))
    before = tl.zeros([BLOCK_C], tl.int64)
    for j in range(groups):
        size = (tl.load(group_start + (j + 1) * num_pages) - tl.load(group_start + j * num_pages)).to(tl.int64)
        cut = cc * size // C
        tl.store(phase_base + j * C + cc, start + before - cut, mask=cc < C)
        before += (cc + 1) * size // C - cut


@triton.jit
def schedule_tiles_kernel(tile_ptr, csr_ptr, csr_query, group_start, below, phase_base, tile_key, tile_edge,
                          tile_count, tile_run_end, position, cta_range, n_tiles, num_keys, num_pages, n_tokens,
                          q_ranges, num_ctas, order_chunk, TILE_Q: tl.constexpr, GROUPED: tl.constexpr,
                          DEAL: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    """Index-map tile t -> its position, in two steps.
    Its place g_pos in the grouped order: t itself with one query range (the index map is head-major),
    else the (group, key) run start from group_start (range_tiles_kernel's counts, prefix-summed) plus
    its rank among its key's tiles of that range. Group g = h * S + r starts at group_start[g * num_pages].
    Then the deal (DEAL): 0 = none (CTA c gets [c T // C, (c + 1) T // C)); 1 = phases (phase_table_kernel's
    offsets; it writes the CTA ranges); 2 = chunks (chunk j of order_chunk tiles to CTA j mod C, a CTA's
    chunks end to end)."""
    pid = tl.program_id(0)
    t = pid * BLOCK + tl.arange(0, BLOCK)
    live = t < n_tiles
    total = tl.load(tile_ptr + num_keys)
    real = t < total
    lo = tl.zeros([BLOCK], tl.int32)              # key = the last k with tile_ptr[k] <= t
    hi = tl.zeros([BLOCK], tl.int32) + num_keys
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go = tl.load(tile_ptr + mid, mask=live, other=0) <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    key = lo
    key_first = tl.load(tile_ptr + key, mask=live, other=0)
    key_end = tl.load(tile_ptr + key + 1, mask=live, other=0)
    first = tl.load(csr_ptr + key, mask=live, other=0) + (t - key_first) * TILE_Q
    count = tl.minimum(tl.load(csr_ptr + key + 1, mask=live, other=0) - first, TILE_Q)
    # runtime ints may arrive as constexprs (Triton specializes the value 1), hence no .to() on them
    C = num_ctas + tl.zeros([BLOCK], tl.int64)
    T = total + tl.zeros([BLOCK], tl.int64)
    h = key // num_pages
    if GROUPED:
        query = tl.load(csr_query + first, mask=live & real, other=0).to(tl.int64)
        g = h * q_ranges + (query * q_ranges // n_tokens).to(tl.int32)
        run_first = tl.load(group_start + g * num_pages + (key - h * num_pages), mask=live & real, other=0)
        ahead = tl.load(below + key * q_ranges + (g - h * q_ranges), mask=live & real, other=0)
        g_pos = (run_first + t - key_first - ahead).to(tl.int64)
    else:
        g = h
        g_pos = t.to(tl.int64)
    if DEAL == 1:
        g_first = tl.load(group_start + g * num_pages, mask=live & real, other=0)
        size = (tl.load(group_start + (g + 1) * num_pages, mask=live & real, other=1) - g_first).to(tl.int64)
        r = g_pos - g_first
        c = ((r + 1) * C - 1) // tl.maximum(size, 1)
        dest = tl.load(phase_base + g * C + c, mask=live & real, other=0) + r
    elif DEAL == 2:
        k = order_chunk + tl.zeros([BLOCK], tl.int64)
        full = T // k
        chunk = g_pos // k
        c = chunk % C
        dest = k * ((full // C) * c + tl.minimum(c, full % C)) + tl.where(full % C < c, T % k, 0) \
            + (chunk // C) * k + g_pos % k
    else:
        dest = g_pos
    if GROUPED or DEAL != 0:
        tl.store(position + t, dest.to(tl.int32), mask=live & real)
    else:
        # key order: a key's run ends with its tiles (other orders: runs can join across groups and CTA
        # ranges, so run_ends_kernel finds their ends after placement)
        tl.store(tile_run_end + t, tl.where(real, key_end, n_tiles), mask=live)
    dest = tl.where(real, dest, t.to(tl.int64))
    tl.store(tile_key + dest, tl.where(real, key, -1), mask=live)
    tl.store(tile_edge + dest, tl.where(real, first, 0), mask=live)
    tl.store(tile_count + dest, tl.where(real, count, 0), mask=live)
    if DEAL != 1:
        if pid == 0:                               # cta_range[c] = [start(c), start(c + 1))
            cc = tl.arange(0, BLOCK_C).to(tl.int64)
            Cc = num_ctas + tl.zeros([BLOCK_C], tl.int64)
            Tc = total + tl.zeros([BLOCK_C], tl.int64)
            if DEAL == 2:
                kc = order_chunk + tl.zeros([BLOCK_C], tl.int64)
                full_c = Tc // kc
                bound = kc * ((full_c // Cc) * cc + tl.minimum(cc, full_c % Cc)) + tl.where(full_c % Cc < cc, Tc % kc, 0)
            else:
                bound = cc * Tc // Cc
            tl.store(cta_range + 2 * cc, bound.to(tl.int32), mask=cc < Cc)
            tl.store(cta_range + 2 * cc - 1, bound.to(tl.int32), mask=(cc >= 1) & (cc <= Cc))


@triton.jit
def run_ends_kernel(tile_key, tile_run_end, n, BLOCK: tl.constexpr):
    """tile_run_end[p] = one past the last position of the run of equal keys that holds p: the smallest
    q >= p that ends a run, plus one. A block's positions are walked backwards (a forward min-scan of the
    reversed block); a run that goes on past the block is followed forward a block at a time."""
    pid = tl.program_id(0)
    p = pid * BLOCK + (BLOCK - 1 - tl.arange(0, BLOCK))                  # reversed
    live = p < n
    key = tl.load(tile_key + p, mask=live, other=0)
    ends_run = (p + 1 >= n) | (tl.load(tile_key + p + 1, mask=p + 1 < n, other=0) != key)
    end = tl.associative_scan(tl.where(ends_run & live, p + 1, n + 1), 0, scan_min)
    if tl.max(tl.where(live, end, 0), 0) > n:                             # the block's last run goes on
        q0 = (pid + 1) * BLOCK
        last_key = tl.load(tile_key + q0 - 1)
        found = n + 1
        while found > n:
            q = q0 + tl.arange(0, BLOCK)
            k = tl.load(tile_key + q, mask=q < n, other=0)
            stop = (q + 1 >= n) | (tl.load(tile_key + q + 1, mask=q + 1 < n, other=0) != last_key)
            found = tl.min(tl.where(stop & (q < n) & (k == last_key), q + 1, n + 1), 0)
            found = tl.where(q0 + BLOCK >= n, tl.minimum(found, n), found)       # never past the end
            q0 += BLOCK
        end = tl.where(end > n, found, end)
    tl.store(tile_run_end + p, end, mask=live)


@triton.jit
def reindex_kernel(src, dst, position, n, TILE_Q: tl.constexpr, BLOCK: tl.constexpr):
    """combine index entry tile * TILE_Q + slot -> position[tile] * TILE_Q + slot (-1 stays -1)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    ci = tl.load(src + i, mask=live, other=-1)
    tile = tl.maximum(ci, 0) // TILE_Q
    moved = tl.load(position + tile, mask=live & (ci >= 0), other=0) * TILE_Q + ci % TILE_Q
    tl.store(dst + i, tl.where(ci >= 0, moved, ci), mask=live)


class Schedule:
    def __init__(self, index_map, num_ctas: int, q_ranges: int = 1, order_chunk: int = 0, phases: bool = False):
        if q_ranges < 1 or order_chunk < 0:
            raise ValueError(f"q_ranges must be >= 1 and order_chunk >= 0 (got {q_ranges}, {order_chunk})")
        if phases and order_chunk:
            raise ValueError(f"order_phases and order_chunk {order_chunk} are two ways to deal the groups; pick one")
        m = index_map
        dev = m.csr_ptr.device
        self.m = m
        self.csr_ptr, self.tile_ptr = m.csr_ptr, m.tile_ptr
        self.num_keys = m.tile_ptr.numel() - 1
        self.tile_q, self.num_ctas = m.tile_q, num_ctas
        self.q_ranges, self.order_chunk, self.phases = q_ranges, order_chunk, phases
        self.grouped = q_ranges > 1 or order_chunk > 0 or phases
        n = m.num_tiles_max
        self.tile_key = torch.empty(n, dtype=torch.int32, device=dev)
        self.tile_edge = torch.empty(n, dtype=torch.int32, device=dev)
        self.tile_count = torch.empty(n, dtype=torch.int32, device=dev)
        self.tile_run_end = torch.empty(n, dtype=torch.int32, device=dev)
        self.cta_range = torch.empty(num_ctas, 2, dtype=torch.int32, device=dev)
        index = getattr(m, "combine_index", None)
        # grouped: a position-addressed copy of the index map's tile-addressed combine index
        self.combine_index = torch.empty_like(index) if (self.grouped and index is not None) else index
        self._tiles = torch.arange(n, dtype=torch.int32, device=dev)
        self._ctas = torch.arange(num_ctas + 1, dtype=torch.int64, device=dev)
        self.closed_form = True           # False: the sorted torch path (the tests' oracle)
        self._position = torch.empty(n, dtype=torch.int32, device=dev) if self.grouped else None
        # phase_table_kernel's offsets (int64, one per group and CTA); a placeholder pointer otherwise
        self._phase_base = torch.empty(m.hkv * q_ranges * num_ctas if phases else 1, dtype=torch.int64, device=dev)
        if q_ranges > 1:                  # range_tiles_kernel's outputs
            self._below = torch.empty(self.num_keys * q_ranges, dtype=torch.int32, device=dev)
            self._counts = torch.zeros(self.num_keys * q_ranges + 1, dtype=torch.int32, device=dev)
            self._group_start = torch.empty_like(self._counts)

    def __call__(self) -> None:
        if self.closed_form:
            return self._closed_form()
        t = self._tiles
        total = self.tile_ptr[-1:]
        key = torch.searchsorted(self.tile_ptr, t, right=True, out_int32=True) - 1
        real = t < total
        kc = key.clamp(max=self.num_keys - 1).long()
        first = self.csr_ptr[kc] + (t - self.tile_ptr[kc]) * self.tile_q
        count = (self.csr_ptr[kc + 1] - first).clamp(max=self.tile_q)
        zero = torch.zeros_like(t)
        if not self.grouped:
            torch.where(real, key, zero - 1, out=self.tile_key)
            torch.where(real, first, zero, out=self.tile_edge)
            torch.where(real, count, zero, out=self.tile_count)
            self._slices(total)
        else:
            key = torch.where(real, key, zero - 1)
            first = torch.where(real, first, zero)
            count = torch.where(real, count, zero)
            group = self._group(kc, first, real)
            order = self._by_group(group)
            if self.phases:
                order = self._phase(order, group[order], total)
            elif self.order_chunk:
                order = self._deal(order, total)
            else:
                self._slices(total)
            torch.index_select(key, 0, order, out=self.tile_key)
            torch.index_select(first, 0, order, out=self.tile_edge)
            torch.index_select(count, 0, order, out=self.tile_count)
            if self.combine_index is not None:
                position = torch.empty_like(order)
                position[order] = torch.arange(order.numel(), device=order.device)
                ci = self.m.combine_index.long()
                tile = torch.div(ci.clamp(min=0), self.tile_q, rounding_mode="floor")
                moved = position[tile] * self.tile_q + ci % self.tile_q
                self.combine_index.copy_(torch.where(ci >= 0, moved, ci))
        self._run_ends_sorted()

    def _closed_form(self) -> None:
        if self.q_ranges > 1:
            self.range_tiles()
            torch.cumsum(self._counts, 0, dtype=torch.int32, out=self._group_start)
        self.place()

    def range_tiles(self) -> None:
        """Each key's tiles per query range, group-major in _counts (q_ranges > 1)."""
        m = self.m
        most_tiles = -(-m.n_tokens * m.topk // self.tile_q)          # a key's list is at most every edge
        launch(range_tiles_kernel, (triton.cdiv(self.num_keys, RANGE_BLOCK),), self.csr_ptr, self.tile_ptr,
               m.csr_query, self._below, self._counts[1:], self.num_keys, m.num_pages, m.n_tokens, self.q_ranges,
               TILE_Q=self.tile_q, SEARCH_STEPS=max(1, most_tiles.bit_length()), BLOCK=RANGE_BLOCK,
               RANGES=triton.next_power_of_2(self.q_ranges))

    def place(self) -> None:
        """The closed forms after the range counts' prefix sum (_group_start): deal, place, run ends and
        the position-addressed combine index (kernels/kv_outer/op.py replays the same launches from C)."""
        m, n = self.m, self._tiles.numel()
        s = self.q_ranges
        group_start, below = self.tile_ptr, self.tile_ptr               # one range: the heads' tile pointers
        if s > 1:
            group_start, below = self._group_start, self._below
        position = self._position if self._position is not None else self.tile_key   # unused in key order
        deal = 1 if self.phases else 2 if self.order_chunk else 0
        block_c = triton.next_power_of_2(self.num_ctas + 1)
        if deal == 1:
            launch(phase_table_kernel, (1,), group_start, self._phase_base, self.cta_range, m.num_pages, m.hkv * s,
                   self.num_ctas, BLOCK_C=block_c)
        launch(schedule_tiles_kernel, (triton.cdiv(n, SCHEDULE_BLOCK),),
               self.tile_ptr, self.csr_ptr, m.csr_query, group_start, below, self._phase_base, self.tile_key,
               self.tile_edge, self.tile_count, self.tile_run_end, position, self.cta_range, n, self.num_keys,
               m.num_pages, m.n_tokens, s, self.num_ctas, max(self.order_chunk, 1), TILE_Q=self.tile_q,
               GROUPED=s > 1, DEAL=deal, SEARCH_STEPS=max(1, self.num_keys.bit_length()), BLOCK=SCHEDULE_BLOCK,
               BLOCK_C=block_c)
        if self.grouped:
            self._run_ends()
            if self.combine_index is not None:
                src = self.m.combine_index
                launch(reindex_kernel, (triton.cdiv(src.numel(), REINDEX_BLOCK),), src, self.combine_index,
                       self._position, src.numel(), TILE_Q=self.tile_q, BLOCK=REINDEX_BLOCK)

    def _slices(self, total) -> None:
        """CTA c gets positions [c * T // C, (c + 1) * T // C)."""
        bounds = torch.div(self._ctas * total.long(), self.num_ctas, rounding_mode="floor").to(torch.int32)
        self.cta_range[:, 0].copy_(bounds[:-1])
        self.cta_range[:, 1].copy_(bounds[1:])

    def _group(self, kc, first, real):
        """Each index-map tile's group: head x q_ranges + query range of its first query; padding
        tiles form the last group (hkv x q_ranges)."""
        m, s = self.m, self.q_ranges
        head = torch.div(kc, m.num_pages, rounding_mode="floor")
        query = m.csr_query[first.long()].long()
        group = head * s + torch.div(query * s, m.n_tokens, rounding_mode="floor")
        return torch.where(real, group, torch.full_like(group, m.hkv * s))

    def _by_group(self, group):
        """Index-map tiles stably sorted by group, padding last."""
        n = group.numel()
        return torch.remainder(torch.sort(group * n + self._tiles.long()).values, n)   # keys are unique

    def _phase(self, by_group, sorted_group, total):
        """Part c of every group (an equal contiguous cut of its tiles) goes to CTA c; each CTA's parts
        lie end to end in group order, and cta_range points at them. Padding keeps its positions."""
        c = self.num_ctas
        groups = self.m.hkv * self.q_ranges
        edges = torch.searchsorted(sorted_group, torch.arange(groups + 1, device=sorted_group.device))
        size = edges.diff()                                                   # tiles per real group
        cut = torch.div(self._ctas.view(1, -1) * size.view(-1, 1), c, rounding_mode="floor")   # [groups, C + 1]
        part = cut.diff(dim=1)                                                # [groups, C]
        owned = part.sum(0)
        start = torch.cumsum(owned, 0) - owned
        before = torch.cumsum(part, 0) - part                                 # earlier groups' parts in CTA c
        pos = self._tiles.long()
        g = sorted_group.clamp(max=groups - 1)
        r = pos - edges[g]
        n_g = size[g].clamp(min=1)
        cta = torch.div((r + 1) * c - 1, n_g, rounding_mode="floor").clamp(0, c - 1)
        dest = start[cta] + before[g, cta] + r - cut[g, cta]
        dest = torch.where(pos < total.long(), dest, pos)
        order = torch.empty_like(by_group)
        order[dest] = by_group
        self.cta_range[:, 0].copy_(start)
        self.cta_range[:, 1].copy_(start + owned)
        return order

    def _deal(self, by_group, total):
        """Chunk j of order_chunk tiles of the sorted sequence goes to CTA j mod C; each CTA's chunks
        are laid out contiguously, in round order, and cta_range points at them."""
        c, k = self.num_ctas, self.order_chunk
        pos = self._tiles.long()
        tot = total.long()
        full, rem = torch.div(tot, k, rounding_mode="floor"), torch.remainder(tot, k)
        ctas = self._ctas[:-1]
        owned = torch.div(full - ctas + (c - 1), c, rounding_mode="floor").clamp(min=0) * k
        owned = owned + torch.where(torch.remainder(full, c) == ctas, rem, torch.zeros_like(rem))
        start = torch.cumsum(owned, 0) - owned
        chunk = torch.div(pos, k, rounding_mode="floor")
        dest = start[torch.remainder(chunk, c)] + torch.div(chunk, c, rounding_mode="floor") * k + torch.remainder(pos, k)
        dest = torch.where(pos < tot, dest, pos)
        order = torch.empty_like(by_group)
        order[dest] = by_group
        self.cta_range[:, 0].copy_(start)
        self.cta_range[:, 1].copy_(start + owned)
        return order

    def _run_ends(self) -> None:
        n = self.tile_key.numel()
        launch(run_ends_kernel, (triton.cdiv(n, RUN_BLOCK),), self.tile_key, self.tile_run_end, n, BLOCK=RUN_BLOCK)

    def _run_ends_sorted(self) -> None:
        """The sorted path's run ends, in torch: the run number (a cumsum over run starts) never
        decreases, so the end is a right-searchsorted of each position's own run number."""
        key = self.tile_key
        start = torch.ones_like(key)
        torch.ne(key[1:], key[:-1], out=start[1:])
        run = torch.cumsum(start, 0, dtype=torch.int32)
        torch.searchsorted(run, run, right=True, out_int32=True, out=self.tile_run_end)
