"""No false alarms: correct kernels that round differently pass (contract §5's admissible family).

examples/rounding_family.py holds FlashAttention-style kernels in plain PyTorch that differ only in
rounding order: exp2 with the scale folded in, a fused s * c - m * c, reversed keys with l summed
from the rounded P, split-K partials, normalisation before P·V. Each must pass drawn cases and the
named regressions, prefill and decode; a verdict other than passed is a false alarm of the rule.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends import registry
from harness.judge import judge_attention
from harness.strategies import fuzz_attention_cases
from tests.budgets import examples
from tests.kernels import test_paged_decode, test_paged_prefill

MEMBERS = ("fa2", "fused_exp2", "split_k", "normalize_first")
NAMED_PREFILL = [
    *test_paged_prefill.NAMED,
    *test_paged_prefill._cases(test_paged_prefill.VLLM_REGRESSIONS),
    *test_paged_prefill.PAGE_BLOCK_PAIR_CASES,
]


def member(name: str):
    return registry.load(f"examples/rounding_family.py:{name}")


@pytest.mark.parametrize("name", MEMBERS)
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@examples(2)
@given(data=st.data())
def test_family_member_passes_drawn_cases(name, decode, data):
    case = data.draw(fuzz_attention_cases(decode=decode))
    verdict = judge_attention(member(name), case, decode=decode, device="cpu")
    assert verdict.passed, verdict.message


@pytest.mark.parametrize("name", MEMBERS)
def test_family_member_passes_the_named_cases(name):
    impl = member(name)
    for param in NAMED_PREFILL:
        verdict = judge_attention(impl, param.values[0], decode=False, device="cpu")
        assert verdict.passed, (param.id, verdict.message)
    for param in test_paged_decode.NAMED:
        verdict = judge_attention(impl, param.values[0], decode=True, device="cpu")
        assert verdict.passed, (param.id, verdict.message)
