"""Token-packed Q-outer schedule: tokens that select the same blocks share a tile and need no partials.

A tile is up to P query tokens of one request whose positions share a window of P (causal: q_limit // P;
otherwise the token's index within its request // P), times the G query heads of one KV head, so P = 8
and G = 16 give 128 rows. A tile walks the union of its tokens' selected blocks with an online softmax
and writes O and LSE once; a token that did not select a union block sees none of its keys.

Stages (all device work, fixed shapes per plan, no host reads):

schedule   (selection -> tiles, their unions and per-token key limits; schedule.py)
  tile_tok0  [T] int32          first token of each tile (T = Hkv x token tiles, head-major)
  tile_ntok  [T] int32          tokens in the tile (0 past the last real tile)
  tile_count [T] int32          union blocks of the tile
  tile_page  [T, U] int32       physical page of each union block (U = P x topk): the blocks only the
                                first P / 2 tokens select, then both halves', then the second's,
                                each ascending
  tile_limit [T, U, P] int32    last visible key of the block for each tile token, as an offset in
                                the block (block - 1 when every key is visible, -1 when the token did
                                not select the block)
  tile_split [T, 2] int32       (lo_end, hi_start): the first half's blocks are slots [0, lo_end),
                                the second half's [hi_start, count); 12-token tiles [T, 4] (e0, s1,
                                e1, s2): the thirds' [0, e0), [s1, e1), [s2, count)

attention  (one program per tile; attention.py)
  out [N, Hq, D] bf16 (fp32 for fp32 inputs), lse [N, Hq] fp32 (natural log)
"""

TILE_TOKENS = (8, 16)
