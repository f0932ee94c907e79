"""An example implementation under test: a plain-PyTorch attention "kernel" with its own cache layout.

The kernel keeps K/V head-major, `[num_pages, num_kv_heads, page_size, head_dim]`, and computes in
float32. The adapter converts the suite's token-major caches with `harness.cache_layouts` and checks
its arguments with the suite's shared validation, so it rejects exactly what the oracle rejects.
Put it under the whole suite with one string (contract §9):

    pytest tests/kernels --backend examples/head_major_kernel.py:impl
"""

import math

import torch

from harness.cache_layouts import to_head_major
from reference.validation import validate_paged_decode, validate_paged_prefill, validate_write_kv


def head_major_attention(q, k_pages, v_pages, pages, mask, scale: float):
    """Attention of one sequence's queries over its head-major pages, in float32.

    Args:
        q: float32 [num_queries, num_heads, head_dim].
        k_pages, v_pages: [num_pages, num_kv_heads, page_size, head_dim], the whole cache.
        pages: int64 [cdiv(seq_len, page_size)], the sequence's pages in order.
        mask: bool [num_heads, num_queries, seq_len], True where a query may see a key.
    Returns:
        out float32 [num_queries, num_heads, head_dim] and lse float32 [num_queries, num_heads]:
        0 and -inf on a row with no visible key, NaN on a row that sees a non-finite input.
    """
    num_heads, seq_len = mask.shape[0], mask.shape[2]
    num_kv_heads, head_dim = k_pages.shape[1], k_pages.shape[3]
    group = num_heads // num_kv_heads
    # [num_kv_heads, seq_len, head_dim]: the sequence's pages laid end to end, per head.
    k, v = (
        c[pages].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len].float()
        for c in (k_pages, v_pages)
    )
    # [num_heads, num_queries, seq_len]: a visible query or key/value with a NaN or Inf.
    bad_q = ~torch.isfinite(q).all(-1).T[:, :, None]
    bad_kv = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1)).repeat_interleave(group, 0)[:, None]
    poisoned = (mask & (bad_q | bad_kv)).any(-1) | bad_q[..., 0]
    # Zeroed before the matmuls: 0 * NaN from a key a row does not see would leak into that row.
    q, k, v = (t.nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v))
    scores = torch.einsum("qhd,hkd->hqk", q, k.repeat_interleave(group, 0)) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, -1)
    # softmax of an all -inf row is NaN; such a row is empty by the mask and gets 0.
    probs = torch.where(mask.any(-1, keepdim=True), torch.softmax(scores, -1), 0.0)
    out = torch.einsum("hqk,hkd->qhd", probs, v.repeat_interleave(group, 0))
    out = out.masked_fill(poisoned.T[..., None], math.nan)
    return out, lse.masked_fill(poisoned, math.nan).T


def _attend(batch, q, k_cache, v_cache, block_tables, layout, return_lse):
    """The kernel on every sequence of a validated batch; out in q's dtype, lse float32."""
    k_pages, v_pages = to_head_major(k_cache, v_cache)
    q32 = q.float().contiguous()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    starts = batch.query_starts
    for b, (seq_len, start, end) in enumerate(zip(batch.seq_lens, starts[:-1], starts[1:], strict=True)):
        if start == end:
            continue
        q_pos, k_pos = torch.arange(seq_len - (end - start), seq_len), torch.arange(seq_len)
        if layout is None:
            mask = (k_pos[None, :] <= q_pos[:, None]).expand(batch.num_heads, -1, -1)
        else:
            mask = layout.token_mask(batch.num_heads, q_pos, k_pos)
        pages = block_tables[b, : math.ceil(seq_len / batch.page_size)].long()
        out[start:end], lse[start:end] = head_major_attention(
            q32[start:end], k_pages, v_pages, pages, mask.to(q.device), batch.scale
        )
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def paged_prefill(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None, return_lse=False
):
    """Block-sparse prefill. q: [num_tokens, num_heads, head_dim]; k_cache, v_cache:
    [num_pages, page_size, num_kv_heads, head_dim]; block_tables int32 [num_seqs, max_pages_per_seq];
    seq_lens int32 [num_seqs]; query_start_loc int32 [num_seqs + 1].
    Returns out [num_tokens, num_heads, head_dim] (q's dtype), and lse float32 [num_tokens, num_heads]."""
    batch = validate_paged_prefill(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale=scale,
        layout=layout,
        return_lse=return_lse,
    )
    return _attend(batch, q, k_cache, v_cache, block_tables, layout, return_lse)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, layout=None, return_lse=False):
    """Block-sparse decode, one query per sequence. q: [num_seqs, num_heads, head_dim]; the rest as in
    `paged_prefill`. Returns out [num_seqs, num_heads, head_dim], and lse float32 [num_seqs, num_heads]."""
    batch = validate_paged_decode(
        q, k_cache, v_cache, block_tables, seq_lens, scale=scale, layout=layout, return_lse=return_lse
    )
    return _attend(batch, q, k_cache, v_cache, block_tables, layout, return_lse)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Writes token t's K/V ([num_tokens, num_kv_heads, head_dim]) to slot `slot_mapping[t]` (int64,
    -1: skip) of k_cache, v_cache ([num_pages, page_size, num_kv_heads, head_dim]), in place."""
    validate_write_kv(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    page, offset = slot_mapping[keep] // k_cache.shape[1], slot_mapping[keep] % k_cache.shape[1]
    for cache, new in ((k_cache, k), (v_cache, v)):
        # A head-major view, not a converted copy: the write must land in the caller's tensor.
        cache.transpose(1, 2)[page, :, offset] = new[keep]


class HeadMajorKernel:
    """Plain-PyTorch attention over head-major KV pages, float32 compute (an example adapter)."""

    write_kv = staticmethod(write_kv)
    paged_prefill = staticmethod(paged_prefill)
    paged_decode = staticmethod(paged_decode)
    capabilities = {
        "dtypes": ("float32", "float16", "bfloat16"),
        "layouts": ("dense", "local_strided", "block_mask"),
        "lse": True,
        "context": True,
        "validates": True,
    }


impl = HeadMajorKernel()
