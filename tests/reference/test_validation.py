"""Every bad-input class of SPEC section 4 raises the right error in the oracle."""

import pytest
import torch

import reference as ref
from tests.bad_inputs import (
    DECODE_CASES,
    PREFILL_CASES,
    WRITE_KV_CASES,
    valid_decode_args,
    valid_prefill_args,
    valid_write_kv_args,
)

CPU = torch.device("cpu")


def _ids(cases):
    return [c[0] for c in cases]


def test_valid_calls_pass():
    ref.paged_prefill(**valid_prefill_args(CPU))
    ref.paged_decode(**valid_decode_args(CPU))
    ref.write_kv(**valid_write_kv_args(CPU))


@pytest.mark.parametrize("name, mutate, error, text", PREFILL_CASES, ids=_ids(PREFILL_CASES))
def test_paged_prefill_bad_input(name, mutate, error, text):
    args = valid_prefill_args(CPU)
    mutate(args)
    with pytest.raises(error, match=text):
        ref.paged_prefill(**args)


@pytest.mark.parametrize("name, mutate, error, text", DECODE_CASES, ids=_ids(DECODE_CASES))
def test_paged_decode_bad_input(name, mutate, error, text):
    args = valid_decode_args(CPU)
    mutate(args)
    with pytest.raises(error, match=text):
        ref.paged_decode(**args)


@pytest.mark.parametrize("name, mutate, error, text", WRITE_KV_CASES, ids=_ids(WRITE_KV_CASES))
def test_write_kv_bad_input(name, mutate, error, text):
    args = valid_write_kv_args(CPU)
    before = args["k_cache"].clone() if isinstance(args["k_cache"], torch.Tensor) else None
    mutate(args)
    with pytest.raises(error, match=text):
        ref.write_kv(**args)
    if (
        before is not None
        and args["k_cache"].shape == before.shape
        and args["k_cache"].device == before.device
    ):
        assert torch.equal(args["k_cache"], before), "a rejected write must leave the cache untouched"
