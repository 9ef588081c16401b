"""MSA-style scatter schedule: KV-stationary like kv-outer, but each partial is normalized in the
attention epilogue and scattered to its (rank, query, head) slot.

Shares with kv_outer: the CSR/tile pointers (index_map.CSRBuilder), the scheduler and the attention
main loop (kv_outer.attention with STORE_MODE = STORE_SCATTER). Differs in:

index_map  edge_slot [Hkv * N * topk] int32   aligned with csr_query: the edge's block rank among the
                                              query's valid blocks (its slot)
attention  o_slot   [topk, N, Hq, D] bf16 (fp32 for fp32 inputs)  O / l of each (slot, query, head)
           lse_slot [topk, N, Hq] fp32        m + log l (natural log; -inf when fully masked)
combine    reads a query's slots contiguously (slot < its number of valid blocks) and merges them by
           log-sum-exp into out [N, Hq, D] and lse [N, Hq]
"""
