"""The campaign's engine target (fuzz/engine_target.py): it catches a block pool that breaks contract
§6's eviction order and an implementation whose cached-context prefill drifts (cold vs warm, by
harness/engine_check.py, whose rule is pinned here too), and it refuses implementations that cannot
serve the engine."""

from types import SimpleNamespace

import pytest
import torch

from backends import registry
from fuzz.engine_target import EngineTarget
from harness.engine_check import compare_cold_warm
from tests.fuzz.implementations import named


def test_engine_target_catches_a_pool_that_frees_head_first(run_worker, monkeypatch):
    from engine.block_pool import BlockPool

    def free_head_first(self, block_table):
        for page_id in block_table:  # the bug: contract §6 frees the tail first
            self.pages[page_id].ref_count -= 1
            if self.pages[page_id].ref_count == 0:
                self.lru[page_id] = None

    monkeypatch.setattr(BlockPool, "free", free_head_first)
    # In this process: a child would not see the patch.
    [(_, failure)] = run_worker("reference", ["engine"], in_process=True).of("failure")
    assert "block pool vs model" in failure["message"]


def test_engine_target_catches_a_warm_run_that_differs(run_worker):
    [(_, failure)] = run_worker(named("CONTEXT_DRIFT"), ["engine"]).of("failure")
    assert failure["message"].startswith("cold vs warm") and "logits differ" in failure["message"]


@pytest.mark.parametrize(
    "name, why",
    [
        pytest.param(named("HEAD_ONE_ZEROED"), "provides no write_kv, paged_decode", id="missing-operators"),
        pytest.param(named("NARROW"), "float32", id="undeclared-dtype"),
        pytest.param("sdpa", "provides no write_kv", id="sdpa"),
    ],
)
def test_engine_target_refuses_what_cannot_serve_the_engine(name, why):
    assert why in EngineTarget().refusal(registry.load(name))


def test_engine_target_accepts_the_oracle():
    assert EngineTarget().refusal(registry.load("reference")) is None


def _output(tokens, logits, cached=0):
    return SimpleNamespace(
        token_ids=list(tokens), logits=[torch.tensor(x) for x in logits], num_cached_tokens=cached
    )


LOGITS = [[2.0, 1.0, 0.0], [0.5, 3.0, 1.0], [1.0, 0.0, 4.0]]
NEAR_TIE = [[1.0, 1.0, 0.0]]  # top-2 gap 0: within any allowance


@pytest.mark.parametrize(
    "cold, warm, compared, problem",
    [
        pytest.param(_output([0, 1, 2], LOGITS), _output([0, 1, 2], LOGITS), 3, "", id="equal"),
        pytest.param(
            _output([0, 1, 2], LOGITS),
            _output([0, 1, 2], [LOGITS[0], [0.5, 3.001, 1.0], LOGITS[2]]),
            2,
            "step 1: logits differ",
            id="logits-beyond-the-float32-floor",
        ),
        pytest.param(
            _output([0, 5, 5], NEAR_TIE + LOGITS[1:]),
            _output([1, 7], NEAR_TIE + [[9.0, 9.0, 9.0]]),
            1,
            "",
            id="near-tie-divergence-stops-the-comparison",
        ),
        pytest.param(
            _output([0, 1, 2], LOGITS),
            _output([1, 1, 2], LOGITS),
            1,
            "step 0: tokens 0 (cold) vs 1",
            id="tokens",
        ),
        pytest.param(
            _output([0, 1, 2], LOGITS, cached=4),
            _output([0, 1, 2], LOGITS),
            0,
            "cold run reports 4",
            id="cold-hit",
        ),
        pytest.param(
            _output([0, 1, 2], LOGITS),
            _output([0, 1], LOGITS[:2]),
            2,
            "3 cold vs 2 warm tokens",
            id="lengths",
        ),
    ],
)
def test_engine_target_rule_is_harness_engine_check(cold, warm, compared, problem):
    result = compare_cold_warm([cold], [warm])
    assert result.compared == compared
    assert (problem in result.problem) if problem else result.equivalent, result.problem
