"""The operators accept the contract's calls; this repository's kernels have the oracle's exact
signatures (STYLE 2)."""

import inspect

import pytest

import kernels
import reference
from backends.registry import OPERATORS

# The calls the suite makes (contract §4): positional tensors, keyword-only options.
CALLS = {
    "write_kv": (5, {}),
    "paged_prefill": (6, {"scale": None, "layout": None, "return_lse": True}),
    "paged_decode": (5, {"scale": None, "layout": None, "return_lse": True}),
}


@pytest.mark.parametrize("operator", OPERATORS)
def test_operator_accepts_the_contract_calls(impl, operator):
    positional, keywords = CALLS[operator]
    if not impl.capabilities.lse:
        keywords = {k: v for k, v in keywords.items() if k != "return_lse"}
    inspect.signature(impl.op(operator)).bind(*range(positional), **keywords)


@pytest.mark.ours
@pytest.mark.parametrize("name", kernels.__all__)
def test_signature_matches_reference(name):
    assert inspect.signature(getattr(kernels, name)) == inspect.signature(getattr(reference, name))


@pytest.mark.ours
def test_public_names():
    assert set(OPERATORS) <= set(kernels.__all__)
