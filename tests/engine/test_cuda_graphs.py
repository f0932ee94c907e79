"""The engine's graphs (engine/cuda_graphs.py) against its eager steps, by the cold-vs-warm rule.

On a GPU the engine replays real CUDA graphs (its default); without one, `rerun_capture` stands in: a
replay runs the step again over the plans made at capture, their metadata rewritten in place, which
is what a graph's launches read. Either way the runs with graphs, prefix caching on and off, must
pass harness/engine_check.py's rule against an eager run without caching.
"""

import importlib
from types import SimpleNamespace

import pytest
import torch
from hypothesis import event, given

from engine import LLM, SamplingParams
from engine.cuda_graphs import PIECE_TOKEN_BUCKETS, StaticInputs, StepGraphs, buckets, rerun_capture, segments
from engine.model import MODEL_CONFIGS
from kernels import device_walk, hopper_prefill
from tests.budgets import examples
from tests.engine.test_engine import TRITON_STREAMS, assert_equivalent, make_llm, run_stream

# The module, not the package's function of the same name (kernels/__init__.py)
paged_prefill = importlib.import_module("kernels.paged_prefill")


def with_graphs(llm: LLM, whole_prefill: bool = True) -> LLM:
    """`llm` replaying graphs: CUDA graphs on a GPU, the stand-in without one; prefill steps whole or
    (`whole_prefill=False`) piece by piece around eager attention."""
    if llm.runner.graphs is None:
        assert not torch.cuda.is_available(), "the engine runs eagerly on a GPU by default"
        llm.runner.graphs = StepGraphs(llm.runner, whole_decode=True, capture=rerun_capture)
    llm.runner.graphs.whole_prefill = whole_prefill
    return llm


def used(llm: LLM) -> tuple[int, int, int]:
    """(decode graphs, prefill graphs, piece-graph buckets) that the engine captured."""
    graphs = llm.runner.graphs
    return len(graphs.decode), len(graphs.prefill), len(graphs.pieces)


@examples(0.05)
@given(stream=TRITON_STREAMS)
def test_graph_steps_equal_eager_steps(stream):
    cold = run_stream(make_llm(stream, backend="triton", caching=False, enforce_eager=True), stream)
    for caching in (True, False):
        llm = with_graphs(make_llm(stream, backend="triton", caching=caching))
        assert_equivalent(run_stream(llm, stream), cold)
        decode, prefill, pieces = used(llm)
        assert prefill or pieces, "no prefill step ran through graphs"
        event(f"decode graphs used: {decode > 0}; prefill graphs: {prefill > 0}; pieces: {pieces > 0}")


def test_graphs_pad_rows_and_share_buckets():
    """Prompts of several lengths under a small token budget: prefill steps of fewer tokens than an
    earlier one in the same bucket (its rows' stale slots must write nothing), and decode steps of
    fewer rows than their bucket (the padding rows)."""
    prompts = [list(range(1, 12)), list(range(1, 10)) + [3], [5] * 30, [7] * 50]
    options = dict(
        backend="triton", num_pages=40, page_size=8, max_num_seqs=3, max_num_batched_tokens=40,
        record_logits=True, dtype="float32",
    )  # fmt: skip
    params = SamplingParams(max_tokens=5)
    cold = LLM("tiny", enable_prefix_caching=False, enforce_eager=True, **options).generate(prompts, params)
    llm = with_graphs(LLM("tiny", **options))
    assert_equivalent(llm.generate(prompts, params), cold)
    assert_equivalent(llm.generate(prompts, params), cold)  # prefix-cache hits, graphs reused
    decode = sorted(llm.runner.graphs.decode)
    assert decode and any(rows > 1 for rows, _ in decode), decode
    assert llm.runner.graphs.prefill and llm.runner.graphs.pieces  # mixed steps go piece by piece


def test_backend_without_the_graphs_capability_decodes_eagerly():
    """The reference backend's plans copy their metadata at planning: no decode graph, and the piece
    graphs leave K/V writes to its eager write_kv."""
    llm = LLM("tiny", backend="reference", num_pages=16, dtype="float32")
    graphs = StepGraphs(llm.runner, whole_decode=llm.runner.ops.capabilities.graphs, capture=rerun_capture)
    llm.runner.graphs = graphs
    eager = LLM("tiny", backend="reference", num_pages=16, dtype="float32", enforce_eager=True)
    params = SamplingParams(max_tokens=3)
    assert llm.generate([[1, 2, 3]], params)[0].token_ids == eager.generate([[1, 2, 3]], params)[0].token_ids
    assert not graphs.decode and graphs.pieces and not next(iter(graphs.pieces.values())).write_kv


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(512, 256) == [256, 512]
    assert buckets(300, 256) == [256, 300]


