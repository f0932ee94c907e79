"""Semantic bugs planted in an otherwise exact attention: what contract §5's rule must always catch.

Each attribute is an implementation (contract §9) whose `paged_prefill` and `paged_decode` compute
attention in float64, exactly, except for one planted mistake of the kind real kernels have shipped.
Their only rounding is the final one to the output dtype, so the ratio a bug reaches measures the
bug, not noise. The suite's own tests (tests/harness/test_planted_bugs.py) require each to be caught,
and `python -m reports.sharpness` reports how far over the allowance each one lands.

    zero_filled_context   vLLM's unmerged prefix-caching kernel (PR #8345's kind): when the cached
                          context is not a multiple of the sparse block, the padding slots of its
                          last block get score 0 instead of -inf and enter the denominator
    sees_next_token       the causal rule off by one: a query also sees the key after it
    scale_ignored         always 1/sqrt(head_dim), whatever `scale` says
    negative_scale_abs    a negative scale taken as its absolute value
    gqa_modulo            query head h reads KV head h % num_kv_heads instead of h // group
    shard_offset_ignored  a tensor-parallel shard's head_offset taken as 0 (local-strided layouts)
    local_window_short    one local block fewer (local-strided layouts)
    vertical_phase        vertical columns shifted by one block (local-strided layouts)
    drops_last_key        the last key of every row ignored (a loop bound off by one)
    no_rescale            online softmax that forgets to rescale the accumulator when the max grows
    lse_base2             the log-sum-exp in base 2
    nan_leak              a NaN or Inf in the V of any key of a 16-key tile reaches every row that
                          sees a key of that tile (0 * NaN in P·V, causality broken)
    empty_rows_unwritten  rows with no visible key left as allocated (torch.empty): NaN-poisoned
"""

import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from backends.comparison import decode_via_prefill, sequences
from reference.layouts import LocalStridedLayout
from reference.paged_prefill import token_mask

NAN_LEAK_TILE = 16
ONLINE_TILE = 16


@dataclass(frozen=True)
class Bug:
    """Which mistake an implementation makes (one field set per bug)."""

    zero_filled_context: bool = False
    sees_next_token: bool = False
    scale_ignored: bool = False
    negative_scale_abs: bool = False
    gqa_modulo: bool = False
    shard_offset_ignored: bool = False
    local_window_short: bool = False
    vertical_phase: bool = False
    drops_last_key: bool = False
    no_rescale: bool = False
    lse_base2: bool = False
    nan_leak: bool = False
    empty_rows_unwritten: bool = False


def _layout(bug: Bug, layout):
    """The local-strided layout as the bug sees it: without the shard's offset, or one local block short."""
    if not isinstance(layout, LocalStridedLayout):
        return layout
    local = layout.local_blocks - (bug.local_window_short and layout.local_blocks > 1)
    offset = 0 if bug.shard_offset_ignored else layout.head_offset
    return LocalStridedLayout(
        layout.block_size, local, layout.vert_stride, layout.homo_head, layout.num_heads_total, offset
    )


