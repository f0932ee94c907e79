"""Layout builders against the per-element formula of contract §2, compared exactly."""

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference as ref
from harness.strategies import block_mask_layouts, block_sizes, local_strided_layouts
from tests.budgets import examples


def allowed_by_formula(layout: ref.LocalStridedLayout, num_heads: int, h: int, qb: int, kb: int) -> bool:
    """contract §2.1, written out per element with plain ints."""
    total = layout.num_heads_total or num_heads
    step = 0 if layout.homo_head else max(1, layout.vert_stride // total)
    g = layout.head_offset + h
    return kb <= qb and ((qb - kb) < layout.local_blocks or (kb + g * step + 1) % layout.vert_stride == 0)


def dense_from_formula(layout, num_heads: int, num_blocks: int) -> torch.Tensor:
    out = torch.zeros(num_heads, num_blocks, num_blocks, dtype=torch.bool)
    for h in range(num_heads):
        for qb in range(num_blocks):
            for kb in range(num_blocks):
                out[h, qb, kb] = allowed_by_formula(layout, num_heads, h, qb, kb)
    return out


PHI3_SMALL = dict(block_size=64, local_blocks=16, vert_stride=8, homo_head=False)


def test_phi3_small_golden_counts():
    layout = ref.LocalStridedLayout(**PHI3_SMALL)
    mask = layout.block_mask(32, 128)
    assert [int(mask[h].sum()) for h in (0, 1, 7, 8)] == [2670, 2684, 2768, 2670]
    assert int(causal_count(128)) == 8256
    assert int(mask[0, -1].sum()) == 30
    for h, first in ((0, 7), (1, 6), (7, 0)):
        vertical = mask[h, -1, : 128 - 16].nonzero().flatten().tolist()
        assert vertical == list(range(first, 128 - 16, 8))


def causal_count(num_blocks: int) -> int:
    return num_blocks * (num_blocks + 1) // 2


@examples(8)
@given(st.integers(1, 6), st.integers(0, 20), st.data())
def test_local_strided_block_mask(num_heads, num_blocks, data):
    layout = data.draw(local_strided_layouts(num_heads)).build(num_heads, 1)
    assert torch.equal(
        layout.block_mask(num_heads, num_blocks), dense_from_formula(layout, num_heads, num_blocks)
    )


@pytest.mark.parametrize(
    "q_pos, k_len",
    [
        pytest.param([0], 1, id="q1-kv1"),
        pytest.param([37], 38, id="decode-unaligned"),
        pytest.param(list(range(5, 12)), 12, id="non-square-unaligned"),
        pytest.param(list(range(3)), 3, id="shorter-than-block"),
        pytest.param(list(range(16, 48)), 48, id="aligned-context"),
    ],
)
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_token_mask_named_edges(q_pos, k_len, block_size):
    layout = ref.LocalStridedLayout(
        block_size, local_blocks=2, vert_stride=3, num_heads_total=4, head_offset=1
    )
    check_token_mask(layout, 3, torch.tensor(q_pos), torch.arange(k_len))


@examples(8)
@given(block_sizes(), st.integers(1, 4), st.integers(1, 60), st.integers(0, 59), st.data())
def test_token_mask_matches_blocks(block_size, num_heads, seq_len, context, data):
    context = min(context, seq_len - 1)
    spec = data.draw(local_strided_layouts(num_heads, st.just(block_size)))
    layout = spec.build(num_heads, seq_len)
    check_token_mask(layout, num_heads, torch.arange(context, seq_len), torch.arange(seq_len))


def check_token_mask(layout, num_heads, q_pos, k_pos):
    got = layout.token_mask(num_heads, q_pos, k_pos)
    for h in range(num_heads):
        for i, pq in enumerate(q_pos.tolist()):
            for j, pk in enumerate(k_pos.tolist()):
                qb, kb = pq // layout.block_size, pk // layout.block_size
                expected = pk <= pq and allowed_by_formula(layout, num_heads, h, qb, kb)
                assert bool(got[h, i, j]) == expected, (h, pq, pk)


@examples(8)
@given(st.integers(0, 24), st.integers(1, 4))
def test_vert_stride_one_is_dense_causal(num_blocks, num_heads):
    layout = ref.LocalStridedLayout(4, local_blocks=1, vert_stride=1)
    expected = ref.causal_block_mask(num_blocks).expand(num_heads, -1, -1)
    assert torch.equal(layout.block_mask(num_heads, num_blocks), expected)


@examples(8)
@given(st.integers(1, 20), st.integers(1, 25), st.integers(1, 6))
def test_block_mask_layout_token_mask(num_blocks, window, block_size):
    mask = ref.sliding_window_block_mask(num_blocks, window)
    for qb in range(num_blocks):
        for kb in range(num_blocks):
            assert bool(mask[qb, kb]) == (0 <= qb - kb < window)
    layout = ref.BlockMaskLayout(mask, block_size)
    positions = torch.arange(num_blocks * block_size)
    got = layout.token_mask(2, positions, positions)
    pq, pk = positions.view(-1, 1), positions.view(1, -1)
    expected = (pk <= pq) & (pq // block_size - pk // block_size < window)
    assert torch.equal(got, expected.expand(2, -1, -1))


@examples(8)
@given(st.integers(1, 3), st.integers(0, 12), st.floats(0, 1), st.integers(0, 2**31 - 1))
def test_random_block_mask(num_heads, num_blocks, density, seed):
    mask = ref.random_block_mask(num_heads, num_blocks, density, seed)
    assert mask.shape == (num_heads, num_blocks, num_blocks)
    assert not mask.triu(1).any()
    assert torch.equal(mask, ref.random_block_mask(num_heads, num_blocks, density, seed))
    layout = ref.BlockMaskLayout(mask, 3)
    assert torch.equal(layout.block_mask(num_heads, num_blocks), mask)
    if density == 0.0:
        assert not mask.any()


def test_block_mask_layout_applies_causal_rule():
    layout = ref.BlockMaskLayout(torch.ones(4, 4, dtype=torch.bool), 2)
    assert torch.equal(layout.block_mask(3, 4), ref.causal_block_mask(4).expand(3, -1, -1))


@pytest.mark.parametrize(
    "make, error",
    [
        pytest.param(lambda: ref.LocalStridedLayout(0, 1, 1), ValueError, id="block_size-0"),
        pytest.param(lambda: ref.LocalStridedLayout(4.0, 1, 1), TypeError, id="block_size-float"),
        pytest.param(lambda: ref.LocalStridedLayout(4, 0, 1), ValueError, id="local_blocks-0"),
        pytest.param(lambda: ref.LocalStridedLayout(4, 1, 0), ValueError, id="vert_stride-0"),
        pytest.param(lambda: ref.LocalStridedLayout(4, 1, 2, homo_head=1), TypeError, id="homo_head-int"),
        pytest.param(lambda: ref.LocalStridedLayout(4, 1, 2, head_offset=-1), ValueError, id="head_offset"),
        pytest.param(
            lambda: ref.LocalStridedLayout(4, 1, 2, num_heads_total=4, head_offset=2).block_mask(4, 3),
            ValueError,
            id="shard-past-total",
        ),
        pytest.param(lambda: ref.BlockMaskLayout(torch.ones(3, 3), 4), TypeError, id="mask-not-bool"),
        pytest.param(
            lambda: ref.BlockMaskLayout(torch.ones(2, 3, dtype=torch.bool), 4),
            ValueError,
            id="mask-not-square",
        ),
        pytest.param(
            lambda: ref.BlockMaskLayout(torch.ones(2, 3, 3, dtype=torch.bool), 4).block_mask(3, 3),
            ValueError,
            id="mask-heads",
        ),
        pytest.param(
            lambda: ref.BlockMaskLayout(torch.ones(3, 3, dtype=torch.bool), 4).block_mask(1, 4),
            ValueError,
            id="mask-too-few-blocks",
        ),
        pytest.param(
            lambda: ref.BlockMaskLayout(torch.ones(3, 3, dtype=torch.bool), 4).token_mask(
                1, torch.tensor([12]), torch.arange(13)
            ),
            ValueError,
            id="position-past-mask",
        ),
        pytest.param(lambda: ref.random_block_mask(1, 3, 1.5, 0), ValueError, id="density"),
    ],
)
def test_layout_bad_input(make, error):
    with pytest.raises(error):
        make()


def test_sparse_layout_count_grows_linearly():
    """Local + stride keeps about local + NB/stride blocks a row: far fewer than dense at length."""
    layout = ref.LocalStridedLayout(**PHI3_SMALL)
    nb = 512
    per_row = layout.block_mask(1, nb)[0, -1].sum()
    assert per_row == 16 + math.ceil((nb - 16) / 8)


def check_protocol(layout, num_heads: int, num_blocks: int) -> None:
    """The layout protocol of reference/layouts.py: a causal bool [H, NB, NB] mask whose smaller grids
    are its corners, and a token_mask, where the layout has one, equal to the block rule per token."""
    mask = layout.block_mask(num_heads, num_blocks)
    assert mask.dtype == torch.bool and tuple(mask.shape) == (num_heads, num_blocks, num_blocks)
    assert not mask.triu(1).any(), "block_mask must include causality (no block above the diagonal)"
    for smaller in {0, min(1, num_blocks), num_blocks // 2}:
        assert torch.equal(layout.block_mask(num_heads, smaller), mask[:, :smaller, :smaller])
    positions = torch.arange(num_blocks * layout.block_size)
    pq, pk = positions.view(-1, 1), positions.view(1, -1)
    rule = (pk <= pq) & mask[:, pq // layout.block_size, pk // layout.block_size]
    assert torch.equal(ref.layouts.token_mask(layout, num_heads, positions, positions), rule)
    if callable(getattr(layout, "token_mask", None)):
        assert torch.equal(layout.token_mask(num_heads, positions, positions), rule)


@examples(0.5)
@given(st.integers(1, 4), st.integers(0, 12), st.data())
def test_layout_family_follows_the_protocol(family, num_heads, num_blocks, data):
    check_protocol(data.draw(family.layouts(num_heads)), num_heads, num_blocks)


@examples(0.5)
@given(st.integers(1, 4), st.integers(0, 12), st.sampled_from(("local_strided", "block_mask")), st.data())
def test_builtin_layouts_follow_the_protocol(num_heads, num_blocks, kind, data):
    spec = data.draw(local_strided_layouts(num_heads) if kind == "local_strided" else block_mask_layouts())
    check_protocol(spec.build(num_heads, max(1, num_blocks) * spec.block_size), num_heads, num_blocks)


@pytest.mark.parametrize(
    "layout, error, match",
    [
        pytest.param(object(), TypeError, "layout must be None or a layout", id="not-a-layout"),
        pytest.param(
            SimpleNamespace(block_size=0, block_mask=None), TypeError, "layout must be", id="no-method"
        ),
        pytest.param(
            SimpleNamespace(block_size=0, block_mask=lambda h, n: None),
            ValueError,
            "block_size",
            id="block_size-0",
        ),
        pytest.param(
            SimpleNamespace(block_size=2, block_mask=lambda h, n: torch.ones(h, n, n)),
            ValueError,
            "bool tensor",
            id="mask-not-bool",
        ),
        pytest.param(
            SimpleNamespace(block_size=2, block_mask=lambda h, n: torch.ones(n, n, dtype=torch.bool)),
            ValueError,
            "bool tensor",
            id="mask-rank",
        ),
    ],
)
def test_layout_block_mask_refuses_what_is_not_a_layout(layout, error, match):
    with pytest.raises(error, match=match):
        ref.layouts.layout_block_mask(layout, 2, 3)


def test_layout_block_mask_is_kept_and_cut_to_corners():
    calls = []

    def block_mask(num_heads, num_blocks):
        calls.append(num_blocks)
        return ref.causal_block_mask(num_blocks).expand(num_heads, -1, -1)

    layout = type("Causal", (), {"block_size": 4, "block_mask": staticmethod(block_mask)})()
    first = ref.layouts.layout_block_mask(layout, 3, 5)
    again = ref.layouts.layout_block_mask(layout, 3, 7)
    assert calls == [8], "one call, on the grid rounded up to a power of two"
    assert first.shape == (1, 5, 5) and again.shape == (1, 7, 7), "heads that agree are kept once"
    assert torch.equal(again[:, :5, :5], first)