@pytest.mark.parametrize("max_num_batched_tokens", [40, 2048, 4096])
def test_token_buckets_rise_to_the_largest_a_step_takes(max_num_batched_tokens):
    """Each token bucket once, in order, up to the batch's budget or the last piece bucket."""
    config = SimpleNamespace(
        max_num_seqs=4, num_pages=16, page_size=8, max_num_batched_tokens=max_num_batched_tokens
    )
    graphs = StepGraphs(SimpleNamespace(config=config), whole_decode=True, capture=rerun_capture)
    largest = min(max_num_batched_tokens, PIECE_TOKEN_BUCKETS[-1])
    assert graphs.token_buckets[-1] == largest
    assert graphs.token_buckets == sorted(set(graphs.token_buckets))
    assert set(graphs.token_buckets) == {t for t in PIECE_TOKEN_BUCKETS if t < largest} | {largest}


@pytest.mark.parametrize("whole_prefill", [True, False])
def test_prefill_graph_padding_rows_write_no_kv(whole_prefill):
    """A prefill of fewer tokens than an earlier one of its bucket, into pages that the earlier request
    held: the earlier rows left in the bucket must not write their K/V over the new request's (whole
    prefill graphs, and pieces around eager attention)."""
    options = dict(backend="triton", num_pages=8, page_size=8, max_num_batched_tokens=40, dtype="float32")
    params = SamplingParams(max_tokens=2)
    prompts = [[3] * 30, [4] * 20, [5] * 20]  # each prompt's pages come from the ones freed before it
    eager = LLM("tiny", enforce_eager=True, record_logits=True, enable_prefix_caching=False, **options)
    llm = with_graphs(LLM("tiny", record_logits=True, **options), whole_prefill)
    for prompt in prompts:
        assert_equivalent(llm.generate([prompt], params), eager.generate([prompt], params))
    graphs = llm.runner.graphs
    # One bucket for all three: 32, or on a GPU a larger one where the linear layers' calibration drops
    # 32 (engine/blas_choice.py's kept_buckets: 40 rows measured 3% faster, as an H100 once did).
    bucket = next(t for t in graphs.token_buckets if t >= 30)
    assert sorted(graphs.prefill if whole_prefill else graphs.pieces) == [bucket]


@pytest.mark.parametrize("num_layers", [1, 2, 3, 4, 7, 32])
def test_segments_cover_the_layers_doubling(num_layers):
    parts = segments(num_layers)
    assert [i for part in parts for i in part] == list(range(num_layers))
    assert all(len(part) == 2**j for j, part in enumerate(parts[:-1]))
    assert 1 <= len(parts[-1]) <= 2 ** (len(parts) - 1)


def test_prefill_plans_that_cannot_replan_in_place_go_piece_by_piece():
    """Under a real capture (here any capture but the stand-in, whose replays plan again), prefill
    plans whose launches do not survive `replan` (the Triton path: its grid follows the batch) leave
    prefill steps to the piece graphs, and their whole-step graph is never captured."""

    def capture(forward, pool, plans):
        return rerun_capture(forward, pool, plans)

    options = dict(backend="triton", num_pages=16, dtype="float32", record_logits=True)
    params = SamplingParams(max_tokens=3)
    llm = LLM("tiny", **options)
    llm.runner.graphs = graphs = StepGraphs(llm.runner, whole_decode=True, capture=capture)
    eager = LLM("tiny", enforce_eager=True, **options)
    assert_equivalent(llm.generate([[1, 2, 3, 4, 5]], params), eager.generate([[1, 2, 3, 4, 5]], params))
    assert graphs.prefill and graphs.pieces
    assert not any(graph.supported or hasattr(graph, "replays") for graph in graphs.prefill.values())


