"""The Hopper prefill's walk order (kernels/hopper_prefill.walk_order): every work item exactly once;
dealt in every round, no program loaded past the mean by more than one item's cost (each round's
costliest item goes to its least-loaded program); dealt in the last round only, the rounds before it
in head-major order and the programs' most load the least the last round allows. It is a schedule,
so the kernel's outputs do not depend on it: the GPU tests of tests/kernels/test_hopper_prefill.py
judge those against the oracle."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels.hopper_prefill import ITEM_COST, PARTIAL_COST, walk_order
from tests.budgets import examples

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


def item_costs(counts, query_tiles, heads) -> np.ndarray:
    """Each item's cost, item w being head w // T, query tile T - 1 - w % T (the kernel's `_work`)."""
    tiles = len(query_tiles)
    cost = np.zeros(tiles * heads)
    for w in range(cost.shape[0]):
        head, t = w // tiles, query_tiles[tiles - 1 - w % tiles][1]
        entry = counts[:, t, min(head, counts.shape[2] - 1)].tolist()
        cost[w] = entry[0] + PARTIAL_COST * entry[1] + ITEM_COST
    return cost


@examples(4)
@given(problems())
def test_walk_dealt_every_round_takes_every_item_once_and_balances_the_programs(problem):
    counts, query_tiles, heads, programs = problem
    order = walk_order(counts, query_tiles, heads, programs, balanced_rounds=10**6)
    cost = item_costs(counts, query_tiles, heads)
    assert order.dtype == torch.int32
    assert sorted(order.tolist()) == list(range(cost.shape[0]))
    loads = [cost[order[p::programs].numpy()].sum() for p in range(programs)]
    assert max(loads) <= cost.sum() / programs + cost.max() + 1e-9


@examples(4)
@given(problems())
def test_walk_dealt_in_its_last_round_keeps_the_rounds_before_it(problem):
    counts, query_tiles, heads, programs = problem
    order = walk_order(counts, query_tiles, heads, programs, balanced_rounds=1).numpy()
    cost = item_costs(counts, query_tiles, heads)
    num_items = cost.shape[0]
    assert sorted(order.tolist()) == list(range(num_items))
    rounds = -(-num_items // programs)
    before = (rounds - 1) * programs
    # Each program's items before the last round are one program's of the head-major walk.
    chains = order[:before].reshape(rounds - 1, programs)
    assert (chains - chains[:1] == (np.arange(rounds - 1) * programs)[:, None]).all()
    assert sorted(chains[:1].reshape(-1).tolist()) == list(range(min(programs, before)))
    # The last round's items go to the least-loaded programs, the costliest to the least loaded: no
    # other dealing of that round leaves a lower most-loaded program.
    prior = cost[order[:before]].reshape(-1, programs).sum(0) if before else np.zeros(programs)
    last = np.sort(cost[order[before:]])[::-1]
    best = max(np.sort(prior)[: last.shape[0]] + last, default=0.0)
    loads = prior.copy()
    loads[: last.shape[0]] += cost[order[before:]]
    assert loads.max() == pytest.approx(max(best, prior.max()))
