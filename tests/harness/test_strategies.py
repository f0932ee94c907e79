"""Every region the shared strategies advertise is reachable (harness/strategies.py).

A strategy that silently stopped drawing, say, negative scales or contexts that are not a multiple
of the sparse block would leave a whole class of bugs untested while every test stayed green. Each
region below is found with hypothesis's `find` (no tensors are built), and a capability narrows what
is drawn without emptying anything else.
"""

import json

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.errors import NoSuchExample

from backends.registry import LAYOUT_KINDS, Capabilities
from harness.cases import DTYPES, AttentionCase, AttentionShape, decode_mask
from harness.strategies import SCALE_LIMIT, attention_cases, engine_cases, scales, write_kv_cases
from reference.layouts import layout_block_mask

# Derandomized: each search is the same every run (a region found today is found every time).
SEARCH = settings(
    max_examples=5_000,
    database=None,
    derandomize=True,
    phases=[Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
    deadline=None,
)


# What must never be drawn: a plain search of this many examples.
NEVER = settings(SEARCH, max_examples=1_000, phases=[Phase.generate])


def reachable(strategy, condition) -> None:
    find(strategy, condition, settings=SEARCH)


@pytest.mark.parametrize(
    "region",
    [
        pytest.param(lambda s: s is None, id="default"),
        pytest.param(lambda s: s == 0.0, id="zero"),
        pytest.param(lambda s: s is not None and s < 0, id="negative"),
        pytest.param(lambda s: s is not None and 0 < s < 1e-20, id="tiny-positive"),
        pytest.param(lambda s: s is not None and -1e-20 < s < 0, id="tiny-negative"),
        pytest.param(lambda s: s is not None and s >= SCALE_LIMIT / 2, id="saturating"),
        pytest.param(lambda s: s is not None and s <= -SCALE_LIMIT / 2, id="saturating-negative"),
        pytest.param(lambda s: s == 1.0 / 128, id="phi3-mup"),
    ],
)
def test_scales_reach(region):
    reachable(scales(), region)


def _sparse(c):
    return c.layout.kind != "dense"


def _field_is(get, value):
    return lambda c: get(c) == value


PREFILL_REGIONS = {
    **{f"layout-{k}": _field_is(lambda c: c.layout.kind, k) for k in LAYOUT_KINDS},
    **{f"dtype-{d}": _field_is(lambda c: c.dtype, d) for d in DTYPES},
    "negative-scale": lambda c: c.scale is not None and c.scale < 0,
    "context-a-multiple-of-S": lambda c: (
        _sparse(c) and any(x and x % c.layout.block_size == 0 for x in c.context_lens)
    ),
    "context-not-a-multiple-of-S": lambda c: (
        _sparse(c) and any(x % c.layout.block_size for x in c.context_lens)
    ),
    "context-a-multiple-of-P": lambda c: any(x and x % c.page_size == 0 for x in c.context_lens),
    "no-context": lambda c: all(x == 0 for x in c.context_lens),
    "P-and-S-unrelated": lambda c: (
        _sparse(c) and c.page_size % c.layout.block_size != 0 and c.layout.block_size % c.page_size != 0
    ),
    "P-above-S": lambda c: _sparse(c) and c.page_size > c.layout.block_size,
    "empty-rows": lambda c: c.layout.kind == "block_mask" and c.layout.density == 0.0,
    "shared-head-mask": lambda c: c.layout.kind == "block_mask" and c.layout.shared_heads,
    "tensor-parallel-shard": lambda c: (
        c.layout.kind == "local_strided"
        and (c.layout.num_heads_total or 0) > c.num_heads
        and c.layout.head_offset > 0
    ),
    "homo-head": lambda c: c.layout.kind == "local_strided" and c.layout.homo_head,
    "dense-stride-1": lambda c: c.layout.kind == "local_strided" and c.layout.vert_stride == 1,
    "gqa": lambda c: c.num_heads > c.num_kv_heads > 1,
    "several-sequences": lambda c: len(c.seq_lens) >= 3,
    "one-token-sequence": lambda c: 1 in c.seq_lens,
    "longest-sequence": lambda c: max(c.seq_lens) == 96,
    "head-dim-not-a-power-of-two": lambda c: c.head_dim & (c.head_dim - 1) != 0,
    "head-dim-1": lambda c: c.head_dim == 1,
    "inputs-x5": lambda c: c.input_scale == 5.0,
    "no-spare-pages": lambda c: c.spare_pages == 0,
    "page-size-1": lambda c: c.page_size == 1,
}


@pytest.mark.parametrize("region", list(PREFILL_REGIONS.values()), ids=list(PREFILL_REGIONS))
def test_prefill_cases_reach(region):
    reachable(attention_cases(), region)


def test_decode_cases_have_one_query_and_a_full_context():
    reachable(
        attention_cases(decode=True),
        lambda c: len(c.seq_lens) > 1 and all(q == 1 for q in c.query_lens) and max(c.context_lens) > 0,
    )


# (declared capabilities, a region still reachable under them, what they exclude)
NARROWING = [
    pytest.param(
        dict(block_sizes=(16, 32)),
        lambda c: c.layout.block_size == 32,
        lambda c: c.layout.kind != "dense" and c.layout.block_size not in (16, 32),
        id="block_sizes",
    ),
    pytest.param(
        dict(page_sizes=(3,)), lambda c: len(c.seq_lens) > 1, lambda c: c.page_size != 3, id="page_sizes"
    ),
    pytest.param(
        dict(context=False), lambda c: len(c.seq_lens) > 1, lambda c: any(c.context_lens), id="context"
    ),
    pytest.param(
        dict(dtypes=("bfloat16",)),
        lambda c: c.layout.kind == "block_mask",
        lambda c: c.dtype != "bfloat16",
        id="dtypes",
    ),
    pytest.param(
        dict(layouts=("dense", "block_mask")),
        lambda c: c.layout.kind == "block_mask",
        lambda c: c.layout.kind == "local_strided",
        id="layouts",
    ),
]


@pytest.mark.parametrize("caps, region, excluded", NARROWING)
def test_capabilities_narrow_without_emptying(caps, region, excluded):
    declared = Capabilities.from_mapping(caps, "test")
    strategy = attention_cases(caps=declared)
    reachable(strategy, region)
    with pytest.raises(NoSuchExample):
        find(strategy, excluded, settings=NEVER)


@pytest.mark.parametrize("caps, region, excluded", NARROWING)
def test_capabilities_refuse_what_they_exclude(caps, region, excluded):
    # The same rule decides at collection time which named cases an implementation is asked for.
    declared = Capabilities.from_mapping(caps, "test")
    outside = find(attention_cases(), excluded, settings=SEARCH)
    assert declared.refuses(outside, "paged_prefill"), outside
    inside = find(attention_cases(caps=declared), lambda c: True, settings=SEARCH)
    assert declared.refuses(inside, "paged_prefill") is None, inside


@pytest.mark.parametrize(
    "region",
    [
        pytest.param(lambda c: c.num_tokens == 0, id="no-tokens"),
        pytest.param(lambda c: c.pad_fraction == 1.0 and c.num_tokens > 0, id="all-padding"),
        pytest.param(lambda c: c.num_tokens == c.page_size * c.num_pages, id="cache-full"),
        pytest.param(lambda c: c.dtype == "bfloat16", id="bfloat16"),
    ],
)
def test_write_kv_cases_reach(region):
    reachable(write_kv_cases(), region)


@pytest.mark.parametrize(
    "region",
    [
        pytest.param(
            lambda c: c.num_pages == max(-(-(len(p) + c.max_tokens - 1) // c.page_size) for p in c.prompts),
            id="pressure",
        ),
        pytest.param(lambda c: len({s for s in c.salts if s}) == 2, id="two-tenants"),
        pytest.param(lambda c: any(len(set(r)) < len(r) for r in c.rounds), id="repeat-in-a-round"),
        pytest.param(lambda c: len(c.rounds) == 3, id="three-rounds"),
    ],
)
def test_engine_cases_reach(region):
    reachable(engine_cases(), region)


def test_family_cases_reach_and_replay_from_their_values(family):
    """A family's case keeps the drawn layout as its block mask: JSON round trip, same layout."""
    strategy = attention_cases(layout_kinds=(), families=(family,))
    case = find(strategy, lambda c: len(set(c.seq_lens)) > 1 and c.layout.block_size > 1, settings=SEARCH)
    assert case.layout.kind == "family" and case.layout.family == family.name
    again = AttentionCase.from_dict(json.loads(json.dumps(case.to_dict())))
    assert again == case
    nb = -(-max(case.seq_lens) // case.layout.block_size)
    built = again.layout.build(case.num_heads, max(case.seq_lens))
    kept = layout_block_mask(built, case.num_heads, nb)
    stored = decode_mask(case.layout.mask)
    assert torch.equal(kept.expand(case.num_heads, -1, -1), stored.expand(case.num_heads, -1, -1))
    assert AttentionShape.of(case).family == family.name and AttentionShape.of(case).block_size == 0


def test_family_layouts_only_for_block_mask_capability(family):
    with pytest.raises(ValueError, match="nothing to draw"):
        find(
            attention_cases(caps=Capabilities(layouts=("dense",)), layout_kinds=(), families=(family,)),
            lambda c: True,
            settings=SEARCH,
        )
    caps = Capabilities(block_sizes=(4,))
    reachable(
        attention_cases(caps=caps, layout_kinds=(), families=(family,)),
        lambda c: c.layout.kind == "family" and c.layout.block_size == 4,
    )
