"""Fixtures of the operator tests, which run against the implementation under test (`--backend`).

- `run_case(case, decode=...)`: the one run-and-judge step (harness/judge.py, which also NaN-poisons
  the implementation's fresh allocations) under the in-flight record of harness/isolation.py, plus
  the error-ratio log (harness/stats_log.py) and the accounting of `expect`.
- `run_entry(op, entry)`: one entry of the edge-case table (harness/bad_inputs.py), likewise.
"""

import pytest

from harness import bad_inputs
from harness.judge import judge_attention
from harness.stats_log import record


@pytest.fixture
def run_case(impl, device, expect, in_flight):
    def run(case, *, decode: bool, single: bool = False, check_without_lse: bool = False, inputs=None):
        with in_flight("decode" if decode else "prefill", case):
            verdict = judge_attention(
                impl, case, decode=decode, device=device, inputs=inputs, check_without_lse=check_without_lse
            )
        record("paged_decode" if decode else "paged_prefill", case, verdict)
        expect(verdict, single=single)
        return verdict

    return run


@pytest.fixture
def run_entry(impl, device, expect, in_flight):
    def run(op: str, entry):
        with in_flight():
            verdict = bad_inputs.check(op, entry, impl, device)
        expect(verdict, single=True)
        return verdict

    return run
