"""Oracle of block-sparse prefill over a paged KV cache (contract §1-4).

Per sequence: gather K/V through the block table, materialise the token mask of the layout
(causal by absolute position), and apply `softmax(scale * q k^T + mask) v` with `-inf` masking.
"""

import math

import torch

from reference.error_bound import attention_bounds
from reference.layouts import token_mask
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


# Rows of one float64 block of the oracle: [num_heads, rows, num_keys] stays near 64 MiB per tensor.
BLOCK_ELEMENTS = 2**23


def masked_softmax_attention(q, k, v, mask, scale: float, model=None, levels=()):
    """softmax(scale * q k^T with -inf where ~mask) v in float64, and optionally its allowances.

    Args:
        q (torch.Tensor):
            [num_queries, num_heads, head_dim].
        k, v (torch.Tensor):
            [num_keys, num_kv_heads, head_dim]; KV head j serves query heads j*G .. j*G+G-1.
        mask (torch.Tensor):
            bool [num_heads, num_queries, num_keys], True where the key is visible.
        model (RoundingModel | None), levels (tuple[tuple[float, float], ...]):
            With a model, also the allowances of contract §5 (reference/error_bound.py) at each
            (lambda, share of the single roundings) level.
    Returns:
        out float64 [num_queries, num_heads, head_dim], lse float64 [num_queries, num_heads]
        (natural log) and a list of (out_bound, lse_bound) of the same shapes, one per level. A row
        with no visible key (decided by `mask` alone) gives out 0 and lse -inf (bounds 0). A row whose
        query, or the K or V of a key it sees, holds NaN or Inf gives NaN in every element of out
        and in lse; such values never reach a row that does not see them.
    """
    group = q.shape[1] // k.shape[1]
    mask = mask.to(q.device)
    # [num_queries, num_heads] and [num_keys, num_kv_heads]: which inputs hold a non-finite value
    q_bad = ~torch.isfinite(q).all(-1)
    kv_bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))
    # The arithmetic runs on zeroed copies, so that 0 * NaN of an unseen key cannot leak into a row.
    # [num_heads, num_queries or num_keys, head_dim]
    q, k, v = (
        torch.where(torch.isfinite(t), t, torch.zeros_like(t)).double().transpose(0, 1) for t in (q, k, v)
    )
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = torch.einsum("hqd,hkd->hqk", q, k) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    # [num_heads, num_queries, 1]
    has_key = mask.any(dim=-1, keepdim=True)
    row_max = (
        scores.amax(dim=-1, keepdim=True) if scores.shape[-1] else torch.zeros_like(has_key, dtype=q.dtype)
    )
    # An empty row has max -inf; pivot it at 0 so that exp gives 0 rather than NaN.
    pivot = torch.where(has_key, row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - pivot)
    denom = weights.sum(dim=-1, keepdim=True)
    safe = torch.where(has_key, denom, torch.ones_like(denom))
    probs = weights / safe
    out = torch.einsum("hqk,hkd->hqd", probs, v)
    lse = torch.where(has_key, pivot + torch.log(safe), torch.full_like(pivot, -math.inf))
    bounds = [
        attention_bounds(q, k, v, mask, scale, scores, probs, out, pivot, lse, model, level)
        for level in levels
    ]
    # [num_heads, num_queries]: rows that see a non-finite input
    bad = q_bad.transpose(0, 1) | (
        mask & kv_bad.repeat_interleave(group, dim=1).transpose(0, 1)[:, None, :]
    ).any(-1)
    out = out.masked_fill(bad[..., None], math.nan)
    lse = lse.squeeze(-1).masked_fill(bad, math.nan)
    bounds = [(ob.permute(1, 0, 2), lb.squeeze(-1).permute(1, 0)) for ob, lb in bounds]
    return out.permute(1, 0, 2), lse.permute(1, 0), bounds


def prefill_float64(batch: PagedBatch, q, k_cache, v_cache, block_tables, layout, model=None, levels=()):
    """The oracle's computation for a validated batch, in float64, unrounded.

    Returns out [num_tokens, num_heads, head_dim] and lse [num_tokens, num_heads] float64, and with a
    `model` (reference/error_bound.py) a list of (out_bound, lse_bound), one per level, of the same
    shapes.
    """
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64, device=q.device)
    bounds = [(torch.zeros_like(out), torch.zeros_like(lse)) for _ in levels]
    for b, seq_len in enumerate(batch.seq_lens):
        start, end = batch.query_starts[b], batch.query_starts[b + 1]
        context = seq_len - (end - start)
        k = gather_pages(k_cache, block_tables[b], seq_len)
        v = gather_pages(v_cache, block_tables[b], seq_len)
        rows = max(1, BLOCK_ELEMENTS // max(1, batch.num_heads * seq_len))
        for lo in range(start, end, rows):
            hi = min(end, lo + rows)
            q_pos = torch.arange(context + lo - start, context + hi - start)
            mask = token_mask(layout, batch.num_heads, q_pos, torch.arange(seq_len))
            o, s, bs = masked_softmax_attention(q[lo:hi], k, v, mask, batch.scale, model, levels)
            out[lo:hi], lse[lo:hi] = o, s
            for (ob, lb), (o_b, l_b) in zip(bounds, bs, strict=True):
                ob[lo:hi], lb[lo:hi] = o_b, l_b
    return out, lse, bounds


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
        out, lse, _ = prefill_float64(self.batch, q, k_cache, v_cache, self.block_tables, self.layout)
        out, lse = out.to(q.dtype), lse.float()
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
        layout (a layout | None):
            Block-sparse layout (the protocol of reference/layouts.py). Default: `None`, dense causal.
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
