"""`kernels.paged_decode` against the float64 oracle with SPEC section 5's rule (out and lse)."""

import math

import pytest
import torch
from hypothesis import given

import kernels as tri
import reference as ref
from tests.bad_inputs import DECODE_CASES, valid_decode_args
from tests.kernels.record import record
from tests.oracle import oracle_and_base
from tests.strategies import DTYPES, KERNEL_DTYPES, AttentionCase, LayoutSpec, attention_cases, build_inputs
from tests.tolerance import assert_close

GPU = torch.cuda.is_available()
CAPS = (
    dict(max_seqs=8, max_seq_len=2048, max_heads=8) if GPU else dict(max_seqs=3, max_seq_len=96, max_heads=4)
)


def run_and_check(case: AttentionCase, device, *, check_without_lse: bool = False) -> None:
    inputs = build_inputs(case, device)
    (ref_out, ref_lse), (base_out, base_lse) = oracle_and_base(inputs)
    args = [inputs[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens")]
    out, lse = tri.paged_decode(*args, scale=inputs["scale"], layout=inputs["layout"], return_lse=True)
    dtype = DTYPES[case.dtype]
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    record("paged_decode", case, assert_close("paged_decode out", out, ref_out, base_out, dtype), "out")
    record("paged_decode", case, assert_close("paged_decode lse", lse, ref_lse, base_lse, dtype), "lse")
    if not check_without_lse:
        return
    # Without return_lse the same output comes back alone.
    alone = tri.paged_decode(*args, scale=inputs["scale"], layout=inputs["layout"])
    assert torch.equal(alone, out)


@given(attention_cases(**CAPS, dtypes=KERNEL_DTYPES, decode=True))
def test_paged_decode(device, case):
    run_and_check(case, device)


@given(
    attention_cases(**CAPS, dtypes=KERNEL_DTYPES, decode=True, layout_kinds=("local_strided", "block_mask"))
)
def test_paged_decode_sparse(device, case):
    run_and_check(case, device)


DENSE = LayoutSpec()


def _case(seq_lens, layout=DENSE, dtype="float32", page_size=16, heads=(8, 2), head_dim=128):
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
]


@pytest.mark.parametrize("case", NAMED)
def test_paged_decode_named(device, case):
    run_and_check(case, device, check_without_lse=True)


def test_paged_decode_all_rows_empty_exact(device):
    inputs = build_inputs(_case((7, 40), LayoutSpec("block_mask", 4, density=0.0), heads=(4, 2)), device)
    args = [inputs[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens")]
    out, lse = tri.paged_decode(*args, layout=inputs["layout"], return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, -math.inf))


@pytest.mark.parametrize("name, mutate, error, text", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_paged_decode_bad_input(device, name, mutate, error, text):
    for twin in (ref, tri):
        args = valid_decode_args(device)
        mutate(args)
        with pytest.raises(error, match=text):
            twin.paged_decode(**args)


# GPU only: Phi-3-small decode (32 query heads, 8 KV heads, D 128) at 8k context, sparse and dense.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(
    "layout",
    [LayoutSpec(), LayoutSpec("local_strided", 64, 16, 8, num_heads_total=32)],
    ids=["dense", "phi3"],
)
def test_paged_decode_phi3_small_gpu(device, dtype, layout):
    run_and_check(_case((8192, 8191, 1, 4097), layout, dtype, heads=(32, 8)), device)
