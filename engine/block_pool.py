"""KV-cache pages with ref counts and automatic prefix caching (contract §6).

Policy:
    - Only full pages are cached. A page's key is `sha256(parent_hash || token_ids || extra_keys)`
      over a canonical byte encoding; the first page's parent is a per-engine seed and its extra keys
      carry the request's `cache_salt`.
    - Collision defence, O(page) per hit: a cached page is a hit only if its node holds the request's
      encoded page (the canonical bytes of its tokens and extra keys: one bytes comparison) and its
      parent node *is* (identity) the node matched just before it; a first page's parent is None, the
      engine seed. Complete by induction over the chain: if the node matched at page i - 1 spells the
      request's first i pages (for i = 0: none, the seed), a node with that parent and the request's
      page i spells its first i + 1. So a colliding hash, at this page or at any before it, is caught
      whatever the hash function, and no prefix is ever compared again.
    - Lookup walks a request's page keys in order and stops at the first miss; it never returns more
      than `(num_tokens - 1) // page_size` pages (the last token is always computed).
    - A cached page's key is known: `digests` maps the digest's input (parent hash, encoded page) of
      each cached page to its key, so a request's keys cost sha256 only for the pages the cache does
      not hold (a hit's keys are the same sha256 chain, read instead of recomputed). A lookup hashes
      no page: it reads the known keys and stops before the first unknown one, which no cached page
      follows in the chain; the others are hashed when offered, after the step's launch.
    - Free pages form an LRU queue. Hits are touched (ref_count += 1, out of the queue) before new
      pages are taken; a new page is the least recently freed one and its key is evicted lazily then;
      `free` releases a block table in reverse order so a sequence's tail is evicted before its prefix.
    - A page is offered to the cache once, right after the step that filled it (prompt and generated
      tokens alike); if its hash is cached already, it stays uncached, and where the page cached under
      that hash holds another prefix, the offer counts a collision (`PoolStats.collisions`).

Prefix nodes:
    A page holds the `PrefixNode` of its content from when it is offered (a hit: the node its first
    owner offered) until it is handed out again; nodes never change and are held by reference, so a
    reused page cannot pass for the prefix it held before. Offering a page reuses the live node that
    `prefix_nodes` (weak) holds for its hash if it has the page's tokens, extra keys and parent. So,
    barring sha256 collisions, a prefix has one node, even after its page was evicted and another page
    cached it again while a cached child still points at the old node: the check misses only on true
    collisions, and lookups agree with `reference.prefix_cache` hit for hit.

Invariants (`check_invariants`):
    - ref_count >= 0, and ref_count == 0 <=> the page is in the LRU queue;
    - every entry of the hash map points to a page (live or in the LRU queue) whose key is that entry,
      and a cached page's key holds the page's node, which spells the page's content;
    - `digests` holds an entry for each cached page and no other: its key's digest input, to its key;
    - free + in use == num_pages.
"""

import functools
import hashlib
import itertools
import struct
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

SEED_DOMAIN = b"engine.block_pool.seed/v1"
NO_EXTRA_KEYS_ENCODED = struct.pack("<Q", 0)


# NOTE: PrefixNode and PageKey are plain, not frozen, dataclasses (a frozen one costs 3x to build, and
# these are built per page), but neither is ever changed once made.
@dataclass(slots=True, eq=False, weakref_slot=True)
class PrefixNode:
    """One full page's tokens after its parent's prefix; compared by identity (`is`)."""

    parent: "PrefixNode | None"  # None: the engine seed (a first page)
    token_ids: tuple[int, ...]
    extra_keys: tuple
    encoded: bytes  # encode_page(token_ids, extra_keys): what a hit compares


@dataclass(slots=True)
class PageKey:
    """A cached page's entry: its hash, the node of the prefix it holds and its parent's hash (with the
    node's encoding, the input of its digest)."""

    hash: bytes
    node: PrefixNode
    parent: bytes

    @property
    def digest_input(self) -> tuple[bytes, bytes]:
        """Its entry's key in `BlockPool.digests`."""
        return self.parent, self.node.encoded


