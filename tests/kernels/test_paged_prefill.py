"""`paged_prefill` of the implementation under test against the float64 oracle (contract §5, out and lse)."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness import bad_inputs
from harness.cases import AttentionCase, LayoutSpec
from harness.strategies import attention_cases

pytestmark = pytest.mark.operator("paged_prefill")
GPU = torch.cuda.is_available()
# The CPU interpreter costs ~5-8 ms per tile-loop iteration: small caps there.
CAPS = (
    dict(max_seqs=3, max_seq_len=512, max_heads=8) if GPU else dict(max_seqs=3, max_seq_len=96, max_heads=4)
)
PHI3 = LayoutSpec(kind="local_strided", block_size=64, local_blocks=16, vert_stride=8, num_heads_total=32)
# On the CPU the Phi-3 regression cases keep 2 of the 32 heads (a tensor-parallel shard at offset 4).
PHI3_HEADS = (32, 8) if GPU else (2, 1)
DTYPES = ("float32", "float16", "bfloat16")


@given(data=st.data())
def test_paged_prefill(impl, run_case, data):
    run_case(data.draw(attention_cases(caps=impl.capabilities, **CAPS)), decode=False)


@pytest.mark.parametrize("layout_kind", ["local_strided", "block_mask"])
@given(data=st.data())
def test_paged_prefill_sparse(impl, run_case, layout_kind, data):
    case = data.draw(attention_cases(caps=impl.capabilities, layout_kinds=(layout_kind,), **CAPS))
    run_case(case, decode=False)


def _phi3_case(context: int, query: int, dtype: str, page_size: int = 16) -> AttentionCase:
    """A Phi-3-small layer's sparse attention (on the CPU, 2 of its heads) with a cached context."""
    heads, kv_heads = PHI3_HEADS
    layout = PHI3 if GPU else dataclasses.replace(PHI3, head_offset=4)
    return AttentionCase(
        seed=context + query,
        seq_lens=(context + query,),
        query_lens=(query,),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=128,
        page_size=page_size,
        dtype=dtype,
        scale=1.0 / 128,
        layout=layout,
    )


def _cases(table, dtypes=DTYPES):
    """pytest params of Phi-3 cases, one per (name, context, query) of `table` and dtype.

    Each is a `case` parameter, so that a case outside the implementation's capabilities (a cached
    context where it declares none, a dtype it does not declare) is skipped alone, at collection.
    """
    return [
        pytest.param(_phi3_case(context, query, dtype), id=f"{name}-{dtype}")
        for name, context, query in table
        for dtype in dtypes
    ]


# vLLM's unmerged prefix-caching kernel zero-filled masked key slots and summed them into the softmax
# denominator whenever the cached context was not a multiple of the sparse block (64 here).
VLLM_REGRESSIONS = [
    ("vllm-ctx16-q200-P16-S64-phi3", 16, 200),
    ("vllm-ctx1922-q598-P16-S64-phi3", 1922, 598),
    ("ctx0-q200-P16-S64-phi3", 0, 200),
    ("ctx64-aligned-q129-P16-S64-phi3", 64, 129),
]


@pytest.mark.parametrize("case", _cases(VLLM_REGRESSIONS))
def test_paged_prefill_vllm_regression(run_case, case):
    run_case(case, decode=False, single=True)


# Page size P and sparse block S are independent: every pair is supported by the built-in kernels
# (none raises), smaller, equal, larger and non-dividing in both directions, with a context aligned
# to neither.
PAGE_BLOCK_PAIRS = [
    (1, 16),
    (3, 16),
    (5, 64),
    (16, 64),
    (64, 16),
    (100, 32),
    (32, 32),
    (7, 3),
    (128, 1),
    (48, 80),
]


def _pair_case(page_size, block_size, layout_kind) -> AttentionCase:
    layout = LayoutSpec(
        kind=layout_kind, block_size=block_size, local_blocks=2, vert_stride=3, density=0.5, mask_seed=7
    )
    return AttentionCase(
        seed=page_size * 1000 + block_size,
        seq_lens=(93, 41),
        query_lens=(38, 41),
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=page_size,
        dtype="float16",
        input_scale=5.0,
        layout=layout,
    )


PAGE_BLOCK_PAIR_CASES = [
    pytest.param(_pair_case(p, s, kind), id=f"{kind}-P{p}-S{s}")
    for kind in ("local_strided", "block_mask")
    for p, s in PAGE_BLOCK_PAIRS
]


@pytest.mark.parametrize("case", PAGE_BLOCK_PAIR_CASES)
def test_paged_prefill_page_block_pairs(run_case, case):
    run_case(case, decode=False, single=True)