def _shifted_columns(layout: LocalStridedLayout, num_heads: int, q_pos, k_pos) -> torch.Tensor:
    """The local-strided token mask with every vertical column one block to the left."""
    g = (layout.head_offset + torch.arange(num_heads)).view(-1, 1, 1)
    qb, kb = (q_pos // layout.block_size).view(-1, 1), (k_pos // layout.block_size).view(1, -1)
    local = (qb - kb) < layout.local_blocks
    vertical = (kb + g * layout.head_step(num_heads) + 2) % layout.vert_stride == 0
    return (k_pos.view(1, -1) <= q_pos.view(-1, 1)) & (local | vertical)


def _mask(bug: Bug, layout, num_heads: int, q_pos, seq_len: int) -> torch.Tensor:
    """bool [H, Q, seq_len] of the keys each row sees under the bug."""
    k_pos = torch.arange(seq_len)
    if bug.vertical_phase and isinstance(layout, LocalStridedLayout):
        mask = _shifted_columns(layout, num_heads, q_pos, k_pos)
    else:
        mask = token_mask(_layout(bug, layout), num_heads, q_pos, k_pos)
    if bug.sees_next_token:
        mask = mask | (k_pos.view(1, -1) == q_pos.view(-1, 1) + 1)
    if bug.drops_last_key:
        last = (mask.long().cumsum(-1) == mask.sum(-1, keepdim=True)) & mask
        mask = mask & ~(last & (mask.sum(-1, keepdim=True) > 1))
    return mask


def _tiles_touched(mask, kv_bad):
    """[H, Q]: the row sees a key of some 16-key tile that holds a non-finite K or V."""
    heads, rows, keys = mask.shape
    width = -(-keys // NAN_LEAK_TILE) * NAN_LEAK_TILE
    pad = width - keys
    touched = torch.nn.functional.pad(mask, (0, pad)).view(heads, rows, -1, NAN_LEAK_TILE).any(-1)
    bad = torch.nn.functional.pad(kv_bad, (0, pad)).view(heads, 1, -1, NAN_LEAK_TILE).any(-1)
    return (touched & bad).any(-1)


def _softmax(bug: Bug, s, v, mask, pad: int):
    """float64 out [H, Q, D] and lse [H, Q] of scores s [H, Q, K] (-inf where masked)."""
    has_key = mask.any(-1, keepdim=True)
    if bug.no_rescale:
        m_run = s.new_full(s.shape[:2] + (1,), -math.inf)
        l = torch.zeros_like(m_run)
        acc = s.new_zeros(s.shape[:2] + (v.shape[-1],))
        for lo in range(0, s.shape[-1], ONLINE_TILE):
            t = s[..., lo : lo + ONLINE_TILE]
            m_new = torch.maximum(m_run, t.amax(-1, keepdim=True))
            safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
            p = torch.exp(t - safe)
            alpha = torch.where(torch.isfinite(m_run), torch.exp(m_run - safe), 0.0)
            l = l * alpha + p.sum(-1, keepdim=True)
            acc = acc + torch.einsum("hqk,hkd->hqd", p, v[:, lo : lo + ONLINE_TILE])  # forgot * alpha
            m_run = m_new
        out = acc / torch.where(has_key, l, 1.0)
        lse = torch.where(torch.isfinite(m_run), m_run, 0.0) + torch.log(torch.where(has_key, l, 1.0))
    else:
        # Padding slots of score 0 (and V 0) join every row's softmax when `pad` > 0.
        m = s.amax(-1, keepdim=True) if s.shape[-1] else torch.zeros_like(has_key, dtype=s.dtype)
        m = torch.where(torch.isfinite(m), m, 0.0)
        m = m.clamp_min(0.0) if pad else m
        w = torch.exp(s - m)
        denom = w.sum(-1, keepdim=True) + pad * torch.exp(-m)
        out = torch.einsum("hqk,hkd->hqd", w, v) / torch.where(denom > 0, denom, 1.0)
        lse = m + torch.log(torch.where(denom > 0, denom, 1.0))
    empty = ~has_key if not pad else torch.zeros_like(has_key)
    out = torch.where(empty, 0.0, out)
    lse = torch.where(empty, -math.inf, lse)
    if bug.lse_base2:
        lse = lse / math.log(2.0)
    return out, lse.squeeze(-1)


def _attend_sequence(bug: Bug, batch, q, k, v, layout, context: int, seq_len: int):
    """One sequence: q [Q, H, D], k, v [seq_len, Hkv, D]; float64 out [Q, H, D], lse [Q, H]."""
    heads, kv_heads = batch.num_heads, batch.num_kv_heads
    group = heads // kv_heads
    heads_idx = torch.arange(heads, device=q.device)
    kv_of = heads_idx % kv_heads if bug.gqa_modulo else heads_idx // group
    q_pos = torch.arange(context, seq_len)
    mask = _mask(bug, layout, heads, q_pos, seq_len).to(q.device)
    q_bad = ~torch.isfinite(q).all(-1).T  # [H, Q]
    kv_bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))[:, kv_of].T  # [H, K]
    bad = q_bad | (mask & kv_bad[:, None, :]).any(-1)
    if bug.nan_leak:
        bad = bad | _tiles_touched(mask, kv_bad)
    q64, k64, v64 = (torch.nan_to_num(t.double(), 0.0, 0.0, 0.0).transpose(0, 1) for t in (q, k, v))
    k64, v64 = k64[kv_of], v64[kv_of]
    scale = 1.0 / math.sqrt(batch.head_dim) if bug.scale_ignored else batch.scale
    if bug.negative_scale_abs:
        scale = abs(scale)
    s = (torch.einsum("hqd,hkd->hqk", q64, k64) * scale).masked_fill(~mask, -math.inf)
    pad = 0
    size = getattr(layout, "block_size", None)
    if bug.zero_filled_context and size and context % size:
        pad = size - context % size
    out, lse = _softmax(bug, s, v64, mask, pad)
    out = out.masked_fill(bad[..., None], math.nan)
    lse = lse.masked_fill(bad, math.nan)
    return out.transpose(0, 1), lse.T, mask.any(-1).T


def _prefill(bug: Bug):
    def paged_prefill(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None,
        return_lse=False,
    ):  # fmt: skip
        """Exact float64 attention with one planted bug (harness/planted_bugs.py)."""
        args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
        batch, per_sequence = sequences(*args, scale=scale, layout=layout, return_lse=return_lse)
        out = torch.empty_like(q) if bug.empty_rows_unwritten else torch.zeros_like(q)
        lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
        for start, end, context, qb, k, v in per_sequence:
            o, s, seen = _attend_sequence(bug, batch, qb, k, v, layout, context, context + end - start)
            if bug.empty_rows_unwritten:
                rows = out[start:end]
                rows[seen] = o[seen].to(q.dtype)
            else:
                out[start:end] = o.to(q.dtype)
            lse[start:end] = s.float()
        return (out, lse) if return_lse else out

    return paged_prefill


def _implementation(bug: Bug) -> SimpleNamespace:
    prefill = _prefill(bug)
    return SimpleNamespace(write_kv=None, paged_prefill=prefill, paged_decode=decode_via_prefill(prefill))


BUGS = tuple(f for f in Bug.__dataclass_fields__)
for _name in BUGS:
    globals()[_name] = _implementation(replace(Bug(), **{_name: True}))
# The same code with no bug planted: the control, which must pass everything.
no_bug = _implementation(Bug())
