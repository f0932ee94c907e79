"""The Hopper prefill's walk (kernels/hopper_prefill.plan_walk): every tile of every item taken exactly
once, by units whose split items' slots are their own; the rounds before the dealt ones in head-major
order; a round dealt whole gives its costliest item to its least-loaded program; a split last round
evens the programs' ends; the cheapest items walked last end the busiest program sooner. It is a
schedule, so the kernel's outputs do not depend on it: the GPU tests of
tests/kernels/test_hopper_prefill.py judge those against the oracle, on walks with split items."""

import importlib
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference
from harness.cases import build_inputs
from kernels import hopper_prefill, tile_lists
from kernels.hopper_prefill import (
    BLOCK_M,
    BLOCK_N,
    ITEM_COST,
    MIN_SPLIT_TILES,
    PARTIAL_COST,
    SPLIT_COST,
    plan_walk,
)
from tests.budgets import examples
from tests.kernels.test_hopper_prefill import ONE_ROUND_CASES

paged_prefill = importlib.import_module("kernels.paged_prefill")  # the module, not the package's function

pytestmark = [pytest.mark.ours, pytest.mark.operator("paged_prefill")]


@st.composite
def problems(draw):
    """(counts, query tiles, heads, programs) of a plan: list counts [2, tiles, 1 or heads]."""
    num_abs = draw(st.integers(1, 12))  # absolute query tiles the lists cover
    heads = draw(st.integers(1, 6))
    lists = 1 if draw(st.booleans()) else heads  # one list for every head, or one a head
    size = 2 * num_abs * lists
    counts = draw(st.lists(st.integers(0, 30), min_size=size, max_size=size))
    query_tiles = draw(
        st.lists(st.tuples(st.integers(0, 3), st.integers(0, num_abs - 1)), min_size=1, max_size=20)
    )
    programs = min(draw(st.integers(1, 40)), len(query_tiles) * heads)  # the launch's grid
    return torch.tensor(counts, dtype=torch.int32).view(2, num_abs, lists), query_tiles, heads, programs


def item_lists(counts, query_tiles, heads) -> np.ndarray:
    """[items, 2]: each item's full and partial counts, item w being head w // T, query tile
    T - 1 - w % T (the kernel's `_work`)."""
    tiles = len(query_tiles)
    out = np.zeros((tiles * heads, 2), dtype=np.int64)
    for w in range(out.shape[0]):
        head, t = w // tiles, query_tiles[tiles - 1 - w % tiles][1]
        out[w] = counts[:, t, min(head, counts.shape[2] - 1)].numpy()
    return out


def unit_cost(lists, unit) -> float:
    w, begin, end = unit[:3]
    fulls = min(end, lists[w, 0]) - min(begin, lists[w, 0])
    return ITEM_COST + fulls + PARTIAL_COST * (end - begin - fulls)


def program_units(walk):
    return [walk.units[walk.offsets[p] : walk.offsets[p + 1]] for p in range(walk.offsets.shape[0] - 1)]


def check_cover(walk, lists):
    """Every item's tiles exactly once, in order, by one whole unit or by parts of at least
    MIN_SPLIT_TILES tiles on their own slots, each split item's slots consecutive and its own."""
    assert walk.units.dtype == np.int32 and walk.offsets[0] == 0 and walk.offsets[-1] == walk.units.shape[0]
    assert (np.diff(walk.offsets) >= 0).all()
    slots = []
    for w in range(lists.shape[0]):
        mine = walk.units[walk.units[:, 0] == w]
        mine = mine[np.argsort(mine[:, 1], kind="stable")]
        assert mine.shape[0] >= 1
        assert mine[0, 1] == 0 and mine[-1, 2] == lists[w].sum()
        assert (mine[1:, 1] == mine[:-1, 2]).all()
        if mine.shape[0] == 1:
            assert tuple(mine[0, 3:]) == (-1, 0, 1)
            continue
        first, parts = mine[0, 4], mine.shape[0]
        assert (mine[:, 4] == first).all() and (mine[:, 5] == parts).all()
        assert sorted(mine[:, 3].tolist()) == list(range(first, first + parts))
        assert (mine[:, 2] - mine[:, 1] >= hopper_prefill.MIN_SPLIT_TILES).all()  # as monkeypatched
        slots += mine[:, 3].tolist()
    assert sorted(slots) == list(range(walk.num_slots))


