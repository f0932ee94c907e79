"""Engine properties over random request streams (contract §4.1 and 6).

Cold-vs-warm equivalence: a stream runs with prefix caching and without, and the two runs are judged
by the one rule of harness/engine_check.py (also the fuzz campaign's engine target): per request,
every generated step's logits pass contract §5's rule against the uncached run with `base` equal to
it (the float32 floor), greedy tokens are identical wherever the uncached top-2 logit gap exceeds
that allowance, the comparison of a request stops at its first legitimate divergence, and the
uncached run reports no cached tokens.

`num_cached_tokens` is predicted by running the same stream on the same scheduler with the block
pool replaced by the reference model (`ModelPool`): page ids, schedules and hence outputs must agree
exactly, and the counters too.
"""

import pytest
import torch
from hypothesis import event, given

from engine import LLM, RequestOutput, SamplingParams, block_pool
from harness.cases import EngineRequest, EngineStream
from harness.engine_check import compare_cold_warm
from harness.strategies import request_streams
from tests.budgets import examples
from tests.engine.test_block_pool import ModelPool

MAX_STEPS = 20_000


def make_llm(stream: EngineStream, *, backend="reference", caching=True, budget=None, **options) -> LLM:
    return LLM(
        "tiny",
        page_size=stream.page_size,
        num_pages=stream.num_pages,
        enable_prefix_caching=caching,
        backend=backend,
        max_num_batched_tokens=budget or stream.max_num_batched_tokens,
        max_num_seqs=stream.max_num_seqs,
        record_logits=True,
        dtype="float32",  # the equivalence tolerance is float32's
        **options,
    )


def check_engine_state(llm: LLM) -> None:
    """Pool invariants; every request in exactly one queue; keyed pages only shared within a salt."""
    llm.pool.check_invariants()
    waiting, running = list(llm.scheduler.waiting), llm.scheduler.running
    ids = [s.seq_id for s in waiting + running]
    assert len(ids) == len(set(ids))
    assert all(not s.block_table for s in waiting)
    for seq in running:
        assert len(seq.block_table) * llm.config.page_size >= seq.num_computed_tokens
        for page_id in seq.block_table:
            key = getattr(llm.pool.pages[page_id], "key", None) if hasattr(llm.pool, "pages") else None
            if key is not None:
                node = key.node
                while node.parent is not None:
                    node = node.parent
                assert node.extra_keys == (seq.cache_salt,), "a page crossed cache salts"


def run_stream(llm: LLM, stream: EngineStream) -> list[RequestOutput]:
    """Feeds the stream (arrivals between steps); returns outputs in request order."""
    ids, outputs = [], {}

    def step():
        for out in llm.step():
            assert out.request_id not in outputs, "a request was answered twice"
            outputs[out.request_id] = out
        check_engine_state(llm)

    for r in stream.requests:
        for _ in range(r.arrival_steps):
            if llm.has_unfinished():
                step()
        ids.append(llm.add_request(list(r.prompt), SamplingParams(max_tokens=r.max_tokens), r.cache_salt))
    for _ in range(MAX_STEPS):
        if not llm.has_unfinished():
            break
        step()
    assert sorted(outputs) == sorted(ids), "a request was lost"
    for r, i in zip(stream.requests, ids, strict=True):
        assert len(outputs[i].token_ids) == r.max_tokens
    return [outputs[i] for i in ids]


def assert_equivalent(warm: list[RequestOutput], cold: list[RequestOutput]) -> int:
    """The cold-vs-warm rule of harness/engine_check.py. Returns the number of steps compared."""
    result = compare_cold_warm(cold, warm)
    assert result.equivalent, result.problem
    return result.compared


# The reference backend is cheap (~0.2 s a stream): the profile's full budget.
@examples(1)
@given(stream=request_streams())
def test_generate_cached_equals_uncached(stream):
    warm_llm = make_llm(stream)
    warm = run_stream(warm_llm, stream)
    event(f"prefix_cache_hits > 0: {warm_llm.stats()['prefix_cache_hits'] > 0}")
    cold_llm = make_llm(stream, caching=False)
    cold = run_stream(cold_llm, stream)
    assert all(o.num_cached_tokens == 0 for o in cold) and cold_llm.stats()["prefix_cache_hits"] == 0
    assert assert_equivalent(warm, cold) >= len(stream.requests)


@examples(1)
@given(stream=request_streams())
def test_generate_num_cached_tokens_matches_reference_model(stream):
    stats = check_against_reference_model(stream)
    for name in ("prefix_cache_hits", "evictions", "preemptions"):
        event(f"{name} > 0: {stats[name] > 0}")  # --hypothesis-show-statistics: not vacuous


