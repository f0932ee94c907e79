"""A slow, obviously-correct model of automatic prefix caching (contract §6).

It implements the engine's page policy (`engine.block_pool`) a different way, for differential tests:
no hashes, no linked lists. A cached page is keyed by `(cache_salt, every token id up to the end of
the page)`, and the LRU queue is explicit timestamps: each page remembers when its ref count last
fell to zero, and a new page is the free page with the smallest timestamp.

Policy, stated once:
    - only full pages are cached; a page is offered to the cache once, right after it is filled; if
      its prefix is cached already (in another page) it stays uncached;
    - lookup walks the pages of a token list in order, stops at the first uncached prefix, and returns
      at most `(len(token_ids) - 1) // page_size` pages;
    - allocate touches the hits first (ref count + 1), then takes the free pages with the oldest
      timestamps, forgetting their prefixes (an eviction each);
    - free releases a block table from its last page to its first, one tick of the clock per page;
    - reset forgets every prefix, only when no page is in use.

Pages that were never used have timestamps -num_pages .. -1, in page-id order.
"""


class PrefixCacheModel:
    """Pages, ref counts and cached prefixes, with plain lists and a dict.

    Args:
        num_pages (int): pages in the cache.
        page_size (int): tokens per page.
        enable_caching (bool): with False, lookups miss and nothing is cached. Default: `True`.
    """

    def __init__(self, num_pages: int, page_size: int, enable_caching: bool = True):
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_pages
        self.freed_at = [i - num_pages for i in range(num_pages)]
        self.prefix_of = [None] * num_pages  # the key a page caches, or None
        self.page_of = {}  # (salt, token prefix) -> page id
        self.clock = 0
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    def _key(self, token_ids, salt, num_pages: int) -> tuple:
        return (salt, tuple(token_ids[: num_pages * self.page_size]))

    def free_order(self) -> list[int]:
        """Free pages, the next one to be taken first."""
        free = [p for p in range(self.num_pages) if self.ref_counts[p] == 0]
        return sorted(free, key=lambda p: self.freed_at[p])

    def cached_prefixes(self) -> dict:
        return dict(self.page_of)

    def lookup(self, token_ids, salt) -> list[int]:
        """Pages holding the longest cached prefix of `token_ids`."""
        if not self.enable_caching:
            return []
        hits = []
        for n in range(1, (len(token_ids) - 1) // self.page_size + 1):
            page = self.page_of.get(self._key(token_ids, salt, n))
            if page is None:
                break
            hits.append(page)
        return hits

    def can_allocate(self, hits, num_new: int) -> bool:
        touched_free = len({p for p in hits if self.ref_counts[p] == 0})
        return len(self.free_order()) - touched_free >= num_new

    def allocate(self, hits, num_new: int, num_query_tokens: int | None = None) -> list[int]:
        """Touches `hits`, then takes `num_new` pages; counts the lookup when `num_query_tokens` is given."""
        if not self.can_allocate(hits, num_new):
            raise RuntimeError("out of pages")
        for p in hits:
            self.ref_counts[p] += 1
        new = self.free_order()[:num_new]
        for p in new:
            if self.prefix_of[p] is not None:
                del self.page_of[self.prefix_of[p]]
                self.prefix_of[p] = None
                self.evictions += 1
            self.ref_counts[p] = 1
        if num_query_tokens is not None:
            self.queries += num_query_tokens
            self.hits += len(hits) * self.page_size
        return list(hits) + new

    def cache(self, block_table, token_ids, salt, first_page: int, num_full_pages: int) -> None:
        """Offers pages `first_page .. num_full_pages - 1` of a block table, full of `token_ids`."""
        if not self.enable_caching:
            return
        for i in range(first_page, num_full_pages):
            key = self._key(token_ids, salt, i + 1)
            page = block_table[i]
            if key not in self.page_of and self.prefix_of[page] is None:
                self.page_of[key] = page
                self.prefix_of[page] = key

    def free(self, block_table) -> None:
        for p in reversed(block_table):
            if self.ref_counts[p] <= 0:
                raise RuntimeError(f"page {p} is not in use")
            self.ref_counts[p] -= 1
            if self.ref_counts[p] == 0:
                self.freed_at[p] = self.clock
                self.clock += 1

    def reset(self) -> bool:
        if any(self.ref_counts):
            return False
        self.page_of.clear()
        self.prefix_of = [None] * self.num_pages
        return True
