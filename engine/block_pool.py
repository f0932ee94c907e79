"""KV-cache pages with ref counts and automatic prefix caching (SPEC section 6).

Policy:
    - Only full pages are cached. A page's key is `sha256(parent_hash || token_ids || extra_keys)`
      over a canonical byte encoding; the first page's parent is a per-engine seed and its extra keys
      carry the request's `cache_salt`.
    - A hit compares the whole token prefix, not only the hash: each key holds a `PrefixNode` chain
      (the page's token ids, extra keys and its parent's node), so a hash collision is caught.
    - Lookup walks a request's page keys in order and stops at the first miss; it never returns more
      than `(num_tokens - 1) // page_size` pages (the last token is always computed).
    - Free pages form an LRU queue. Hits are touched (ref_count += 1, out of the queue) before new
      pages are taken; a new page is the least recently freed one and its key is evicted lazily then;
      `free` releases a block table in reverse order so a sequence's tail is evicted before its prefix.
    - A page is offered to the cache once, right after the step that filled it (prompt and generated
      tokens alike); if its prefix is cached already, it stays uncached.

Invariants (`check_invariants`):
    - ref_count >= 0, and ref_count == 0 <=> the page is in the LRU queue;
    - every entry of the hash map points to a page (live or in the LRU queue) whose key is that entry;
    - free + in use == num_pages.
"""

import hashlib
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

SEED_DOMAIN = b"engine.block_pool.seed/v1"


@dataclass(frozen=True, slots=True, eq=False)
class PrefixNode:
    """One full page's tokens in a chain that spells out the whole prefix."""

    parent: "PrefixNode | None"
    token_ids: tuple[int, ...]
    extra_keys: tuple


def same_prefix(a: PrefixNode | None, b: PrefixNode | None) -> bool:
    """Whether two chains spell the same prefix (stops early at a shared node)."""
    while a is not b:
        if a is None or b is None or a.token_ids != b.token_ids or a.extra_keys != b.extra_keys:
            return False
        a, b = a.parent, b.parent
    return True


@dataclass(frozen=True, slots=True)
class PageKey:
    hash: bytes
    node: PrefixNode


def _encode(value) -> bytes:
    if value is None:
        return b"N"
    if isinstance(value, str):
        data = value.encode("utf-8")
        return b"S" + struct.pack("<Q", len(data)) + data
    if isinstance(value, int) and not isinstance(value, bool):
        return b"I" + struct.pack("<q", value)
    raise TypeError(f"cannot encode an extra key of type {type(value).__name__}")


def hash_page(parent_hash: bytes, token_ids: tuple[int, ...], extra_keys: tuple) -> bytes:
    """sha256 over a canonical encoding: parent || count || int64 token ids || tagged extra keys."""
    payload = [parent_hash, struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids)]
    payload.append(struct.pack("<Q", len(extra_keys)))
    payload.extend(_encode(k) for k in extra_keys)
    return hashlib.sha256(b"".join(payload)).digest()


def engine_seed_hash(seed: int) -> bytes:
    """The parent hash of every first page: distinct engines never share keys."""
    return hashlib.sha256(SEED_DOMAIN + struct.pack("<Q", seed)).digest()


@dataclass(slots=True)
class Page:
    page_id: int
    ref_count: int = 0
    key: PageKey | None = None


