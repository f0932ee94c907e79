"""Every bad-input class of SPEC section 4, as named mutations of one valid call.

Both twins must reject each with the same exception type, naming the argument, before any launch.
Each entry: (id, mutate(kwargs) -> None, exception type, text the message must contain).
"""

import math

import torch

import reference


def valid_prefill_args(device) -> dict:
    """A small valid `paged_prefill` call: 2 sequences, page size 4, 4 query heads over 2 KV heads."""
    gen = torch.Generator().manual_seed(0)
    cache = lambda: torch.randn(6, 4, 2, 8, generator=gen).to(device)
    return dict(
        q=torch.randn(5, 4, 8, generator=gen).to(device),
        k_cache=cache(),
        v_cache=cache(),
        block_tables=torch.tensor([[0, 1, 7], [2, 3, 4]], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([6, 9], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32, device=device),
    )


def valid_decode_args(device) -> dict:
    args = valid_prefill_args(device)
    del args["query_start_loc"]
    args["q"] = args["q"][:2]
    return args


def valid_write_kv_args(device) -> dict:
    gen = torch.Generator().manual_seed(0)
    return dict(
        k=torch.randn(3, 2, 8, generator=gen).to(device),
        v=torch.randn(3, 2, 8, generator=gen).to(device),
        k_cache=torch.zeros(4, 4, 2, 8, device=device),
        v_cache=torch.zeros(4, 4, 2, 8, device=device),
        slot_mapping=torch.tensor([5, -1, 15], dtype=torch.int64, device=device),
    )


def _set(key, value_fn):
    def mutate(args):
        args[key] = value_fn(args)

    return mutate


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _with(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


# Shared by paged_prefill and paged_decode (q, caches, block tables, seq_lens, options).
ATTENTION_CASES = [
    ("q-rank", _set("q", lambda a: a["q"][0]), ValueError, "q"),
    ("q-dtype", _set("q", lambda a: a["q"].double()), TypeError, "q"),
    ("q-not-tensor", _set("q", lambda a: a["q"].tolist()), TypeError, "q"),
    ("k_cache-dtype", _set("k_cache", lambda a: a["k_cache"].half()), TypeError, "k_cache"),
    ("v_cache-rank", _set("v_cache", lambda a: a["v_cache"][0]), ValueError, "v_cache"),
    ("v_cache-shape", _set("v_cache", lambda a: a["v_cache"][:, :2]), ValueError, "v_cache"),
    ("head_dim", _set("q", lambda a: a["q"][..., :4]), ValueError, "head_dim"),
    ("gqa-ratio", _set("q", lambda a: a["q"][:, :3]), ValueError, "num_kv_heads"),
    ("seq_lens-dtype", _set("seq_lens", lambda a: a["seq_lens"].long()), TypeError, "seq_lens"),
    (
        "block_tables-dtype",
        _set("block_tables", lambda a: a["block_tables"].long()),
        TypeError,
        "block_tables",
    ),
    ("block_tables-rows", _set("block_tables", lambda a: a["block_tables"][:1]), ValueError, "block_tables"),
    (
        "block_table-too-short",
        _set("block_tables", lambda a: a["block_tables"][:, :2]),
        ValueError,
        "block_tables",
    ),
    (
        "page-id-too-large",
        _set("block_tables", lambda a: _with(a["block_tables"], (1, 2), 6)),
        ValueError,
        "block_tables",
    ),
    (
        "page-id-negative",
        _set("block_tables", lambda a: _with(a["block_tables"], (0, 0), -1)),
        ValueError,
        "block_tables",
    ),
    ("device-mismatch", _set("block_tables", lambda a: _meta(a["block_tables"])), ValueError, "device"),
    ("scale-type", _set("scale", lambda a: "0.1"), TypeError, "scale"),
    ("scale-nan", _set("scale", lambda a: math.nan), ValueError, "scale"),
    ("layout-type", _set("layout", lambda a: "local"), TypeError, "layout"),
    (
        "layout-too-small",
        _set("layout", lambda a: reference.BlockMaskLayout(torch.ones(2, 2, dtype=torch.bool), 4)),
        ValueError,
        "layout",
    ),
    (
        "layout-heads",
        _set("layout", lambda a: reference.BlockMaskLayout(torch.ones(3, 4, 4, dtype=torch.bool), 4)),
        ValueError,
        "layout",
    ),
    (
        "layout-shard",
        _set("layout", lambda a: reference.LocalStridedLayout(4, 1, 2, num_heads_total=4, head_offset=1)),
        ValueError,
        "num_heads_total",
    ),
    ("return_lse-type", _set("return_lse", lambda a: 1), TypeError, "return_lse"),
]

PREFILL_CASES = ATTENTION_CASES + [
    (
        "query_start_loc-dtype",
        _set("query_start_loc", lambda a: a["query_start_loc"].long()),
        TypeError,
        "query_start_loc",
    ),
    (
        "query_start_loc-length",
        _set("query_start_loc", lambda a: a["query_start_loc"][:2]),
        ValueError,
        "query_start_loc",
    ),
    (
        "query_start_loc-end",
        _set("query_start_loc", lambda a: _with(a["query_start_loc"], 2, 4)),
        ValueError,
        "query_start_loc",
    ),
    (
        "query_start_loc-non-monotonic",
        _set("query_start_loc", lambda a: _with(a["query_start_loc"], 1, 6)),
        ValueError,
        "query_start_loc",
    ),
    (
        "seq_lens-below-queries",
        _set("seq_lens", lambda a: _with(a["seq_lens"], 0, 1)),
        ValueError,
        "seq_lens",
    ),
]

DECODE_CASES = ATTENTION_CASES + [
    ("seq_lens-count", _set("seq_lens", lambda a: a["seq_lens"][:1]), ValueError, "seq_lens"),
    ("seq_lens-zero", _set("seq_lens", lambda a: _with(a["seq_lens"], 0, 0)), ValueError, "seq_lens"),
]

WRITE_KV_CASES = [
    ("k-rank", _set("k", lambda a: a["k"][0]), ValueError, "k"),
    ("v-shape", _set("v", lambda a: a["v"][:2]), ValueError, "v"),
    ("v-dtype", _set("v", lambda a: a["v"].half()), TypeError, "v"),
    ("k_cache-dtype", _set("k_cache", lambda a: a["k_cache"].double()), TypeError, "k_cache"),
    ("v_cache-shape", _set("v_cache", lambda a: a["v_cache"][:2]), ValueError, "v_cache"),
    (
        "head-shape",
        lambda a: a.update(k_cache=a["k_cache"][..., :4], v_cache=a["v_cache"][..., :4]),
        ValueError,
        "the cache holds",
    ),
    (
        "slot_mapping-dtype",
        _set("slot_mapping", lambda a: a["slot_mapping"].int()),
        TypeError,
        "slot_mapping",
    ),
    (
        "slot_mapping-length",
        _set("slot_mapping", lambda a: a["slot_mapping"][:2]),
        ValueError,
        "slot_mapping",
    ),
    (
        "slot-too-large",
        _set("slot_mapping", lambda a: _with(a["slot_mapping"], 0, 16)),
        ValueError,
        "slot_mapping",
    ),
    (
        "slot-below-minus-one",
        _set("slot_mapping", lambda a: _with(a["slot_mapping"], 1, -2)),
        ValueError,
        "slot_mapping",
    ),
    (
        "slot-twice",
        _set("slot_mapping", lambda a: _with(a["slot_mapping"], 0, 15)),
        ValueError,
        "slot_mapping",
    ),
    ("device-mismatch", _set("slot_mapping", lambda a: _meta(a["slot_mapping"])), ValueError, "device"),
]