def test_prefill_graphs_replay_their_lead_before_any_replan():
    """A prefill graph's first replay is its lead (the embedding and the first layer's attention inputs),
    before any plan is replanned: the GPU works while the host replans. (The stand-in capture on every
    machine: float32 takes the Triton path, whose plans replan in no real graph.)"""
    options = dict(backend="triton", num_pages=16, page_size=8, max_num_batched_tokens=40, dtype="float32")
    llm = LLM("tiny", **options)
    llm.runner.graphs = StepGraphs(llm.runner, whole_decode=True, capture=rerun_capture)
    llm.generate([[3] * 20], SamplingParams(max_tokens=1))  # captures the bucket
    (graph,) = llm.runner.graphs.prefill.values()
    events = []

    def logged(label, fn):
        return lambda *args: (events.append(label), fn(*args))[1]

    graph.replays = [logged(f"replay {j}", replay) for j, replay in enumerate(graph.replays)]
    for plans in graph.segment_plans:
        for plan in plans:
            plan.replan = logged("replan", plan.replan)
    llm.generate([[4] * 18], SamplingParams(max_tokens=1))
    assert events[:2] == ["replay 0", "replan"], events


# A model on the Hopper path's shapes (head_dim 128, 32 heads), small otherwise: a prompt of hundreds of
# tokens takes more than a round of (query tile, head) items on an H100's programs, a cached one's rest one.
HOPPER_SHAPED = dict(
    MODEL_CONFIGS["tiny"], dim=256, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=256, sparse_block_size=64
)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU"
)
@pytest.mark.parametrize("one_round", [False, True], ids=["whole", "split-one-round"])
def test_prefill_graphs_write_a_lone_rounds_walks_in_their_lead(monkeypatch, one_round):
    """On the Hopper path a prefill graph's lead writes a lone round's walks on the GPU and its step
    replans nothing (kernels/device_walk.py), with the items whole or split over the idle programs
    (SPLIT_ONE_ROUND); a step of more items replans on the host. Both kinds of step, against an engine whose
    every walk the host makes (device_walk.ENABLED off), bit for bit: the lead writes the host's walk word
    for word (tests/kernels/test_device_walk.py), so the logits may differ only where it does not. Not the
    cold-vs-warm rule: it holds a run to float32's floor, and the Hopper path runs bfloat16, whose products
    at a graph's bucket rows and at an eager step's rows round an ulp apart (an H100 found that)."""
    monkeypatch.setitem(MODEL_CONFIGS, "hopper-shaped", HOPPER_SHAPED)
    monkeypatch.setattr(hopper_prefill, "SPLIT_ONE_ROUND", one_round)
    lone = []  # each step's answer in the engine whose lead writes walks
    lone_round = paged_prefill.PrefillPlan.lone_round

    def recorded(plan, *args):
        answer = lone_round(plan, *args)
        if device_walk.ENABLED:
            lone.append(answer)
        return answer

    monkeypatch.setattr(paged_prefill.PrefillPlan, "lone_round", recorded)
    options = dict(
        backend="triton", num_pages=160, page_size=16, max_num_batched_tokens=1024, record_logits=True
    )
    prefix = [(7 * i) % 128 for i in range(700)]
    prompts = [prefix + [1, 2, 3], prefix[:650] + [9] * 90, prefix[:200] + [5] * 40]
    params = SamplingParams(max_tokens=3)
    llm, host = LLM("hopper-shaped", **options), LLM("hopper-shaped", **options)
    for prompt in prompts:
        (led,) = llm.generate([prompt], params)
        monkeypatch.setattr(device_walk, "ENABLED", False)
        (hosted,) = host.generate([prompt], params)
        monkeypatch.setattr(device_walk, "ENABLED", True)
        assert led.num_cached_tokens == hosted.num_cached_tokens and led.token_ids == hosted.token_ids
        assert all(torch.equal(a, b) for a, b in zip(led.logits, hosted.logits, strict=True))
    assert any(graph.lead_walks for graph in llm.runner.graphs.prefill.values())
    assert not any(graph.lead_walks for graph in host.runner.graphs.prefill.values())
    assert True in lone and False in lone, lone


def count_launched_ahead(llm: LLM) -> list[int]:
    """A counter (a one-element list) of the decode steps `llm` launches before reading the step
    they follow."""
    count, launch = [0], llm.runner.launch

    def counted(batch, feed=None):
        count[0] += feed is not None
        return launch(batch, feed)

    llm.runner.launch = counted
    return count


