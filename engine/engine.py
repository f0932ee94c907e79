"""`LLM`: the public entry point of the engine (contract §4.1)."""

import struct

from engine.block_pool import BlockPool, pages_for
from engine.config import EngineConfig
from engine.model import ModelArgs
from engine.model_runner import ModelRunner
from engine.scheduler import Scheduler
from engine.sequence import RequestOutput, SamplingParams, Sequence, SequenceStatus


def _packed(token_ids: list[int]) -> bytes | None:
    """The ids as 64-bit little-endian bytes (one `struct` call, the fastest conversion of Python ints), or
    None where one is negative or beyond 64 bits. Packed unsigned, so that a packing is itself the check
    of the ids' lower bound; ids below 2**63, which are all that admission lets through, have the same
    bytes as int64, from which the block pool encodes the prompt's pages (`Sequence.packed_prompt`): a
    request's fixed host cost, paid at every hit share."""
    try:
        return struct.pack(f"<{len(token_ids)}Q", *token_ids)
    except struct.error:
        return None


class LLM:
    """A small serving engine with automatic prefix caching.

    Args:
        model (str):
            A name of `engine.model.MODEL_CONFIGS`. Default: `"tiny"`.
        page_size, num_pages, enable_prefix_caching, backend, seed, **options:
            The fields of `engine.config.EngineConfig` (keyword-only), validated there.
    Example:
        >>> llm = LLM("tiny", backend="reference", num_pages=64)
        >>> out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
        >>> len(out[0].token_ids)
        4
    """

    def __init__(self, model: str = "tiny", **options):
        self.config = EngineConfig(model=model, **options)
        self.args = ModelArgs.from_name(model)
        cfg = self.config
        self.pool = BlockPool(cfg.num_pages, cfg.page_size, cfg.seed, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.pool)
        self.runner = ModelRunner(cfg, self.args)
        self._next_id = 0
        self._done: dict[int, Sequence] = {}
        self._ahead = None  # (batch, LaunchedStep) of a step launched by the last `step`, unread

    def _check_prompt(
        self, prompt, params: SamplingParams, cache_salt
    ) -> tuple[list[int] | tuple, bytes | None]:
        """The prompt and `_packed`, once checked; TypeError/ValueError naming what is wrong."""
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"a prompt must be a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("a prompt must hold at least one token id")
        vocab = self.args.vocab_size
        # bool and other int subclasses are not token ids (count tests types by identity: cheaper than a set)
        if list(map(type, prompt)).count(int) != len(prompt):
            bad = next(t for t in prompt if type(t) is not int)
            raise TypeError(f"token ids must be ints, got {type(bad).__name__}")
        packed = _packed(prompt)
        # A packed prompt has no negative id. Python's max over the ints took a third of the time of numpy's
        # min and max over the packed bytes, on a host whose caches the step before had left cold.
        lowest, highest = (min(prompt), max(prompt)) if packed is None else (0, max(prompt))
        if lowest < 0 or highest >= vocab:
            bad = lowest if lowest < 0 else highest
            raise ValueError(f"token id {bad} lies outside the vocabulary [0, {vocab})")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        # The last generated token's KV is never written.
        needed = pages_for(len(prompt) + params.max_tokens - 1, self.config.page_size)
        if needed > self.config.num_pages:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens with max_tokens={params.max_tokens} needs {needed} pages, "
                f"the whole cache has {self.config.num_pages}"
            )
        return prompt, packed  # `Sequence` takes a list copy

    def add_request(self, prompt: list[int], params: SamplingParams | None = None, cache_salt=None) -> int:
        """Queues one request (validated first) and returns its id."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        return self._add(self._check_prompt(prompt, params, cache_salt), params, cache_salt)

    def _add(
        self, checked: tuple[list[int] | tuple, bytes | None], params: SamplingParams, cache_salt
    ) -> int:
        tokens, packed = checked
        seq = Sequence(self._next_id, tokens, params, cache_salt, packed_prompt=packed)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq.seq_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One scheduling step and forward pass. Returns the requests that finished in it.

        With `async_decode`, a decode step replayed from a CUDA graph whose every running sequence goes on
        decoding greedily launches the next decode step before it reads its own tokens, which the next
        step then takes on the device: the GPU runs while the host reads, schedules and packs. The
        step so launched is the next call's (nothing else is scheduled before it)."""
        return [self._output(seq) for seq in self._step()]

    def _step(self) -> list[Sequence]:
        """`step`, returning the finished sequences (`generate` makes outputs of its own requests only)."""
        if self._ahead is not None:
            batch, launched = self._ahead
            self._ahead = None
            alive = [item.seq.status is SequenceStatus.RUNNING for item in batch]  # abort() may drop some
        else:
            batch = self.scheduler.schedule()
            if not batch:
                if self.has_unfinished():
                    raise RuntimeError("the scheduler made no progress with requests pending")
                return []
            launched, alive = self.runner.launch(batch), [True] * len(batch)
        live = [item for item, a in zip(batch, alive, strict=True) if a]
        finished = self.scheduler.advance(live)
        if self.config.async_decode and launched.pairs is not None:
            self._ahead = self._launch_next(batch, launched)
        samples = [s for s, a in zip(launched.samples(), alive, strict=True) if a]
        self.scheduler.fill(live, samples)
        for seq in finished:
            self._done[seq.seq_id] = seq
        return finished

    def _launch_next(self, batch, launched):
        """The next step launched now, fed with `launched`'s tokens (`step`), as (batch, LaunchedStep); None
        unless every running sequence sampled a token in `batch` (its placeholder is last; `launched.pairs`
        holds them: a decode graph's step, every row greedy) and the next step takes them all, a token
        each, without admitting or preempting."""
        sched, page = self.scheduler, self.config.page_size
        running = sched.running
        if sched.waiting or not running or len(running) > self.config.max_num_batched_tokens:
            return None
        rows = {id(item.seq): j for j, item in enumerate(batch)}
        need = 0
        for seq in running:
            if seq.token_ids[-1] is not None or id(seq) not in rows:
                return None
            need += pages_for(seq.num_computed_tokens + 1, page) - len(seq.block_table)
        if not self.pool.can_allocate([], need):
            return None
        nxt = sched.schedule()  # every running sequence, a token each
        return nxt, self.runner.launch(nxt, feed=(launched.pairs, [rows[id(item.seq)] for item in nxt]))

    def abort(self, request_ids) -> None:
        """Drops unfinished requests and frees their pages."""
        ids = set(request_ids)
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            if seq.seq_id in ids:
                self.scheduler.finish(seq)

    def generate(self, prompts, sampling_params: SamplingParams | None = None, *, cache_salt=None):
        """Runs prompts to completion. Returns one RequestOutput per prompt, in order.

        Args:
            prompts (list[list[int]]): token ids, each in [0, vocab_size).
            sampling_params (SamplingParams | None): Default: `None`, SamplingParams().
            cache_salt (str | list[str | None] | None): one salt for all prompts, or one per prompt;
                requests with different salts never share a cached page. Default: `None`.
        Raises:
            TypeError, ValueError: before anything is queued, for any bad prompt or argument.
        """
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        salts = cache_salt if isinstance(cache_salt, (list, tuple)) else [cache_salt] * len(prompts)
        if len(salts) != len(prompts):
            raise ValueError(f"{len(salts)} cache salts for {len(prompts)} prompts")
        checked = [self._check_prompt(p, params, s) for p, s in zip(prompts, salts, strict=True)]
        ids = [self._add(p, params, s) for p, s in zip(checked, salts, strict=True)]
        try:
            while any(i not in self._done for i in ids):
                self._step()
        except BaseException:
            self.abort(ids)
            for i in ids:
                self._done.pop(i, None)
            raise
        return [self._output(self._done.pop(i)) for i in ids]

    def take_output(self, request_id: int) -> RequestOutput:
        """The output of a finished request queued with `add_request`."""
        return self._output(self._done.pop(request_id))

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=seq.output_token_ids,
            logprobs=list(seq.logprobs),
            num_cached_tokens=seq.num_cached_tokens or 0,
            num_preemptions=seq.num_preemptions,
            logits=list(seq.logits) if self.config.record_logits else None,
        )

    def stats(self) -> dict:
        """Counters of contract §6 (queries and hits in tokens), plus the cache's occupancy."""
        s = self.pool.stats
        return {
            "prefix_cache_queries": s.queries,
            "prefix_cache_hits": s.hits,
            "prefix_cache_hit_rate": s.hits / s.queries if s.queries else 0.0,
            "evictions": s.evictions,
            "preemptions": s.preemptions,
            "hash_collisions": s.collisions,
            "num_pages": self.pool.num_pages,
            "free_pages": self.pool.num_free_pages,
            "cached_pages": self.pool.num_cached_pages,
        }

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; returns False (and changes nothing) while requests hold pages."""
        return self.pool.reset()