@examples(6)
@given(problems(), st.sampled_from([0, 1, 2, 10**6]), st.booleans(), st.booleans())
def test_walk_takes_every_tile_once(monkeypatch, problem, dealt_rounds, split, cheapest_last):
    monkeypatch.setattr(hopper_prefill, "CHEAPEST_LAST_ROUNDS", 2)  # walks this small take it too
    counts, query_tiles, heads, programs = problem
    walk = plan_walk(counts, query_tiles, heads, programs, dealt_rounds, split, cheapest_last=cheapest_last)
    check_cover(walk, item_lists(counts, query_tiles, heads))
    assert walk.offsets.shape[0] == programs + 1


@examples(6)
@given(problems(), st.integers(0, 40), st.booleans())
def test_walk_for_every_program_gives_an_idle_program_one_stand_in(problem, extra, split):
    """`every_program` (a launch planned for more items, replanned): each program takes at least one
    unit, a program without work exactly one stand-in (item -1, no tiles, a whole item's fields), and
    the items' units are those of the walk without it; the stand-ins' rows are zero but for those
    fields. Also when there is no query tile at all."""
    counts, query_tiles, heads, programs = problem
    if extra == 40:
        query_tiles = []
    programs += extra  # more programs than items, as a replanned launch may have
    plain = plan_walk(counts, query_tiles, heads, programs, 1, split)
    walk = plan_walk(counts, query_tiles, heads, programs, 1, split, every_program=True)
    for before, after in zip(program_units(plain), program_units(walk), strict=True):
        if before.shape[0]:
            assert np.array_equal(before, after)
        else:
            assert after.tolist() == [[-1, 0, 0, -1, 0, 1]]
    seqs = max((b for b, _ in query_tiles), default=0) + 1
    flat = walk.flat(counts, query_tiles, [900] * seqs, list(range(0, 10 * seqs + 1, 10)))
    rows = flat[programs + 1 :].reshape(-1, hopper_prefill.ROW_FIELDS)
    assert (flat[: programs + 1] == walk.offsets).all()
    assert (rows[walk.units[:, 0] < 0] == [0, 0, 0, 0, 0, 0, -1, 0, 1, 0, 0, 0]).all()
    assert (rows[walk.units[:, 0] >= 0, 11] == 900).all()


