"""The edge-case table of contract §4: named mutations of one small valid call, per operator.

Three kinds of entries; both twins (the oracle and the implementation under test) face every one:
    Rejected    bad input: the call raises `error` (ValueError or TypeError) whose message names the
                argument (`text`), before any launch;
    View        the same values as a non-contiguous view (a slice with a step, a transposed copy, a
                column-major block table): the result equals the contiguous call's bit for bit, or a
                ValueError names the argument;
    NonFinite   NaN or Inf placed in an input: exactly the (token, head) rows in `nan_rows` see it and
                are NaN (out and lse); garbage where no row may look changes nothing.
"""

import math
from dataclasses import dataclass

import torch

import reference
from harness.cases import DTYPES

# Values planted where a view skips: a kernel that reads the raw memory instead of the view's
# elements gets these (a page id past the cache, a sequence far longer than its table).
GARBAGE_INT = 1_000_003
GARBAGE_FLOAT = 1e4


@dataclass(frozen=True)
class Rejected:
    id: str
    mutate: object
    error: type
    text: str


@dataclass(frozen=True)
class View:
    id: str
    mutate: object
    argument: str  # named in the ValueError of an implementation that refuses the view


@dataclass(frozen=True)
class NonFinite:
    id: str
    mutate: object
    nan_rows: frozenset = frozenset()  # (token, head) rows that see the planted value


