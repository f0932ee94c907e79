"""Fixtures of the operator tests, which run against the implementation under test (`--backend`).

- NaN poisoning (STYLE 15): outputs the implementation allocates start as NaN, so an unwritten one
  fails (harness/poison.py).
- `run_case(case, decode=...)`: the one run-and-judge step (harness/judge.py) plus the error-ratio log
  (harness/stats_log.py) and the failed / unsupported accounting of `expect`.
"""

import pytest

from harness.judge import judge_attention
from harness.poison import poison_allocations
from harness.stats_log import record


@pytest.fixture(autouse=True)
def nan_poisoning(impl):
    with poison_allocations(impl.sources):
        yield


@pytest.fixture
def run_case(impl, device, expect):
    def run(case, *, decode: bool, single: bool = False, check_without_lse: bool = False):
        verdict = judge_attention(
            impl, case, decode=decode, device=device, check_without_lse=check_without_lse
        )
        record("paged_decode" if decode else "paged_prefill", case, verdict)
        expect(verdict, single=single)
        return verdict

    return run
