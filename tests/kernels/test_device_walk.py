"""A lone round's walk written by the GPU (kernels/device_walk.py) against its host twin: for any batch
of at most a round of items, `lone_round_walk_kernel` writes the tiles buffer's query tile pairs and
walk exactly as `PrefillPlan._fill` does on the host (`_query_tiles`, `hopper_prefill.settled_walk`,
`Walk.flat`), reads only the batch's sequences and writes nothing else. The GPU tests of
tests/kernels/test_hopper_prefill.py judge replans through it against the oracle."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels import device_walk, hopper_prefill
from kernels.paged_prefill import _query_tiles, max_query_tiles
from tests.budgets import examples

pytestmark = [pytest.mark.ours, pytest.mark.operator("paged_prefill")]

BLOCK_M = hopper_prefill.BLOCK_M
UNWRITTEN = -7  # the buffer's entries before the launch
STALE = 10**6  # metadata rows past the batch's: the kernel must not read them


@st.composite
def batches(draw):
    """(seq_lens, query_start_loc, planned rows, heads, programs, list counts [2, tiles, 1 or heads]) of a
    batch of at most a round of items, its metadata rows followed by stale ones."""
    num_seqs = draw(st.integers(1, 4))
    seq_lens, queries = [], []
    for _ in range(num_seqs):
        seq_len = draw(st.integers(0, 6 * BLOCK_M))
        seq_lens.append(seq_len)
        queries.append(draw(st.integers(0, seq_len)))
    tiles = len(_query_tiles(seq_lens, np.cumsum([0, *queries]).tolist(), BLOCK_M))
    heads = draw(st.integers(1, 5))
    programs = max(tiles * heads, 1) + draw(st.integers(0, 20))
    list_heads = heads if draw(st.booleans()) else 1
    abs_tiles = 6
    counts = draw(
        st.lists(st.integers(0, 40), min_size=2 * abs_tiles * list_heads, max_size=2 * abs_tiles * list_heads)
    )
    counts = torch.tensor(counts, dtype=torch.int32).view(2, abs_tiles, list_heads)
    rows = num_seqs + draw(st.integers(0, 3))  # the plan's sequences: the batch's, then stale rows
    return seq_lens, np.cumsum([0, *queries]).tolist(), rows, heads, programs, counts


def device_buffer(batch, device: torch.device) -> tuple[torch.Tensor, int]:
    """(the tiles buffer after the kernel, on the CPU; max_tiles) for a plan of `rows` sequences."""
    seq_lens, query_start_loc, rows, heads, programs, counts = batch
    tokens = max(query_start_loc[-1], 1)
    max_tiles = max_query_tiles(rows, tokens, BLOCK_M)
    size = 2 * max_tiles + programs + 1 + programs * hopper_prefill.ROW_FIELDS
    # The lists as the kernels read them: entry 0 of each row its count, the key tiles after it unread.
    lists = torch.full((*counts.shape, 3), UNWRITTEN, dtype=torch.int32)
    lists[..., 0] = counts
    kind, tile, head, _ = lists.stride()
    stale = rows - len(seq_lens)
    planned = dict(
        tiles=torch.full((size,), UNWRITTEN, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens + [STALE] * stale, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc + [STALE] * stale, dtype=torch.int32, device=device),
        tile_lists=lists.to(device),
        stride_list_kind=kind,
        stride_list_tile=tile,
        stride_list_head=head if counts.shape[2] > 1 else 0,
        BLOCK_M=BLOCK_M,
    )
    launch = device_walk.bind(planned, heads, programs, max_tiles)
    tiles = _query_tiles(seq_lens, query_start_loc, BLOCK_M)
    launch(len(seq_lens), len(tiles))
    return planned["tiles"].cpu(), max_tiles


@examples(8)
@given(batches())
def test_lone_round_walk_is_the_hosts(monkeypatch, device, batch):
    monkeypatch.setattr(hopper_prefill, "SPLIT_ONE_ROUND", False)
    monkeypatch.setattr(hopper_prefill, "SPLIT_LAST", False)
    seq_lens, query_start_loc, rows, heads, programs, counts = batch
    tiles = _query_tiles(seq_lens, query_start_loc, BLOCK_M)
    if not tiles:
        assert not device_walk.applies(len(tiles), heads, programs)
        return
    assert device_walk.applies(len(tiles), heads, programs)
    buffer, max_tiles = device_buffer(batch, device)
    walk = hopper_prefill.settled_walk(counts, tiles, heads, programs, fits=(0, programs))
    expected = np.full(buffer.shape[0], UNWRITTEN, dtype=np.int32)
    expected[: 2 * len(tiles)] = np.array(tiles, dtype=np.int32).reshape(-1)
    walk.flat(counts, tiles, seq_lens, query_start_loc, out=expected[2 * max_tiles :])
    assert np.array_equal(buffer.numpy(), expected)


def test_applies_to_a_round_at_most(monkeypatch):
    monkeypatch.setattr(hopper_prefill, "SPLIT_ONE_ROUND", False)
    monkeypatch.setattr(hopper_prefill, "SPLIT_LAST", False)
    assert device_walk.applies(2, 32, 64) and device_walk.applies(2, 32, 132)
    assert not device_walk.applies(3, 32, 64)  # two rounds
    assert not device_walk.applies(0, 32, 64)  # no queries


@pytest.mark.parametrize(
    "module, flag, value",
    [
        (hopper_prefill, "SPLIT_ONE_ROUND", True),
        (hopper_prefill, "SPLIT_LAST", True),
        (device_walk, "ENABLED", False),
    ],
)
def test_applies_to_no_walk_that_splits_nor_when_off(monkeypatch, module, flag, value):
    monkeypatch.setattr(hopper_prefill, "SPLIT_ONE_ROUND", False)
    monkeypatch.setattr(hopper_prefill, "SPLIT_LAST", False)
    monkeypatch.setattr(module, flag, value)
    assert not device_walk.applies(2, 32, 132)