def valid_prefill_args(device, dtype=torch.float32, context: bool = True) -> dict:
    """A small valid `paged_prefill` call: 2 sequences, page size 4, 4 query heads over 2 KV heads.

    Sequence 0: 6 tokens in pages 0, 1 (table padding holds 7, past the 6 pages), queries at positions
    4, 5 (tokens 0, 1). Sequence 1: 9 tokens in pages 2, 3, 4, queries at 6, 7, 8 (tokens 2, 3, 4).
    Page 5 is unused. Query heads 0, 1 read KV head 0; heads 2, 3 read KV head 1. Without `context`
    every position is a query (tokens 0-5 and 6-14), for implementations that declare no cached
    context (contract §9); `nan_rows` of the table describe the call with context.
    """
    gen = torch.Generator().manual_seed(0)
    cache = lambda: torch.randn(6, 4, 2, 8, generator=gen).to(device, dtype)
    starts = [0, 2, 5] if context else [0, 6, 15]
    return dict(
        q=torch.randn(starts[-1], 4, 8, generator=gen).to(device, dtype),
        k_cache=cache(),
        v_cache=cache(),
        block_tables=torch.tensor([[0, 1, 7], [2, 3, 4]], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([6, 9], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
    )


def valid_decode_args(device, dtype=torch.float32, context: bool = True) -> dict:
    """The prefill call's sequences with one query each: positions 5 and 8 (tokens 0 and 1).

    (A decode query always has its sequence's earlier tokens as context; `context` is ignored.)
    """
    args = valid_prefill_args(device, dtype)
    del args["query_start_loc"]
    args["q"] = args["q"][:2].clone()
    return args


def valid_write_kv_args(device, dtype=torch.float32) -> dict:
    """Three tokens (the second not written) into a 4-page cache of page size 4."""
    gen = torch.Generator().manual_seed(0)
    return dict(
        k=torch.randn(3, 2, 8, generator=gen).to(device, dtype),
        v=torch.randn(3, 2, 8, generator=gen).to(device, dtype),
        k_cache=torch.zeros(4, 4, 2, 8, device=device, dtype=dtype),
        v_cache=torch.zeros(4, 4, 2, 8, device=device, dtype=dtype),
        slot_mapping=torch.tensor([5, -1, 15], dtype=torch.int64, device=device),
    )


VALID_ARGS = {
    "paged_prefill": valid_prefill_args,
    "paged_decode": valid_decode_args,
    "write_kv": valid_write_kv_args,
}


def _set(key, value_fn):
    def mutate(args):
        args[key] = value_fn(args[key])

    return mutate


def _set_args(key, value_fn):
    def mutate(args):
        args[key] = value_fn(args)

    return mutate


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _with(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def _other_dtype(t: torch.Tensor) -> torch.Tensor:
    """`t` in a supported dtype other than its own."""
    return t.to(torch.float16 if t.dtype != torch.float16 else torch.float32)


def table_dtype(caps) -> torch.dtype:
    """The dtype the table's valid calls are built in: float32 when declared, else the first declared."""
    return DTYPES["float32" if "float32" in caps.dtypes else caps.dtypes[0]]


def strided(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The values of `t` as a view with stride 2 along `dim`; the skipped elements hold garbage."""
    shape = list(t.shape)
    shape[dim] *= 2
    fill = GARBAGE_FLOAT if t.is_floating_point() else GARBAGE_INT
    big = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    view = big.narrow(dim, 0, shape[dim]).unflatten(dim, (-1, 2)).select(dim + 1, 0)
    view.copy_(t)
    return view


def transposed_copy(t: torch.Tensor, d0: int, d1: int) -> torch.Tensor:
    """The values of `t` stored with dims d0 and d1 swapped in memory (a non-contiguous view)."""
    return t.transpose(d0, d1).contiguous().transpose(d0, d1)


def column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


# Shared by paged_prefill and paged_decode (q, caches, block tables, seq_lens, options).
ATTENTION_REJECTED = [
    ("q-rank", _set_args("q", lambda a: a["q"][0]), ValueError, "q"),
    ("q-dtype", _set_args("q", lambda a: a["q"].double()), TypeError, "q"),
    ("q-not-tensor", _set_args("q", lambda a: a["q"].tolist()), TypeError, "q"),
    ("k_cache-dtype", _set_args("k_cache", lambda a: a["k_cache"].double()), TypeError, "k_cache"),
    (
        "k_cache-dtype-mismatch",
        _set_args("k_cache", lambda a: _other_dtype(a["k_cache"])),
        TypeError,
        "k_cache",
    ),
    ("v_cache-rank", _set_args("v_cache", lambda a: a["v_cache"][0]), ValueError, "v_cache"),
    ("v_cache-shape", _set_args("v_cache", lambda a: a["v_cache"][:, :2]), ValueError, "v_cache"),
    ("head_dim", _set_args("q", lambda a: a["q"][..., :4]), ValueError, "head_dim"),
    ("gqa-ratio", _set_args("q", lambda a: a["q"][:, :3]), ValueError, "num_kv_heads"),
    ("seq_lens-dtype", _set_args("seq_lens", lambda a: a["seq_lens"].long()), TypeError, "seq_lens"),
    (
        "block_tables-dtype",
        _set_args("block_tables", lambda a: a["block_tables"].long()),
        TypeError,
        "block_tables",
    ),
    (
        "block_tables-rows",
        _set_args("block_tables", lambda a: a["block_tables"][:1]),
        ValueError,
        "block_tables",
    ),
    (
        "block_table-too-short",
        _set_args("block_tables", lambda a: a["block_tables"][:, :2]),
        ValueError,
        "block_tables",
    ),
    (
        "page-id-too-large",
        _set_args("block_tables", lambda a: _with(a["block_tables"], (1, 2), 6)),
        ValueError,
        "block_tables",
    ),
    (
        "page-id-negative",
        _set_args("block_tables", lambda a: _with(a["block_tables"], (0, 0), -1)),
        ValueError,
        "block_tables",
    ),
    ("device-mismatch", _set_args("block_tables", lambda a: _meta(a["block_tables"])), ValueError, "device"),
    ("scale-type", _set_args("scale", lambda a: "0.1"), TypeError, "scale"),
    ("scale-nan", _set_args("scale", lambda a: math.nan), ValueError, "scale"),
    ("layout-type", _set_args("layout", lambda a: "local"), TypeError, "layout"),
    (
        "layout-too-small",
        _set_args("layout", lambda a: reference.BlockMaskLayout(torch.ones(2, 2, dtype=torch.bool), 4)),
        ValueError,
        "layout",
    ),
    (
        "layout-heads",
        _set_args("layout", lambda a: reference.BlockMaskLayout(torch.ones(3, 4, 4, dtype=torch.bool), 4)),
        ValueError,
        "layout",
    ),
    (
        "layout-shard",
        _set_args(
            "layout", lambda a: reference.LocalStridedLayout(4, 1, 2, num_heads_total=4, head_offset=1)
        ),
        ValueError,
        "num_heads_total",
    ),
    ("return_lse-type", _set_args("return_lse", lambda a: 1), TypeError, "return_lse"),
]

PREFILL_REJECTED = ATTENTION_REJECTED + [
    (
        "query_start_loc-dtype",
        _set_args("query_start_loc", lambda a: a["query_start_loc"].long()),
        TypeError,
        "query_start_loc",
    ),
    (
        "query_start_loc-length",
        _set_args("query_start_loc", lambda a: a["query_start_loc"][:2]),
        ValueError,
        "query_start_loc",
    ),
    (
        "query_start_loc-end",
        _set_args("query_start_loc", lambda a: _with(a["query_start_loc"], 2, 4)),
        ValueError,
        "query_start_loc",
    ),
    (
        "query_start_loc-non-monotonic",
        _set_args(
            "query_start_loc", lambda a: _with(a["query_start_loc"], 1, int(a["query_start_loc"][2]) + 1)
        ),
        ValueError,
        "query_start_loc",
    ),
    (
        "seq_lens-below-queries",
        _set_args("seq_lens", lambda a: _with(a["seq_lens"], 0, 1)),
        ValueError,
        "seq_lens",
    ),
]

DECODE_REJECTED = ATTENTION_REJECTED + [
    ("seq_lens-count", _set_args("seq_lens", lambda a: a["seq_lens"][:1]), ValueError, "seq_lens"),
    ("seq_lens-zero", _set_args("seq_lens", lambda a: _with(a["seq_lens"], 0, 0)), ValueError, "seq_lens"),
]

WRITE_KV_REJECTED = [
    ("k-rank", _set_args("k", lambda a: a["k"][0]), ValueError, "k"),
    ("v-shape", _set_args("v", lambda a: a["v"][:2]), ValueError, "v"),
    ("v-dtype", _set_args("v", lambda a: a["v"].double()), TypeError, "v"),
    ("v-dtype-mismatch", _set_args("v", lambda a: _other_dtype(a["v"])), TypeError, "v"),
    ("k_cache-dtype", _set_args("k_cache", lambda a: a["k_cache"].double()), TypeError, "k_cache"),
    ("v_cache-shape", _set_args("v_cache", lambda a: a["v_cache"][:2]), ValueError, "v_cache"),
    (
        "head-shape",
        lambda a: a.update(k_cache=a["k_cache"][..., :4], v_cache=a["v_cache"][..., :4]),
        ValueError,
        "the cache holds",
    ),
    (
        "slot_mapping-dtype",
        _set_args("slot_mapping", lambda a: a["slot_mapping"].int()),
        TypeError,
        "slot_mapping",
    ),
    (
        "slot_mapping-length",
        _set_args("slot_mapping", lambda a: a["slot_mapping"][:2]),
        ValueError,
        "slot_mapping",
    ),
    (
        "slot-too-large",
        _set_args("slot_mapping", lambda a: _with(a["slot_mapping"], 0, 16)),
        ValueError,
        "slot_mapping",
    ),
    (
        "slot-below-minus-one",
        _set_args("slot_mapping", lambda a: _with(a["slot_mapping"], 1, -2)),
        ValueError,
        "slot_mapping",
    ),
    (
        "slot-twice",
        _set_args("slot_mapping", lambda a: _with(a["slot_mapping"], 0, 15)),
        ValueError,
        "slot_mapping",
    ),
    ("device-mismatch", _set_args("slot_mapping", lambda a: _meta(a["slot_mapping"])), ValueError, "device"),
]


def _rows(pairs) -> frozenset:
    return frozenset(pairs)


def _poison(key: str, index, value: float):
    """Places one non-finite value at `index` of input `key`."""
    return _set(key, lambda t: _with(t, index, value))


# Sequence 1's position 7 lives in page 3 at offset 3; KV head 1 serves query heads 2 and 3.
SEQ1_POS7_KV1 = (3, 3, 1, 2)
# The prefill rows that see sequence 1's position 7: queries at 7 and 8 (tokens 3, 4), heads 2, 3.
PREFILL_SEES_SEQ1_POS7 = _rows((t, h) for t in (3, 4) for h in (2, 3))
# Positions 6, 7 of sequence 0 (past its 6 tokens, in its last page) and page 5 (no sequence's).
PAST_SEQ_LEN = (1, slice(2, None))
UNUSED_PAGE = 5

ATTENTION_VIEWS = [
    View("block_tables-column-major", _set("block_tables", column_major), "block_tables"),
    View("block_tables-strided", _set("block_tables", lambda t: strided(t, 1)), "block_tables"),
    View("seq_lens-strided", _set("seq_lens", strided), "seq_lens"),
    View("q-strided-head-dim", _set("q", lambda t: strided(t, 2)), "q"),
    View("q-heads-major", _set("q", lambda t: transposed_copy(t, 0, 1)), "q"),
    View("k_cache-heads-major", _set("k_cache", lambda t: transposed_copy(t, 1, 2)), "k_cache"),
    View("v_cache-strided-pages", _set("v_cache", strided), "v_cache"),
]
PREFILL_VIEWS = ATTENTION_VIEWS + [
    View("query_start_loc-strided", _set("query_start_loc", strided), "query_start_loc"),
]
DECODE_VIEWS = ATTENTION_VIEWS

ATTENTION_GARBAGE = [
    NonFinite("k-nan-past-seq-len", _poison("k_cache", PAST_SEQ_LEN, math.nan)),
    NonFinite("v-inf-past-seq-len", _poison("v_cache", PAST_SEQ_LEN, math.inf)),
    NonFinite("k-nan-unused-page", _poison("k_cache", UNUSED_PAGE, math.nan)),
    NonFinite("v-nan-unused-page", _poison("v_cache", UNUSED_PAGE, math.nan)),
]
PREFILL_NON_FINITE = ATTENTION_GARBAGE + [
    NonFinite("q-nan", _poison("q", (1, 2, 5), math.nan), _rows([(1, 2)])),
    NonFinite("q-inf", _poison("q", (3, 0, 0), math.inf), _rows([(3, 0)])),
    NonFinite("q-neg-inf", _poison("q", (2, 3, 7), -math.inf), _rows([(2, 3)])),
    NonFinite("k-nan-visible", _poison("k_cache", SEQ1_POS7_KV1, math.nan), PREFILL_SEES_SEQ1_POS7),
    NonFinite("k-inf-visible", _poison("k_cache", SEQ1_POS7_KV1, math.inf), PREFILL_SEES_SEQ1_POS7),
    NonFinite("k-neg-inf-visible", _poison("k_cache", SEQ1_POS7_KV1, -math.inf), PREFILL_SEES_SEQ1_POS7),
    NonFinite("v-nan-visible", _poison("v_cache", SEQ1_POS7_KV1, math.nan), PREFILL_SEES_SEQ1_POS7),
    NonFinite("v-inf-visible", _poison("v_cache", SEQ1_POS7_KV1, math.inf), PREFILL_SEES_SEQ1_POS7),
]
DECODE_NON_FINITE = ATTENTION_GARBAGE + [
    NonFinite("q-nan", _poison("q", (1, 0, 3), math.nan), _rows([(1, 0)])),
    NonFinite("k-nan-visible", _poison("k_cache", SEQ1_POS7_KV1, math.nan), _rows([(1, 2), (1, 3)])),
    # Sequence 0's position 1 (page 0, offset 1), KV head 0: query heads 0 and 1 of token 0.
    NonFinite("v-inf-visible", _poison("v_cache", (0, 1, 0, 4), math.inf), _rows([(0, 0), (0, 1)])),
    NonFinite("k-neg-inf-visible", _poison("k_cache", (0, 1, 0, 4), -math.inf), _rows([(0, 0), (0, 1)])),
]

WRITE_KV_REJECTED.append(
    Rejected(
        "k_cache-overlapping",
        _set("k_cache", lambda t: t[:1].expand(t.shape)),
        ValueError,
        "k_cache",
    )
)
WRITE_KV_VIEWS = [
    View("slot_mapping-strided", _set("slot_mapping", strided), "slot_mapping"),
    View("k-strided", _set("k", strided), "k"),
    View("v-heads-major", _set("v", lambda t: transposed_copy(t, 0, 1)), "v"),
    View("k_cache-heads-major", _set("k_cache", lambda t: transposed_copy(t, 1, 2)), "k_cache"),
    View("v_cache-strided-pages", _set("v_cache", strided), "v_cache"),
]
WRITE_KV_NON_FINITE = [
    NonFinite("k-nan-copied", _poison("k", (0, 1, 3), math.nan)),
    NonFinite("v-inf-copied", _poison("v", (2, 0, 0), -math.inf)),
]


def _entries(rejected, views, non_finite) -> list:
    return [Rejected(*e) if isinstance(e, tuple) else e for e in rejected] + views + non_finite


# operator -> every entry it faces.
TABLE = {
    "paged_prefill": _entries(PREFILL_REJECTED, PREFILL_VIEWS, PREFILL_NON_FINITE),
    "paged_decode": _entries(DECODE_REJECTED, DECODE_VIEWS, DECODE_NON_FINITE),
    "write_kv": _entries(WRITE_KV_REJECTED, WRITE_KV_VIEWS, WRITE_KV_NON_FINITE),
}


def entries(op: str, kind: type) -> list:
    """The table's entries of one kind for `op`, e.g. `entries("paged_decode", View)`."""
    return [e for e in TABLE[op] if isinstance(e, kind)]


def _call(op: str, fn, args: dict, with_lse: bool):
    """(out, lse or None) of an attention twin, or the two caches after a write."""
    if op == "write_kv":
        fn(**args)
        return args["k_cache"], args["v_cache"]
    if with_lse:
        return tuple(fn(**args, return_lse=True))
    return fn(**args), None


def _oracle_inputs(op: str, args: dict) -> dict:
    inputs = dict(args, scale=None, layout=None)
    if op == "paged_decode":
        inputs["query_start_loc"] = torch.arange(
            args["q"].shape[0] + 1, dtype=torch.int32, device=args["q"].device
        )
    return inputs


def check(op: str, entry, impl, device):
    """Runs one table entry against the implementation's operator `op`: a `harness.judge.Verdict`.

    The valid call is built in a dtype the implementation declares (`table_dtype`), without a
    cached context when it declares none. Passed verdicts say what happened in `message`:
    "rejected", "same" (a view gave the contiguous result), "refused" (a view was refused with a
    ValueError naming it) or "judged" (a non-finite case passed the NaN rule). NotImplementedError
    makes the entry unsupported (contract §9); any other departure from the entry's rule fails it.
    """
    from harness.judge import Verdict, guarded_call, judge_outputs, judge_write_kv, oracle, raised, same_bits

    caps, fn = impl.capabilities, impl.op(op)
    dtype, with_lse = table_dtype(caps), caps.lse and op != "write_kv"
    build = lambda: VALID_ARGS[op](device, dtype, **({} if op == "write_kv" else {"context": caps.context}))
    failed = lambda why: Verdict("failed", math.inf, f"{op} [{entry.id}]: {why}")
    args = build()
    entry.mutate(args)
    if isinstance(entry, Rejected):
        try:
            guarded_call(lambda: _call(op, fn, args, with_lse=False), device)
        except entry.error as exc:
            if entry.text not in str(exc):
                return failed(f"the {type(exc).__name__} does not name {entry.text!r}: {exc}")
            return Verdict("passed", message="rejected")
        except Exception as exc:  # noqa: BLE001
            return failed(f"expected {entry.error.__name__}, got {type(exc).__name__}: {exc}")
        return failed(f"accepted bad input (expected {entry.error.__name__} naming {entry.text!r})")
    try:
        if isinstance(entry, View):
            plain = build()
            want = guarded_call(lambda: _call(op, fn, plain, with_lse), device)
            try:
                got = guarded_call(lambda: _call(op, fn, args, with_lse), device)
            except ValueError as exc:
                if entry.argument not in str(exc):
                    return failed(f"refused the view without naming {entry.argument!r}: {exc}")
                return Verdict("passed", message="refused")
            for name, w, g in zip(("first output", "second output"), want, got, strict=True):
                if w is not None and not same_bits(w, g):
                    return failed(f"the {name} through the view differs from the contiguous call's")
            return Verdict("passed", message="same")
        if op == "write_kv":
            verdict = judge_write_kv(SimpleWriter(fn), args)
        else:
            outputs = guarded_call(
                lambda: _call(op, fn, {k: v.clone() for k, v in args.items()}, with_lse), device
            )
            q = args["q"]
            verdict = judge_outputs(op, outputs, oracle(_oracle_inputs(op, args)), q.dtype, q.shape)
    except NotImplementedError as exc:
        return Verdict("unsupported", message=f"NotImplementedError: {exc}")
    except Exception as exc:  # noqa: BLE001
        verdict = raised(exc, device)
    if verdict.failed:
        return Verdict(verdict.status, verdict.ratio, f"{op} [{entry.id}]: {verdict.message}", verdict.stats)
    return (
        verdict if verdict.status != "passed" else Verdict("passed", verdict.ratio, "judged", verdict.stats)
    )


class SimpleWriter:
    """A bare `write_kv` callable in the shape `judge_write_kv` expects."""

    def __init__(self, fn):
        self.write_kv = fn


def nan_rows(out: torch.Tensor, lse: torch.Tensor) -> frozenset:
    """(token, head) rows whose out is NaN; AssertionError when out and lse disagree or a row is
    only partly NaN (contract §4: such a row is NaN in out and lse)."""
    row_nan = torch.isnan(out).any(-1)
    if not torch.equal(row_nan, torch.isnan(out).all(-1)):
        raise AssertionError("a row of out is only partly NaN")
    if not torch.equal(row_nan, torch.isnan(lse)):
        raise AssertionError("out and lse disagree on which rows are NaN")
    return frozenset(tuple(int(i) for i in ix) for ix in row_nan.nonzero().tolist())
