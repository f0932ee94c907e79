"""Oracle of paged decode: `paged_prefill` with exactly one query per sequence (contract §4)."""

from reference.paged_prefill import ReferencePlan
from reference.validation import PlanGuard, validate_paged_decode


def plan_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, layout=None, return_lse=False):
    """Validates a `paged_decode` call once; returns a plan whose `run(q, k_cache, v_cache)` computes it.

    Arguments as `paged_decode`; `run` refuses (ValueError) tensors of other shapes, dtypes or devices
    and metadata modified in place after planning.
    """
    batch = validate_paged_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale=scale, layout=layout, return_lse=return_lse
    )
    guard = PlanGuard(
        dict(q=q, k_cache=k_cache, v_cache=v_cache), dict(block_tables=block_tables, seq_lens=seq_lens)
    )
    return ReferencePlan(batch, guard, block_tables, layout, return_lse)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, layout=None, return_lse=False):
    """Attention of each sequence's last token over its paged KV cache.

    The query of sequence b sits at position `seq_lens[b] - 1` and sees keys `0 .. seq_lens[b] - 1`
    allowed by the layout.

    Args:
        q (torch.Tensor):
            [num_seqs, num_heads, head_dim], float32, float16 or bfloat16.
        k_cache, v_cache (torch.Tensor):
            [num_pages, page_size, num_kv_heads, head_dim], q's dtype.
        block_tables (torch.Tensor):
            int32 [num_seqs, max_pages_per_seq]; entries past a sequence's last page are never read.
        seq_lens (torch.Tensor):
            int32 [num_seqs], >= 1, the new token included.
        scale (float | None):
            Score scale. Default: `None`, meaning 1/sqrt(head_dim).
        layout (a layout | None):
            Block-sparse layout (the protocol of reference/layouts.py). Default: `None`, dense causal.
        return_lse (bool):
            Also return the log-sum-exp. Default: `False`.
    Returns:
        out [num_seqs, num_heads, head_dim] in q's dtype; with `return_lse`, also
        lse [num_seqs, num_heads] float32 (natural log; -inf and out 0 for a row with no key, NaN
        for a row that sees a non-finite value).
    """
    plan = plan_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale=scale, layout=layout, return_lse=return_lse
    )
    return plan.run(q, k_cache, v_cache)
