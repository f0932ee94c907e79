"""The block pool against the slow prefix-cache model, differentially (STYLE rule 17).

`ModelPool` puts `reference.prefix_cache.PrefixCacheModel` behind the engine pool's interface, so the
same scheduler (tests/engine/test_engine.py) can run on either one.
"""

import hashlib
import struct
from unittest.mock import patch

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from engine import block_pool
from engine.block_pool import BlockPool, PoolStats, pages_for
from engine.sequence import SamplingParams, Sequence
from harness.cases import EngineRequest, EngineStream
from harness.strategies import pool_prompts
from reference.prefix_cache import PrefixCacheModel
from tests.budgets import examples


class ModelPool:
    """The engine pool's interface (lookup / can_allocate / allocate / cache_full_pages / free /
    reset / stats) over the reference model, which sees only token lists and salts."""

    def __init__(self, num_pages: int, page_size: int, enable_caching: bool = True):
        self.model = PrefixCacheModel(num_pages, page_size, enable_caching)
        self.num_pages, self.page_size = num_pages, page_size
        self.stats = PoolStats()

    def _sync(self):
        self.stats.queries, self.stats.hits = self.model.queries, self.model.hits
        self.stats.evictions = self.model.evictions

    @property
    def num_free_pages(self) -> int:
        return len(self.model.free_order())

    @property
    def num_cached_pages(self) -> int:
        return len(self.model.page_of)

    def lookup(self, seq) -> list[int]:
        return self.model.lookup(seq.token_ids, seq.cache_salt)

    def can_allocate(self, hits, num_new) -> bool:
        return self.model.can_allocate(hits, num_new)

    def allocate(self, hits, num_new, num_query_tokens=None) -> list[int]:
        table = self.model.allocate(hits, num_new, num_query_tokens)
        self._sync()
        return table

    def cache_full_pages(self, seq) -> None:
        num_full = seq.num_computed_tokens // self.page_size
        self.model.cache(seq.block_table, seq.token_ids, seq.cache_salt, seq.num_offered_pages, num_full)
        seq.num_offered_pages = max(seq.num_offered_pages, num_full)

    def free(self, block_table) -> None:
        self.model.free(block_table)

    def reset(self) -> bool:
        return self.model.reset()

    def check_invariants(self) -> None:
        pass


def cached_prefixes(pool: BlockPool) -> dict:
    """The pool's hash map as the model keys it: (salt, token prefix) -> page id."""
    out = {}
    for page_id in pool.cached.values():
        node, tokens = pool.pages[page_id].key.node, []
        while node.parent is not None:
            tokens[:0] = node.token_ids
            node = node.parent
        out[(node.extra_keys[0], tuple(list(node.token_ids) + tokens))] = page_id
    return out