EMPTY_ROWS = AttentionCase(
    seed=3,
    seq_lens=(40, 7),
    query_lens=(25, 7),
    num_heads=2,
    num_kv_heads=1,
    head_dim=80,
    page_size=16,
    dtype="float32",
    layout=LayoutSpec(kind="block_mask", block_size=16, density=0.0),
)


@pytest.mark.parametrize("case", [pytest.param(EMPTY_ROWS, id="all-rows-empty")])
def test_paged_prefill_empty_rows(run_case, case):
    # Density 0: every row is empty. Their allowance is 0, so the judge wants out 0 and lse -inf
    # exactly, never NaN, in every (poisoned) element.
    run_case(case, decode=False, single=True)


# (num_heads_total, head_offset, vert_stride) of the shard cases: each shifts the vertical columns by
# (head_offset * step) % vert_stride != 0 blocks, so a kernel that ignores the offset is wrong there.
SHARDS = ((16, 4, 8), (8, 4, 16), (32, 12, 8))
NAMED = [
    # A sequence with no new token in the middle of a batch: its query range is empty.
    pytest.param(
        AttentionCase(
            seed=5,
            seq_lens=(20, 33, 9),
            query_lens=(20, 0, 4),
            num_heads=2,
            num_kv_heads=2,
            head_dim=32,
            page_size=4,
            dtype="float32",
            layout=LayoutSpec(kind="local_strided", block_size=4, local_blocks=2, vert_stride=3),
        ),
        id="sequence-without-queries",
    ),
    # scale < 0 (the kernels negate q), scale 0 (uniform weights), a saturating scale, a tiny one.
    *[
        pytest.param(
            AttentionCase(
                seed=11,
                seq_lens=(70, 33),
                query_lens=(30, 33),
                num_heads=4,
                num_kv_heads=2,
                head_dim=60,
                page_size=16,
                dtype="float16",
                input_scale=5.0,
                scale=scale,
                layout=LayoutSpec(kind="local_strided", block_size=16, local_blocks=2, vert_stride=3),
            ),
            id=f"scale-{name}-D60-padded",
        )
        for name, scale in (("negative", -0.3), ("zero", 0.0), ("saturating", 32.0), ("tiny", 1e-30))
    ],
    # Tensor-parallel shards of the local-strided layout: this shard's heads are global heads
    # head_offset .., so its vertical columns are theirs (contract §2.1). A kernel that ignores the
    # offset attends head 0's columns.
    *[
        pytest.param(
            AttentionCase(
                seed=13,
                seq_lens=(150, 61),
                query_lens=(90, 61),
                num_heads=4,
                num_kv_heads=2,
                head_dim=32,
                page_size=8,
                dtype="float32",
                layout=LayoutSpec(
                    kind="local_strided",
                    block_size=8,
                    local_blocks=2,
                    vert_stride=vert_stride,
                    num_heads_total=total,
                    head_offset=offset,
                ),
            ),
            id=f"shard-offset{offset}-of{total}-stride{vert_stride}",
        )
        for total, offset, vert_stride in SHARDS
    ],
]


@pytest.mark.parametrize("case", NAMED)
def test_paged_prefill_named(run_case, case):
    run_case(case, decode=False, single=True, check_without_lse=True)


@pytest.mark.requires(validates=True)
@pytest.mark.parametrize(
    "entry", bad_inputs.entries("paged_prefill", bad_inputs.Rejected), ids=lambda e: e.id
)
def test_paged_prefill_bad_input(run_entry, entry):
    run_entry("paged_prefill", entry)


# Without the `context` capability the table's valid call has no cached context (harness/bad_inputs.py).
@pytest.mark.parametrize("entry", bad_inputs.entries("paged_prefill", bad_inputs.View), ids=lambda e: e.id)
def test_paged_prefill_non_contiguous(run_entry, entry):
    run_entry("paged_prefill", entry)


@pytest.mark.parametrize(
    "entry", bad_inputs.entries("paged_prefill", bad_inputs.NonFinite), ids=lambda e: e.id
)
def test_paged_prefill_non_finite(run_entry, entry):
    run_entry("paged_prefill", entry)


# GPU only: Phi-3-small shapes (32 query heads, 8 KV heads, D 128, S 64) up to 8k tokens, sparse and
# dense.
PHI3_GPU = [
    ("phi3-ctx0-q4096", 0, 4096),
    ("phi3-ctx4097-q4095-8k", 4097, 4095),
    ("phi3-ctx6143-q2049-8k", 6143, 2049),
]
PHI3_GPU_CASES = _cases(PHI3_GPU) + [
    pytest.param(dataclasses.replace(p.values[0], layout=LayoutSpec()), id=f"{p.id}-dense")
    for p in _cases(PHI3_GPU)
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PHI3_GPU_CASES)
def test_paged_prefill_phi3_small_gpu(run_case, case):
    run_case(case, decode=False, single=True)
