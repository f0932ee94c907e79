"""The operators accept the contract's calls; this repository's kernels have the oracle's exact
signatures (STYLE 2); NaN poisoning reaches the implementation's own code only."""

import inspect
import pathlib

import pytest
import torch

import kernels
import reference
from harness.poison import poison_allocations
from harness.registry import OPERATORS

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


def test_nan_poisoning_scope(impl):
    # Code compiled under a file name inside the implementation's sources gets NaN; the test's own
    # allocations do not.
    if not impl.sources:
        pytest.skip(f"{impl.name}: no source location known")
    root = pathlib.Path(impl.sources[0])
    probe = root / "_poison_probe.py" if root.is_dir() else root
    ns = {"torch": torch}
    code = "a = torch.empty(8); b = torch.empty_like(a); c = a.new_empty(3)"
    with poison_allocations(impl.sources):
        exec(compile(code, str(probe), "exec"), ns)
        mine = torch.empty(1024)
    assert all(ns[k].isnan().all() for k in "abc")
    assert not mine.isnan().all(), "an allocation of the test itself was poisoned"
