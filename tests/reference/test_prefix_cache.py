"""Hand-sized examples of the slow prefix-cache model (reference/prefix_cache.py)."""

import pytest

from reference.prefix_cache import PrefixCacheModel

P = 4  # page size of every example


def _run(model: PrefixCacheModel, tokens: list[int], salt=None) -> list[int]:
    """Admits a request whose whole prompt is computed at once; returns its block table."""
    hits = model.lookup(tokens, salt)
    table = model.allocate(hits, -(-len(tokens) // P) - len(hits), num_query_tokens=len(tokens))
    model.cache(table, tokens, salt, len(hits), len(tokens) // P)
    return table


def test_prefix_cache_lookup_hits_full_pages_only():
    model = PrefixCacheModel(num_pages=8, page_size=P)
    table = _run(model, list(range(10)))  # pages 0, 1 full; page 2 holds 2 tokens
    model.free(table)
    assert model.lookup(list(range(10)), None) == [0, 1]
    assert model.lookup(list(range(8)) + [99], None) == [0, 1]
    assert model.lookup([0, 1, 2, 3, 9], None) == [0]
    assert model.lookup([1, 1, 2, 3, 9], None) == []


@pytest.mark.parametrize(
    "length, expected",
    [
        pytest.param(8, [0], id="exact-two-pages-keeps-last-token"),
        pytest.param(9, [0, 1], id="one-past"),
        pytest.param(4, [], id="one-page"),
        pytest.param(5, [0], id="page-plus-one"),
    ],
)
def test_prefix_cache_lookup_cap(length, expected):
    model = PrefixCacheModel(num_pages=8, page_size=P)
    model.free(_run(model, list(range(12))))
    assert model.lookup(list(range(length)), None) == expected


def test_prefix_cache_salt_separates_tenants():
    model = PrefixCacheModel(num_pages=8, page_size=P)
    model.free(_run(model, list(range(9)), salt="a"))
    assert model.lookup(list(range(9)), "a") == [0, 1]
    assert model.lookup(list(range(9)), "b") == []
    assert model.lookup(list(range(9)), None) == []


def test_prefix_cache_reverse_free_evicts_tail_first():
    model = PrefixCacheModel(num_pages=4, page_size=P)
    table = _run(model, list(range(13)))  # pages 0, 1, 2 full, page 3 partial
    assert table == [0, 1, 2, 3]
    model.free(table)
    assert model.free_order() == [3, 2, 1, 0]
    # A request sharing one page needs 2 new pages: it takes 3 (uncached) then 2 (evicts [0..12)).
    table = _run(model, [0, 1, 2, 3, 7, 7, 7, 7, 7])
    assert table == [0, 3, 2]
    assert model.evictions == 1
    assert model.lookup(list(range(13)), None) == [0, 1]


def test_prefix_cache_touch_before_allocate():
    model = PrefixCacheModel(num_pages=3, page_size=P)
    model.free(_run(model, list(range(9))))  # free order [2, 1, 0]: page 0 is the hit, taken last
    model.free(_run(model, [5] * 9))  # takes 2, 1, 0 -> everything evicted, hit order reversed
    assert model.lookup(list(range(9)), None) == []
    model.free(_run(model, list(range(5))))
    hits = model.lookup(list(range(9)), None)
    assert len(hits) == 1
    assert model.can_allocate(hits, 2)  # 3 free; the hit is touched, 2 others remain
    assert not model.can_allocate(hits, 3)
    table = model.allocate(hits, 2)
    assert table[0] == hits[0] and set(table) == {0, 1, 2}
    assert model.evictions == 3 + 1  # three evicted above, then the [5]*9 page not hit


def test_prefix_cache_duplicate_page_stays_uncached():
    model = PrefixCacheModel(num_pages=8, page_size=P)
    a = model.allocate([], 2)
    b = model.allocate([], 2)
    tokens = list(range(8))
    model.cache(a, tokens, None, 0, 2)
    model.cache(b, tokens, None, 0, 2)
    assert model.lookup(tokens + [1], None) == a
    assert sorted(model.cached_prefixes().values()) == sorted(a)


def test_prefix_cache_counters_and_reset():
    model = PrefixCacheModel(num_pages=8, page_size=P)
    model.free(_run(model, list(range(9))))
    table = _run(model, list(range(9)))
    assert (model.queries, model.hits) == (18, 8)
    assert not model.reset()  # pages in use
    model.free(table)
    assert model.reset()
    assert model.lookup(list(range(9)), None) == []


def test_prefix_cache_disabled():
    model = PrefixCacheModel(num_pages=8, page_size=P, enable_caching=False)
    model.free(_run(model, list(range(9))))
    assert model.lookup(list(range(9)), None) == []
    assert model.cached_prefixes() == {}