@dataclass(slots=True)
class PoolStats:
    """Counters in tokens (queries, hits) and events (evictions, collisions, preemptions)."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0
    collisions: int = 0
    preemptions: int = 0


@dataclass(slots=True)
class BlockPool:
    """Pages, ref counts, the prefix-cache hash map and the LRU free queue.

    Args:
        num_pages (int): pages in the cache.
        page_size (int): tokens per page.
        seed (int): the per-engine seed of the first page's parent hash.
        enable_caching (bool): with False, lookups miss and nothing is cached.
    """

    num_pages: int
    page_size: int
    seed: int = 0
    enable_caching: bool = True
    pages: list[Page] = field(init=False)
    lru: OrderedDict = field(init=False)  # page_id -> None, least recently freed first
    cached: dict = field(init=False)  # hash -> page_id
    stats: PoolStats = field(init=False)
    seed_hash: bytes = field(init=False)

    def __post_init__(self):
        self.pages = [Page(i) for i in range(self.num_pages)]
        self.lru = OrderedDict((i, None) for i in range(self.num_pages))
        self.cached = {}
        self.stats = PoolStats()
        self.seed_hash = engine_seed_hash(self.seed)

    @property
    def num_free_pages(self) -> int:
        return len(self.lru)

    @property
    def num_cached_pages(self) -> int:
        return len(self.cached)

    def page_keys(self, seq) -> list[PageKey]:
        """Extends and returns `seq.page_keys`: one key per full page of `seq.token_ids`."""
        keys, size = seq.page_keys, self.page_size
        for i in range(len(keys), len(seq.token_ids) // size):
            tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
            parent = keys[-1] if keys else None
            extra = (seq.cache_salt,) if i == 0 else ()
            node = PrefixNode(parent.node if parent else None, tokens, extra)
            keys.append(PageKey(hash_page(parent.hash if parent else self.seed_hash, tokens, extra), node))
        return keys

    def lookup(self, seq) -> list[int]:
        """Page ids of the longest cached prefix of `seq`, capped at (len(seq) - 1) // page_size pages."""
        if not self.enable_caching:
            return []
        hits, prev = [], None
        for key in self.page_keys(seq)[: (len(seq.token_ids) - 1) // self.page_size]:
            page_id = self.cached.get(key.hash)
            if page_id is None:
                break
            node, ours = self.pages[page_id].key.node, key.node
            # The token check: this page's tokens and extra keys, then its parent chain. The parent is
            # usually the node just matched (O(1)); otherwise the whole chain is compared.
            if (
                node.token_ids != ours.token_ids
                or node.extra_keys != ours.extra_keys
                or not (node.parent is prev or same_prefix(node.parent, ours.parent))
            ):
                self.stats.collisions += 1
                break
            hits.append(page_id)
            prev = node
        return hits

    def num_pages_needed(self, hits: list[int], num_new: int) -> int:
        """Free pages that allocate(hits, num_new) takes out of the LRU queue."""
        return num_new + sum(1 for p in hits if self.pages[p].ref_count == 0)

    def can_allocate(self, hits: list[int], num_new: int) -> bool:
        return self.num_pages_needed(hits, num_new) <= len(self.lru)

    def allocate(self, hits: list[int], num_new: int, num_query_tokens: int | None = None) -> list[int]:
        """Touches the hit pages, then takes `num_new` pages. Returns hits + new page ids.

        With `num_query_tokens`, the call also counts as one prefix-cache query of that many tokens.
        """
        if not self.can_allocate(hits, num_new):
            raise RuntimeError(f"allocate: {num_new} new pages requested, {len(self.lru)} free")
        for page_id in hits:
            page = self.pages[page_id]
            if page.ref_count == 0:
                del self.lru[page_id]
            page.ref_count += 1
        new = []
        for _ in range(num_new):
            page_id, _ = self.lru.popitem(last=False)
            page = self.pages[page_id]
            if page.key is not None:  # lazy eviction
                del self.cached[page.key.hash]
                page.key = None
                self.stats.evictions += 1
            page.ref_count = 1
            new.append(page_id)
        if num_query_tokens is not None:
            self.stats.queries += num_query_tokens
            self.stats.hits += len(hits) * self.page_size
        return hits + new

    def cache_full_pages(self, seq) -> None:
        """Offers the pages of `seq` filled by computed tokens since the last call to the cache."""
        num_full = seq.num_computed_tokens // self.page_size
        if self.enable_caching and num_full > seq.num_offered_pages:
            keys = self.page_keys(seq)
            for i in range(seq.num_offered_pages, num_full):
                page = self.pages[seq.block_table[i]]
                if page.key is None and keys[i].hash not in self.cached:
                    page.key = keys[i]
                    self.cached[keys[i].hash] = page.page_id
        seq.num_offered_pages = max(seq.num_offered_pages, num_full)

    def free(self, block_table: list[int]) -> None:
        """Releases a block table in reverse order: the tail reaches the LRU queue first."""
        for page_id in reversed(block_table):
            page = self.pages[page_id]
            if page.ref_count <= 0:
                raise RuntimeError(f"free: page {page_id} is not in use")
            page.ref_count -= 1
            if page.ref_count == 0:
                self.lru[page_id] = None

    def reset(self) -> bool:
        """Forgets every cached prefix; refuses (returns False) while any page is in use."""
        if len(self.lru) != self.num_pages:
            return False
        for page in self.pages:
            page.key = None
        self.cached.clear()
        return True

    def check_invariants(self) -> None:
        """Raises AssertionError when an invariant of the module docstring does not hold."""
        for page in self.pages:
            if page.ref_count < 0 or (page.ref_count == 0) != (page.page_id in self.lru):
                raise AssertionError(f"page {page.page_id}: ref_count {page.ref_count} vs LRU membership")
        for h, page_id in self.cached.items():
            key = self.pages[page_id].key
            if key is None or key.hash != h:
                raise AssertionError(f"hash map entry points to page {page_id} with another key")
        in_use = sum(1 for p in self.pages if p.ref_count > 0)
        if in_use + len(self.lru) != self.num_pages:
            raise AssertionError("free + in use != num_pages")
        if sum(1 for p in self.pages if p.key is not None) != len(self.cached):
            raise AssertionError("a page holds a key the hash map does not")


def pages_for(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)
