"""engine/blas_choice.py: each token bucket's libraries and the buckets kept, from timings; and the graphs
that take them (the stand-in capture without a GPU: there `linear` is torch's product whatever the
choice, so these tests check which buckets and libraries the graphs were captured with)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine import LLM, SamplingParams, blas_choice
from engine.blas_choice import LIBRARIES, MARGIN, WEIGHTS, calibrate, choosing, fastest, kept_buckets
from engine.cuda_graphs import StepGraphs, rerun_capture
from tests.budgets import examples
from tests.engine.test_engine import assert_equivalent


def test_fastest_takes_another_library_only_by_the_margin():
    default, other = LIBRARIES
    assert fastest({default: 10.0, other: 10.0 * (1 - MARGIN) - 1e-6}) == other
    assert fastest({default: 10.0, other: 10.0 * (1 - MARGIN) + 1e-6}) == default
    assert fastest({default: 10.0, other: 12.0}) == default


@examples(4)
@given(costs=st.dictionaries(st.integers(1, 64), st.floats(0.5, 2.0), min_size=1, max_size=12))
def test_kept_buckets_are_those_no_larger_bucket_undercuts(costs):
    kept = kept_buckets(costs)
    assert kept == sorted(set(kept)) and max(costs) in kept
    for bucket in costs:
        undercut = any(costs[u] < costs[bucket] * (1 - MARGIN) for u in costs if u > bucket)
        assert (bucket not in kept) == undercut, (bucket, kept)


def test_calibrate_chooses_by_weight_and_drops_undercut_buckets():
    default, other = LIBRARIES
    times = {  # rows -> weight -> library -> µs
        16: {"qkv": {default: 5.0, other: 4.0}, "up": {default: 9.0, other: 9.0}},
        32: {"qkv": {default: 4.0, other: 6.0}, "up": {default: 8.0, other: 3.0}},
        48: {"qkv": {default: 6.0, other: 6.0}, "up": {default: 9.0, other: 9.0}},
    }
    kept, choices = calibrate([16, 32, 48], times.__getitem__)
    assert choices == {
        16: {"qkv": other, "up": default},
        32: {"qkv": default, "up": other},
        48: {"qkv": default, "up": default},
    }
    assert kept == [32, 48]  # 16 costs 4 + 9, 32 costs 4 + 3


def test_calibrated_measures_once_a_process_for_each_model_shape(monkeypatch):
    """The first call with a key times every bucket; later calls with that key and buckets time nothing
    and give the same result, whatever the caller did with an earlier one; another key times again."""
    monkeypatch.setattr(blas_choice, "_calibrations", {})
    default, other = LIBRARIES
    timed = []

    def timer(rows):
        timed.append(rows)
        return {"qkv": {default: 2.0, other: 1.0 if len(timed) % 2 else 3.0}}

    want = ([16, 32], {16: {"qkv": other}, 32: {"qkv": default}})
    first = blas_choice.calibrated(("a",), [16, 32], timer)
    assert timed == [16, 32] and first == want
    first[0].clear()
    first[1][16]["qkv"] = "mkl"
    assert blas_choice.calibrated(("a",), [16, 32], timer) == want
    assert timed == [16, 32]
    blas_choice.calibrated(("b",), [16, 32], timer)
    assert timed == [16, 32, 16, 32]


def test_shape_key_names_what_the_timings_depend_on():
    layer = torch.nn.Module()
    for name, shape in zip(WEIGHTS, [(12, 4), (4, 4), (8, 4), (4, 8)], strict=True):
        setattr(layer, name, torch.nn.Linear(shape[1], shape[0], bias=False))
    key = blas_choice.shape_key([layer] * 3)
    assert key == ("cpu", torch.float32, ((12, 4), (4, 4), (8, 4), (4, 8)), 3)
    assert blas_choice.shape_key([layer] * 20)[-1] == blas_choice.TIMED_LAYERS


def test_choosing_sets_and_restores_the_libraries():
    with choosing({"qkv": LIBRARIES[1]}):
        assert blas_choice._chosen == {"qkv": LIBRARIES[1]}
        with choosing({}):
            assert blas_choice._chosen == {}
        assert blas_choice._chosen == {"qkv": LIBRARIES[1]}
    assert blas_choice._chosen == {}
    with pytest.raises(ValueError, match="libraries must be among"), choosing({"qkv": "mkl"}):
        pass


def test_linear_is_the_product_through_any_library():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, w = torch.randn(208, 256, device=device, dtype=dtype), torch.randn(96, 256, device=device, dtype=dtype)
    want = x.double() @ w.double().t()
    # The inputs are exact in float64: the error is float32 accumulation over K products (K unit
    # roundoffs of the absolute sum) plus the result's rounding to its dtype (one unit roundoff, doubled).
    roundoff = torch.finfo(dtype).eps / 2
    bound = 2 * roundoff * want.abs() + 256 * torch.finfo(torch.float32).eps / 2 * (
        x.double().abs() @ w.double().abs().t()
    )
    for library in LIBRARIES:
        with choosing({"up": library}):
            got = blas_choice.linear(x, w, "up")
        assert got.shape == (208, 96) and got.dtype == dtype
        assert ((got.double() - want).abs() <= bound).all(), library


@pytest.mark.parametrize("whole_prefill", [True, False])
def test_graphs_take_the_calibrated_buckets_and_libraries(monkeypatch, whole_prefill):
    """A timer under which bucket 16 costs more than 32, and `up` runs faster through the second library:
    a 10-token prompt takes bucket 32's graphs, captured with `up` through that library and every other
    weight through the default, and its results are the eager run's."""
    default, other = LIBRARIES

    def timer(rows):
        times = {name: {default: 1.0, other: 1.0} for name in WEIGHTS}
        times["up"][other] = 0.5
        if rows == 16:
            times["qkv"] = {default: 4.0, other: 4.0}
        return times

    seen = set()  # (weight, library) of the products made under a bucket's choice
    linear = blas_choice.linear

    def spied(x, weight, name):
        if blas_choice._chosen:
            seen.add((name, blas_choice._chosen.get(name)))
        return linear(x, weight, name)

    monkeypatch.setattr(blas_choice, "linear", spied)
    options = dict(backend="triton", num_pages=16, page_size=8, max_num_batched_tokens=40, dtype="float32")
    params = SamplingParams(max_tokens=2)
    llm = LLM("tiny", record_logits=True, **options)
    llm.runner.graphs = graphs = StepGraphs(
        llm.runner, whole_decode=True, capture=rerun_capture, whole_prefill=whole_prefill, timer=timer
    )
    eager = LLM("tiny", enforce_eager=True, record_logits=True, **options)
    assert_equivalent(llm.generate([[3] * 10], params), eager.generate([[3] * 10], params))
    assert graphs.token_buckets == [32, 40]
    assert sorted(graphs.prefill if whole_prefill else graphs.pieces) == [32]
    assert seen == {("up", other)} | {(name, default) for name in WEIGHTS if name != "up"}


