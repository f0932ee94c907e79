"""The float64 oracle of the suite: block-sparse attention over a paged KV cache.

Everything here is slow on purpose and imports only torch and the standard library. The kernels
in `kernels/` and the engine in `engine/` are tested against it; docs/contract.md is its contract.

Symbols used in shapes throughout the suite:
    num_tokens          T, query tokens of a packed batch
    num_seqs            B, sequences in the batch
    num_heads           Hq, query heads (query head h reads KV head h // (Hq // Hkv))
    num_kv_heads        Hkv, key/value heads
    head_dim            D
    page_size           P, tokens per KV-cache page
    num_pages           pages in the KV cache
    max_pages_per_seq   columns of a block table
    block_size          S, tokens per sparse block (position p lies in block p // S)
    num_blocks          NB, sparse blocks per side of a layout's block grid

Edge rules every implementation must copy:
    - causality is by absolute position: a query at position pq sees a key at pk only if pk <= pq
      (bottom-right alignment when a cached context precedes the queries);
    - a query row with no allowed key gives output 0 and log-sum-exp -inf, never NaN (emptiness is
      decided by the mask alone);
    - a row whose query, or the K or V of any key it may see, holds NaN or Inf is NaN in every
      element of out and in lse; such a value never reaches a row that does not see it, and
      whatever lies where no row may look (past seq_len, unused pages, table padding) never reaches
      any output;
    - lse is the natural-log log-sum-exp of the scaled, masked scores, in float32.
"""

from reference.layouts import (
    BlockMaskLayout,
    LocalStridedLayout,
    causal_block_mask,
    random_block_mask,
    sliding_window_block_mask,
)
from reference.paged_decode import paged_decode, plan_decode
from reference.paged_prefill import paged_prefill, plan_prefill
from reference.write_kv import plan_write_kv, write_kv

__all__ = [
    "BlockMaskLayout",
    "LocalStridedLayout",
    "causal_block_mask",
    "random_block_mask",
    "sliding_window_block_mask",
    "paged_decode",
    "paged_prefill",
    "plan_decode",
    "plan_prefill",
    "plan_write_kv",
    "write_kv",
]
