"""Hypothesis strategies shared by the tests, `fuzz/` and `reports/`.

They draw cases of `harness.cases` (plain values); the tensors are built afterwards from each case's
seed. Every strategy that draws attention or write cases takes the implementation's `Capabilities`,
so that a case outside what it declares is never drawn (contract §9).
"""

import math

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis import strategies as st

from backends import layout_families
from backends.registry import LAYOUT_KINDS, Capabilities
from harness.cases import (
    DTYPES,
    AttentionCase,
    AttentionShape,
    EngineCase,
    EngineRequest,
    EngineStream,
    LayoutSpec,
    WriteKVCase,
)

ALL = Capabilities()
PAGE_SIZES = (1, 2, 5, 16, 64, 128)
BLOCK_SIZES = (1, 2, 3, 4, 8, 16, 32, 64, 128)
HEAD_DIMS = (16, 32, 60, 64, 80, 96, 128)
MAX_SIZE = 128  # page sizes, sparse block sizes and head dims are drawn from 1..MAX_SIZE as well
GQA_GROUPS = (1, 2, 3, 4, 8)
INPUT_SCALES = (1.0, 5.0)  # contract §5: randn inputs, x1 and x5
DENSITIES = (0.0, 0.15, 0.5, 0.85, 1.0)
# |scale| up to SCALE_LIMIT: with randn inputs x5 and head_dim <= 128 the scores reach ~1.4e3 (5 sigma
# of 25 * sqrt(128)), so |scale * score| stays under float16's 65504 and the in-dtype oracle (the
# tolerance rule's base) stays finite; 32 also saturates the softmax (weights exp(-32 * gap)).
SCALE_LIMIT = 32.0
SPECIAL_SCALES = (0.0, 1.0 / 128, 1e-30, -1e-30, -1.0, SCALE_LIMIT, -SCALE_LIMIT)
SEED_LIMIT = 2**31 - 1


def sample(strategy, n: int, seed_value: int) -> list:
    """Up to n values of `strategy`, drawn by hypothesis with `seed_value` (generation only: fewer when
    the strategy holds fewer distinct values)."""
    found = []

    @seed(seed_value)
    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    @given(value=strategy)
    def collect(value):
        found.append(value)

    collect()
    return found


def _allowed(values, declared):
    """`values` restricted to a declared collection (None: no restriction)."""
    return tuple(values) if declared is None else tuple(v for v in values if v in declared)


def _sizes(named, declared) -> st.SearchStrategy[int]:
    """Named sizes, weighted up, and any size in 1..MAX_SIZE; only declared ones when declared."""
    if declared is not None:
        return st.sampled_from(tuple(declared))
    return st.one_of(st.sampled_from(named), st.integers(1, MAX_SIZE))


def scales() -> st.SearchStrategy[float | None]:
    """The whole valid domain of `scale`: the default, any finite float up to SCALE_LIMIT in size
    (negative, tiny, subnormal, saturating) and named edge values."""
    return st.one_of(
        st.none(),
        st.floats(-SCALE_LIMIT, SCALE_LIMIT, allow_nan=False, allow_infinity=False),
        st.sampled_from(SPECIAL_SCALES),
    )


def block_sizes(declared=None) -> st.SearchStrategy[int]:
    """Sparse block sizes 1..128, the usual powers of two weighted up (only declared ones if given)."""
    return _sizes(BLOCK_SIZES, declared)


def page_sizes(block_size: int | None = None, declared=None) -> st.SearchStrategy[int]:
    """Page sizes: the named ones, any size in 1..128, and (given S) ones that do not divide S."""
    if declared is not None:
        return st.sampled_from(tuple(declared))
    named = st.sampled_from(PAGE_SIZES)
    if block_size is None or block_size < 3:
        return st.one_of(named, st.integers(1, MAX_SIZE))
    non_divisors = [p for p in range(2, min(block_size, MAX_SIZE) + 8) if block_size % p and p % block_size]
    return st.one_of(named, st.integers(1, MAX_SIZE), st.sampled_from(non_divisors or [3]))


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
        density=draw(st.one_of(st.sampled_from(DENSITIES), st.floats(0.0, 1.0))),
        mask_seed=draw(st.integers(0, 2**31 - 1)),
        shared_heads=draw(st.booleans()),
    )


