"""A request's state as the scheduler and the block pool see it."""

import enum
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # queued, or preempted and waiting for recompute; owns no page
    RUNNING = enum.auto()  # owns pages; its first num_computed_tokens tokens are in the KV cache
    FINISHED = enum.auto()  # answered; owns no page


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request is decoded.

    Args:
        max_tokens (int):
            Tokens to generate, >= 1. Default: `16`.
        temperature (float):
            0.0 is greedy; > 0 samples from softmax(logits / temperature) with the engine's seeded
            generator. Default: `0.0`.
    """

    max_tokens: int = 16
    temperature: float = 0.0

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise TypeError(f"max_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a float, got {type(self.temperature).__name__}")
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")


@dataclass(slots=True)
class Sequence:
    """One request. All state is per instance (no class attributes).

    `token_ids` is the prompt followed by the generated tokens (the last one None inside `LLM.step`, between
    the scheduler's `advance` and `fill`). The KV of the first
    `num_computed_tokens` tokens sits in the pages of `block_table` (in order). `page_keys` holds the
    prefix-cache keys of the first full pages of `token_ids` known so far (a lookup hashes none: it stops at
    the first page the cache does not hold) and `encoded_pages` the canonical encoding of every full page
    encoded so far (both filled by the block pool); the first `num_offered_pages`
    pages of `block_table` have been offered to the prefix cache.
    """

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_prompt_tokens: int = field(init=False)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_offered_pages: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at the first scheduling
    # The prompt's ids as int64 little-endian bytes, where admission packed them (`LLM._check_prompt`):
    # the block pool encodes the prompt's pages from them rather than packing the ids again.
    packed_prompt: bytes | None = field(default=None, repr=False)
    num_preemptions: int = 0
    page_keys: list = field(default_factory=list)
    encoded_pages: list = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logits: list = field(default_factory=list)  # only with EngineConfig.record_logits

    def __post_init__(self):
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What `LLM.generate` returns per prompt, in prompt order.

    Attributes:
        request_id: the engine's id of the request.
        prompt_token_ids: the prompt.
        token_ids: the generated tokens.
        logprobs: log-probability of each generated token under the distribution it was sampled from.
        num_cached_tokens: prompt tokens served from the prefix cache at the request's first scheduling.
        num_preemptions: times the request was preempted and recomputed.
        logits: per generated token, the float32 logits [vocab_size] (only with `record_logits`).
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    num_cached_tokens: int
    num_preemptions: int = 0
    logits: list | None = None
