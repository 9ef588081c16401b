"""KV-outer schedule: each selected (KV head, block) is loaded once and attends every query that chose it.

Data passed between the four stages (all device tensors, shapes fixed per plan, no host reads):

index_map  (selection pages [Hkv, N, topk] -> block-to-query lists and the combine's gather index)
  key of an edge        = head * num_pages + page            (num_keys = Hkv * num_pages)
  csr_ptr   [num_keys + 1] int32   edges of each key, in key order
  csr_query [Hkv * N * topk] int32 query of each edge; within a key, queries ascending
  tile_ptr  [num_keys + 1] int32   tiles of each key: ceil(count / TILE_Q) each, cumulated
  combine_index [N, Hkv, topk] int32
                                   where the (query, head, rank) partial lives: tile * TILE_Q + slot,
                                   -1 for padding ranks
  num_tiles_max = Hkv * ceil(N * topk / TILE_Q) + min(Hkv * num_pages, Hkv * N * topk)

schedule   (tile counts -> a contiguous, nearly equal slice of the tile sequence per persistent CTA)
  tile_key  [num_tiles_max] int32  key of each tile (-1 past the last real tile)
  tile_edge [num_tiles_max] int32  first edge (index into csr_query) of each tile
  tile_count[num_tiles_max] int32  queries in the tile (1..TILE_Q; 0 past the end)
  cta_range [num_ctas, 2] int32    [begin, end) tile range of each CTA

attention  (persistent; K/V of a key loaded once per CTA visit, Q gathered per tile)
  o_part [num_tiles_max * TILE_Q * G, D] bf16 (fp32 for fp32 inputs)
                                   raw, unnormalized P V (v_scale applied); row = tile * TILE_Q * G + slot * G + g,
                                   so a (query, head, rank) partial is G contiguous rows
  m_part [num_tiles_max * TILE_Q * G] fp32    row max of the scaled scores (natural-log units)
  l_part [num_tiles_max * TILE_Q * G] fp32    row sum of exp(score - m)
  Rows of a tile past tile_count hold garbage and are never read. Cache layout: fp8 reads V
  d-major ([num_pages, Hkv, D, block], a transposed copy made once in plan(), outside the timed
  stages) so P V's second operand is K-major; other dtypes read the cache as is.

combine    (gather each (query, head)'s partials through combine_index, log-sum-exp merge, normalize)
  out [N, Hq, D] bf16 (fp32 for fp32 inputs), lse [N, Hq] fp32 (natural log)

TILE_Q = 8 query tokens, so a tile is TILE_Q * G = 128 rows with the study's G = 16 (config.tile_q
can change it; G, D, block and tile_q must be powers of two, D, block and tile_q * G >= 16).

Code: index_map.py (IndexMap; CSRBuilder is shared with msa_scatter), scheduler.py (Schedule),
attention.py (the Triton kernel, also msa-scatter's with STORE_MODE 1), combine.py, config.py
(launch knobs, TUNED defaults), backend.py (plan; ATTENTION_IMPLS hook for other attention stages),
stage_checks.py (each stage's output checked independently); ../triton_common.py (interpreter on CPU)
is the Triton toolkit every Triton backend shares.
"""

TILE_Q = 8
