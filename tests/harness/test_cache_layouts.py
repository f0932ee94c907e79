"""Cache-layout conversions (harness/cache_layouts.py): exact, inverse of each other, and agreeing with
the per-element definitions of each layout; compared with torch.equal, never a tolerance."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from harness import cache_layouts as cl
from harness.bad_inputs import strided, transposed_copy
from harness.cases import DTYPES, PADDING_IDS
from harness.strategies import block_mask_layouts, local_strided_layouts

dtypes = st.sampled_from(tuple(DTYPES.values()))
# Any size 1..128, with the odd and non-power-of-two ones drawn on purpose.
page_sizes = st.one_of(st.sampled_from((1, 3, 7, 16, 100, 128)), st.integers(1, 128))


def random_cache(shape, dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def as_view(t: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values as `t`, contiguous or through a non-contiguous view."""
    if kind == "strided-pages":
        return strided(t, 0)
    if kind == "heads-major":
        return transposed_copy(t, 1, 2)
    return t


views = st.sampled_from(("contiguous", "strided-pages", "heads-major"))


@st.composite
def suite_caches(draw, head_dim_multiple_of_x: bool = False):
    """(k_cache, v_cache) [num_pages, page_size, num_kv_heads, head_dim], maybe as non-contiguous views."""
    dtype = draw(dtypes)
    x = cl.vllm_v0_chunk(dtype)
    head_dim = x * draw(st.integers(1, 16)) if head_dim_multiple_of_x else draw(st.integers(1, 80))
    shape = (draw(st.integers(1, 5)), draw(page_sizes), draw(st.integers(1, 4)), head_dim)
    seed, kind = draw(st.integers(0, 2**31 - 1)), draw(views)
    return tuple(as_view(random_cache(shape, dtype, seed + i), kind) for i in range(2))


def owns_memory(out: torch.Tensor, inp: torch.Tensor) -> bool:
    return out.is_contiguous() and out.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr()


