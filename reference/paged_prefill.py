"""Oracle of block-sparse prefill over a paged KV cache (contract §1-4).

Per sequence: gather K/V through the block table, materialise the token mask of the layout
(causal by absolute position), and apply `softmax(scale * q k^T + mask) v` with `-inf` masking.
"""

import math

import torch

from reference.validation import PagedBatch, PlanGuard, validate_paged_prefill


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Positions 0 .. seq_len-1 of one sequence.

    Args:
        cache (torch.Tensor):
            [num_pages, page_size, num_kv_heads, head_dim].
        pages (torch.Tensor):
            int [>= cdiv(seq_len, page_size)], the sequence's block-table row; later entries unread.
    Returns:
        [seq_len, num_kv_heads, head_dim].
    """
    page_size = cache.shape[1]
    used = pages[: math.ceil(seq_len / page_size)].long()
    return cache[used].reshape(-1, *cache.shape[2:])[:seq_len]


def masked_softmax_attention(q, k, v, mask, scale: float, compute_dtype: torch.dtype):
    """softmax(scale * q k^T with -inf where ~mask) v, all arithmetic in `compute_dtype`.

    Args:
        q (torch.Tensor):
            [num_queries, num_heads, head_dim].
        k, v (torch.Tensor):
            [num_keys, num_kv_heads, head_dim]; KV head j serves query heads j*G .. j*G+G-1.
        mask (torch.Tensor):
            bool [num_heads, num_queries, num_keys], True where the key is visible.
    Returns:
        out [num_queries, num_heads, head_dim] and lse [num_queries, num_heads] (natural log), both
        in `compute_dtype`. A row with no visible key (decided by `mask` alone) gives out 0 and lse
        -inf. A row whose query, or the K or V of a key it sees, holds NaN or Inf gives NaN in every
        element of out and in lse; such values never reach a row that does not see them.
    """
    group = q.shape[1] // k.shape[1]
    mask = mask.to(q.device)
    # [num_queries, num_heads] and [num_keys, num_kv_heads]: which inputs hold a non-finite value
    q_bad = ~torch.isfinite(q).all(-1)
    kv_bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))
    # The arithmetic runs on zeroed copies, so that 0 * NaN of an unseen key cannot leak into a row.
    q, k, v = (torch.where(torch.isfinite(t), t, torch.zeros_like(t)).to(compute_dtype) for t in (q, k, v))
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    # [num_heads, num_queries, num_keys]
    scores = torch.einsum("qhd,khd->hqk", q, k) * torch.tensor(scale, dtype=compute_dtype)
    scores = scores.masked_fill(~mask, -math.inf)
    # [num_heads, num_queries, 1]
    has_key = mask.any(dim=-1, keepdim=True)
    row_max = (
        scores.amax(dim=-1, keepdim=True)
        if scores.shape[-1]
        else torch.zeros_like(has_key, dtype=scores.dtype)
    )
    # An empty row has max -inf; pivot it at 0 so that exp gives 0 rather than NaN.
    pivot = torch.where(has_key, row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - pivot)
    denom = weights.sum(dim=-1, keepdim=True)
    numer = torch.einsum("hqk,khd->hqd", weights, v)
    safe = torch.where(has_key, denom, torch.ones_like(denom))
    out = torch.where(has_key, numer / safe, torch.zeros_like(numer))
    lse = torch.where(has_key, pivot + torch.log(safe), torch.full_like(pivot, -math.inf)).squeeze(-1)
    # [num_heads, num_queries]: rows that see a non-finite input
    bad = q_bad.transpose(0, 1) | (
        mask & kv_bad.repeat_interleave(group, dim=1).transpose(0, 1)[:, None, :]
    ).any(-1)
    out = out.masked_fill(bad[..., None], math.nan)
    lse = lse.masked_fill(bad, math.nan)
    return out.permute(1, 0, 2), lse.permute(1, 0)


def token_mask(layout, num_heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The layout's token mask, or plain causal for `layout=None`. Returns: bool [H, Q, K]."""
    if layout is None:
        causal = k_pos.view(1, -1) <= q_pos.view(-1, 1)
        return causal.expand(num_heads, -1, -1)
    return layout.token_mask(num_heads, q_pos, k_pos)


