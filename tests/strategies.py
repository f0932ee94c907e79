"""Hypothesis strategies shared by the tests, `fuzz/` and `reports/`.

A drawn case is a small frozen dataclass of plain values (JSON-ready, so that a fuzz failure can be
saved and replayed); its tensors are built afterwards from the case's seed by `build_inputs`, never
element by element by hypothesis.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import reference

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Triton's CPU interpreter computes bfloat16 on raw bits (TRITON-CPU.md): kernels check it on GPU only.
KERNEL_DTYPES = ("float32", "float16", "bfloat16") if torch.cuda.is_available() else ("float32", "float16")
PAGE_SIZES = (1, 2, 5, 16, 64, 128)
BLOCK_SIZES = (1, 2, 3, 4, 8, 16, 32, 64, 128)
HEAD_DIMS = (16, 32, 60, 64, 80, 96, 128)
GQA_GROUPS = (1, 2, 3, 4, 8)
INPUT_SCALES = (1.0, 5.0)
# Out-of-range ids placed in block-table padding: a kernel that reads one faults or goes wrong.
PADDING_IDS = (-1, 2**31 - 1)


@dataclass(frozen=True)
class LayoutSpec:
    """A layout as plain values. kind: "dense" (layout=None), "local_strided" or "block_mask"."""

    kind: str = "dense"
    block_size: int = 16
    local_blocks: int = 1
    vert_stride: int = 1
    homo_head: bool = False
    num_heads_total: int | None = None
    head_offset: int = 0
    density: float = 1.0  # block_mask: probability that a causal block is kept
    mask_seed: int = 0
    shared_heads: bool = False  # block_mask: one [NB, NB] mask for every head

    def build(self, num_heads: int, max_len: int):
        """The layout object for `num_heads` heads and sequences up to `max_len` tokens."""
        if self.kind == "dense":
            return None
        if self.kind == "local_strided":
            return reference.LocalStridedLayout(
                self.block_size,
                self.local_blocks,
                self.vert_stride,
                homo_head=self.homo_head,
                num_heads_total=self.num_heads_total,
                head_offset=self.head_offset,
            )
        if self.kind == "block_mask":
            num_blocks = max(1, math.ceil(max_len / self.block_size))
            mask = reference.random_block_mask(
                1 if self.shared_heads else num_heads, num_blocks, self.density, self.mask_seed
            )
            return reference.BlockMaskLayout(mask[0] if self.shared_heads else mask, self.block_size)
        raise ValueError(f"unknown layout kind {self.kind!r}")


@dataclass(frozen=True)
class AttentionCase:
    """One paged-attention problem: batch shape, cache geometry, layout, dtype and a seed."""

    seed: int
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]  # the last query_lens[b] tokens of sequence b are queries
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    input_scale: float = 1.0
    scale: float | None = None
    layout: LayoutSpec = LayoutSpec()
    spare_pages: int = 2  # pages no sequence owns; they hold garbage

    @property
    def context_lens(self) -> tuple[int, ...]:
        return tuple(n - q for n, q in zip(self.seq_lens, self.query_lens, strict=True))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionCase":
        d = dict(d)
        d["layout"] = LayoutSpec(**d["layout"])
        d["seq_lens"], d["query_lens"] = tuple(d["seq_lens"]), tuple(d["query_lens"])
        return cls(**d)


def build_inputs(case: AttentionCase, device) -> dict:
    """Tensors of a case, from its seed alone.

    Pages are scattered at random over the cache; unused pages and the unused tail of each
    sequence's last page hold NaN, and block-table padding holds out-of-range page ids, so a kernel
    that reads what it must not fails loudly.

    Returns a dict with q [num_tokens, num_heads, head_dim], k_cache and v_cache
    [num_pages, page_size, num_kv_heads, head_dim], block_tables int32 [num_seqs, max_pages_per_seq],
    seq_lens int32 [num_seqs], query_start_loc int32 [num_seqs + 1], layout and scale.
    """
    gen = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]
    page = case.page_size
    pages_per_seq = [math.ceil(n / page) for n in case.seq_lens]
    num_pages = sum(pages_per_seq) + case.spare_pages
    width = max(pages_per_seq, default=0) + 1 + int(torch.randint(0, 3, (1,), generator=gen))
    order = torch.randperm(num_pages, generator=gen)
    table = torch.tensor(PADDING_IDS, dtype=torch.int64)[
        torch.randint(0, len(PADDING_IDS), (len(case.seq_lens), width), generator=gen)
    ]
    cache_shape = (num_pages, page, case.num_kv_heads, case.head_dim)
    k_cache = torch.full(cache_shape, math.nan, dtype=torch.float32)
    v_cache = torch.full(cache_shape, math.nan, dtype=torch.float32)
    used = 0
    for b, n in enumerate(case.seq_lens):
        ids = order[used : used + pages_per_seq[b]]
        used += pages_per_seq[b]
        table[b, : len(ids)] = ids
        for cache in (k_cache, v_cache):
            values = torch.randn(n, case.num_kv_heads, case.head_dim, generator=gen) * case.input_scale
            flat = cache[ids].reshape(-1, case.num_kv_heads, case.head_dim)
            flat[:n] = values
            cache[ids] = flat.view(len(ids), page, case.num_kv_heads, case.head_dim)
    num_tokens = sum(case.query_lens)
    q = torch.randn(num_tokens, case.num_heads, case.head_dim, generator=gen) * case.input_scale
    starts = [0]
    for n in case.query_lens:
        starts.append(starts[-1] + n)
    return dict(
        q=q.to(dtype).to(device),
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        block_tables=table.to(torch.int32).to(device),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        layout=case.layout.build(case.num_heads, max(case.seq_lens, default=1)),
        scale=case.scale,
    )


def block_sizes() -> st.SearchStrategy[int]:
    """Sparse block sizes 1..128, the usual powers of two weighted up."""
    return st.one_of(st.sampled_from(BLOCK_SIZES), st.integers(1, 128))


def page_sizes(block_size: int | None = None) -> st.SearchStrategy[int]:
    """Page sizes: the named ones, any size in 1..128, and (given S) ones that do not divide S."""
    named = st.sampled_from(PAGE_SIZES)
    if block_size is None or block_size < 3:
        return st.one_of(named, st.integers(1, 128))
    non_divisors = [p for p in range(2, min(block_size, 128) + 8) if block_size % p and p % block_size]
    return st.one_of(named, st.integers(1, 128), st.sampled_from(non_divisors or [3]))


@st.composite
def local_strided_layouts(draw, num_heads: int, block_size: st.SearchStrategy[int] | None = None):
    """Local + vertical-stride layouts: homo and per-head columns, tensor-parallel shards."""
    homo = draw(st.booleans())
    shards = draw(st.sampled_from((1, 1, 2, 4)))
    total = num_heads * shards if shards > 1 else draw(st.sampled_from((None, num_heads)))
    offset = num_heads * draw(st.integers(0, shards - 1)) if shards > 1 else 0
    return LayoutSpec(
        kind="local_strided",
        block_size=draw(block_sizes() if block_size is None else block_size),
        local_blocks=draw(st.integers(1, 6)),
        vert_stride=draw(st.integers(1, 10)),
        homo_head=homo,
        num_heads_total=total,
        head_offset=offset,
    )


@st.composite
def block_mask_layouts(draw, block_size: st.SearchStrategy[int] | None = None):
    """Random block masks, empty rows included (density 0 empties every row)."""
    return LayoutSpec(
        kind="block_mask",
        block_size=draw(block_sizes() if block_size is None else block_size),
        density=draw(st.sampled_from((0.0, 0.15, 0.5, 0.85, 1.0))),
        mask_seed=draw(st.integers(0, 2**31 - 1)),
        shared_heads=draw(st.booleans()),
    )


def layouts(num_heads: int, block_size: st.SearchStrategy[int] | None = None):
    """Dense causal, local/vertical-stride or random block-mask layouts."""
    return st.one_of(
        st.just(LayoutSpec()), local_strided_layouts(num_heads, block_size), block_mask_layouts(block_size)
    )


@st.composite
def context_len(draw, seq_len: int, block_size: int, page_size: int) -> int:
    """Cached context before the queries: 0, 1, unaligned, aligned to S or P, or seq_len - 1."""
    choices = [0, 1, seq_len - 1, draw(st.integers(0, seq_len - 1))]
    for unit in (block_size, page_size):
        if seq_len > unit:
            choices.append(unit * draw(st.integers(1, (seq_len - 1) // unit)))
    return min(draw(st.sampled_from(choices)), seq_len - 1)


@st.composite
def attention_cases(
    draw,
    *,
    max_seqs: int = 3,
    max_seq_len: int = 96,
    max_heads: int = 8,
    head_dims=HEAD_DIMS,
    dtypes=tuple(DTYPES),
    decode: bool = False,
    layout_kinds=("dense", "local_strided", "block_mask"),
    page_size=None,
):
    """A mixed batch of sequences with cached contexts over a scattered paged cache.

    Args:
        max_seqs, max_seq_len, max_heads: size caps (keep them small under the CPU interpreter).
        head_dims, dtypes: values to draw from.
        decode: one query per sequence (`paged_decode`).
        layout_kinds: which layout families to draw.
        page_size: a fixed page-size strategy, else `page_sizes(block_size)`.
    """
    num_kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([g for g in GQA_GROUPS if g * num_kv_heads <= max_heads] or [1]))
    num_heads = num_kv_heads * group
    kind = draw(st.sampled_from(layout_kinds))
    if kind == "dense":
        layout = LayoutSpec(block_size=draw(block_sizes()))
    elif kind == "local_strided":
        layout = draw(local_strided_layouts(num_heads))
    else:
        layout = draw(block_mask_layouts())
    page = draw(page_size if page_size is not None else page_sizes(layout.block_size))
    num_seqs = draw(st.integers(1, max_seqs))
    seq_lens, query_lens = [], []
    for _ in range(num_seqs):
        n = draw(st.one_of(st.integers(1, max_seq_len), st.sampled_from([1, 2, max_seq_len])))
        ctx = n - 1 if decode else draw(context_len(n, layout.block_size, page))
        seq_lens.append(n)
        query_lens.append(n - ctx)
    return AttentionCase(
        seed=draw(st.integers(0, 2**31 - 1)),
        seq_lens=tuple(seq_lens),
        query_lens=tuple(query_lens),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from(head_dims)),
        page_size=page,
        dtype=draw(st.sampled_from(dtypes)),
        input_scale=draw(st.sampled_from(INPUT_SCALES)),
        scale=draw(st.sampled_from((None, None, 1.0 / 128, 0.3))),
        layout=layout,
        spare_pages=draw(st.integers(0, 3)),
    )


# Fuzz strategies

# The campaign's caps, wider than the test profile's defaults (3 sequences, 96 tokens, 8 heads).
# On the CPU the Triton interpreter pays per tile iteration, so its caps stay interpreter-sized.
FUZZ_CAPS = {
    "cpu": dict(max_seqs=4, max_seq_len=160, max_heads=8),
    "cuda": dict(max_seqs=8, max_seq_len=2048, max_heads=32),
}
FUZZ_DECODE_SEQS = {"cpu": 8, "cuda": 32}


def fuzz_attention_cases(
    *,
    device: str = "cpu",
    decode: bool = False,
    dtypes=tuple(DTYPES),
    layout_kinds=("dense", "local_strided", "block_mask"),
):
    """`attention_cases` with the fuzz campaign's wider caps for `device` ("cpu" or "cuda")."""
    caps = dict(FUZZ_CAPS[device])
    if decode:
        caps["max_seqs"] = FUZZ_DECODE_SEQS[device]
    return attention_cases(**caps, decode=decode, dtypes=dtypes, layout_kinds=layout_kinds)