def _encode(value) -> bytes:
    if value is None:
        return b"N"
    if isinstance(value, str):
        data = value.encode("utf-8")
        return b"S" + struct.pack("<Q", len(data)) + data
    if isinstance(value, int) and not isinstance(value, bool):
        return b"I" + struct.pack("<q", value)
    raise TypeError(f"cannot encode an extra key of type {type(value).__name__}")


@functools.cache
def _tokens_struct(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<Q{num_tokens}q")


def page_digest(parent_hash: bytes, encoded_page: bytes) -> bytes:
    """sha256(parent_hash || encoded_page): the chain's one hash (the collision tests replace it)."""
    return hashlib.sha256(parent_hash + encoded_page).digest()


def encode_page(token_ids: tuple[int, ...] | list[int], extra_keys: tuple) -> bytes:
    """The canonical encoding of a page: count || int64 token ids || count || tagged extra keys."""
    tokens = _tokens_struct(len(token_ids)).pack(len(token_ids), *token_ids)
    if not extra_keys:
        return tokens + NO_EXTRA_KEYS_ENCODED
    return b"".join([tokens, struct.pack("<Q", len(extra_keys)), *map(_encode, extra_keys)])


@functools.cache
def _framed_page_struct(page_size: int) -> struct.Struct:
    """count || a page's packed int64 ids || no extra keys (0), as `encode_page` lays them out."""
    return struct.Struct(f"<Q{page_size * 8}sQ")


def encode_pages(token_ids: list[int] | bytes | memoryview, page_size: int) -> list[bytes]:
    """`encode_page(page, ())` of each page of `token_ids` (whole pages), built at once: a list of ints,
    or the same ids already packed as int64 little-endian bytes (`Sequence.packed_prompt`)."""
    if isinstance(token_ids, list):
        token_ids = struct.pack(f"<{len(token_ids)}q", *token_ids)  # several times faster than np.array(list)
    # struct, not numpy: slower warm (a 2k prompt's pages in 18 µs against 5 on the CI machine), but half the
    # time on a host whose caches the step before had left cold (33 µs against 65), where admission runs.
    ids, frame, step = bytes(token_ids), _framed_page_struct(page_size).pack, page_size * 8
    return [frame(page_size, ids[at : at + step], 0) for at in range(0, len(ids) - step + 1, step)]


def hash_page(parent_hash: bytes, token_ids: tuple[int, ...] | list[int], extra_keys: tuple) -> bytes:
    """sha256 over a canonical encoding: parent || count || int64 token ids || tagged extra keys."""
    return page_digest(parent_hash, encode_page(token_ids, extra_keys))


def engine_seed_hash(seed: int) -> bytes:
    """The parent hash of every first page: distinct engines never share keys."""
    return hashlib.sha256(SEED_DOMAIN + struct.pack("<Q", seed)).digest()


@dataclass(slots=True)
class Page:
    page_id: int
    ref_count: int = 0
    key: PageKey | None = None
    node: PrefixNode | None = None  # what its content spells, from its offer until it is handed out again


@dataclass(slots=True)
class PoolStats:
    """Counters in tokens (queries, hits) and events: evictions, preemptions, and collisions (a page
    offered whose key the cache holds for another prefix, or a hit refused because the page cached under a
    known key follows another prefix's node)."""

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
    digests: dict = field(init=False)  # (parent hash, encoded page) -> hash, of each cached page
    prefix_nodes: dict = field(init=False)  # hash -> weakref.ref of a node of that hash
    _sweep_at: int = field(init=False)  # len(prefix_nodes) that triggers dropping its dead entries
    stats: PoolStats = field(init=False)
    seed_hash: bytes = field(init=False)

    def __post_init__(self):
        self.pages = [Page(i) for i in range(self.num_pages)]
        self.lru = OrderedDict((i, None) for i in range(self.num_pages))
        self.cached = {}
        self.digests = {}
        self.prefix_nodes = {}
        self._sweep_at = 2 * self.num_pages
        self.stats = PoolStats()
        self.seed_hash = engine_seed_hash(self.seed)

    @property
    def num_free_pages(self) -> int:
        return len(self.lru)

    @property
    def num_cached_pages(self) -> int:
        return len(self.cached)

    def page_keys(self, seq, known_only: bool = False) -> list[bytes]:
        """Extends and returns `seq.page_keys`: the chained hash of each full page of `seq.token_ids`, or
        with `known_only` only up to the first page whose key is not known (`digests`), hashing nothing:
        that page is not cached and no cached page follows it in the chain, so a lookup needs no key from
        it on, and the keys of the pages a step computes are hashed when they are offered
        (`cache_full_pages`), while the GPU runs.

        Extends `seq.encoded_pages` alongside, whole: the encoded page each key hashes after its parent.
        """
        keys, encoded, size, tokens = seq.page_keys, seq.encoded_pages, self.page_size, seq.token_ids
        start, stop = len(encoded) * size, len(tokens) // size * size
        if start == 0 and stop > 0:  # the first page carries the request's cache_salt
            encoded.append(encode_page(tokens[:size], (seq.cache_salt,)))
            start = size
        if start < stop:
            prompt = seq.packed_prompt  # the prompt's pages from admission's packing, the others packed here
            if prompt is not None and stop * 8 <= len(prompt):
                encoded += encode_pages(memoryview(prompt)[start * 8 : stop * 8], size)
            else:
                encoded += encode_pages(tokens[start:stop], size)
        parent, known = keys[-1] if keys else self.seed_hash, self.digests.get
        for page in encoded[len(keys) :]:
            key = known((parent, page))
            if key is None and known_only:
                break
            parent = page_digest(parent, page) if key is None else key
            keys.append(parent)
        return keys

    def lookup(self, seq) -> list[int]:
        """Page ids of the longest cached prefix of `seq`, capped at (len(seq) - 1) // page_size pages."""
        if not self.enable_caching:
            return []
        cached, pages = self.cached, self.pages
        keys = self.page_keys(seq, known_only=True)[: (len(seq.token_ids) - 1) // self.page_size]
        if not keys or keys[0] not in cached:
            return []
        hits, prev = [], None
        for key, encoded in zip(keys, seq.encoded_pages, strict=False):  # keys are capped
            page_id = cached.get(key)
            if page_id is None:
                break
            node = pages[page_id].node
            # The collision defence of the module docstring: this page's tokens and extra keys (their
            # encoding), and the identity of its parent with the node matched before it.
            if node.parent is not prev or node.encoded != encoded:
                self.stats.collisions += 1
                break
            hits.append(page_id)
            prev = node
        return hits

    def num_pages_needed(self, hits: list[int], num_new: int) -> int:
        """Free pages that allocate(hits, num_new) takes out of the LRU queue."""
        # A page is in the LRU queue exactly while its ref count is 0 (check_invariants).
        return num_new + sum(map(self.lru.__contains__, hits))

    def can_allocate(self, hits: list[int], num_new: int) -> bool:
        return self.num_pages_needed(hits, num_new) <= len(self.lru)

    def allocate(self, hits: list[int], num_new: int, num_query_tokens: int | None = None) -> list[int]:
        """Touches the hit pages, then takes `num_new` pages. Returns hits + new page ids.

        With `num_query_tokens`, the call also counts as one prefix-cache query of that many tokens.
        """
        if not self.can_allocate(hits, num_new):
            raise RuntimeError(f"allocate: {num_new} new pages requested, {len(self.lru)} free")
        pages, lru = self.pages, self.lru
        for page_id in hits:
            page = pages[page_id]
            if page.ref_count == 0:
                del lru[page_id]
            page.ref_count += 1
        new = list(itertools.islice(lru, num_new))  # the least recently freed; half popitem's cost
        for page_id in new:
            del lru[page_id]
            page = pages[page_id]
            if page.key is not None:  # lazy eviction
                del self.cached[page.key.hash]
                del self.digests[page.key.digest_input]
                page.key = None
                self.stats.evictions += 1
            page.node = None
            page.ref_count = 1
        if num_query_tokens is not None:
            self.stats.queries += num_query_tokens
            self.stats.hits += len(hits) * self.page_size
        return [*hits, *new]

    def _prefix_node(self, key: bytes, new: PrefixNode) -> PrefixNode:
        """The live node of `new`'s prefix if there is one, else `new` (registered if the hash is free)."""
        ref = self.prefix_nodes.get(key)
        node = ref() if ref is not None else None
        if node is None:
            if len(self.prefix_nodes) >= self._sweep_at:
                # Dead entries go once the map has doubled: amortized O(1) per registration.
                self.prefix_nodes = {h: r for h, r in self.prefix_nodes.items() if r() is not None}
                self._sweep_at = 2 * (len(self.prefix_nodes) + self.num_pages)
            self.prefix_nodes[key] = weakref.ref(new)
            return new
        if node.parent is not new.parent or node.encoded != new.encoded:
            return new  # a hash collision: this one stays unregistered
        return node

    def cache_full_pages(self, seq) -> None:
        """Offers the pages of `seq` filled by computed tokens since the last call to the cache."""
        first, num_full = seq.num_offered_pages, seq.num_computed_tokens // self.page_size
        if self.enable_caching and num_full > first:
            keys, size, table = self.page_keys(seq), self.page_size, seq.block_table
            parent = self.pages[table[first - 1]].node if first else None
            if first and parent is None:
                raise RuntimeError(f"cache_full_pages: page {first - 1} of the sequence was never offered")
            for i in range(first, num_full):
                page = self.pages[table[i]]
                if page.node is None:
                    tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
                    extra_keys = (seq.cache_salt,) if i == 0 else ()
                    new = PrefixNode(parent, tokens, extra_keys, seq.encoded_pages[i])
                    page.node = self._prefix_node(keys[i], new)
                holder = self.cached.get(keys[i])
                if holder is None:
                    if page.key is None:
                        page.key = PageKey(keys[i], page.node, keys[i - 1] if i else self.seed_hash)
                        self.cached[keys[i]] = page.page_id
                        self.digests[page.key.digest_input] = keys[i]
                elif self.pages[holder].node is not page.node:  # the hash is another prefix's
                    self.stats.collisions += 1
                parent = page.node
        seq.num_offered_pages = max(first, num_full)

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
            page.key = page.node = None
        self.cached.clear()
        self.digests.clear()
        self.prefix_nodes.clear()
        return True

    def check_invariants(self) -> None:
        """Raises AssertionError when an invariant of the module docstring does not hold."""
        for page in self.pages:
            if page.ref_count < 0 or (page.ref_count == 0) != (page.page_id in self.lru):
                raise AssertionError(f"page {page.page_id}: ref_count {page.ref_count} vs LRU membership")
            if page.key is not None and page.key.node is not page.node:
                raise AssertionError(f"page {page.page_id}: its key holds another node than the page")
        for h, page_id in self.cached.items():
            key = self.pages[page_id].key
            if key is None or key.hash != h:
                raise AssertionError(f"hash map entry points to page {page_id} with another key")
            if self.digests.get(key.digest_input) != h or page_digest(*key.digest_input) != h:
                raise AssertionError(
                    f"page {page_id}: its key is not the known digest of its parent and page"
                )
        if len(self.digests) != len(self.cached):
            raise AssertionError("a known digest is not a cached page's key")
        in_use = sum(1 for p in self.pages if p.ref_count > 0)
        if in_use + len(self.lru) != self.num_pages:
            raise AssertionError("free + in use != num_pages")
        if sum(1 for p in self.pages if p.key is not None) != len(self.cached):
            raise AssertionError("a page holds a key the hash map does not")


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)  # exact for any int (a float division is not past 2**53)