def prefill_in_dtype(
    batch: PagedBatch,
    q,
    k_cache,
    v_cache,
    block_tables,
    layout,
    compute_dtype: torch.dtype,
    *,
    cast_outputs: bool = True,
):
    """The oracle's computation for a validated batch, in `compute_dtype`.

    The test suite uses it twice: in float64 with `cast_outputs=False` (the unrounded oracle) and in
    the input dtype (the `base` of the tolerance rule, contract §5). Returns:
    out [num_tokens, num_heads, head_dim] and lse [num_tokens, num_heads], in q's dtype and float32
    when `cast_outputs`, else in `compute_dtype`.
    """
    out_dtype, lse_dtype = (q.dtype, torch.float32) if cast_outputs else (compute_dtype, compute_dtype)
    out = torch.zeros(q.shape, dtype=out_dtype, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=lse_dtype, device=q.device)
    for b, seq_len in enumerate(batch.seq_lens):
        start, end = batch.query_starts[b], batch.query_starts[b + 1]
        if end == start:
            continue
        context = seq_len - (end - start)
        k = gather_pages(k_cache, block_tables[b], seq_len)
        v = gather_pages(v_cache, block_tables[b], seq_len)
        q_pos = torch.arange(context, seq_len)
        mask = token_mask(layout, batch.num_heads, q_pos, torch.arange(seq_len))
        o, s = masked_softmax_attention(q[start:end], k, v, mask, batch.scale, compute_dtype)
        out[start:end] = o.to(out_dtype)
        lse[start:end] = s.to(lse_dtype)
    return out, lse


class ReferencePlan:
    """The oracle's planned path: the validated batch, run on any q and caches of the planned shapes.

    The twin of `kernels.paged_prefill.PrefillPlan` (and of the decode plan), with the same refusals.
    """

    def __init__(self, batch: PagedBatch, guard: PlanGuard, block_tables, layout, return_lse: bool):
        self.batch, self.guard, self.block_tables = batch, guard, block_tables
        self.layout, self.return_lse = layout, return_lse

    def run(self, q, k_cache, v_cache):
        """out in q's dtype; with return_lse also lse float32 (as `paged_prefill`)."""
        self.guard.check(q=q, k_cache=k_cache, v_cache=v_cache)
        out, lse = prefill_in_dtype(
            self.batch, q, k_cache, v_cache, self.block_tables, self.layout, torch.float64
        )
        return (out, lse) if self.return_lse else out


def plan_prefill(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None, return_lse=False
):
    """Validates a `paged_prefill` call once; returns a plan whose `run(q, k_cache, v_cache)` computes it.

    Arguments as `paged_prefill`. Only the shapes, strides, dtypes and devices of q, k_cache and
    v_cache are planned: `run` takes any tensors of those, and refuses (ValueError) others and
    metadata modified in place after planning.
    """
    batch = validate_paged_prefill(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale, layout=layout,
        return_lse=return_lse,
    )  # fmt: skip
    guard = PlanGuard(
        dict(q=q, k_cache=k_cache, v_cache=v_cache),
        dict(block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc),
    )
    return ReferencePlan(batch, guard, block_tables, layout, return_lse)


def paged_prefill(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None, return_lse=False
):
    """Block-sparse attention of new tokens over a paged KV cache that already holds them.

    Sequence b has `seq_lens[b]` tokens; its last `query_start_loc[b+1] - query_start_loc[b]` are the
    queries, at absolute positions `seq_lens[b] - q_len .. seq_lens[b] - 1`.

    Args:
        q (torch.Tensor):
            [num_tokens, num_heads, head_dim], float32, float16 or bfloat16.
        k_cache, v_cache (torch.Tensor):
            [num_pages, page_size, num_kv_heads, head_dim], q's dtype.
        block_tables (torch.Tensor):
            int32 [num_seqs, max_pages_per_seq]; entries past a sequence's last page are never read.
        seq_lens (torch.Tensor):
            int32 [num_seqs], context plus new tokens.
        query_start_loc (torch.Tensor):
            int32 [num_seqs + 1], cumulative query counts.
        scale (float | None):
            Score scale. Default: `None`, meaning 1/sqrt(head_dim).
        layout (LocalStridedLayout | BlockMaskLayout | None):
            Block-sparse layout. Default: `None`, dense causal.
        return_lse (bool):
            Also return the log-sum-exp. Default: `False`.
    Returns:
        out [num_tokens, num_heads, head_dim] in q's dtype; with `return_lse`, also
        lse [num_tokens, num_heads] float32 (natural log; -inf and out 0 for a row with no key, NaN
        for a row that sees a non-finite value).
    """
    plan = plan_prefill(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale, layout=layout,
        return_lse=return_lse,
    )  # fmt: skip
    return plan.run(q, k_cache, v_cache)
