"""The decode oracle equals the prefill oracle with one query per sequence."""

import dataclasses

import torch
from hypothesis import given

import reference as ref
from harness.cases import DTYPES, build_inputs
from harness.strategies import attention_cases
from tests.budgets import examples

CPU = torch.device("cpu")


@examples(4)
@given(attention_cases(dtypes=tuple(DTYPES), decode=True, max_seqs=4, max_seq_len=96))
def test_paged_decode_equals_prefill_with_one_query(case):
    inputs = build_inputs(case, CPU)
    common = dict(scale=inputs["scale"], layout=inputs["layout"], return_lse=True)
    tables = (inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"], inputs["seq_lens"])
    out, lse = ref.paged_decode(*tables, **common)
    out2, lse2 = ref.paged_prefill(*tables, inputs["query_start_loc"], **common)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert out.dtype == inputs["q"].dtype and lse.dtype == torch.float32


@examples(4)
@given(attention_cases(dtypes=("float32",), decode=True, max_seqs=2, max_seq_len=64))
def test_paged_decode_without_lse(case):
    inputs = build_inputs(dataclasses.replace(case), CPU)
    args = (inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"], inputs["seq_lens"])
    out = ref.paged_decode(*args, scale=inputs["scale"], layout=inputs["layout"])
    assert isinstance(out, torch.Tensor) and out.shape == inputs["q"].shape