def check_against_reference_model(stream: EngineStream) -> dict:
    """Same stream, same scheduler, pool replaced by the reference model: all must agree exactly."""
    llm = make_llm(stream)
    warm = run_stream(llm, stream)
    modeled = make_llm(stream)
    modeled.pool = modeled.scheduler.pool = ModelPool(stream.num_pages, stream.page_size)
    predicted = run_stream(modeled, stream)
    stats = llm.stats()
    assert [o.num_cached_tokens for o in warm] == [o.num_cached_tokens for o in predicted]
    assert [o.token_ids for o in warm] == [o.token_ids for o in predicted]
    for w, p in zip(warm, predicted, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(w.logits, p.logits, strict=True))
    assert stats == modeled.stats()
    return stats


# The interpreter costs ~0.3-1 s an engine step: few (5 under the ci profile), small streams.
TRITON_STREAMS = request_streams(
    max_requests=3,
    max_prompt_len=40,
    max_new_tokens=2,
    page_sizes=(16,),
    budgets=(512, 16),
    spare_pages=(1, 64),
)


@examples(0.09)
@given(stream=TRITON_STREAMS)
def test_generate_cached_equals_uncached_triton(stream):
    warm_llm = make_llm(stream, backend="triton")
    warm = run_stream(warm_llm, stream)
    event(f"prefix_cache_hits > 0: {warm_llm.stats()['prefix_cache_hits'] > 0}")
    assert_equivalent(warm, run_stream(make_llm(stream, backend="triton", caching=False), stream))


PREAMBLE = [(7 * i + 3) % 128 for i in range(40)]  # an instruction preamble of 2.5 pages


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_generate_preamble_hits_without_hint(backend):
    options = dict(backend=backend, num_pages=32, record_logits=True, dtype="float32")
    llm = LLM("tiny", **options)
    first = llm.generate([PREAMBLE + [1, 2, 3]], SamplingParams(max_tokens=3))
    second = llm.generate([PREAMBLE + [9, 8]], SamplingParams(max_tokens=3))
    assert first[0].num_cached_tokens == 0
    assert second[0].num_cached_tokens == 32  # two full pages of the preamble; no hint passed
    assert llm.stats()["prefix_cache_hits"] == 32
    cold = LLM("tiny", enable_prefix_caching=False, **options)
    assert_equivalent(second, cold.generate([PREAMBLE + [9, 8]], SamplingParams(max_tokens=3)))


