"""The oracle faces the whole edge-case table of contract §4 (harness/bad_inputs.py): it rejects bad
input, reads non-contiguous views correctly, and makes exactly the right rows NaN."""

import pytest
import torch

import reference as ref
from backends import registry
from harness import bad_inputs
from harness.bad_inputs import NonFinite, Rejected, View

CPU = torch.device("cpu")
OPS = ("paged_prefill", "paged_decode", "write_kv")
ORACLE = registry.load("reference")


def outcome(op, entry) -> str:
    """What the oracle did with the table entry: a passed verdict's message."""
    verdict = bad_inputs.check(op, entry, ORACLE, CPU)
    assert verdict.passed, verdict.message
    return verdict.message


def _cases(kind):
    return [pytest.param(op, e, id=f"{op}-{e.id}") for op in OPS for e in bad_inputs.entries(op, kind)]


def test_valid_calls_pass():
    for op in OPS:
        getattr(ref, op)(**bad_inputs.VALID_ARGS[op](CPU))


@pytest.mark.parametrize("op, entry", _cases(Rejected))
def test_bad_input_is_rejected(op, entry):
    args = bad_inputs.VALID_ARGS[op](CPU)
    before = args.get("k_cache").clone() if op == "write_kv" else None
    assert outcome(op, entry) == "rejected"
    if op == "write_kv":
        entry.mutate(args)
        with pytest.raises(entry.error):
            ref.write_kv(**args)
        cache = args["k_cache"]
        if cache.shape == before.shape and cache.device == before.device and not cache.stride().count(0):
            assert torch.equal(cache, before), "a rejected write must leave the cache untouched"


@pytest.mark.parametrize("op, entry", _cases(View))
def test_non_contiguous_views_give_the_contiguous_result(op, entry):
    assert outcome(op, entry) == "same"


@pytest.mark.parametrize("op, entry", [p for p in _cases(NonFinite) if p.values[0] != "write_kv"])
def test_non_finite_rows_are_exactly_those_that_see_it(op, entry):
    args = bad_inputs.VALID_ARGS[op](CPU)
    clean_out, clean_lse = getattr(ref, op)(**args, return_lse=True)
    entry.mutate(args)
    out, lse = getattr(ref, op)(**args, return_lse=True)
    assert bad_inputs.nan_rows(out, lse) == entry.nan_rows
    # Every other row is exactly the clean call's: the planted value never leaks into it.
    keep = ~torch.isnan(lse)
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])
    assert outcome(op, entry) == "judged"


@pytest.mark.parametrize("op, entry", [p for p in _cases(NonFinite) if p.values[0] == "write_kv"])
def test_write_kv_copies_non_finite_values(op, entry):
    assert outcome(op, entry) == "judged"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device metadata: the host copy is kept")
def test_metadata_modified_in_place_is_validated_again():
    """Validation keeps its last host copy of the metadata (one layout's plan and the next share it),
    but never for tensors written in place since."""
    args = bad_inputs.valid_prefill_args(torch.device("cuda"))
    ref.plan_prefill(**args)
    ref.plan_prefill(**args)  # the kept copy
    args["seq_lens"].fill_(10**6)  # now past what the block tables hold
    with pytest.raises(ValueError, match="block_tables"):
        ref.plan_prefill(**args)