def run_requests(llm: LLM, requests: list) -> list:
    """Queues (prompt, SamplingParams) pairs at once and steps until all are answered; outputs in order."""
    ids = [llm.add_request(prompt, params) for prompt, params in requests]
    answered = {}
    while llm.has_unfinished() or llm._ahead is not None:
        answered.update((out.request_id, out) for out in llm.step())
    return [answered[i] for i in ids]


@pytest.mark.gpu
def test_static_inputs_are_packed_only_after_the_last_copy_read_them():
    """A step's copy waits on the stream behind the work before it, and the next step packs on the host
    meanwhile: the packing must not overwrite the pinned bytes before that copy has read them
    (`StaticInputs.writable`)."""
    inputs = StaticInputs([("ids", torch.int64, 4)], torch.device("cuda"))
    seen = []
    for values in ([1, 2, 3, 4], [5, 6, 7, 8]):
        torch.cuda._sleep(50_000_000)  # cycles, tens of ms: the stream is busy long past the packing
        inputs.writable()
        inputs.pack("ids", values)
        inputs.copy()
        seen.append(inputs.device["ids"].clone())
    assert [row.tolist() for row in seen] == [[1, 2, 3, 4], [5, 6, 7, 8]]


@pytest.mark.parametrize("num_pages", [40, 10], ids=["roomy", "preempting"])
def test_decode_steps_launched_ahead_equal_steps_read_first(num_pages):
    """Decode steps launched before the step they follow was read (`async_decode`, tokens fed on the
    device) give the same tokens, logprobs and logits, bit for bit, as steps launched after it: the
    same batches, the same graphs. None is launched ahead while a sampled (temperature > 0) request
    runs, nor where pages are short (the preempting case's preemptions are the same)."""
    greedy, sampled = SamplingParams(max_tokens=6), SamplingParams(max_tokens=4, temperature=8.0)
    requests = [(list(range(1, 12)), greedy), ([2] * 5, sampled), ([5] * 20, greedy)]
    options = dict(
        backend="triton", num_pages=num_pages, page_size=4, max_num_seqs=3,
        max_num_batched_tokens=40, record_logits=True, dtype="float32",
    )  # fmt: skip
    outputs, ahead, preempted = {}, {}, {}
    for async_decode in (False, True):
        llm = with_graphs(LLM("tiny", async_decode=async_decode, **options))
        count = count_launched_ahead(llm)
        outputs[async_decode] = run_requests(llm, requests)
        ahead[async_decode], preempted[async_decode] = count[0], llm.stats()["preemptions"]
        assert llm.pool.num_free_pages == num_pages
    for read_first, launched_ahead in zip(outputs[False], outputs[True], strict=True):
        assert launched_ahead.token_ids == read_first.token_ids
        assert launched_ahead.logprobs == read_first.logprobs
        assert all(torch.equal(a, b) for a, b in zip(launched_ahead.logits, read_first.logits, strict=True))
    assert ahead[False] == 0 and ahead[True] > 0
    assert preempted[True] == preempted[False] and (preempted[True] > 0) == (num_pages == 10)


def test_abort_while_a_decode_step_is_launched_ahead():
    """A request aborted while a step launched ahead holds it: the step's other rows go on, the aborted
    one is never answered, and every page comes back."""
    options = dict(backend="triton", num_pages=40, page_size=8, max_num_seqs=3, dtype="float32")
    prompts, params = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]], SamplingParams(max_tokens=5)
    llm = with_graphs(LLM("tiny", record_logits=True, **options))
    ids = [llm.add_request(p, params) for p in prompts]
    answered = {}
    while llm._ahead is None:
        answered.update((out.request_id, out) for out in llm.step())
    llm.abort([ids[1]])
    while llm.has_unfinished() or llm._ahead is not None:
        answered.update((out.request_id, out) for out in llm.step())
        llm.pool.check_invariants()
    assert sorted(answered) == [ids[0], ids[2]]
    assert llm.pool.num_free_pages == options["num_pages"]
    eager = LLM("tiny", enforce_eager=True, enable_prefix_caching=False, record_logits=True, **options)
    cold = eager.generate([prompts[0], prompts[2]], params)
    assert_equivalent([answered[ids[0]], answered[ids[2]]], cold)
