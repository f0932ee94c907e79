"""Implementations of SPEC section 4's operators that the campaign and the report put under test.

Each backend is one adapter: a name, a loader that returns an object with the operator functions
(`write_kv`, `paged_prefill`, `paged_decode`, any of them `None` when unsupported) and what it
supports (dtypes, layout families, whether it returns the log-sum-exp). Loaders import lazily, so a
backend whose module does not exist yet is reported "unavailable" instead of breaking the campaign.

- `triton`: the Triton twins in `kernels/` (the default).
- `sdpa`: `torch.nn.functional.scaled_dot_product_attention` over K/V gathered through the block
  table, dense causal layout only (bottom-right aligned bool mask); no log-sum-exp.
- `flex`: FlexAttention with a `mask_mod` reproducing any layout, uncompiled (eager), which runs on
  the CPU and the GPU.
- `reference`: the oracle itself, for smoke tests of the campaign (it must always pass).
"""

import importlib
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

ALL_DTYPES = ("float32", "float16", "bfloat16")
ALL_LAYOUTS = ("dense", "local_strided", "block_mask")


@dataclass(frozen=True)
class Backend:
    """An adapter: `load()` returns the operators or raises ImportError/RuntimeError (unavailable)."""

    name: str
    load: callable
    dtypes: tuple[str, ...] = ALL_DTYPES
    layout_kinds: tuple[str, ...] = ALL_LAYOUTS
    has_lse: bool = True
    notes: str = ""
    interpreted_dtypes: tuple[str, ...] | None = field(default=None)  # dtypes allowed on the CPU

    def dtypes_on(self, device: str) -> tuple[str, ...]:
        """The dtypes to draw on `device` (the Triton interpreter cannot do bfloat16)."""
        if device == "cpu" and self.interpreted_dtypes is not None:
            return self.interpreted_dtypes
        return self.dtypes


def _load_module(name: str):
    module = importlib.import_module(name)
    return SimpleNamespace(
        write_kv=getattr(module, "write_kv", None),
        paged_prefill=getattr(module, "paged_prefill", None),
        paged_decode=getattr(module, "paged_decode", None),
    )


def _decode_via_prefill(prefill):
    """paged_decode from a paged_prefill: one query per sequence."""

    def paged_decode(
        q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, layout=None, return_lse=False
    ):
        import torch

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


def _sequences(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, layout):
    """Validates like the oracle, then yields (start, end, context, q_b, k_b, v_b, scale) per sequence."""
    from reference.paged_prefill import gather_pages
    from reference.validation import validate_paged_prefill

    batch = validate_paged_prefill(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale, layout=layout
    )
    for b, seq_len in enumerate(batch.seq_lens):
        start, end = batch.query_starts[b], batch.query_starts[b + 1]
        if end > start:
            k = gather_pages(k_cache, block_tables[b], seq_len)
            v = gather_pages(v_cache, block_tables[b], seq_len)
            yield start, end, seq_len - (end - start), q[start:end], k, v, batch.scale


def sdpa_prefill(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None, return_lse=False
):
    """Dense causal prefill through `scaled_dot_product_attention`, one call per sequence."""
    import torch
    import torch.nn.functional as F

    if layout is not None:
        raise ValueError("sdpa backend: layout must be None (dense causal only)")
    if return_lse:
        raise ValueError("sdpa backend: return_lse is not supported")
    out = torch.zeros_like(q)
    for start, end, context, qb, kb, vb, sc in _sequences(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, layout
    ):
        q_pos = torch.arange(context, context + end - start, device=q.device)
        k_pos = torch.arange(kb.shape[0], device=q.device)
        # Bottom-right aligned causal mask: query at absolute position p sees keys 0..p.
        mask = k_pos.view(1, -1) <= q_pos.view(-1, 1)
        # [1, heads, tokens, head_dim]
        o = F.scaled_dot_product_attention(
            qb.transpose(0, 1)[None],
            kb.transpose(0, 1)[None],
            vb.transpose(0, 1)[None],
            attn_mask=mask,
            scale=sc,
            enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


def flex_prefill(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale=None, layout=None, return_lse=False
):
    """Block-sparse prefill through FlexAttention (eager), one call per sequence."""
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    num_heads = q.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    for start, end, context, qb, kb, vb, sc in _sequences(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, layout
    ):
        # Square problems only: queries are padded in front to the key length, so that query row i
        # sits at absolute position i. torch 2.11's eager flex on CUDA got Q_LEN < KV_LEN wrong
        # (the context offset was lost: lse off by nats); the padded rows are dropped afterwards.
        seq_len = kb.shape[0]
        q_full = qb.new_zeros(seq_len, *qb.shape[1:])
        q_full[context:] = qb
        if layout is None:

            def mask_mod(b, h, q_idx, kv_idx):
                return kv_idx <= q_idx

        else:
            size = layout.block_size
            # [H, NB, NB], the causal rule included by both layout classes
            blocks = layout.block_mask(num_heads, math.ceil(seq_len / size)).to(q.device)
            last = blocks.shape[-1] - 1

            # create_block_mask also evaluates indices padded up to its own block size: clamp them
            # into the grid (they are masked by length anyway), or CUDA indexing asserts.
            def mask_mod(b, h, q_idx, kv_idx, blocks=blocks, size=size, last=last):
                qb_, kb_ = (q_idx // size).clamp(max=last), (kv_idx // size).clamp(max=last)
                return (kv_idx <= q_idx) & blocks[h, qb_, kb_]

        block_mask = create_block_mask(mask_mod, None, num_heads, seq_len, seq_len, device=q.device.type)
        o, aux = flex_attention(
            q_full.transpose(0, 1)[None],
            kb.transpose(0, 1)[None],
            vb.transpose(0, 1)[None],
            block_mask=block_mask,
            scale=sc,
            enable_gqa=True,
            return_aux=AuxRequest(lse=True),
        )
        out[start:end] = o[0].transpose(0, 1)[context:]
        lse[start:end] = aux.lse[0].transpose(0, 1)[context:].float()
    return (out, lse) if return_lse else out


def _load_sdpa():
    return SimpleNamespace(
        write_kv=None, paged_prefill=sdpa_prefill, paged_decode=_decode_via_prefill(sdpa_prefill)
    )


def _load_flex():
    import warnings

    from torch.nn.attention.flex_attention import AuxRequest  # noqa: F401  (older torch: unavailable)

    # Uncompiled flex_attention warns once that it materialises the scores: that is the point here.
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    return SimpleNamespace(
        write_kv=None, paged_prefill=flex_prefill, paged_decode=_decode_via_prefill(flex_prefill)
    )


BACKENDS = {
    "triton": Backend(
        "triton",
        lambda: _load_module("kernels"),
        interpreted_dtypes=("float32", "float16"),
        notes="Triton twins in kernels/ (bfloat16 on the GPU only: TRITON-CPU.md)",
    ),
    "sdpa": Backend(
        "sdpa", _load_sdpa, layout_kinds=("dense",), has_lse=False, notes="torch SDPA, dense causal only"
    ),
    "flex": Backend("flex", _load_flex, notes="torch FlexAttention, eager (uncompiled)"),
    "reference": Backend("reference", lambda: _load_module("reference"), notes="the oracle itself"),
}


def get_backend(name: str) -> Backend:
    """The adapter called `name`; ValueError naming the known ones otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def load_ops(name: str):
    """(operators, None) or (None, reason) when the backend cannot be imported here."""
    try:
        return get_backend(name).load(), None
    except (ImportError, AttributeError, RuntimeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
