"""The scheduler over the real block pool, with a fake model that checks the paged KV cache itself.

`FakeRunner` keeps a cache of (token id, position) per slot: each step writes the scheduled tokens
to their slots, then reads every position of every scheduled sequence back through its block table
(the way attention does) and fails on any mismatch, so a page shared, reused or evicted wrongly is
caught without a model. Its "next token" depends only on the sequence's tokens, so outputs must not
depend on scheduling, chunking, caching or preemption.
"""

from hypothesis import given

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.model_runner import Sample
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, SequenceStatus
from harness.cases import EngineRequest, EngineStream
from harness.strategies import request_streams
from tests.budgets import examples

VOCAB = 128
MAX_STEPS = 20_000


class FakeRunner:
    def __init__(self, num_pages: int, page_size: int):
        self.page = page_size
        self.slots: list[tuple[int, int] | None] = [None] * (num_pages * page_size)

    def run(self, batch) -> list[Sample | None]:
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            for p in range(start, start + item.num_tokens):
                self.slots[seq.block_table[p // self.page] * self.page + p % self.page] = (
                    seq.token_ids[p],
                    p,
                )
        out = []
        for item in batch:
            seq = item.seq
            for p in range(seq.num_computed_tokens + item.num_tokens):
                got = self.slots[seq.block_table[p // self.page] * self.page + p % self.page]
                assert got == (seq.token_ids[p], p), f"seq {seq.seq_id} position {p} reads {got}"
            out.append(Sample(next_token(seq.token_ids), 0.0, None) if item.samples else None)
        return out


def next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % VOCAB


def expected_output(prompt, max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def run(stream: EngineStream, caching: bool = True) -> tuple[dict, Scheduler]:
    config = EngineConfig(
        page_size=stream.page_size,
        num_pages=stream.num_pages,
        max_num_batched_tokens=stream.max_num_batched_tokens,
        max_num_seqs=stream.max_num_seqs,
        enable_prefix_caching=caching,
    )
    pool = BlockPool(stream.num_pages, stream.page_size, enable_caching=caching)
    sched, runner = Scheduler(config, pool), FakeRunner(stream.num_pages, stream.page_size)
    done: dict[int, Sequence] = {}

    def step():
        batch = sched.schedule()
        assert batch, "no progress"
        assert sum(item.num_tokens for item in batch) <= config.max_num_batched_tokens
        assert len({id(item.seq) for item in batch}) == len(batch)
        assert len(sched.running) <= config.max_num_seqs
        for item in batch:
            assert item.num_tokens >= 1 and item.seq.status is SequenceStatus.RUNNING
            assert (
                len(item.seq.block_table) * stream.page_size >= item.seq.num_computed_tokens + item.num_tokens
            )
        for seq in sched.postprocess(batch, runner.run(batch)):
            assert seq.seq_id not in done, "answered twice"
            done[seq.seq_id] = seq
        pool.check_invariants()
        # First come, first served: every running request arrived before every waiting one.
        waiting = [s.seq_id for s in sched.waiting]
        assert waiting == sorted(waiting)
        assert not waiting or not sched.running or max(s.seq_id for s in sched.running) < min(waiting)
        in_use = sum(len(s.block_table) for s in sched.running)
        assert in_use >= pool.num_pages - pool.num_free_pages  # shared pages are counted once

    for i, r in enumerate(stream.requests):
        for _ in range(r.arrival_steps):
            if sched.has_unfinished():
                step()
        sched.add(Sequence(i, list(r.prompt), SamplingParams(max_tokens=r.max_tokens), r.cache_salt))
    for _ in range(MAX_STEPS):
        if not sched.has_unfinished():
            break
        step()
    assert sorted(done) == list(range(len(stream.requests))), "a request was lost"
    return done, sched


@examples(2.5)
@given(stream=request_streams(max_requests=8, max_new_tokens=12))
def test_scheduler_answers_every_request_once(stream):
    for caching in (True, False):
        done, sched = run(stream, caching)
        for i, r in enumerate(stream.requests):
            assert done[i].output_token_ids == expected_output(r.prompt, r.max_tokens)
            assert done[i].block_table == [] and done[i].status is SequenceStatus.FINISHED
        assert sched.pool.num_free_pages == stream.num_pages


def test_scheduler_chunked_prefill_and_preemption():
    prompt = tuple(range(40))
    stream = EngineStream(
        requests=(EngineRequest(prompt, 20), EngineRequest(prompt[:30], 20), EngineRequest(prompt, 4)),
        page_size=4,
        num_pages=16,
        max_num_batched_tokens=7,
        max_num_seqs=4,
    )
    done, sched = run(stream)
    assert sched.pool.stats.preemptions > 0
    assert done[1].num_preemptions > 0  # the most recently arrived running request goes first
    assert done[0].num_preemptions == 0
    # Preempted requests keep the num_cached_tokens of their first scheduling.
    assert [done[i].num_cached_tokens for i in range(3)] == [0, 28, 36]


def test_scheduler_budget_splits_a_long_prompt():
    stream = EngineStream((EngineRequest(tuple(range(50)), 1),), 8, 8, 16, 1)
    config = EngineConfig(page_size=8, num_pages=8, max_num_batched_tokens=16)
    sched = Scheduler(config, BlockPool(8, 8))
    runner = FakeRunner(8, 8)
    sched.add(Sequence(0, list(stream.requests[0].prompt), SamplingParams(max_tokens=1)))
    chunks = []
    while sched.has_unfinished():
        batch = sched.schedule()
        chunks.append(batch[0].num_tokens)
        sched.postprocess(batch, runner.run(batch))
    assert chunks == [16, 16, 16, 2]