@pytest.mark.gpu
def test_an_engine_on_the_gpu_calibrates_its_buckets_and_equals_its_eager_run(monkeypatch):
    """The real timings (`time_linears` through real captures): a finite time for every weight and library
    at every bucket, the largest bucket kept, and graphs taken with the chosen libraries that pass the
    cold-vs-warm rule against an eager run, in bfloat16 (where the libraries' kernels differ most)."""
    monkeypatch.setattr(blas_choice, "ENABLED", True)
    options = dict(
        backend="triton", num_pages=32, page_size=16, max_num_batched_tokens=96, record_logits=True
    )
    llm = LLM("tiny", **options)
    graphs = llm.runner.graphs
    times = graphs.timer(48)
    assert set(times) == set(WEIGHTS) and all(set(t) == set(LIBRARIES) for t in times.values())
    assert all(0 < us < 1e4 for t in times.values() for us in t.values())
    params = SamplingParams(max_tokens=3)
    prompts = [list(range(1, 40)), [7] * 70]
    eager = LLM("tiny", enforce_eager=True, enable_prefix_caching=False, **options)
    assert_equivalent(llm.generate(prompts, params), eager.generate(prompts, params))
    assert graphs.token_buckets[-1] == 96 and set(graphs.token_buckets) <= set(graphs.choices)
    assert graphs.prefill and all(set(graphs.choices[t].values()) <= set(LIBRARIES) for t in graphs.prefill)
    second = LLM("tiny", **options)  # the same model shape: the process's calibration, not one of its own
    second.generate(prompts[:1], params)
    theirs = second.runner.graphs
    assert (theirs.token_buckets, theirs.choices) == (graphs.token_buckets, graphs.choices)
