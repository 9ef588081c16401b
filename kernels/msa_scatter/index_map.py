"""MSA slot mapping: the kv-outer CSR plus, for every sorted edge, its block's rank among the query's
valid blocks (the slot its normalized partial is scattered to).

After the shared sort (CSRBuilder.sort_and_count), one Triton pass over the sorted edges writes each
edge's query (csr_query) and slot (edge_slot); the slot is counted from the edge's own row of
`pages`, so no per-row cumsum or gather is materialized."""
from __future__ import annotations

import torch

from .. import triton_common  # noqa: F401  (before triton: the interpreter on a CPU)
from ..kv_outer.index_map import PLACE_BLOCK, CSRBuilder
import triton
import triton.language as tl


@triton.jit
def place_slots_kernel(perm_ptr, pages_ptr, csr_query_ptr, edge_slot_ptr, n_edges, n_tokens,
                       TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK: tl.constexpr):
    """Sorted edge j = original edge e = (h * N + n) * topk + r: csr_query[j] = n and
    edge_slot[j] = (number of valid pages among ranks 0..r of row (h, n)) - 1."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = j < n_edges
    e = tl.load(perm_ptr + j, mask=live, other=0)
    row = e // TOPK
    r = e % TOPK
    i = tl.arange(0, TOPK_P2)
    pages = tl.load(pages_ptr + row[:, None] * TOPK + i[None, :], mask=live[:, None] & (i[None, :] < TOPK),
                    other=-1)
    upto = (pages >= 0) & (i[None, :] <= r[:, None])
    slot = tl.sum(upto.to(tl.int32), axis=1) - 1
    tl.store(csr_query_ptr + j, (row % n_tokens).to(tl.int32), mask=live)
    tl.store(edge_slot_ptr + j, slot.to(tl.int32), mask=live)


class SlotIndexMap(CSRBuilder):
    def __init__(self, pages: torch.Tensor, num_pages: int, tile_q: int):
        super().__init__(pages, num_pages, tile_q)
        self.edge_slot = torch.empty(pages.numel(), dtype=torch.int32, device=pages.device)

    def __call__(self) -> None:
        self.sort_and_count()
        n_edges = self.perm.numel()
        place_slots_kernel[(triton.cdiv(n_edges, PLACE_BLOCK),)](
            self.perm, self.pages, self.csr_query, self.edge_slot, n_edges, self.n_tokens,
            TOPK=self.topk, TOPK_P2=triton.next_power_of_2(self.topk), BLOCK=PLACE_BLOCK)
