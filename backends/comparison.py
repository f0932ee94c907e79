"""The comparison implementations of the registry: torch SDPA and FlexAttention behind the §4 operators.

Both gather each sequence's K/V through its block table and call torch once per sequence; both
validate their arguments with the oracle's shared validation. Neither writes the cache (`write_kv`
is None). Decode is prefill with one query per sequence.

NOTE (FlexAttention, torch 2.11 on CUDA): torch's internal compile of `create_block_mask` reused a
cached graph whose mask function took an integer default argument, so an old block count stayed baked
in and later calls at other lengths went wrong (pytorch issue 178365; the order of calls decided
which lengths failed). The mask functions below capture their values in closures, never in default
arguments; `tests/harness/test_comparison.py` fails if that pattern comes back.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from reference.paged_prefill import gather_pages
from reference.validation import validate_paged_decode, validate_paged_prefill


def sequences(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale, layout, return_lse=False
):
    """Validates a `paged_prefill` call like the oracle (errors before anything else happens) and
    returns (batch, [(start, end, context, q_b, k_b, v_b), ...]): the validated `PagedBatch`, and per
    sequence with queries its token range in q, its cached context, q_b [end - start, num_heads,
    head_dim] and its K/V gathered through the block table, [seq_len, num_kv_heads, head_dim].

    The comparison backends, the rounding family (examples/) and the planted bugs walk a batch this way.
    """
    batch = validate_paged_prefill(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale, layout=layout,
        return_lse=return_lse,
    )  # fmt: skip
    per_sequence = []
    for b, seq_len in enumerate(batch.seq_lens):
        start, end = batch.query_starts[b], batch.query_starts[b + 1]
        if end > start:
            k = gather_pages(k_cache, block_tables[b], seq_len)
            v = gather_pages(v_cache, block_tables[b], seq_len)
            per_sequence.append((start, end, seq_len - (end - start), q[start:end], k, v))
    return batch, per_sequence


def decode_via_prefill(prefill):
    """paged_decode from a paged_prefill (contract §4: decode is prefill with one query per sequence).

    The adapters of this file, the examples and the planted bugs all build their decode this way;
    the arguments are validated as decode's first, so decode's own errors name what they should.
    """

    def paged_decode(
        q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, layout=None, return_lse=False
    ):
        validate_paged_decode(
            q, k_cache, v_cache, block_tables, seq_lens, scale=scale, layout=layout, return_lse=return_lse
        )
        starts = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return prefill(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            starts,
            scale=scale,
            layout=layout,
            return_lse=return_lse,
        )

    return paged_decode


def sdpa_prefill(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None, return_lse=False
):
    """Dense causal prefill through `scaled_dot_product_attention`, one call per sequence."""
    if layout is not None:
        raise NotImplementedError("sdpa: dense causal only (layout must be None)")
    if return_lse:
        raise NotImplementedError("sdpa: no log-sum-exp")
    batch, per_sequence = sequences(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale, layout=layout
    )
    out = torch.zeros_like(q)
    for start, end, context, qb, kb, vb in per_sequence:
        q_pos = torch.arange(context, context + end - start, device=q.device)
        # Bottom-right aligned causal mask: the query at absolute position p sees keys 0..p.
        mask = torch.arange(kb.shape[0], device=q.device).view(1, -1) <= q_pos.view(-1, 1)
        # [1, heads, tokens, head_dim]
        o = F.scaled_dot_product_attention(
            qb.transpose(0, 1)[None],
            kb.transpose(0, 1)[None],
            vb.transpose(0, 1)[None],
            attn_mask=mask,
            scale=batch.scale,
            enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


SDPA = SimpleNamespace(
    write_kv=None,
    paged_prefill=sdpa_prefill,
    paged_decode=decode_via_prefill(sdpa_prefill),
    capabilities={"layouts": ("dense",), "lse": False},
)


def flex_mask_mod(layout, num_heads: int, seq_len: int, device):
    """The FlexAttention `mask_mod` of a layout (None: dense causal) over one square sequence.

    Everything it reads is captured in a closure, never in a default argument (see the module note).
    """
    if layout is None:

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

        return causal
    size = layout.block_size
    # [H, NB, NB], the causal rule included by both layout classes
    blocks = layout.block_mask(num_heads, math.ceil(seq_len / size)).to(device)
    last = blocks.shape[-1] - 1

    # create_block_mask also evaluates indices padded up to its own block size: clamp them into the
    # grid (they are masked by length anyway), or CUDA indexing asserts.
    def block_sparse(b, h, q_idx, kv_idx):
        qb, kb = (q_idx // size).clamp(max=last), (kv_idx // size).clamp(max=last)
        return (kv_idx <= q_idx) & blocks[h, qb, kb]

    return block_sparse


def flex_prefill(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None, return_lse=False
):
    """Block-sparse prefill through FlexAttention (eager), one call per sequence."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    batch, per_sequence = sequences(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale, layout=layout,
        return_lse=return_lse,
    )  # fmt: skip
    num_heads = batch.num_heads
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    for start, end, context, qb, kb, vb in per_sequence:
        # Square problems only: queries are padded in front to the key length, so that query row i
        # sits at absolute position i. torch 2.11's eager flex on CUDA got Q_LEN < KV_LEN wrong
        # (the context offset was lost); the padded rows are dropped afterwards.
        seq_len = kb.shape[0]
        q_full = qb.new_zeros(seq_len, *qb.shape[1:])
        q_full[context:] = qb
        mask_mod = flex_mask_mod(layout, num_heads, seq_len, q.device)
        block_mask = create_block_mask(mask_mod, None, num_heads, seq_len, seq_len, device=q.device.type)
        o, aux = flex_attention(
            q_full.transpose(0, 1)[None],
            kb.transpose(0, 1)[None],
            vb.transpose(0, 1)[None],
            block_mask=block_mask,
            scale=batch.scale,
            enable_gqa=True,
            return_aux=AuxRequest(lse=True),
        )
        out[start:end] = o[0].transpose(0, 1)[context:]
        lse[start:end] = aux.lse[0].transpose(0, 1)[context:].float()
    return (out, lse) if return_lse else out


FLEX_CAPABILITIES = None  # every dtype and layout, with lse


def load_flex():
    """The flex implementation; ImportError on a torch without FlexAttention's AuxRequest."""
    import warnings

    from torch.nn.attention.flex_attention import AuxRequest  # noqa: F401  (older torch: unavailable)

    # Uncompiled flex_attention warns once that it materialises the scores: that is the point here.
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    return SimpleNamespace(
        write_kv=None, paged_prefill=flex_prefill, paged_decode=decode_via_prefill(flex_prefill)
    )
