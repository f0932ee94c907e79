"""The tile lists of kernels/tile_lists.py against a per-position brute force, compared exactly: a
key tile is full exactly when every position of the query tile sees every key of it, and partial
exactly when some position sees some key but not all see all."""

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference as ref
from harness.cases import AttentionCase, LayoutSpec
from kernels import tile_lists as tl_module
from kernels.tile_lists import MASK_ROWS, build, tile_lists
from tests.budgets import examples

paged_prefill_module = importlib.import_module("kernels.paged_prefill")

pytestmark = [pytest.mark.ours, pytest.mark.operator("paged_prefill")]


def brute_force(mask: torch.Tensor, size: int, rows: int, block_n: int, group: int) -> dict:
    """(query tile, list head) -> (full key tiles, partial key tiles), position by position."""
    heads, nb, _ = mask.shape
    length = nb * size
    pos = torch.arange(length)
    # [heads, length, length]: the token rule of contract §2
    sees = (pos.view(-1, 1) >= pos.view(1, -1)) & mask[:, pos // size][:, :, pos // size]
    lists = {}
    for t in range(-(-length // rows)):
        # Positions past the grid belong to no sequence: only the grid's rows count.
        q = slice(t * rows, min(t * rows + rows, length))
        for hl in range(heads // group if heads > 1 else 1):
            members = slice(hl * group, hl * group + group) if heads > 1 else slice(0, 1)
            full, partial = [], []
            for k in range(-(-length // block_n)):
                keys = slice(k * block_n, min(k * block_n + block_n, length))
                tile = sees[members, q, keys]
                # A full tile is read unmasked: all block_n of its keys exist.
                if tile.all() and keys.stop - keys.start == block_n:
                    full.append(k)
                elif tile.any():
                    partial.append(k)
            lists[t, hl] = (full, partial)
    return lists


@examples(2)
@given(
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(1, 6),
    st.sampled_from((1, 2, 3, 4, 8)),
    st.sampled_from((1, 2, 4, 8)),
    st.floats(0, 1),
    st.booleans(),
    st.data(),
)
def test_tile_lists_match_positions(heads, num_blocks, size, rows, block_n, density, grouped, data):
    group = heads if grouped else 1
    mask = ref.random_block_mask(heads, num_blocks, density, data.draw(st.integers(0, 2**31 - 1)))
    got = build(mask, size, rows, block_n, group)
    want = brute_force(mask, size, rows, block_n, group)
    assert got.lists.shape[1] == len({t for t, _ in want})
    for (t, hl), (full, partial) in want.items():
        for kind, expected in ((0, full), (1, partial)):
            row = got.lists[kind, t, hl]
            assert row[1 : 1 + row[0]].tolist() == expected, (kind, t, hl)
            assert got.counts[kind, t, hl] == len(expected)


def brute_force_halves(mask: torch.Tensor, size: int, rows: int, block_n: int) -> dict:
    """(query tile, head, key tile) -> the HALF_* mode of each half of the query tile that holds
    positions of the grid, position by position: nothing seen, all of it (every key there), every
    element the layout allows (causality and the grid's end cut the rest), or else masked."""
    heads, nb, _ = mask.shape
    length = nb * size
    pos = torch.arange(length)
    allowed = mask[:, pos // size][:, :, pos // size]
    sees = (pos.view(-1, 1) >= pos.view(1, -1)) & allowed
    modes = {}
    for t in range(-(-length // rows)):
        for k in range(-(-length // block_n)):
            keys = slice(k * block_n, min(k * block_n + block_n, length))
            for h in range(heads):
                half_modes = []
                for first in (t * rows, t * rows + rows // 2):
                    q = slice(min(first, length), min(first + rows // 2, length))
                    tile = sees[h, q, keys]
                    if not tile.any():
                        half_modes.append(None if q.start == q.stop else tl_module.HALF_SKIP)
                    elif tile.all() and keys.stop - keys.start == block_n:
                        half_modes.append(tl_module.HALF_WHOLE)
                    elif allowed[h, q, keys].all():
                        half_modes.append(tl_module.HALF_CAUSAL)
                    else:
                        half_modes.append(tl_module.HALF_MASKED)
                modes[t, h, k] = half_modes
    return modes


@examples(2)
@given(
    st.integers(1, 3),
    st.integers(1, 6),
    st.integers(1, 6),
    st.sampled_from((2, 4, 8)),
    st.sampled_from((1, 2, 4, 8)),
    st.floats(0, 1),
    st.data(),
)
def test_tile_lists_halves_match_positions(heads, num_blocks, size, rows, block_n, density, data):
    """Lists with halves: the same partial tiles, and each half's mode of each, position by position."""
    mask = ref.random_block_mask(heads, num_blocks, density, data.draw(st.integers(0, 2**31 - 1)))
    got = build(mask, size, rows, block_n, 1, halves=True)
    plain = build(mask, size, rows, block_n, 1)
    want = brute_force_halves(mask, size, rows, block_n)
    assert torch.equal(got.lists[0], plain.lists[0])
    for t in range(got.lists.shape[1]):
        for h in range(got.lists.shape[2]):
            row = got.lists[1, t, h]
            entries = row[1 : 1 + row[0]]
            assert torch.equal(entries & tl_module.TILE_MASK, plain.lists[1, t, h, 1 : 1 + row[0]])
            for entry in entries.tolist():
                k = entry & tl_module.TILE_MASK
                for half, expected in enumerate(want[t, h, k]):
                    if expected is not None:  # a half past the grid holds no position
                        assert (entry >> tl_module.TILE_BITS + 2 * half) & 3 == expected, (t, h, k, half)


def test_halves_need_one_head_a_list_and_even_rows():
    mask = ref.random_block_mask(2, 3, 1.0, 0)
    with pytest.raises(ValueError, match="halves"):
        build(mask, 4, 3, 4, 1, halves=True)
    with pytest.raises(ValueError, match="halves"):
        build(mask, 4, 4, 4, 2, halves=True)


def test_prefill_reads_key_tiles_past_the_halves_modes(run_case, monkeypatch):
    """The Triton prefill walks the Hopper path's lists when a run's caches are misaligned: entries
    carrying their halves' modes (forced here on the interpreter), judged against the oracle."""
    built = []

    def with_halves(*args, **kwargs):
        built.append(tile_lists(*args, **{**kwargs, "halves": True}))
        return built[-1]

    monkeypatch.setattr(paged_prefill_module.tile_lists, "tile_lists", with_halves)
    case = AttentionCase(
        seed=7,
        seq_lens=(300, 90),
        query_lens=(200, 90),
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        page_size=16,
        dtype="float32",
        layout=LayoutSpec("local_strided", 16, 2, 3),
    )
    run_case(case, decode=False)
    assert built and (built[0].lists[1, ..., 1:] >> tl_module.TILE_BITS).any(), "no entry had modes"


@pytest.mark.parametrize("block_size", [32, 96])
def test_prefill_reads_the_mask_per_row_when_query_tiles_straddle_blocks(run_case, monkeypatch, block_size):
    """MASK_ROWS: key tiles of 32 inside one block, query tiles of 64 over two (a GPU config's
    shape, forced on the interpreter), judged against the oracle."""
    for name in ("CONFIG_INTERPRETER", "CONFIG_FP32"):  # the float32 case's config, CPU and GPU
        monkeypatch.setattr(paged_prefill_module, name, (64, 32, 4, 1))
    case = AttentionCase(
        seed=5,
        seq_lens=(200, 77),
        query_lens=(150, 77),
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        page_size=16,
        dtype="float32",
        layout=LayoutSpec("block_mask", block_size, density=0.5, mask_seed=3),
    )
    lists = tile_lists(case.layout.build(4, 200), 4, 200, 64, 32, 1, "cpu")
    assert lists.mask_mode == MASK_ROWS
    run_case(case, decode=False)
