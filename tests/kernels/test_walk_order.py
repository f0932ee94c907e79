"""The Hopper prefill's walk order (kernels/hopper_prefill.walk_order): every work item exactly once,
and no program loaded past the mean by more than one item's cost (each round's costliest item goes to
its least-loaded program). It is a schedule, so the kernel's outputs do not depend on it: the GPU
tests of tests/kernels/test_hopper_prefill.py judge those against the oracle."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels.hopper_prefill import ITEM_COST, PARTIAL_COST, walk_order
from tests.budgets import examples

pytestmark = [pytest.mark.ours, pytest.mark.operator("paged_prefill")]


@examples(4)
@given(
    st.integers(1, 12),  # absolute query tiles the lists cover
    st.integers(1, 6),  # heads
    st.booleans(),  # one list for every head
    st.integers(1, 40),  # programs
    st.data(),
)
def test_walk_takes_every_item_once_and_balances_the_programs(num_abs, heads, shared, programs, data):
    counts = torch.tensor(
        data.draw(
            st.lists(
                st.integers(0, 30),
                min_size=2 * num_abs * (1 if shared else heads),
                max_size=2 * num_abs * (1 if shared else heads),
            )
        ),
        dtype=torch.int32,
    ).view(2, num_abs, 1 if shared else heads)
    query_tiles = data.draw(
        st.lists(st.tuples(st.integers(0, 3), st.integers(0, num_abs - 1)), min_size=1, max_size=20)
    )
    num_items = len(query_tiles) * heads
    programs = min(programs, num_items)  # the launch's grid
    order = walk_order(counts, query_tiles, heads, programs)
    assert order.dtype == torch.int32
    assert sorted(order.tolist()) == list(range(num_items))
    # Item w: head w // T, query tile T - 1 - w % T (the kernel's `_work`).
    tiles = len(query_tiles)
    cost = np.zeros(num_items)
    for w in range(num_items):
        head, t = w // tiles, query_tiles[tiles - 1 - w % tiles][1]
        entry = counts[:, t, 0 if shared else head].tolist()
        cost[w] = entry[0] + PARTIAL_COST * entry[1] + ITEM_COST
    loads = [cost[order[p::programs].numpy()].sum() for p in range(programs)]
    assert max(loads) <= cost.sum() / programs + cost.max() + 1e-9
