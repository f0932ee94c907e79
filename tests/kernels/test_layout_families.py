"""Outside layout families (`--layout-family`, backends/layout_families.py) under the operator tests,
swept like the built-ins: every block size, context and page size, oracle against implementation."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kernels
import reference as ref
from harness.cases import attention_args, build_inputs
from harness.strategies import attention_cases, family_layouts
from reference.layouts import layout_block_mask
from tests.budgets import examples
from tests.kernels import test_paged_prefill

CAPS = test_paged_prefill.CAPS


@pytest.mark.operator("paged_prefill")
@given(data=st.data())
def test_paged_prefill_family(impl, run_case, family, data):
    case = data.draw(attention_cases(caps=impl.capabilities, layout_kinds=(), families=(family,), **CAPS))
    run_case(case, decode=False)


@pytest.mark.operator("paged_decode")
@given(data=st.data())
def test_paged_decode_family(impl, run_case, family, data):
    case = data.draw(
        attention_cases(caps=impl.capabilities, decode=True, layout_kinds=(), families=(family,), **CAPS)
    )
    run_case(case, decode=True)


@pytest.mark.ours
@examples(0.1)
@given(data=st.data())
def test_kernels_read_a_layout_only_through_its_block_mask(device, family, data):
    """Our kernels take the family's own objects, and give bit for bit what the same block mask gives
    as a BlockMaskLayout: no layout class reaches them."""
    case = data.draw(attention_cases(layout_kinds=(), families=(family,), dtypes=("float32",), **CAPS))
    layout = data.draw(family_layouts(family, case.num_heads))
    inputs = build_inputs(case, device)
    mask = layout_block_mask(layout, case.num_heads, -(-max(case.seq_lens) // layout.block_size))
    as_mask = ref.BlockMaskLayout(mask.expand(case.num_heads, -1, -1).contiguous(), layout.block_size)
    args = attention_args(inputs, decode=False)
    got = kernels.paged_prefill(*args, layout=layout, return_lse=True)
    want = kernels.paged_prefill(*args, layout=as_mask, return_lse=True)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