def _pressure_stream(page_size=8) -> EngineStream:
    shared = PREAMBLE[:24]
    prompts = [shared + [i] * (10 + 7 * i) for i in range(4)] + [PREAMBLE, shared + [0] * 10]
    requests = tuple(EngineRequest(tuple(p), 6, None, 1) for p in prompts)
    need = max(-(-(len(r.prompt) + r.max_tokens - 1) // page_size) for r in requests)
    return EngineStream(requests, page_size, need + 2, 16, 4)


def test_generate_under_memory_pressure():
    """Chunked prefill, preemption by recompute and eviction all happen; outputs stay equal."""
    stream = _pressure_stream()
    llm = make_llm(stream)
    warm = run_stream(llm, stream)
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["evictions"] > 0 and stats["prefix_cache_hits"] > 0
    assert any(o.num_preemptions for o in warm)
    assert_equivalent(warm, run_stream(make_llm(stream, caching=False, budget=512), stream))
    assert check_against_reference_model(stream) == stats


def test_generate_cache_salt_never_shares():
    llm = LLM("tiny", num_pages=32)
    params = SamplingParams(max_tokens=2)
    got = [llm.generate([PREAMBLE], params, cache_salt=s)[0].num_cached_tokens for s in ("a", "b", None, "a")]
    assert got == [0, 0, 0, 32]


def test_generate_forced_hash_collision(monkeypatch):
    """Every page hashes alike: the token check rejects the false hits and outputs stay correct."""
    monkeypatch.setattr(block_pool, "page_digest", lambda parent, encoded: b"\x5a" * 32)
    prompts = [[5] * 40, [5] * 56, [6] * 16 + [5] * 30, PREAMBLE]
    stream = EngineStream(tuple(EngineRequest(tuple(p), 3, None, 40) for p in prompts), 8, 64, 512, 4)
    llm = make_llm(stream)
    warm = run_stream(llm, stream)
    assert llm.stats()["hash_collisions"] > 0
    assert warm[1].num_cached_tokens == 8  # the one true hit: [5]*8 at page 0
    assert_equivalent(warm, run_stream(make_llm(stream, caching=False), stream))


@pytest.mark.parametrize(
    "prompts, params, error",
    [
        pytest.param([[]], SamplingParams(), ValueError, id="empty-prompt"),
        pytest.param([[1, 128]], SamplingParams(), ValueError, id="token-past-vocab"),
        pytest.param([[1, -1]], SamplingParams(), ValueError, id="negative-token"),
        pytest.param([[1, 2.0]], SamplingParams(), TypeError, id="float-token"),
        pytest.param([[1, True]], SamplingParams(), TypeError, id="bool-token"),
        pytest.param([[1, 2**64]], SamplingParams(), ValueError, id="token-past-int64"),
        pytest.param([[1, 2**63]], SamplingParams(), ValueError, id="token-past-int64-fits-uint64"),
        pytest.param([[1, -(2**70)]], SamplingParams(), ValueError, id="negative-token-past-int64"),
        pytest.param([[1, 2], [3] * 300], SamplingParams(), ValueError, id="larger-than-cache"),
        pytest.param([[1, 2]], SamplingParams(max_tokens=300), ValueError, id="output-larger-than-cache"),
        pytest.param("abc", SamplingParams(), TypeError, id="prompts-not-a-list"),
        pytest.param([[1]], {"max_tokens": 3}, TypeError, id="params-not-samplingparams"),
    ],
)
def test_generate_bad_input_leaves_engine_usable(prompts, params, error):
    llm = LLM("tiny", num_pages=16)
    good = llm.generate([PREAMBLE[:20]], SamplingParams(max_tokens=3))
    with pytest.raises(error):
        llm.generate(prompts, params)
    assert not llm.has_unfinished() and llm.pool.num_free_pages == 16
    again = llm.generate([PREAMBLE[:20]], SamplingParams(max_tokens=3))
    assert again[0].token_ids == good[0].token_ids and again[0].num_cached_tokens == 16


@pytest.mark.parametrize(
    "kwargs, error",
    [
        pytest.param(dict(max_tokens=0), ValueError, id="max-tokens-0"),
        pytest.param(dict(max_tokens=True), TypeError, id="max-tokens-bool"),
        pytest.param(dict(temperature=-1.0), ValueError, id="negative-temperature"),
    ],
)
def test_sampling_params_errors(kwargs, error):
    with pytest.raises(error):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        pytest.param(dict(model="huge"), ValueError, id="unknown-model"),
        pytest.param(dict(backend="cuda"), ValueError, id="unknown-backend"),
        pytest.param(dict(page_size=0), ValueError, id="page-size-0"),
        pytest.param(dict(num_pages=2.5), TypeError, id="num-pages-float"),
        pytest.param(dict(max_num_batched_tokens=0), ValueError, id="budget-0"),
        pytest.param(dict(enable_prefix_caching="yes"), TypeError, id="caching-not-bool"),
        pytest.param(dict(dtype="int8"), ValueError, id="bad-dtype"),
    ],
)
def test_llm_config_errors(kwargs, error):
    with pytest.raises(error):
        LLM(**kwargs)


def test_reset_prefix_cache():
    llm = LLM("tiny", num_pages=32)
    params = SamplingParams(max_tokens=2)
    llm.generate([PREAMBLE], params)
    rid = llm.add_request(PREAMBLE, params)
    llm.step()
    assert llm.reset_prefix_cache() is False  # a request holds pages
    while llm.has_unfinished():
        llm.step()
    assert llm.take_output(rid).num_cached_tokens == 32
    assert llm.reset_prefix_cache() is True
    assert llm.stats()["cached_pages"] == 0
    assert llm.generate([PREAMBLE], params)[0].num_cached_tokens == 0


def test_generate_temperature_is_seeded():
    params = SamplingParams(max_tokens=5, temperature=1.0)
    a = LLM("tiny", num_pages=16, seed=3).generate([PREAMBLE[:10]], params)
    b = LLM("tiny", num_pages=16, seed=3).generate([PREAMBLE[:10]], params)
    assert a[0].token_ids == b[0].token_ids and len(a[0].logprobs) == 5


def test_batched_sampling_equals_row_by_row():
    """A step's greedy rows are sampled together (one device read) and its other rows one by one from
    the runner's generator: the same tokens and logprobs as a per-row argmax and draws in row order."""
    runner = LLM("tiny", backend="reference", num_pages=8, seed=3).runner
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, runner.args.vocab_size, generator=gen).to(runner.device) * 4
    temperatures = [0.0, 0.7, 0.0, 0.0, 1.3, 0.0]
    draws = torch.Generator(device=runner.device).manual_seed(11)
    want = []
    for row, t in zip(logits, temperatures, strict=True):
        logprobs = torch.log_softmax(row / (t or 1.0), dim=-1)
        token = (
            int(torch.argmax(row)) if t == 0.0 else int(torch.multinomial(logprobs.exp(), 1, generator=draws))
        )
        want.append((token, float(logprobs[token])))
    runner.generator.manual_seed(11)
    got = [(s.token_id, s.logprob) for s in runner._sample(logits, temperatures)]
    assert got == want
