"""`paged_decode` of the implementation under test against the float64 oracle (contract §5, out and lse)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reference as ref
from harness import bad_inputs
from harness.cases import AttentionCase, LayoutSpec, build_inputs
from harness.strategies import attention_cases
from tests.kernels import test_paged_prefill

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
    # Tensor-parallel shards: this shard's heads are global heads head_offset .. (contract §2.1).
    *[
        pytest.param(
            _case(
                (300, 129, 64),
                LayoutSpec("local_strided", 16, 2, stride, num_heads_total=total, head_offset=offset),
                heads=(4, 2),
                head_dim=32,
            ),
            id=f"shard-offset{offset}-of{total}-stride{stride}",
        )
        for total, offset, stride in test_paged_prefill.SHARDS
    ],
    # An all-empty batch (density 0): its allowance is 0, so out 0 and lse -inf exactly.
    pytest.param(
        _case((7, 40), LayoutSpec("block_mask", 4, density=0.0), heads=(4, 2)), id="all-rows-empty-exact"
    ),
]


@pytest.mark.parametrize("case", NAMED)
def test_paged_decode_named(run_case, case):
    run_case(case, decode=True, single=True, check_without_lse=True)


@pytest.mark.requires(validates=True)
@pytest.mark.parametrize("entry", bad_inputs.entries("paged_decode", bad_inputs.Rejected), ids=lambda e: e.id)
def test_paged_decode_bad_input(run_entry, entry):
    run_entry("paged_decode", entry)


@pytest.mark.parametrize("entry", bad_inputs.entries("paged_decode", bad_inputs.View), ids=lambda e: e.id)
def test_paged_decode_non_contiguous(run_entry, entry):
    run_entry("paged_decode", entry)


@pytest.mark.parametrize(
    "entry", bad_inputs.entries("paged_decode", bad_inputs.NonFinite), ids=lambda e: e.id
)
def test_paged_decode_non_finite(run_entry, entry):
    run_entry("paged_decode", entry)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "neg-inf"])
def test_paged_decode_non_finite_v_seen_by_one_head_of_its_group(run_case, device, value):
    """A NaN or Inf in V at a key block that one head of a GQA group sees and the other does not: the
    group's key tile is partial, each head reading its own bit of the decode lists
    (kernels/tile_lists.py), and only the head that sees the value turns NaN (contract §4)."""
    case = _case((200, 150), LayoutSpec("block_mask", 64), heads=(2, 1), head_dim=32)
    inputs = build_inputs(case, device)
    mask = ref.causal_block_mask(4).repeat(2, 1, 1)
    mask[1, 2:, 1] = False  # head 1 does not see block 1 from the queries' blocks (2 and 3)
    inputs["layout"] = ref.BlockMaskLayout(mask, 64)
    position = 70  # in block 1 of both sequences
    for b in range(2):
        page = inputs["block_tables"][b, position // case.page_size]
        inputs["v_cache"][page, position % case.page_size, 0, 5] = value
    run_case(case, decode=True, single=True, inputs=inputs)


# GPU only: Phi-3-small decode (32 query heads, 8 KV heads, D 128) at 8k context, sparse and dense.
PHI3_GPU_CASES = [
    pytest.param(_case((8192, 8191, 1, 4097), layout, dtype, heads=(32, 8)), id=f"{name}-{dtype}")
    for name, layout in (
        ("dense", LayoutSpec()),
        ("phi3", LayoutSpec("local_strided", 64, 16, 8, num_heads_total=32)),
    )
    for dtype in DTYPES
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PHI3_GPU_CASES)
def test_paged_decode_phi3_small_gpu(run_case, case):
    run_case(case, decode=True, single=True)