@examples(4)
@given(problems(), st.sampled_from([0, 1, 3]), st.booleans())
def test_walk_keeps_the_rounds_before_the_dealt_ones_head_major(problem, dealt_rounds, split):
    counts, query_tiles, heads, programs = problem
    walk = plan_walk(counts, query_tiles, heads, programs, dealt_rounds, split)
    rounds = -(-len(query_tiles) * heads // programs)
    fixed = max(rounds - max(dealt_rounds, int(split)), 0)
    num_items = len(query_tiles) * heads
    for p, units in enumerate(program_units(walk)):
        head_major = [p + r * programs for r in range(fixed) if p + r * programs < num_items]
        assert units[: len(head_major), 0].tolist() == head_major
        assert (units[: len(head_major), 3] == -1).all()


@examples(4)
@given(problems())
def test_walk_dealt_whole_gives_each_rounds_costliest_item_to_its_least_loaded_program(problem):
    counts, query_tiles, heads, programs = problem
    lists = item_lists(counts, query_tiles, heads)
    walk = plan_walk(counts, query_tiles, heads, programs, 10**6, False)
    loads = np.zeros(programs)
    units = program_units(walk)
    for r in range(max(map(len, units))):
        taking = [p for p in range(programs) if len(units[p]) > r]
        cost = {p: unit_cost(lists, units[p][r]) for p in taking}
        # No program that takes a cheaper item this round was loaded less than one taking a costlier one.
        for p in taking:
            for q in taking:
                if cost[p] > cost[q] + 1e-9:
                    assert loads[p] <= loads[q] + 1e-9  # sums in another order
        assert len(taking) == programs or r == max(map(len, units)) - 1
        for p in taking:
            loads[p] += cost[p]


def model_loads(walk, lists) -> np.ndarray:
    """Each program's cost of its units whole, by the cost model."""
    return np.array([sum(unit_cost(lists, u) for u in units) for units in program_units(walk)])


@examples(6)
@given(problems(), st.integers(1, 4))
def test_walk_cheapest_last_ends_sooner_by_the_cost_model(monkeypatch, problem, min_rounds):
    """`cheapest_last`: a walk of at least CHEAPEST_LAST_ROUNDS rounds is either the dealt walk, or one
    whose most-loaded program ends CHEAPEST_LAST_GAIN sooner by the cost model: the other items in
    head-major rounds (the p-th of each round to program p), then the cheapest items, each costing no
    more than any other, costliest first, each to the program least loaded so far."""
    monkeypatch.setattr(hopper_prefill, "CHEAPEST_LAST_ROUNDS", min_rounds)
    counts, query_tiles, heads, programs = problem
    lists = item_lists(counts, query_tiles, heads)
    cost = np.array([unit_cost(lists, (w, 0, lists[w].sum())) for w in range(lists.shape[0])])
    dealt = plan_walk(counts, query_tiles, heads, programs, 1, False)
    walk = plan_walk(counts, query_tiles, heads, programs, 1, False, cheapest_last=True)
    check_cover(walk, lists)
    if np.array_equal(walk.units, dealt.units) and np.array_equal(walk.offsets, dealt.offsets):
        return
    assert -(-lists.shape[0] // programs) >= min_rounds
    gain = hopper_prefill.CHEAPEST_LAST_GAIN
    assert model_loads(walk, lists).max() < model_loads(dealt, lists).max() * (1 - gain + 1e-9)
    units = program_units(walk)
    # The other items' rounds: as many in every program, a round's items in head-major order
    rounds = next(
        r
        for r in range(min(map(len, units)), 0, -1)
        if (np.diff(np.stack([u[:r, 0] for u in units], 1).reshape(-1)) > 0).all()
    )
    rest = np.concatenate([u[:rounds, 0] for u in units])
    tail = np.concatenate([u[rounds:, 0] for u in units])
    assert cost[tail].max() <= cost[rest].min() + 1e-9
    loads = np.array([cost[u[:rounds, 0]].sum() for u in units])
    taken = [rounds] * programs
    for w in sorted(tail.tolist(), key=lambda w: (-cost[w], -w)):  # ties: the later item first
        # A program takes its tail items costliest first, each while it is among the least loaded.
        p = next(p for p, u in enumerate(units) if w in u[rounds:, 0])
        assert cost[units[p][taken[p], 0]] == cost[w]
        assert loads[p] <= loads.min() + 1e-9
        loads[p] += cost[w]
        taken[p] += 1


def test_walk_cheapest_last_at_8k_full_prefill():
    """Issue 16's 8k full prefill (the Phi-3 layout, 2048 items on an H200's 132 programs): the dealt
    walk's most-loaded program is 3.6% over the mean by the cost model, the cheapest-last one's 0.8%."""
    layout = reference.LocalStridedLayout(64, 16, 8)
    lists = tile_lists.tile_lists(layout, 32, 8192, BLOCK_M, BLOCK_N, 1, "cpu", halves=True)
    query_tiles = [(0, t) for t in range(8192 // BLOCK_M)]
    costs = item_lists(lists.counts, query_tiles, 32)
    spread = {}
    for cheapest_last in (False, True):
        walk = plan_walk(lists.counts, query_tiles, 32, 132, 1, False, cheapest_last=cheapest_last)
        check_cover(walk, costs)
        loads = model_loads(walk, costs)
        spread[cheapest_last] = loads.max() / loads.mean()
    assert spread[False] > 1.03 and spread[True] < 1.01


@examples(6)
@given(problems(), st.sampled_from([0.0, SPLIT_COST]))
def test_walk_split_in_its_last_round_ends_no_later_and_evens_the_ends(monkeypatch, problem, split_cost):
    """Split, the last round's programs end no later (by the cost model, a part costing SPLIT_COST
    more) than dealt whole; and each program ends at most a short part (under two MIN_SPLIT_TILES of
    partial tiles and two set-ups) past the mean end, or where the rounds before the last left it."""
    monkeypatch.setattr(hopper_prefill, "SPLIT_COST", split_cost)
    counts, query_tiles, heads, programs = problem
    lists = item_lists(counts, query_tiles, heads)
    rounds = -(-len(query_tiles) * heads // programs)

    def loads(walk):
        out, before = np.zeros(programs), np.zeros(programs)
        for p, units in enumerate(program_units(walk)):
            out[p] = sum(unit_cost(lists, u) + (split_cost if u[3] >= 0 else 0) for u in units)
            before[p] = sum(unit_cost(lists, u) for u in units[: rounds - 1])
        return out, before

    walk = plan_walk(counts, query_tiles, heads, programs, 1, True)
    split, before = loads(walk)
    whole, _ = loads(plan_walk(counts, query_tiles, heads, programs, 1, False))
    assert split.max() <= whole.max() + 1e-9
    if walk.num_slots:
        slack = 2 * MIN_SPLIT_TILES * PARTIAL_COST + 2 * ITEM_COST + 2 * split_cost
        assert split.max() <= max(before.max(), split.mean() + slack) + 1e-9


@examples(2)
@given(problems(), st.booleans())
def test_walk_rows_are_each_units_item_and_metadata(problem, split):
    """`Walk.flat`: each unit's row as the kernel reads it, against its item's lists and sequence."""
    counts, query_tiles, heads, programs = problem
    walk = plan_walk(counts, query_tiles, heads, programs, 1, split)
    seqs = max(b for b, _ in query_tiles) + 1
    seq_lens = [1000 + 7 * b for b in range(seqs)]
    starts = np.cumsum([0] + [100 + b for b in range(seqs)]).tolist()
    flat = walk.flat(counts, query_tiles, seq_lens, starts)
    assert (flat[: programs + 1] == walk.offsets).all()
    rows = flat[programs + 1 :].reshape(-1, hopper_prefill.ROW_FIELDS)
    tiles = len(query_tiles)
    for row, unit in zip(rows, walk.units, strict=True):
        w = unit[0]
        seq, qtile = query_tiles[tiles - 1 - w % tiles]
        head = w // tiles
        query_len = starts[seq + 1] - starts[seq]
        expected = [seq, qtile, head, counts[0, qtile, min(head, counts.shape[2] - 1)].item()]
        expected += unit[1:].tolist() + [starts[seq], seq_lens[seq] - query_len, seq_lens[seq]]
        assert row.tolist() == expected


def settled_options(monkeypatch, one_round: bool) -> dict:
    """The module's settings for `settled_walk` (SPLIT_LAST off, its default), SPLIT_ONE_ROUND as
    given, and the plain `plan_walk` options it must take."""
    monkeypatch.setattr(hopper_prefill, "SPLIT_LAST", False)
    monkeypatch.setattr(hopper_prefill, "SPLIT_ONE_ROUND", one_round)
    rounds = hopper_prefill.BALANCED_ROUNDS if hopper_prefill.BALANCED_WALK else 0
    cheapest_last = hopper_prefill.BALANCED_WALK and hopper_prefill.CHEAPEST_LAST
    return dict(dealt_rounds=rounds, every_program=True, cheapest_last=cheapest_last)


def same_walk(a, b) -> bool:
    return (
        np.array_equal(a.offsets, b.offsets)
        and np.array_equal(a.units, b.units)
        and a.num_slots == b.num_slots
    )


SPLIT_MODELS = st.sampled_from([(1, 0.0), (MIN_SPLIT_TILES, SPLIT_COST)])  # (MIN_SPLIT_TILES, SPLIT_COST)


@examples(6)
@given(problems(), st.integers(0, 40), st.booleans(), SPLIT_MODELS)
def test_settled_walk_splits_only_a_lone_round_that_leaves_programs_idle(
    monkeypatch, problem, extra, one_round, split_model
):
    """`settled_walk` at planning: with SPLIT_ONE_ROUND, a walk of fewer items than programs is
    `split_one_round`'s where it splits an item; any other walk, and every walk with the flag off, is
    the unsplit one."""
    monkeypatch.setattr(hopper_prefill, "MIN_SPLIT_TILES", split_model[0])
    monkeypatch.setattr(hopper_prefill, "SPLIT_COST", split_model[1])
    options = settled_options(monkeypatch, one_round)
    counts, query_tiles, heads, programs = problem
    programs += extra
    walk = hopper_prefill.settled_walk(counts, query_tiles, heads, programs)
    split = one_round and len(query_tiles) * heads < programs
    split = split and hopper_prefill.split_one_round(counts, query_tiles, heads, programs)
    expected = split or plan_walk(counts, query_tiles, heads, programs, split=False, **options)
    assert same_walk(walk, expected)
    check_cover(walk, item_lists(counts, query_tiles, heads))


def one_round_parts(lists: np.ndarray, programs: int) -> list[int] | None:
    """`split_one_round`'s parts an item, its rule read plainly in tenths of a full tile: for u = 1,
    2, ... parts of the costliest item, each item in ceil(u * cost / costliest) parts, at most so many
    that each is worth MIN_SPLIT_TILES + 1 partial tiles and at least one; the last u whose parts the
    programs hold. None where an item ends no sooner than the costliest whole (a part: its share,
    SPLIT_COST and a partial tile for its ends' rounding)."""
    min_tiles, split_cost = hopper_prefill.MIN_SPLIT_TILES, round(10 * hopper_prefill.SPLIT_COST)
    partial = round(10 * PARTIAL_COST)
    cost = [10 * f + partial * p for f, p in lists.tolist()]
    costliest = max(cost, default=0)
    if not costliest:
        return None
    parts = None
    for u in range(1, programs + 1):
        ks = [
            max(1, min(math.ceil(Fraction(u * c, costliest)), c // (partial * (min_tiles + 1)))) for c in cost
        ]
        if sum(ks) <= programs:
            parts = ks
    ends = [Fraction(c, k) + split_cost + partial if k > 1 else c for c, k in zip(cost, parts, strict=True)]
    return None if max(ends) >= costliest else parts


@examples(8)
@given(problems(), st.integers(1, 60), SPLIT_MODELS)
def test_split_one_round_gives_idle_programs_parts_of_every_item(monkeypatch, problem, extra, split_model):
    """`split_one_round`: each item in as many parts as the oracle's plain reading of its rule gives
    (`one_round_parts`), and None where it gives none; every tile of every item once, a unit a program
    (the items' parts in order, then stand-ins), parts of at least MIN_SPLIT_TILES tiles, each costing
    at most its item's share and a tile's rounding, so that the busiest program ends sooner than the
    costliest item whole."""
    monkeypatch.setattr(hopper_prefill, "MIN_SPLIT_TILES", split_model[0])
    monkeypatch.setattr(hopper_prefill, "SPLIT_COST", split_model[1])
    counts, query_tiles, heads, _ = problem
    lists = item_lists(counts, query_tiles, heads)
    programs = lists.shape[0] + extra  # more programs than items
    cost = lists[:, 0] + PARTIAL_COST * lists[:, 1]
    walk = hopper_prefill.split_one_round(counts, query_tiles, heads, programs)
    parts = one_round_parts(lists, programs)
    assert (walk is None) == (parts is None)
    if walk is None:
        return
    check_cover(walk, lists)
    assert (walk.offsets == np.arange(programs + 1)).all() and walk.num_slots == sum(
        k for k in parts if k > 1
    )
    real = walk.units[:, 0] >= 0
    assert real[: real.sum()].all() and (walk.units[~real] == hopper_prefill.STAND_IN).all()
    assert (walk.units[real, 0] == np.repeat(np.arange(len(parts)), parts)).all()  # in item order
    assert (walk.units[real, 5] == np.repeat(parts, parts)).all()
    ends = []
    for unit in walk.units[real]:
        w, k = unit[0], unit[5]
        end = unit_cost(lists, unit) + (split_model[1] if k > 1 else 0.0)
        assert end <= ITEM_COST + cost[w] / k + (split_model[1] if k > 1 else 0.0) + PARTIAL_COST + 1e-9
        ends.append(end)
    assert max(ends) < ITEM_COST + cost.max()


def test_split_one_round_at_the_engines_2k_step():
    """The engine's prefill step over a cached 2k prompt (the Phi-3 layout, 208 queries: 64 items on an
    H200's 132 programs): every item in two parts, the busiest program's cost by the model 0.75 of the
    costliest item's (each part pays a unit's set-up and SPLIT_COST)."""
    layout = reference.LocalStridedLayout(64, 16, 8)
    lists = tile_lists.tile_lists(layout, 32, 2048, BLOCK_M, BLOCK_N, 1, "cpu", halves=True)
    query_tiles = [(0, 14), (0, 15)]
    walk = hopper_prefill.split_one_round(lists.counts, query_tiles, 32, 132)
    costs = item_lists(lists.counts, query_tiles, 32)
    check_cover(walk, costs)
    assert walk.num_slots == 128 and (walk.units[:128, 5] == 2).all()
    whole = max(unit_cost(costs, (w, 0, costs[w].sum())) for w in range(64))
    split = max(unit_cost(costs, u) + SPLIT_COST for u in walk.units[:128])
    assert split < 0.76 * whole


@pytest.mark.parametrize("name", list(ONE_ROUND_CASES))
def test_split_one_round_splits_the_gpu_tests_one_round_cases(monkeypatch, name):
    """Each of tests/kernels/test_hopper_prefill.py's ONE_ROUND_CASES, whose GPU test wants a split, is
    split by the rule under that test's settings, over the programs its plan launches on a 132-SM GPU (an
    H100 or an H200): the host's check of what only a GPU runs."""
    monkeypatch.setattr(hopper_prefill, "MIN_SPLIT_TILES", 1)
    monkeypatch.setattr(hopper_prefill, "SPLIT_COST", 0.0)
    monkeypatch.setattr(hopper_prefill, "num_sms", lambda device: 132)
    case = ONE_ROUND_CASES[name]
    inputs = build_inputs(case, "cpu")
    lens, starts = inputs["seq_lens"].tolist(), inputs["query_start_loc"].tolist()
    query_tiles = paged_prefill._query_tiles(lens, starts, BLOCK_M)
    lists = tile_lists.tile_lists(
        inputs["layout"], case.num_heads, max(lens), BLOCK_M, BLOCK_N, 1, "cpu", halves=True
    )
    max_tiles = paged_prefill.max_query_tiles(len(lens), inputs["q"].shape[0], BLOCK_M)
    programs = hopper_prefill.num_programs((max_tiles, case.num_heads), torch.device("cuda"))
    walk = hopper_prefill.split_one_round(lists.counts, query_tiles, case.num_heads, programs)
    assert walk is not None and walk.num_slots > 0, "the rule splits no item of the case"
    check_cover(walk, item_lists(lists.counts, query_tiles, case.num_heads))


@examples(6)
@given(problems(), st.integers(0, 40), st.integers(0, 80), st.integers(0, 120))
def test_settled_walk_at_a_replan_fits_the_launch(monkeypatch, problem, extra, slots, units):
    """`settled_walk` at a replan (`fits`: the split states and units the plan's launch and buffer
    hold): the split walk where it fits them, else the unsplit one; a launch without split states
    never gets a split walk."""
    monkeypatch.setattr(hopper_prefill, "MIN_SPLIT_TILES", 1)
    monkeypatch.setattr(hopper_prefill, "SPLIT_COST", 0.0)
    options = settled_options(monkeypatch, True)
    counts, query_tiles, heads, programs = problem
    programs += extra
    walk = hopper_prefill.settled_walk(counts, query_tiles, heads, programs, fits=(slots, units))
    planned = hopper_prefill.settled_walk(counts, query_tiles, heads, programs)
    unsplit = plan_walk(counts, query_tiles, heads, programs, split=False, **options)
    fits = planned.num_slots <= slots and planned.units.shape[0] <= units
    assert same_walk(walk, planned if fits else unsplit)
    assert walk.num_slots <= slots


@pytest.mark.parametrize("one_round", [False, True])
def test_split_slots_where_a_plan_takes_about_one_round(monkeypatch, one_round):
    """`split_slots`: a launch holds a one-round walk's split states (a part a program) when its plan's
    queries take at most a round of query tiles on every head, with SPLIT_ONE_ROUND only."""
    monkeypatch.setattr(hopper_prefill, "SPLIT_ONE_ROUND", one_round)
    for tokens, heads, programs in [
        (208, 32, 132),
        (528, 32, 132),
        (529, 32, 132),
        (2048, 8, 132),
        (1, 1, 1),
    ]:
        expected = programs if one_round and tokens * heads <= programs * BLOCK_M else 0
        assert hopper_prefill.split_slots(tokens, heads, programs) == expected
    assert hopper_prefill.split_slots(208, 32, 132) == (132 if one_round else 0)  # the engine's 2k h.9 step