@given(suite_caches(head_dim_multiple_of_x=True))
def test_to_vllm_v0(caches):
    k_cache, v_cache = caches
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    x = 16 // k_cache.element_size()
    key, value = cl.to_vllm_v0(k_cache, v_cache)
    assert key.shape == (num_pages, num_kv_heads, head_dim // x, page_size, x)
    assert value.shape == (num_pages, num_kv_heads, head_dim, page_size)
    assert owns_memory(key, k_cache) and owns_memory(value, v_cache)
    # Every element: key[page, h, d // x, p, d % x] and value[page, h, d, p] hold suite[page, p, h, d].
    page, p, h, d = torch.meshgrid(*(torch.arange(n) for n in k_cache.shape), indexing="ij")
    assert torch.equal(key[page, h, d // x, p, d % x], k_cache)
    assert torch.equal(value[page, h, d, p], v_cache)


@given(suite_caches(head_dim_multiple_of_x=True))
def test_vllm_v0_round_trip(caches):
    k_cache, v_cache = caches
    k, v = cl.from_vllm_v0(*cl.to_vllm_v0(k_cache, v_cache))
    assert k.is_contiguous() and v.is_contiguous()
    assert torch.equal(k, k_cache) and torch.equal(v, v_cache)


@given(suite_caches())
def test_to_head_major(caches):
    k_cache, v_cache = caches
    k, v = cl.to_head_major(k_cache, v_cache)
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    assert k.shape == v.shape == (num_pages, num_kv_heads, page_size, head_dim)
    assert owns_memory(k, k_cache) and owns_memory(v, v_cache)
    page, p, h, d = torch.meshgrid(*(torch.arange(n) for n in k_cache.shape), indexing="ij")
    assert torch.equal(k[page, h, p, d], k_cache) and torch.equal(v[page, h, p, d], v_cache)


@given(suite_caches())
def test_head_major_round_trip(caches):
    k_cache, v_cache = caches
    k, v = cl.from_head_major(*cl.to_head_major(k_cache, v_cache))
    assert k.is_contiguous() and v.is_contiguous()
    assert torch.equal(k, k_cache) and torch.equal(v, v_cache)


@st.composite
def paged_batches(draw):
    """A paged cache and its batch: (k_cache, v_cache, block_tables int32, seq_lens int32).

    Pages are shuffled over the cache, unused slots hold NaN and block-table padding holds page ids
    out of range, so a read of anything a sequence does not use shows up.
    """
    dtype, page_size = draw(dtypes), draw(page_sizes)
    seq_lens = draw(st.lists(st.integers(0, 3 * page_size + 5), min_size=1, max_size=4))
    pages_per_seq = [math.ceil(n / page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + draw(st.integers(0, 2))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    width = max(pages_per_seq) + draw(st.integers(0, 2))
    padding = torch.tensor(PADDING_IDS, dtype=torch.int32)
    block_tables = padding[torch.randint(0, len(padding), (len(seq_lens), width), generator=gen)]
    order, used = torch.randperm(num_pages, generator=gen).to(torch.int32), 0
    for b, n in enumerate(pages_per_seq):
        block_tables[b, :n], used = order[used : used + n], used + n
    shape = (max(num_pages, 1), page_size, draw(st.integers(1, 3)), draw(st.integers(1, 40)))
    caches = []
    for _ in range(2):
        cache = torch.full(shape, math.nan, dtype=dtype)
        for b, n in enumerate(seq_lens):
            for pos in range(n):
                cache[block_tables[b, pos // page_size], pos % page_size] = torch.randn(
                    shape[2:], generator=gen
                ).to(dtype)
        caches.append(as_view(cache, draw(views)))
    return caches[0], caches[1], block_tables, torch.tensor(seq_lens, dtype=torch.int32)


@given(paged_batches())
def test_gather_varlen(batch):
    k_cache, v_cache, block_tables, seq_lens = batch
    k, v, cu_seqlens_k = cl.gather_varlen(k_cache, v_cache, block_tables, seq_lens)
    lens = seq_lens.tolist()
    assert cu_seqlens_k.dtype == torch.int32
    assert cu_seqlens_k.tolist() == [sum(lens[:b]) for b in range(len(lens) + 1)]
    page_size = k_cache.shape[1]
    # Position p of sequence b lives in page block_tables[b, p // P] at offset p % P (contract §3).
    rows = [
        (int(block_tables[b, p // page_size]), p % page_size) for b, n in enumerate(lens) for p in range(n)
    ]
    for got, cache in ((k, k_cache), (v, v_cache)):
        want = torch.stack([cache[page, offset] for page, offset in rows]) if rows else cache[:0, 0]
        assert torch.equal(got, want)


@given(paged_batches(), views)
def test_varlen_round_trip(batch, view):
    k_cache, v_cache, block_tables, seq_lens = batch
    k, v, cu_seqlens_k = cl.gather_varlen(k_cache, v_cache, block_tables, seq_lens)
    # Into a cache of sentinels through a view: the used slots come back, every other slot is untouched.
    sentinel = 7.0
    fresh_k, fresh_v = (as_view(torch.full(k_cache.shape, sentinel, dtype=k.dtype), view) for _ in range(2))
    cl.scatter_varlen(k, v, cu_seqlens_k, block_tables, fresh_k, fresh_v)
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    page_size = k_cache.shape[1]
    for b, n in enumerate(seq_lens.tolist()):
        for p in range(n):
            used[block_tables[b, p // page_size], p % page_size] = True
    for fresh, cache in ((fresh_k, k_cache), (fresh_v, v_cache)):
        assert torch.equal(fresh[used], cache[used])
        assert torch.equal(fresh[~used], torch.full_like(fresh[~used], sentinel))


@st.composite
def block_layouts(draw):
    """(layout or None, num_heads, num_blocks) over local-strided, block-mask and dense causal."""
    num_heads, num_blocks = draw(st.integers(1, 6)), draw(st.integers(0, 24))
    kind = draw(st.sampled_from(("local_strided", "block_mask", "dense")))
    if kind == "dense":
        return None, num_heads, num_blocks
    spec = draw(local_strided_layouts(num_heads) if kind == "local_strided" else block_mask_layouts())
    return spec.build(num_heads, max(num_blocks, 1) * spec.block_size), num_heads, num_blocks


def dense_mask(layout, num_heads: int, num_blocks: int) -> torch.Tensor:
    if layout is None:
        return reference.causal_block_mask(num_blocks).expand(num_heads, -1, -1)
    return layout.block_mask(num_heads, num_blocks)


@given(block_layouts())
def test_block_layout_to_csr(drawn):
    layout, num_heads, num_blocks = drawn
    crow, col = cl.block_layout_to_csr(layout, num_heads, num_blocks)
    mask = dense_mask(layout, num_heads, num_blocks)
    nnz = mask.sum((1, 2))
    assert crow.dtype == col.dtype == torch.int32
    assert crow.shape == (num_heads, num_blocks + 1)
    assert col.shape == (num_heads, int(nnz.max()))
    for h in range(num_heads):
        for r in range(num_blocks):
            row = col[h, int(crow[h, r]) : int(crow[h, r + 1])]
            assert torch.equal(row.long(), mask[h, r].nonzero().flatten())
        assert torch.equal(col[h, int(nnz[h]) :], torch.full_like(col[h, int(nnz[h]) :], -1))
    assert torch.equal(cl.csr_to_block_mask(crow, col), mask)


def test_block_layout_to_csr_phi3_small():
    layout = reference.LocalStridedLayout(64, 16, 8)
    crow, col = cl.block_layout_to_csr(layout, 32, 128)
    # contract §2.1's golden counts: 2670 blocks in head 0, 30 in its last row (16 local + 14 vertical).
    assert int(crow[0, -1]) == 2670 and int(crow[0, -1] - crow[0, -2]) == 30
    assert torch.equal(cl.csr_to_block_mask(crow, col), layout.block_mask(32, 128))


def _cache(shape=(3, 4, 2, 8), dtype=torch.float16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def _gather_args(**changes) -> dict:
    args = dict(
        k_cache=_cache(),
        v_cache=_cache(),
        block_tables=torch.tensor([[0, 1], [2, -1]], dtype=torch.int32),
        seq_lens=torch.tensor([6, 3], dtype=torch.int32),
    )
    return {**args, **changes}


def _scatter_args(**changes) -> dict:
    """The gather call's batch in packed form: 6 + 3 keys."""
    args = dict(
        k=_cache((9, 2, 8)),
        v=_cache((9, 2, 8)),
        cu_seqlens_k=torch.tensor([0, 6, 9], dtype=torch.int32),
        block_tables=_gather_args()["block_tables"],
        k_cache=_cache(),
        v_cache=_cache(),
    )
    return {**args, **changes}


_LOCAL = reference.LocalStridedLayout(4, 1, 2)
# Dense causal over 3 blocks, one head, padded by one slot.
_CSR = (
    torch.tensor([[0, 1, 3, 6]], dtype=torch.int32),
    torch.tensor([[0, 0, 1, 0, 1, 2, -1]], dtype=torch.int32),
)


def test_csr_to_block_mask_by_hand():
    assert torch.equal(cl.csr_to_block_mask(*_CSR), reference.causal_block_mask(3)[None])


BAD_INPUTS = [
    (
        "vllm-head-dim-16bit",
        cl.to_vllm_v0,
        dict(k_cache=_cache((3, 4, 2, 12)), v_cache=_cache((3, 4, 2, 12))),
        ValueError,
        "head_dim",
    ),
    (
        "vllm-head-dim-float32",
        cl.to_vllm_v0,
        dict(k_cache=_cache((3, 4, 2, 6), torch.float32), v_cache=_cache((3, 4, 2, 6), torch.float32)),
        ValueError,
        "head_dim",
    ),
    ("vllm-not-tensor", cl.to_vllm_v0, dict(k_cache=[[0.0]], v_cache=_cache()), TypeError, "k_cache"),
    ("vllm-rank", cl.to_vllm_v0, dict(k_cache=_cache()[0], v_cache=_cache()[0]), ValueError, "k_cache"),
    (
        "vllm-v-dtype",
        cl.to_vllm_v0,
        dict(k_cache=_cache(), v_cache=_cache(dtype=torch.float32)),
        TypeError,
        "v_cache",
    ),
    (
        "vllm-v-shape",
        cl.to_vllm_v0,
        dict(k_cache=_cache((3, 4, 2, 16)), v_cache=_cache((3, 4, 1, 16))),
        ValueError,
        "v_cache",
    ),
    (
        "vllm-key-x",
        cl.from_vllm_v0,
        dict(key_cache=_cache((3, 2, 4, 4, 4)), value_cache=_cache((3, 2, 16, 4))),
        ValueError,
        "key_cache",
    ),
    (
        "vllm-value-shape",
        cl.from_vllm_v0,
        dict(key_cache=_cache((3, 2, 2, 4, 8)), value_cache=_cache((3, 2, 16, 5))),
        ValueError,
        "value_cache",
    ),
    (
        "head-major-rank",
        cl.from_head_major,
        dict(k_cache=_cache()[0], v_cache=_cache()),
        ValueError,
        "k_cache",
    ),
    (
        "gather-table-dtype",
        cl.gather_varlen,
        _gather_args(block_tables=torch.zeros(2, 2)),
        TypeError,
        "block_tables",
    ),
    (
        "gather-table-rows",
        cl.gather_varlen,
        _gather_args(block_tables=torch.zeros(1, 2, dtype=torch.int32)),
        ValueError,
        "block_tables",
    ),
    (
        "gather-table-too-short",
        cl.gather_varlen,
        _gather_args(seq_lens=torch.tensor([9, 3], dtype=torch.int32)),
        ValueError,
        "block_tables",
    ),
    (
        "gather-page-id-out-of-range",
        cl.gather_varlen,
        _gather_args(block_tables=torch.tensor([[0, 3], [2, -1]], dtype=torch.int32)),
        ValueError,
        "block_tables",
    ),
    (
        "gather-device",
        cl.gather_varlen,
        _gather_args(block_tables=torch.zeros(2, 2, dtype=torch.int32, device="meta")),
        ValueError,
        "block_tables",
    ),
    (
        "gather-seq-len-negative",
        cl.gather_varlen,
        _gather_args(seq_lens=torch.tensor([-1, 3], dtype=torch.int32)),
        ValueError,
        "seq_lens",
    ),
    (
        "gather-seq-lens-rank",
        cl.gather_varlen,
        _gather_args(seq_lens=torch.ones(2, 1, dtype=torch.int32)),
        ValueError,
        "seq_lens",
    ),
    (
        "scatter-cu-end",
        cl.scatter_varlen,
        _scatter_args(cu_seqlens_k=torch.tensor([0, 6, 8], dtype=torch.int32)),
        ValueError,
        "cu_seqlens_k",
    ),
    (
        "scatter-cu-decreasing",
        cl.scatter_varlen,
        _scatter_args(cu_seqlens_k=torch.tensor([0, 10, 9], dtype=torch.int32)),
        ValueError,
        "cu_seqlens_k",
    ),
    (
        "scatter-k-dtype",
        cl.scatter_varlen,
        _scatter_args(k_cache=_cache(dtype=torch.float32), v_cache=_cache(dtype=torch.float32)),
        TypeError,
        "k",
    ),
    (
        "scatter-k-heads",
        cl.scatter_varlen,
        _scatter_args(k_cache=_cache((3, 4, 1, 8)), v_cache=_cache((3, 4, 1, 8))),
        ValueError,
        "k",
    ),
    (
        "csr-layout-type",
        cl.block_layout_to_csr,
        dict(layout="local", num_heads=2, num_blocks=4),
        TypeError,
        "layout",
    ),
    (
        "csr-num-heads",
        cl.block_layout_to_csr,
        dict(layout=None, num_heads=0, num_blocks=4),
        ValueError,
        "num_heads",
    ),
    (
        "csr-num-blocks",
        cl.block_layout_to_csr,
        dict(layout=_LOCAL, num_heads=2, num_blocks=-1),
        ValueError,
        "num_blocks",
    ),
    (
        "csr-past-block-mask",
        cl.block_layout_to_csr,
        dict(
            layout=reference.BlockMaskLayout(torch.ones(3, 3, dtype=torch.bool), 4), num_heads=2, num_blocks=4
        ),
        ValueError,
        "num_blocks",
    ),
    ("dense-crow-dtype", cl.csr_to_block_mask, dict(crow=_CSR[0].float(), col=_CSR[1]), TypeError, "crow"),
    (
        "dense-crow-decreasing",
        cl.csr_to_block_mask,
        dict(crow=_CSR[0].flip(1), col=_CSR[1]),
        ValueError,
        "crow",
    ),
    ("dense-col-range", cl.csr_to_block_mask, dict(crow=_CSR[0], col=_CSR[1] + 3), ValueError, "col"),
    ("dense-col-heads", cl.csr_to_block_mask, dict(crow=_CSR[0], col=_CSR[1][:0]), ValueError, "col"),
]


@pytest.mark.parametrize("fn, args, error, text", [pytest.param(*e[1:], id=e[0]) for e in BAD_INPUTS])
def test_cache_layouts_bad_input(fn, args, error, text):
    with pytest.raises(error, match=text):
        fn(**args)
