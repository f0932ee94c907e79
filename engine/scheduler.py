"""Continuous batching: a per-step token budget, chunked prefill, preemption by recompute.

Each step builds one mixed batch:
    1. running sequences, oldest first: a decode token, or the next chunk of an unfinished prefill;
       when pages run out, the most recently arrived running sequence is preempted (its pages freed
       in reverse order, its computed tokens forgotten) and put back at the front of the waiting
       queue, possibly the sequence being scheduled itself;
    2. if nothing was preempted, waiting sequences first come, first served: a prefix-cache lookup,
       then as much of the rest of the sequence as the budget allows. The first waiting sequence that
       does not fit stops admission (no overtaking).

A preempted sequence is recomputed from its prompt and the tokens it generated; its reported
`num_cached_tokens` stays the value of its first scheduling.
"""

import bisect
from collections import deque

from engine.block_pool import BlockPool, pages_for
from engine.config import EngineConfig
from engine.model_runner import Sample, ScheduledSeq
from engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Waiting and running queues over one block pool.

    Invariants: a sequence is in exactly one of `waiting` (owning no page), `running` (kept sorted by
    arrival, i.e. seq_id) or finished; a running sequence's block table covers its computed tokens.
    """

    def __init__(self, config: EngineConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        """The next batch; each sequence's pages cover the tokens it computes in this step."""
        budget = self.config.max_num_batched_tokens
        page = self.pool.page_size
        batch: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            need = pages_for(seq.num_computed_tokens + n, page) - len(seq.block_table)
            if need > 0:  # a decode step needs a page once every page_size steps (most steps: none)
                while not self.pool.can_allocate([], need) and seq.status is SequenceStatus.RUNNING:
                    self.preempt(self.running[-1])
                    preempted = True
                if seq.status is not SequenceStatus.RUNNING:
                    break
                seq.block_table += self.pool.allocate([], need)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.pool.lookup(seq)
            hit_tokens = len(hits) * page
            n = min(len(seq) - hit_tokens, budget)
            need = pages_for(hit_tokens + n, page) - len(hits)
            if not self.pool.can_allocate(hits, need):
                break
            self.waiting.popleft()
            seq.block_table = self.pool.allocate(hits, need, num_query_tokens=len(seq))
            seq.num_computed_tokens = hit_tokens
            seq.num_offered_pages = len(hits)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's pages (reverse order) and queues it first for recompute."""
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_offered_pages = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.pool.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, batch: list[ScheduledSeq], samples: list[Sample | None]) -> list[Sequence]:
        """Advances computed tokens, caches newly full pages, appends samples. Returns finished ones."""
        finished = self.advance(batch)
        self.fill(batch, samples)
        return finished

    def advance(self, batch: list[ScheduledSeq]) -> list[Sequence]:
        """What a step does to its sequences whatever tokens it samples: computed tokens advanced, newly
        full pages offered to the cache, a placeholder (None) for each sampled token until `fill`, and
        the sequences that reach max_tokens finished. Returns those, finished."""
        finished, page = [], self.pool.page_size
        for item in batch:
            seq = item.seq
            samples = item.samples
            seq.num_computed_tokens += item.num_tokens
            if seq.num_computed_tokens // page > seq.num_offered_pages:  # a page filled up
                self.pool.cache_full_pages(seq)  # before the placeholder: it hashes full pages only
            if not samples:
                continue
            seq.token_ids.append(None)
            if len(seq.token_ids) - seq.num_prompt_tokens >= seq.params.max_tokens:
                self.finish(seq)
                finished.append(seq)
        return finished

    def fill(self, batch: list[ScheduledSeq], samples: list[Sample | None]) -> None:
        """Puts an `advance`d step's samples in place of their placeholders."""
        for item, sample in zip(batch, samples, strict=True):
            if sample is None:
                continue
            seq = item.seq
            if seq.token_ids[-1] is not None:
                raise RuntimeError(f"fill: sequence {seq.seq_id} has no sampled token to fill")
            seq.token_ids[-1] = sample.token_id
            seq.logprobs.append(sample.logprob)
            if sample.logits is not None:
                seq.logits.append(sample.logits)

    def finish(self, seq: Sequence) -> None:
        """Removes a sequence from its queue and frees its pages in reverse order."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.pool.free(seq.block_table)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED
