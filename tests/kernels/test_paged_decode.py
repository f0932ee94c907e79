"""`paged_decode` of the implementation under test against the float64 oracle (contract §5, out and lse)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness import bad_inputs
from harness.cases import AttentionCase, LayoutSpec, attention_args, build_inputs
from harness.strategies import attention_cases

pytestmark = pytest.mark.operator("paged_decode")
GPU = torch.cuda.is_available()
CAPS = (
    dict(max_seqs=8, max_seq_len=2048, max_heads=8) if GPU else dict(max_seqs=3, max_seq_len=96, max_heads=4)
)
DTYPES = ("float32", "float16", "bfloat16")


@given(data=st.data())
def test_paged_decode(impl, run_case, data):
    run_case(data.draw(attention_cases(caps=impl.capabilities, decode=True, **CAPS)), decode=True)


@given(data=st.data())
def test_paged_decode_sparse(impl, run_case, data):
    sparse = tuple(k for k in impl.capabilities.layouts if k != "dense") or ("dense",)
    case = data.draw(attention_cases(caps=impl.capabilities, decode=True, layout_kinds=sparse, **CAPS))
    run_case(case, decode=True)


DENSE = LayoutSpec()


def _case(seq_lens, layout=DENSE, dtype="float32", page_size=16, heads=(8, 2), head_dim=128, scale=None):
    return AttentionCase(
        seed=sum(seq_lens),
        seq_lens=tuple(seq_lens),
        query_lens=(1,) * len(seq_lens),
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        input_scale=5.0,
        scale=scale,
        layout=layout,
    )


NAMED = [
    # Short sequences next to a long one: their later splits see no key.
    pytest.param(_case((1, 2, 95)), id="empty-splits"),
    pytest.param(_case((64, 65, 17), page_size=5, head_dim=80), id="P5-D80-unaligned"),
    pytest.param(
        _case((70, 96, 33), LayoutSpec("local_strided", 16, 1, 4, num_heads_total=8), page_size=3),
        id="local-strided-P3-S16",
    ),
    pytest.param(
        _case((1, 96), LayoutSpec("block_mask", 8, density=0.0), heads=(4, 4), head_dim=96),
        id="all-rows-empty",
    ),
    pytest.param(
        _case((50, 96), LayoutSpec("block_mask", 24, density=0.15, mask_seed=2), heads=(6, 2)),
        id="block-mask-sparse-G3",
    ),
    # GQA group of 4 heads with distinct vertical columns, S a multiple of the key tile: the columns
    # are enumerated from the group's residues (kernels/paged_decode.py), splits included.
    pytest.param(
        _case((400, 257, 33), LayoutSpec("local_strided", 64, 2, 3, num_heads_total=8), heads=(8, 2)),
        id="local-strided-S64-G4-residues",
    ),
    pytest.param(_case((40, 7), scale=-0.2, head_dim=60, dtype="float16"), id="scale-negative-D60-padded"),
    pytest.param(_case((40, 90), scale=32.0, dtype="float16"), id="scale-saturating"),
]


@pytest.mark.parametrize("case", NAMED)
def test_paged_decode_named(run_case, case):
    run_case(case, decode=True, single=True, check_without_lse=True)


@pytest.mark.parametrize(
    "case",
    [pytest.param(_case((7, 40), LayoutSpec("block_mask", 4, density=0.0), heads=(4, 2)))],
    ids=["all-rows-empty-exact"],
)
def test_paged_decode_all_rows_empty_exact(impl, device, case):
    inputs = build_inputs(case, device)
    if impl.capabilities.lse:
        out, lse = impl.paged_decode(*attention_args(inputs, True), layout=inputs["layout"], return_lse=True)
        assert torch.equal(lse, torch.full_like(lse, -math.inf))
    else:
        out = impl.paged_decode(*attention_args(inputs, True), layout=inputs["layout"])
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.requires(validates=True)
@pytest.mark.parametrize("entry", bad_inputs.entries("paged_decode", bad_inputs.Rejected), ids=lambda e: e.id)
def test_paged_decode_bad_input(impl, device, entry):
    bad_inputs.check(
        "paged_decode", entry, impl.paged_decode, device, dtype=bad_inputs.table_dtype(impl.capabilities)
    )


@pytest.mark.parametrize("entry", bad_inputs.entries("paged_decode", bad_inputs.View), ids=lambda e: e.id)
def test_paged_decode_non_contiguous(impl, device, entry):
    caps = impl.capabilities
    bad_inputs.check(
        "paged_decode",
        entry,
        impl.paged_decode,
        device,
        dtype=bad_inputs.table_dtype(caps),
        with_lse=caps.lse,
    )


@pytest.mark.parametrize(
    "entry", bad_inputs.entries("paged_decode", bad_inputs.NonFinite), ids=lambda e: e.id
)
def test_paged_decode_non_finite(impl, device, entry):
    caps = impl.capabilities
    bad_inputs.check(
        "paged_decode",
        entry,
        impl.paged_decode,
        device,
        dtype=bad_inputs.table_dtype(caps),
        with_lse=caps.lse,
    )


# GPU only: Phi-3-small decode (32 query heads, 8 KV heads, D 128) at 8k context, sparse and dense.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "layout",
    [LayoutSpec(), LayoutSpec("local_strided", 64, 16, 8, num_heads_total=32)],
    ids=["dense", "phi3"],
)
def test_paged_decode_phi3_small_gpu(run_case, dtype, layout):
    run_case(_case((8192, 8191, 1, 4097), layout, dtype, heads=(32, 8)), decode=True, single=True)
