"""`kernels.paged_prefill` against the float64 oracle with SPEC section 5's rule (out and lse)."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given

import kernels as tri
import reference as ref
from tests.bad_inputs import PREFILL_CASES, valid_prefill_args
from tests.kernels.record import record
from tests.oracle import oracle_and_base
from tests.strategies import DTYPES, KERNEL_DTYPES, AttentionCase, LayoutSpec, attention_cases, build_inputs
from tests.tolerance import assert_close

GPU = torch.cuda.is_available()
# The CPU interpreter costs ~5-8 ms per tile-loop iteration: small caps there.
CAPS = (
    dict(max_seqs=3, max_seq_len=512, max_heads=8) if GPU else dict(max_seqs=3, max_seq_len=96, max_heads=4)
)
PHI3 = LayoutSpec(kind="local_strided", block_size=64, local_blocks=16, vert_stride=8, num_heads_total=32)
# On the CPU the Phi-3 regression cases keep 2 of the 32 heads (a tensor-parallel shard at offset 4).
PHI3_HEADS = (32, 8) if GPU else (2, 1)


def run_and_check(case: AttentionCase, device, *, check_without_lse: bool = False) -> None:
    inputs = build_inputs(case, device)
    (ref_out, ref_lse), (base_out, base_lse) = oracle_and_base(inputs)
    args = [inputs[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc")]
    out, lse = tri.paged_prefill(*args, scale=inputs["scale"], layout=inputs["layout"], return_lse=True)
    dtype = DTYPES[case.dtype]
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    record("paged_prefill", case, assert_close("paged_prefill out", out, ref_out, base_out, dtype), "out")
    record("paged_prefill", case, assert_close("paged_prefill lse", lse, ref_lse, base_lse, dtype), "lse")
    if not check_without_lse:
        return
    # Without return_lse the same output comes back alone.
    alone = tri.paged_prefill(*args, scale=inputs["scale"], layout=inputs["layout"])
    assert torch.equal(alone, out)


@given(attention_cases(**CAPS, dtypes=KERNEL_DTYPES))
def test_paged_prefill(device, case):
    run_and_check(case, device)


@given(attention_cases(**CAPS, dtypes=KERNEL_DTYPES, layout_kinds=("local_strided",)))
def test_paged_prefill_local_strided(device, case):
    run_and_check(case, device)


@given(attention_cases(**CAPS, dtypes=KERNEL_DTYPES, layout_kinds=("block_mask",)))
def test_paged_prefill_block_mask(device, case):
    run_and_check(case, device)


def _phi3_case(context: int, query: int, dtype: str, page_size: int = 16, seed: int = 0) -> AttentionCase:
    heads, kv_heads = PHI3_HEADS
    layout = PHI3 if GPU else dataclasses.replace(PHI3, head_offset=4)
    return AttentionCase(
        seed=seed,
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


# vLLM's unmerged prefix-caching kernel zero-filled masked key slots and summed them into the softmax
# denominator whenever the cached context was not a multiple of the sparse block (64 here).
VLLM_REGRESSIONS = [
    pytest.param(16, 200, id="vllm-ctx16-q200-P16-S64-phi3"),
    pytest.param(1922, 598, id="vllm-ctx1922-q598-P16-S64-phi3"),
    pytest.param(0, 200, id="ctx0-q200-P16-S64-phi3"),
    pytest.param(64, 129, id="ctx64-aligned-q129-P16-S64-phi3"),
]


@pytest.mark.parametrize("context, query", VLLM_REGRESSIONS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_paged_prefill_vllm_regression(device, context, query, dtype):
    run_and_check(_phi3_case(context, query, dtype), device)


# Page size P and sparse block S are independent: every pair is supported (none raises), smaller,
# equal, larger and non-dividing in both directions, with a context aligned to neither.
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


@pytest.mark.parametrize(
    "page_size, block_size", [pytest.param(p, s, id=f"P{p}-S{s}") for p, s in PAGE_BLOCK_PAIRS]
)
@pytest.mark.parametrize("kind", ["local_strided", "block_mask"])
def test_paged_prefill_page_block_pairs(device, page_size, block_size, kind):
    layout = LayoutSpec(
        kind=kind, block_size=block_size, local_blocks=2, vert_stride=3, density=0.5, mask_seed=7
    )
    case = AttentionCase(
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
    run_and_check(case, device)


def test_paged_prefill_empty_rows(device):
    # Density 0: every row is empty -> out 0 and lse -inf, never NaN (and every element written).
    layout = LayoutSpec(kind="block_mask", block_size=16, density=0.0)
    case = AttentionCase(
        seed=3,
        seq_lens=(40, 7),
        query_lens=(25, 7),
        num_heads=2,
        num_kv_heads=1,
        head_dim=80,
        page_size=16,
        dtype="float32",
        layout=layout,
    )
    inputs = build_inputs(case, device)
    args = [inputs[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc")]
    out, lse = tri.paged_prefill(*args, layout=inputs["layout"], return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, -math.inf))
    run_and_check(case, device)


def test_paged_prefill_sequence_without_queries(device):
    # A sequence with no new token in the middle of a batch: its query range is empty.
    case = AttentionCase(
        seed=5,
        seq_lens=(20, 33, 9),
        query_lens=(20, 0, 4),
        num_heads=2,
        num_kv_heads=2,
        head_dim=32,
        page_size=4,
        dtype="float32",
        layout=LayoutSpec(kind="local_strided", block_size=4, local_blocks=2, vert_stride=3),
    )
    run_and_check(case, device, check_without_lse=True)


@pytest.mark.parametrize("name, mutate, error, text", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_paged_prefill_bad_input(device, name, mutate, error, text):
    for twin in (ref, tri):
        args = valid_prefill_args(device)
        mutate(args)
        with pytest.raises(error, match=text):
            twin.paged_prefill(**args)


# GPU only: Phi-3-small shapes (32 query heads, 8 KV heads, D 128, S 64) up to 8k tokens.
PHI3_GPU_CASES = [
    pytest.param(0, 4096, id="phi3-ctx0-q4096"),
    pytest.param(4097, 4095, id="phi3-ctx4097-q4095-8k"),
    pytest.param(6143, 2049, id="phi3-ctx6143-q2049-8k"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("context, query", PHI3_GPU_CASES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_paged_prefill_phi3_small_gpu(device, context, query, dtype):
    run_and_check(_phi3_case(context, query, dtype, seed=context + query), device)
    dense = dataclasses.replace(_phi3_case(context, query, dtype, seed=1), layout=LayoutSpec())
    run_and_check(dense, device)
