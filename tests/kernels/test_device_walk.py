"""A lone round's walk written by the GPU (kernels/device_walk.py) against its host twin: for any batch,
`lone_round_walk_kernel` writes the tiles buffer's query tile pairs and walk exactly as
`PrefillPlan._fill` does on the host (`_query_tiles`, `hopper_prefill.settled_walk`, `Walk.flat`) where
its items fit a round, whole or split over the idle programs (SPLIT_ONE_ROUND), and writes nothing
where they do not; rows past the batch's own (no queries) change nothing. The GPU tests of
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
ABS_TILES = 6


@st.composite
def batches(draw):
    """(seq_lens, query_start_loc, planned rows, heads, programs, list counts [2, tiles, 1 or heads]) of a
    batch of about a round of items, its metadata rows followed by rows without queries (an engine's
    padding: any length, the last query start repeated)."""
    num_seqs = draw(st.integers(1, 4))
    seq_lens, queries = [], []
    for _ in range(num_seqs):
        seq_len = draw(st.integers(0, ABS_TILES * BLOCK_M))
        seq_lens.append(seq_len)
        queries.append(draw(st.integers(0, seq_len)))
    query_start_loc = np.cumsum([0, *queries]).tolist()
    tiles = len(_query_tiles(seq_lens, query_start_loc, BLOCK_M))
    heads = draw(st.integers(1, 5))
    programs = max(tiles * heads + draw(st.integers(-3, 40)), 1)
    list_heads = heads if draw(st.booleans()) else 1
    counts = draw(
        st.lists(st.integers(0, 40), min_size=2 * ABS_TILES * list_heads, max_size=2 * ABS_TILES * list_heads)
    )
    counts = torch.tensor(counts, dtype=torch.int32).view(2, ABS_TILES, list_heads)
    padding = draw(st.integers(0, 3))
    seq_lens += draw(st.lists(st.integers(0, 10**6), min_size=padding, max_size=padding))
    query_start_loc += query_start_loc[-1:] * padding
    return seq_lens, query_start_loc, num_seqs, heads, programs, counts


def device_buffer(batch, split_slots: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(the tiles buffer after the kernel, on the CPU; max_tiles) for a plan of the batch's rows."""
    seq_lens, query_start_loc, _, heads, programs, counts = batch
    rows = len(seq_lens)
    max_tiles = max_query_tiles(rows, max(query_start_loc[-1], 1), BLOCK_M)
    size = 2 * max_tiles + programs + 1 + programs * hopper_prefill.ROW_FIELDS
    # The lists as the kernels read them: entry 0 of each row its count, the key tiles after it unread.
    lists = torch.full((*counts.shape, 3), UNWRITTEN, dtype=torch.int32)
    lists[..., 0] = counts
    kind, tile, head, _ = lists.stride()
    planned = dict(
        tiles=torch.full((size,), UNWRITTEN, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        tile_lists=lists.to(device),
        stride_list_kind=kind,
        stride_list_tile=tile,
        stride_list_head=head if counts.shape[2] > 1 else 0,
        BLOCK_M=BLOCK_M,
    )
    device_walk.bind(planned, rows, heads, programs, max_tiles, split_slots)()
    return planned["tiles"].cpu(), max_tiles


# (MIN_SPLIT_TILES, SPLIT_COST): the defaults, no split cost, and one so dear that only costly items split
SPLIT_MODELS = st.sampled_from(
    [(1, 0.0), (1, 20.0), (hopper_prefill.MIN_SPLIT_TILES, hopper_prefill.SPLIT_COST)]
)


@examples(10)
@given(batches(), st.booleans(), st.integers(0, 200), SPLIT_MODELS)
def test_lone_round_walk_is_the_hosts(monkeypatch, device, batch, one_round, slots, split_model):
    """Where the batch's items fit a round, the host's walk at a replan (`fits`: the launch's split
    states, `slots` up to the programs; a part a program); else nothing written."""
    monkeypatch.setattr(hopper_prefill, "SPLIT_ONE_ROUND", one_round)
    monkeypatch.setattr(hopper_prefill, "SPLIT_LAST", False)
    monkeypatch.setattr(hopper_prefill, "MIN_SPLIT_TILES", split_model[0])
    monkeypatch.setattr(hopper_prefill, "SPLIT_COST", split_model[1])
    seq_lens, query_start_loc, num_seqs, heads, programs, counts = batch
    split_slots = min(slots, programs)
    buffer, max_tiles = device_buffer(batch, split_slots, device)
    tiles = _query_tiles(seq_lens, query_start_loc, BLOCK_M)
    assert len(tiles) == device_walk.num_query_tiles(seq_lens, query_start_loc, BLOCK_M)
    assert tiles == _query_tiles(seq_lens[:num_seqs], query_start_loc[: num_seqs + 1], BLOCK_M)
    expected = np.full(buffer.shape[0], UNWRITTEN, dtype=np.int32)
    if device_walk.lone_round(len(tiles), heads, programs):
        walk = hopper_prefill.settled_walk(counts, tiles, heads, programs, fits=(split_slots, programs))
        expected[: 2 * len(tiles)] = np.array(tiles, dtype=np.int32).reshape(-1)
        walk.flat(counts, tiles, seq_lens, query_start_loc, out=expected[2 * max_tiles :])
    assert np.array_equal(buffer.numpy(), expected)


@pytest.mark.parametrize(("full", "partial", "split"), [(40, 2, False), (39, 3, True)])
def test_lone_round_walk_splits_where_the_cost_model_ends_sooner(device, monkeypatch, full, partial, split):
    """At the cost model's edge (SPLIT_COST 20: an item of 43.4 tiles' cost in two parts ends exactly when
    whole, one of 44.1 sooner), the device splits as the host does."""
    monkeypatch.setattr(hopper_prefill, "SPLIT_ONE_ROUND", True)
    monkeypatch.setattr(hopper_prefill, "SPLIT_LAST", False)
    monkeypatch.setattr(hopper_prefill, "MIN_SPLIT_TILES", 1)
    monkeypatch.setattr(hopper_prefill, "SPLIT_COST", 20.0)
    counts = torch.zeros(2, ABS_TILES, 1, dtype=torch.int32)
    counts[:, 0, 0] = torch.tensor([full, partial])
    buffer, max_tiles = device_buffer(([128], [0, 128], 1, 1, 2, counts), 2, device)
    walk = hopper_prefill.settled_walk(counts, [(0, 0)], 1, 2, fits=(2, 2))
    assert (walk.num_slots > 0) == split
    expected = walk.flat(counts, [(0, 0)], [128], [0, 128])
    assert np.array_equal(buffer[2 * max_tiles : 2 * max_tiles + expected.shape[0]].numpy(), expected)


@pytest.mark.parametrize("split_slots", [127, 128])
def test_lone_round_walk_splits_the_engines_2k_step(device, monkeypatch, split_slots):
    """The engine's step over a cached 2k prompt (208 queries of the 32-layer model's Phi-3 layout, 64 items
    on 132 programs) with SPLIT_ONE_ROUND: every item in two parts where the launch holds their 128
    states, else whole, as on the host."""
    import reference
    from kernels import tile_lists

    monkeypatch.setattr(hopper_prefill, "SPLIT_ONE_ROUND", True)
    monkeypatch.setattr(hopper_prefill, "SPLIT_LAST", False)
    layout = reference.LocalStridedLayout(64, 16, 8)
    lists = tile_lists.tile_lists(layout, 32, 2048, BLOCK_M, hopper_prefill.BLOCK_N, 1, "cpu", halves=True)
    buffer, max_tiles = device_buffer(
        ([2048, 0], [0, 208, 208], 1, 32, 132, lists.counts), split_slots, device
    )
    tiles = [(0, 14), (0, 15)]
    walk = hopper_prefill.settled_walk(lists.counts, tiles, 32, 132, fits=(split_slots, 132))
    assert walk.num_slots == (128 if split_slots == 128 else 0)
    expected = walk.flat(lists.counts, tiles, [2048, 0], [0, 208, 208])
    assert np.array_equal(buffer[2 * max_tiles : 2 * max_tiles + expected.shape[0]].numpy(), expected)


def test_lone_round_at_most_a_round(monkeypatch):
    monkeypatch.setattr(hopper_prefill, "SPLIT_LAST", False)
    assert device_walk.lone_round(2, 32, 64) and device_walk.lone_round(2, 32, 132)
    assert not device_walk.lone_round(3, 32, 64)  # two rounds
    assert not device_walk.lone_round(0, 32, 64)  # no queries


@pytest.mark.parametrize(
    ("module", "flag", "value"), [(hopper_prefill, "SPLIT_LAST", True), (device_walk, "ENABLED", False)]
)
def test_no_lone_round_with_split_last_or_when_off(monkeypatch, module, flag, value):
    monkeypatch.setattr(hopper_prefill, "SPLIT_LAST", False)
    monkeypatch.setattr(module, flag, value)
    assert not device_walk.active() and not device_walk.lone_round(2, 32, 132)
