"""The cache-write oracle against a position-by-position reading of contract §3."""

import torch
from hypothesis import given
from hypothesis import strategies as st

import reference as ref
from harness.cases import DTYPES
from harness.strategies import page_sizes
from tests.budgets import examples


@examples(8)
@given(
    page_sizes(),
    st.integers(1, 6),
    st.integers(0, 40),
    st.sampled_from(tuple(DTYPES)),
    st.integers(0, 2**31 - 1),
)
def test_write_kv(page_size, num_pages, num_tokens, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_slots = page_size * num_pages
    num_tokens = min(num_tokens, num_slots)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # padding tokens
    k = torch.randn(num_tokens, 2, 8, generator=gen).to(DTYPES[dtype])
    v = torch.randn(num_tokens, 2, 8, generator=gen).to(DTYPES[dtype])
    k_cache = torch.randn(num_pages, page_size, 2, 8, generator=gen).to(DTYPES[dtype])
    v_cache = torch.randn(num_pages, page_size, 2, 8, generator=gen).to(DTYPES[dtype])
    k_before, v_before = k_cache.clone(), v_cache.clone()
    ref.write_kv(k, v, k_cache, v_cache, slots)
    written = {int(s): t for t, s in enumerate(slots.tolist()) if s >= 0}
    for slot in range(num_slots):
        page, offset = slot // page_size, slot % page_size
        want_k = k[written[slot]] if slot in written else k_before[page, offset]
        want_v = v[written[slot]] if slot in written else v_before[page, offset]
        assert torch.equal(k_cache[page, offset], want_k) and torch.equal(v_cache[page, offset], want_v)
