"""`write_kv` of the implementation under test against the oracle: an exact scatter (bit for bit)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import bad_inputs
from harness.cases import write_kv_case_inputs
from harness.judge import judge_write_kv
from harness.strategies import write_kv_cases

pytestmark = pytest.mark.operator("write_kv")


@given(data=st.data())
def test_write_kv(impl, device, expect, in_flight, data):
    case = data.draw(write_kv_cases(caps=impl.capabilities))
    with in_flight():
        verdict = judge_write_kv(impl, write_kv_case_inputs(case, device), case)
    expect(verdict)


@pytest.mark.requires(validates=True)
@pytest.mark.parametrize("entry", bad_inputs.entries("write_kv", bad_inputs.Rejected), ids=lambda e: e.id)
def test_write_kv_bad_input(run_entry, entry):
    run_entry("write_kv", entry)


@pytest.mark.parametrize("entry", bad_inputs.entries("write_kv", bad_inputs.View), ids=lambda e: e.id)
def test_write_kv_non_contiguous(run_entry, entry):
    run_entry("write_kv", entry)


@pytest.mark.parametrize("entry", bad_inputs.entries("write_kv", bad_inputs.NonFinite), ids=lambda e: e.id)
def test_write_kv_non_finite(run_entry, entry):
    run_entry("write_kv", entry)
