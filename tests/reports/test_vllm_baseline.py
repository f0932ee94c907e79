"""The layout as vLLM's block-sparse kernel reads it (reports/vllm_baseline.csr): its CSR rows and
columns spell exactly the block mask they were built from. (The kernel itself is fetched from a wheel
and checked against the oracle by `python -m reports.vllm_baseline --check DIR`, not in CI.)"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference as ref
from reports.vllm_baseline import csr
from tests.budgets import examples


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])  # vLLM's, and the check's
@examples(2)
@given(st.integers(1, 4), st.integers(1, 9), st.floats(0, 1), st.integers(0, 2**31 - 1))
def test_csr_spells_the_block_mask(dtype, heads, num_blocks, density, seed):
    mask = ref.random_block_mask(heads, num_blocks, density, seed)
    crow, col = csr(mask, dtype)
    assert crow.dtype == col.dtype == dtype and crow.shape == (heads, num_blocks + 1)
    rebuilt = torch.zeros_like(mask)
    for h in range(heads):
        for row in range(num_blocks):
            rebuilt[h, row, col[h, crow[h, row] : crow[h, row + 1]].long()] = True
        assert (col[h, crow[h, -1] :] == -1).all()  # padding
    assert torch.equal(rebuilt, mask)
