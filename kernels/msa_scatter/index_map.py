"""MSA slot mapping: the kv-outer CSR plus, for every sorted edge, its block's rank among the query's
valid blocks (the slot its normalized partial is scattered to)."""
from __future__ import annotations

import torch

from ..kv_outer.index_map import CSRBuilder


class SlotIndexMap(CSRBuilder):
    def __init__(self, pages: torch.Tensor, num_pages: int, tile_q: int):
        super().__init__(pages, num_pages, tile_q)
        self.edge_slot = torch.empty(pages.numel(), dtype=torch.int32, device=pages.device)

    def __call__(self) -> None:
        super().__call__()
        rank = torch.cumsum((self.pages >= 0).to(torch.int32), dim=-1, dtype=torch.int32) - 1
        torch.gather(rank.view(-1), 0, self.perm, out=self.edge_slot)