# Kernel-test strategies (tests/kernels): cache-write cases.


@dataclass(frozen=True)
class WriteKVCase:
    """One cache write: token count, cache geometry, dtype, share of padding (-1) slots, seed."""

    seed: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    dtype: str
    pad_fraction: float


@st.composite
def write_kv_cases(draw, *, max_tokens: int = 48, dtypes=KERNEL_DTYPES):
    """Cache writes over any page size, odd head dims and padding slots; tokens never exceed slots."""
    page = draw(page_sizes())
    num_pages = draw(st.integers(1, max(1, 2 * max_tokens // page + 1)))
    return WriteKVCase(
        seed=draw(st.integers(0, 2**31 - 1)),
        num_tokens=draw(st.integers(0, min(max_tokens, page * num_pages))),
        num_kv_heads=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from(HEAD_DIMS)),
        page_size=page,
        num_pages=num_pages,
        dtype=draw(st.sampled_from(dtypes)),
        pad_fraction=draw(st.sampled_from((0.0, 0.25, 1.0))),
    )


# Engine strategies

ENGINE_VOCAB = 128  # engine.model.MODEL_CONFIGS["tiny"]["vocab_size"]
ENGINE_SALTS = (None, "tenant-a", "tenant-b")
ENGINE_BUDGETS = (16, 5, 37, 512)  # max_num_batched_tokens: tiny chunks to whole prompts
ENGINE_ARRIVALS = (1, 0, 4, 0, 40)  # engine steps between two arrivals (40: the earlier ones are done)
ENGINE_SPARE_PAGES = (1, 0, 3, 8, 256)  # pages beyond the largest request's need: pressure to plenty


@dataclass(frozen=True)
class EngineRequest:
    """One request of a stream; it arrives `arrival_steps` engine steps after the previous one."""

    prompt: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    arrival_steps: int = 0


@dataclass(frozen=True)
class EngineStream:
    """A request stream and the engine geometry it runs on (plain values, JSON-ready)."""

    requests: tuple[EngineRequest, ...]
    page_size: int
    num_pages: int
    max_num_batched_tokens: int
    max_num_seqs: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineStream":
        d = dict(d)
        d["requests"] = tuple(EngineRequest(**{**r, "prompt": tuple(r["prompt"])}) for r in d["requests"])
        return cls(**d)


def token_ids(vocab: int, min_size: int, max_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, vocab - 1), min_size=min_size, max_size=max_size)


@st.composite
def request_streams(
    draw,
    *,
    vocab: int = ENGINE_VOCAB,
    max_requests: int = 6,
    max_prompt_len: int = 80,
    max_new_tokens: int = 6,
    page_sizes=(8, 16),
    salts=ENGINE_SALTS,
    budgets=ENGINE_BUDGETS,
    spare_pages=ENGINE_SPARE_PAGES,
):
    """Streams with shared system prompts, repeated prompts, random suffixes and staggered arrivals.

    The cache holds the largest request alone plus a drawn number of spare pages, so streams range
    from constant preemption and eviction to no pressure at all.
    """
    page = draw(st.sampled_from(page_sizes))
    systems = draw(st.lists(token_ids(vocab, page, 56), min_size=1, max_size=2))
    requests: list[EngineRequest] = []
    for _ in range(draw(st.integers(min(2, max_requests), max_requests))):
        kind = draw(st.sampled_from(("system", "repeat", "random", "system")))
        if kind == "repeat" and requests:
            prompt = list(draw(st.sampled_from(requests)).prompt)
        elif kind == "random":
            prompt = draw(token_ids(vocab, 1, max_prompt_len))
        else:
            prompt = draw(st.sampled_from(systems)) + draw(token_ids(vocab, 1, 24))
        requests.append(
            EngineRequest(
                prompt=tuple(prompt[:max_prompt_len]),
                max_tokens=draw(st.integers(1, max_new_tokens)),
                cache_salt=draw(st.sampled_from(salts)),
                arrival_steps=draw(st.sampled_from(ENGINE_ARRIVALS)),
            )
        )
    need = max(math.ceil((len(r.prompt) + r.max_tokens - 1) / page) for r in requests)
    return EngineStream(
        requests=tuple(requests),
        page_size=page,
        num_pages=need + draw(st.sampled_from(spare_pages)),
        max_num_batched_tokens=draw(st.sampled_from(budgets)),
        max_num_seqs=draw(st.sampled_from((4, 16, 2, 1))),
    )


def pool_prompts(page_size: int) -> st.SearchStrategy[list[int]]:
    """Block-pool prompts over a 3-letter alphabet: page contents repeat, so prefixes collide often."""
    return token_ids(3, 1, 4 * page_size + 1)


# The tiny engine model's vocabulary (engine/model.py, MODEL_CONFIGS["tiny"]).
TINY_VOCAB = 128


@dataclass(frozen=True)
class EngineCase:
    """A request stream for the engine: prompts sharing prefixes, sent in rounds of `generate` calls.

    `rounds[i]` lists the prompt indexes of the i-th `generate` call (repeats allowed, so a round can
    hit pages cached by an earlier one); `salts[j]` is prompt j's cache_salt.
    """

    seed: int
    page_size: int
    num_pages: int
    max_tokens: int
    prompts: tuple[tuple[int, ...], ...]
    salts: tuple[str | None, ...]
    rounds: tuple[tuple[int, ...], ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineCase":
        d = dict(d)
        d["prompts"] = tuple(tuple(p) for p in d["prompts"])
        d["rounds"] = tuple(tuple(r) for r in d["rounds"])
        d["salts"] = tuple(d["salts"])
        return cls(**d)


@st.composite
def engine_cases(draw, *, max_prompts: int = 5, max_len: int = 40, vocab: int = TINY_VOCAB):
    """Prompts cut from a few shared stems plus private suffixes, in 1-3 rounds, over a cache whose
    size ranges from just enough for the longest request (evictions, preemptions) to roomy."""
    page = draw(st.sampled_from((1, 2, 3, 4, 8, 16)))
    token = st.integers(0, vocab - 1)
    stems = draw(st.lists(st.lists(token, min_size=1, max_size=max_len), min_size=1, max_size=3))
    prompts = []
    for _ in range(draw(st.integers(1, max_prompts))):
        stem = stems[draw(st.integers(0, len(stems) - 1))]
        cut = draw(st.integers(0, len(stem)))
        prompt = stem[:cut] + draw(st.lists(token, min_size=0 if cut else 1, max_size=page + 3))
        prompts.append(tuple(prompt))
    max_tokens = draw(st.integers(1, 4))
    indexes = st.integers(0, len(prompts) - 1)
    rounds = draw(st.lists(st.lists(indexes, min_size=1, max_size=4), min_size=1, max_size=3))
    longest = max(math.ceil((len(p) + max_tokens - 1) / page) for p in prompts)
    return EngineCase(
        seed=draw(st.integers(0, 2**31 - 1)),
        page_size=page,
        num_pages=longest + draw(st.sampled_from((0, 1, 3, 8, 64))),
        max_tokens=max_tokens,
        prompts=tuple(prompts),
        salts=tuple(draw(st.sampled_from((None, None, "a", "b"))) for _ in prompts),
        rounds=tuple(tuple(r) for r in rounds),
    )