class PoolVsModel(RuleBasedStateMachine):
    """Random allocate / append / free / lookup / reset on both; they must agree exactly."""

    seqs = Bundle("seqs")

    @initialize(page_size=st.integers(1, 4), num_pages=st.integers(2, 10), caching=st.booleans())
    def setup(self, page_size, num_pages, caching):
        self.page = page_size
        self.pool = BlockPool(num_pages, page_size, seed=7, enable_caching=caching or page_size > 2)
        self.model = PrefixCacheModel(num_pages, page_size, self.pool.enable_caching)
        self.next_id = 0

    def _compute(self, seq: Sequence, first_offered: int) -> None:
        seq.num_computed_tokens = len(seq.token_ids)
        self.pool.cache_full_pages(seq)
        self.model.cache(seq.block_table, seq.token_ids, seq.cache_salt, first_offered, len(seq) // self.page)

    @rule(target=seqs, data=st.data(), salt=st.sampled_from((None, "s")))
    def start(self, data, salt):
        tokens = data.draw(pool_prompts(self.page))
        seq = Sequence(self.next_id, tokens, SamplingParams(), salt)
        self.next_id += 1
        hits = self.pool.lookup(seq)
        assert hits == self.model.lookup(tokens, salt)
        need = pages_for(len(tokens), self.page) - len(hits)
        can = self.pool.can_allocate(hits, need)
        assert can == self.model.can_allocate(hits, need)
        if not can:
            return None
        seq.block_table = self.pool.allocate(hits, need, num_query_tokens=len(tokens))
        assert seq.block_table == self.model.allocate(hits, need, num_query_tokens=len(tokens))
        seq.num_offered_pages = len(hits)
        self._compute(seq, len(hits))
        return seq

    @rule(seq=seqs, data=st.data())
    def append(self, seq, data):
        if seq is None or not seq.block_table:
            return
        extra = data.draw(pool_prompts(self.page))
        need = pages_for(len(seq) + len(extra), self.page) - len(seq.block_table)
        can = self.pool.can_allocate([], need)
        assert can == self.model.can_allocate([], need)
        if can:
            new = self.pool.allocate([], need)
            assert new == self.model.allocate([], need)
            seq.block_table += new
            seq.token_ids += extra
            first = seq.num_offered_pages
            self._compute(seq, first)

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq is None or not seq.block_table:
            return
        self.pool.free(seq.block_table)
        self.model.free(seq.block_table)
        seq.block_table = []

    @rule(data=st.data(), salt=st.sampled_from((None, "s")))
    def lookup(self, data, salt):
        tokens = data.draw(pool_prompts(self.page))
        seq = Sequence(-1, tokens, SamplingParams(), salt)
        assert self.pool.lookup(seq) == self.model.lookup(tokens, salt)

    @rule()
    def reset(self):
        assert self.pool.reset() == self.model.reset()

    @invariant()
    def agree(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        # The eviction order, reverse-free tie-break included, is compared exactly.
        assert list(self.pool.lru) == self.model.free_order()
        assert cached_prefixes(self.pool) == self.model.cached_prefixes()
        s = self.pool.stats
        assert (s.queries, s.hits, s.evictions) == (self.model.queries, self.model.hits, self.model.evictions)


TestPoolVsModel = PoolVsModel.TestCase
# Cheap (no model): many more runs than the profile's default.
TestPoolVsModel.settings = settings(examples(5), stateful_step_count=40, deadline=None)


def test_block_pool_hash_is_chained_and_salted():
    a = block_pool.hash_page(b"p" * 32, (1, 2, 3), ("salt",))
    assert a == block_pool.hash_page(b"p" * 32, (1, 2, 3), ("salt",))
    assert len({a, block_pool.hash_page(b"q" * 32, (1, 2, 3), ("salt",))}) == 2
    assert len({a, block_pool.hash_page(b"p" * 32, (1, 2, 3), (None,))}) == 2
    assert len({a, block_pool.hash_page(b"p" * 32, (1, 2, 3), ())}) == 2
    # The encoding is canonical: the boundary between token ids and extra keys cannot shift.
    assert block_pool.hash_page(b"", (1,), ()) != block_pool.hash_page(b"", (), (1,))
    assert (
        a
        == hashlib.sha256(
            b"p" * 32
            + (3).to_bytes(8, "little")
            + b"".join(t.to_bytes(8, "little", signed=True) for t in (1, 2, 3))
            + (1).to_bytes(8, "little")
            + b"S"
            + (4).to_bytes(8, "little")
            + b"salt"
        ).digest()
    )
    assert block_pool.engine_seed_hash(0) != block_pool.engine_seed_hash(1)


def hash_page_chain(seed: bytes, tokens: list[int], size: int, salt) -> list[bytes]:
    """The key of each full page of `tokens`, hash_page after hash_page from `seed`, the salt on the first."""
    keys, parent = [], seed
    for i in range(len(tokens) // size):
        parent = block_pool.hash_page(parent, tokens[i * size : (i + 1) * size], (salt,) if i == 0 else ())
        keys.append(parent)
    return keys


@given(
    tokens=st.lists(st.integers(0, 2**63 - 1), max_size=60),
    size=st.integers(1, 8),
    cut=st.integers(0, 60),
    salt=st.one_of(st.none(), st.text(max_size=3)),
    packed=st.booleans(),
)
def test_page_keys_are_the_chain_of_hash_page(tokens, size, cut, salt, packed):
    """The batched page keys, built in two steps as a sequence grows, equal hash_page page by page,
    whether the prompt's ids came packed from admission (`Sequence.packed_prompt`) or not."""
    pool = BlockPool(num_pages=1, page_size=size)
    prompt = tokens[:cut]
    packed_prompt = struct.pack(f"<{len(prompt)}q", *prompt) if packed else None
    seq = Sequence(0, prompt, SamplingParams(), cache_salt=salt, packed_prompt=packed_prompt)
    pool.page_keys(seq)
    seq.token_ids.extend(tokens[cut:])
    assert pool.page_keys(seq) == hash_page_chain(pool.seed_hash, tokens, size, salt)


@given(
    data=st.data(),
    page_size=st.integers(1, 3),
    num_pages=st.integers(2, 12),
    num_requests=st.integers(1, 8),
)
def test_page_keys_hash_only_the_pages_the_cache_does_not_hold(data, page_size, num_pages, num_requests):
    """A request's keys are the sha256 chain whatever the cache holds, evictions included, and sha256 runs
    once for each of its pages whose key is not cached (`BlockPool.digests` knows the others); a lookup
    hashes none, keeps the keys before the first such page, and finds the hits that the whole chain gives."""
    honest, calls = block_pool.page_digest, []

    def counted(parent: bytes, encoded: bytes) -> bytes:
        calls.append(encoded)
        return honest(parent, encoded)

    with patch.object(block_pool, "page_digest", counted):
        pool, live, prompts, known = BlockPool(num_pages, page_size), [], [[]], 0
        for n in range(num_requests):
            earlier = data.draw(st.sampled_from(prompts))  # a shared prefix, as a conversation's turns
            tokens = earlier[: data.draw(st.integers(0, len(earlier)))] + data.draw(pool_prompts(page_size))
            prompts.append(tokens)
            salt = data.draw(st.sampled_from((None, "s")))
            seq = Sequence(n, tokens, SamplingParams(), salt)
            want = hash_page_chain(pool.seed_hash, tokens, page_size, salt)
            unknown = sum(key not in pool.cached for key in want)
            first = next((i for i, key in enumerate(want) if key not in pool.cached), len(want))
            whole = Sequence(n, tokens, SamplingParams(), salt)
            pool.page_keys(whole)
            calls.clear()  # hash_page_chain's and the whole chain's digests
            hits = pool.lookup(seq)
            assert seq.page_keys == want[:first] and not calls
            assert hits == pool.lookup(whole)
            assert pool.page_keys(seq) == want
            assert len(calls) == unknown
            known += len(want) - unknown
            if not admitted(pool, seq, hits, live):
                continue
            if data.draw(st.booleans()):
                pool.free(live.pop(0).block_table)
    event("a page's key known" if known else "no key known")


def test_block_pool_collision_caught_by_token_check(monkeypatch):
    """Every page hashes alike: only the true prefix is served, and each page offered under a key that the
    cache holds for another prefix counts a collision."""
    monkeypatch.setattr(block_pool, "page_digest", lambda parent, encoded: b"\0" * 32)
    pool = BlockPool(num_pages=8, page_size=2)
    a = computed(pool, 0, [1, 1, 5])
    # [1, 1] at page 1 has the same hash and the same page tokens, but another parent.
    b = computed(pool, 1, [1, 1, 1, 1, 5])
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] not in a.block_table
    assert pool.stats.collisions == 1  # b's second page
    c = computed(pool, 2, [2, 2, 1, 1, 5])
    assert not set(c.block_table) & set(a.block_table + b.block_table)
    assert pool.stats.collisions == 3  # and both of c's
    assert pool.num_cached_pages == 1


def test_block_pool_free_is_reverse_and_lru_is_touched():
    pool = BlockPool(num_pages=4, page_size=2)
    table = pool.allocate([], 3)
    assert table == [0, 1, 2]
    pool.free(table)
    assert list(pool.lru) == [3, 2, 1, 0]
    with pytest.raises(RuntimeError):
        pool.free([0])
    assert not pool.can_allocate([], 5)


def test_block_pool_touch_before_allocate():
    """The hit sits early in the free queue: it must be touched out of it, not handed out again."""
    pool = BlockPool(num_pages=3, page_size=2)
    a = Sequence(0, [1, 2, 3], SamplingParams())
    a.block_table = pool.allocate([], 2)
    a.num_computed_tokens = 3
    pool.cache_full_pages(a)
    pool.free(a.block_table[:1])
    pool.free(a.block_table[1:])
    assert list(pool.lru) == [2, 0, 1]  # page 0 holds the cached [1, 2]
    b = Sequence(1, [1, 2, 9, 9, 9], SamplingParams())
    hits = pool.lookup(b)
    assert hits == [0] and pool.can_allocate(hits, 2) and not pool.can_allocate(hits, 3)
    assert pool.allocate(hits, 2) == [0, 2, 1]
    assert pool.stats.evictions == 0 and pool.num_cached_pages == 1
    pool.check_invariants()


def admitted(pool, seq: Sequence, hits: list[int], live: list[Sequence]) -> bool:
    """Whether `seq` fit on `pool` after its `hits`, the oldest of `live` freed until it did; if so it is
    allocated, computed in full (no model), its full pages offered, and appended to `live`."""
    need = pages_for(len(seq.token_ids), pool.page_size) - len(hits)
    while live and not pool.can_allocate(hits, need):
        pool.free(live.pop(0).block_table)
    if not pool.can_allocate(hits, need):
        return False
    seq.block_table = pool.allocate(hits, need, len(seq.token_ids))
    seq.num_offered_pages, seq.num_computed_tokens = len(hits), len(seq.token_ids)
    pool.cache_full_pages(seq)
    pool.check_invariants()
    live.append(seq)
    return True


def computed(pool, seq_id: int, tokens: list[int]) -> Sequence:
    """A new sequence looked up, allocated and computed in full on `pool`, its full pages offered."""
    seq = Sequence(seq_id, tokens, SamplingParams())
    if not admitted(pool, seq, pool.lookup(seq), []):
        raise RuntimeError(f"computed: {len(tokens)} tokens do not fit on the pool")
    return seq


def test_block_pool_collision_with_another_parent_is_caught(monkeypatch):
    """The hash ignores the parent: [B] after [D] collides with [B] after [A], same page tokens."""
    # Imported here: test_engine imports ModelPool from this module.
    from tests.engine.test_engine import assert_equivalent, make_llm, run_stream

    honest = block_pool.page_digest
    monkeypatch.setattr(block_pool, "page_digest", lambda parent, encoded: honest(b"", encoded))
    pool = BlockPool(num_pages=8, page_size=2)
    ab = computed(pool, 0, [1, 1, 2, 2, 5])
    db = computed(pool, 1, [3, 3, 2, 2, 5])
    assert pool.num_cached_pages == 3  # db's [2, 2] stays uncached: its hash is ab's
    assert pool.stats.collisions == 1  # counted when db offered it
    assert pool.lookup(Sequence(2, [1, 1, 2, 2, 7], SamplingParams())) == ab.block_table[:2]
    assert pool.lookup(Sequence(3, [3, 3, 2, 2, 7], SamplingParams())) == db.block_table[:1]
    assert pool.stats.collisions == 1
    pool.check_invariants()

    a, b, d = [5] * 8, [6] * 8, [7] * 8
    prompts = [a + b + [1, 2, 3], d + b + [4, 5], d + b + [8, 9, 10]]
    stream = EngineStream(tuple(EngineRequest(tuple(p), 3, None, 40) for p in prompts), 8, 16, 512, 4)
    llm = make_llm(stream)
    warm = run_stream(llm, stream)
    assert [o.num_cached_tokens for o in warm] == [0, 0, 8]  # [d] hits, the [b] after [a] does not
    assert llm.stats()["hash_collisions"] == 2  # the [b] after [d], offered by the second and the third
    assert_equivalent(warm, run_stream(make_llm(stream, caching=False), stream))


def test_block_pool_hit_after_a_colliding_parent_is_refused(monkeypatch):
    """The hash ignores the parent, so y's [2, 2] collides with x's and stays uncached, while y's [4, 4] is
    cached after it: z's chain reaches that [4, 4] through x's [2, 2], by a known key, and the lookup refuses
    it (its node follows y's [2, 2], not the node matched before it), since its K/V follows [3, 3]."""
    honest = block_pool.page_digest
    monkeypatch.setattr(block_pool, "page_digest", lambda parent, encoded: honest(b"", encoded))
    pool = BlockPool(num_pages=12, page_size=2)
    x = computed(pool, 0, [1, 1, 2, 2, 5])
    computed(pool, 1, [3, 3, 2, 2, 4, 4, 5])
    assert pool.stats.collisions == 1
    assert pool.lookup(Sequence(2, [1, 1, 2, 2, 4, 4, 9], SamplingParams())) == x.block_table[:2]
    assert pool.stats.collisions == 2
    pool.check_invariants()


def test_block_pool_prefix_cached_again_keeps_its_children():
    """[1, 2] is cached by one page, then by another after an eviction; the page [3, 4] cached after
    it by a sequence whose own [1, 2] page was a duplicate stays a hit, as in the reference model."""
    for pool in (BlockPool(num_pages=3, page_size=2), ModelPool(num_pages=3, page_size=2)):
        t = computed(pool, 0, [1, 2])
        s = computed(pool, 1, [1, 2])  # the last page is never a hit: s's [1, 2] stays uncached
        s.block_table += pool.allocate([], 1)
        s.token_ids += [3, 4]
        s.num_computed_tokens = 4
        pool.cache_full_pages(s)
        query = Sequence(2, [1, 2, 3, 4, 5], SamplingParams())
        assert pool.lookup(query) == [t.block_table[0], s.block_table[1]] == [0, 2]
        pool.free(t.block_table)
        pool.free(s.block_table)
        u = computed(pool, 3, [1, 2])  # takes t's page, evicting its [1, 2], and caches [1, 2] again
        assert u.block_table == [0] and pool.stats.evictions == 1
        assert pool.lookup(query) == [0, 2]
        assert pool.stats.collisions == 0
        pool.check_invariants()


@examples(4)
@given(
    data=st.data(),
    page_size=st.integers(1, 3),
    num_pages=st.integers(2, 12),
    num_requests=st.integers(1, 12),
)
def test_block_pool_weak_hash_serves_only_true_prefixes(data, page_size, num_pages, num_requests):
    """With a 2-bit page hash, keys collide all the time (other tokens, other parents, other salts); the
    collision defence must still serve only pages that hold the request's salt and exact prefix."""
    honest = block_pool.page_digest

    def weak(parent: bytes, encoded: bytes) -> bytes:
        return bytes([honest(parent, encoded)[0] % 4])

    hits_served = 0
    with patch.object(block_pool, "page_digest", weak):
        pool = BlockPool(num_pages, page_size)
        held = {}  # page id -> (salt, the prefix its KV was computed for), full pages only
        live = []
        for n in range(num_requests):
            tokens = data.draw(pool_prompts(page_size))
            salt = data.draw(st.sampled_from((None, "s")))
            seq = Sequence(n, tokens, SamplingParams(), salt)
            hits = pool.lookup(seq)
            for i, page_id in enumerate(hits):
                assert held.get(page_id) == (salt, tuple(tokens[: (i + 1) * page_size]))
            hits_served += len(hits)
            if not admitted(pool, seq, hits, live):
                continue
            for i, page_id in enumerate(seq.block_table):
                full = (i + 1) * page_size <= len(tokens)
                held[page_id] = (salt, tuple(tokens[: (i + 1) * page_size])) if full else None
            if data.draw(st.booleans()):
                pool.free(live.pop(0).block_table)
    event("a collision caught" if pool.stats.collisions else "no collision")
    event("a page served" if hits_served else "no hit")