@st.composite
def context_len(draw, seq_len: int, block_size: int, page_size: int) -> int:
    """Cached context before the queries: 0, 1, unaligned, aligned to S or P, or seq_len - 1."""
    choices = [0, 1, seq_len - 1, draw(st.integers(0, seq_len - 1))]
    for unit in (block_size, page_size):
        if seq_len > unit:
            choices.append(unit * draw(st.integers(1, (seq_len - 1) // unit)))
    return min(draw(st.sampled_from(choices)), seq_len - 1)


def case_seeds(shard: tuple[int, int] | None = None) -> st.SearchStrategy[int]:
    """Seeds of a case's tensors; with shard (k, n), 1 <= k <= n, only those congruent to k - 1 mod
    n, so the draws of different shards of one campaign are disjoint."""
    if shard is None:
        return st.integers(0, SEED_LIMIT)
    k, n = shard
    return st.integers(0, (SEED_LIMIT - (k - 1)) // n).map(lambda s: s * n + k - 1)


def _family_named(name: str, families):
    """The family called `name`: one of `families`, else loaded (backends/layout_families.py)."""
    for family in families:
        if family.name == name:
            return family
    return layout_families.load(name)


@st.composite
def attention_shapes(
    draw,
    *,
    caps: Capabilities = ALL,
    max_heads: int = 8,
    dtypes=tuple(DTYPES),
    layout_kinds=LAYOUT_KINDS,
    families=(),
):
    """The compile-time part of `attention_cases` (harness.cases.AttentionShape), within `caps`.
    `families` (backends.layout_families.Family) join the layout kinds when `caps` declares
    general block masks."""
    dtypes, kinds = _allowed(dtypes, caps.dtypes), _allowed(layout_kinds, caps.layouts)
    layouts = [(kind, None) for kind in kinds]
    if "block_mask" in caps.layouts:
        layouts += [("family", family.name) for family in families]
    if not dtypes or not layouts:
        raise ValueError(f"nothing to draw: dtypes {dtypes}, layouts {kinds} under {caps}")
    num_kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([g for g in GQA_GROUPS if g * num_kv_heads <= max_heads] or [1]))
    kind, family = draw(st.sampled_from(layouts))
    block_size = 0 if family else draw(block_sizes(None if kind == "dense" else caps.block_sizes))
    return AttentionShape(
        dtype=draw(st.sampled_from(dtypes)),
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=draw(_sizes(HEAD_DIMS, caps.head_dims)),
        page_size=draw(page_sizes(block_size or None, caps.page_sizes)),
        layout_kind=kind,
        block_size=block_size,
        family=family,
    )


def family_layouts(family, num_heads: int, caps: Capabilities = ALL):
    """The layouts of `family` for `num_heads` heads, within the block sizes `caps` declares."""
    layouts = family.layouts(num_heads)
    if caps.block_sizes is not None:
        layouts = layouts.filter(lambda layout: layout.block_size in caps.block_sizes)
    return layouts


@st.composite
def attention_cases(
    draw,
    *,
    caps: Capabilities = ALL,
    decode: bool = False,
    max_seqs: int = 3,
    max_seq_len: int = 96,
    max_heads: int = 8,
    dtypes=tuple(DTYPES),
    layout_kinds=LAYOUT_KINDS,
    families=(),
    shape: AttentionShape | None = None,
    seeds: st.SearchStrategy[int] | None = None,
):
    """A mixed batch of sequences with cached contexts over a scattered paged cache.

    Args:
        caps: the implementation's capabilities; nothing outside them is drawn.
        decode: one query per sequence (`paged_decode`).
        max_seqs, max_seq_len, max_heads: size caps (keep them small under the CPU interpreter).
        dtypes, layout_kinds: narrow the draw further (a test of one layout kind, a fuzz --dtype).
        families: outside layout families (backends.layout_families.Family) drawn beside the kinds.
        shape: the compile-time part, fixed (default: drawn by `attention_shapes`, within the above).
        seeds: the strategy of the tensors' seed (default `case_seeds()`).
    """
    if shape is None:
        shape = draw(
            attention_shapes(
                caps=caps, max_heads=max_heads, dtypes=dtypes, layout_kinds=layout_kinds, families=families
            )
        )
    block = st.just(shape.block_size)
    drawn = None  # a family's layout object
    if shape.layout_kind == "family":
        drawn = draw(family_layouts(_family_named(shape.family, families), shape.num_heads, caps))
        layout = None
    elif shape.layout_kind == "dense":
        layout = LayoutSpec(block_size=shape.block_size)
    elif shape.layout_kind == "local_strided":
        layout = draw(local_strided_layouts(shape.num_heads, block))
    else:
        layout = draw(block_mask_layouts(block))
    block_size = shape.block_size if drawn is None else drawn.block_size
    num_seqs = draw(st.integers(1, max_seqs))
    seq_lens, query_lens = [], []
    for _ in range(num_seqs):
        n = draw(st.one_of(st.integers(1, max_seq_len), st.sampled_from([1, 2, max_seq_len])))
        if decode:
            ctx = n - 1
        elif caps.context:
            ctx = draw(context_len(n, block_size, shape.page_size))
        else:
            ctx = 0
        seq_lens.append(n)
        query_lens.append(n - ctx)
    if drawn is not None:
        layout = LayoutSpec.of_family(shape.family, drawn, shape.num_heads, max(seq_lens))
    return AttentionCase(
        seed=draw(case_seeds() if seeds is None else seeds),
        seq_lens=tuple(seq_lens),
        query_lens=tuple(query_lens),
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        page_size=shape.page_size,
        dtype=shape.dtype,
        input_scale=draw(st.sampled_from(INPUT_SCALES)),
        scale=draw(scales()),
        layout=layout,
        spare_pages=draw(st.integers(0, 3)),
    )


# The campaign's caps, wider than the test profile's defaults (3 sequences, 96 tokens, 8 heads).
# On the CPU the Triton interpreter pays per tile iteration, so its caps stay interpreter-sized.
FUZZ_CAPS = {
    "cpu": dict(max_seqs=4, max_seq_len=160, max_heads=8),
    "cuda": dict(max_seqs=8, max_seq_len=2048, max_heads=32),
}
FUZZ_DECODE_SEQS = {"cpu": 8, "cuda": 32}


def fuzz_attention_shapes(
    *,
    caps: Capabilities = ALL,
    device: str = "cpu",
    dtypes=tuple(DTYPES),
    families=(),
    layout_kinds=LAYOUT_KINDS,
):
    """`attention_shapes` with the fuzz campaign's head cap for `device`."""
    return attention_shapes(
        caps=caps,
        max_heads=FUZZ_CAPS[device]["max_heads"],
        dtypes=dtypes,
        layout_kinds=layout_kinds,
        families=families,
    )


def fuzz_attention_cases(
    *,
    caps: Capabilities = ALL,
    device: str = "cpu",
    decode: bool = False,
    dtypes=tuple(DTYPES),
    shape: AttentionShape | None = None,
    seeds: st.SearchStrategy[int] | None = None,
    families=(),
):
    """`attention_cases` with the fuzz campaign's wider caps for `device` ("cpu" or "cuda")."""
    sizes = dict(FUZZ_CAPS[device])
    if decode:
        sizes["max_seqs"] = FUZZ_DECODE_SEQS[device]
    return attention_cases(
        caps=caps, decode=decode, dtypes=dtypes, shape=shape, seeds=seeds, families=families, **sizes
    )


@st.composite
def write_kv_cases(draw, *, caps: Capabilities = ALL, max_tokens: int = 48, dtypes=tuple(DTYPES)):
    """Cache writes over any page size, odd head dims and padding slots; tokens never exceed slots."""
    page = draw(page_sizes(declared=caps.page_sizes))
    num_pages = draw(st.integers(1, max(1, 2 * max_tokens // page + 1)))
    return WriteKVCase(
        seed=draw(case_seeds()),
        num_tokens=draw(st.integers(0, min(max_tokens, page * num_pages))),
        num_kv_heads=draw(st.integers(1, 3)),
        head_dim=draw(_sizes(HEAD_DIMS, caps.head_dims)),
        page_size=page,
        num_pages=num_pages,
        dtype=draw(st.sampled_from(_allowed(dtypes, caps.dtypes))),
        pad_fraction=draw(st.sampled_from((0.0, 0.25, 1.0))),
    )


# Engine strategies

ENGINE_VOCAB = 128  # engine.model.MODEL_CONFIGS["tiny"]["vocab_size"]
ENGINE_SALTS = (None, "tenant-a", "tenant-b")
ENGINE_BUDGETS = (16, 5, 37, 512)  # max_num_batched_tokens: tiny chunks to whole prompts
ENGINE_ARRIVALS = (1, 0, 4, 0, 40)  # engine steps between two arrivals (40: the earlier ones are done)
ENGINE_SPARE_PAGES = (1, 0, 3, 8, 256)  # pages beyond the largest request's need: pressure to plenty


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


ENGINE_PAGE_SIZES = (1, 2, 3, 4, 8, 16)


@st.composite
def engine_cases(
    draw,
    *,
    max_prompts: int = 5,
    max_len: int = 40,
    vocab: int = TINY_VOCAB,
    page_size: int | None = None,
    seeds: st.SearchStrategy[int] | None = None,
):
    """Prompts cut from a few shared stems plus private suffixes, in 1-3 rounds, over a cache whose
    size ranges from just enough for the longest request (evictions, preemptions) to roomy.
    `page_size` fixes the page size (default: drawn from ENGINE_PAGE_SIZES); `seeds` as in
    `attention_cases`."""
    page = draw(st.sampled_from(ENGINE_PAGE_SIZES)) if page_size is None else page_size
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
        seed=draw(case_seeds() if seeds is None else seeds),
        page_size=page,
        num_pages=longest + draw(st.sampled_from((0, 1, 3, 8, 64))),
        max_tokens=max_tokens,
        prompts=tuple(prompts),
        salts=tuple(draw(st.sampled_from((None, None, "a", "b"))) for _ in prompts),
        rounds=tuple(tuple(r) for r in rounds),
    )
