"""The planned prefill's Hopper path (sm_90, 16-bit inputs), in Gluon: the same tile lists and math as
`paged_prefill_kernel`, with the kernel structure Triton does not produce there (FlashAttention-3's).

spec: `reference.paged_prefill.paged_prefill`, through `kernels.paged_prefill.PrefillPlan`, which
takes this path when `ENABLED` is set and `supports(...)` holds, and falls back to the Triton kernel
otherwise (and for a run whose caches are not 16-byte aligned, which the tensor-memory copies need).
The K and V caches' TMA descriptors are made on the host and encoded once per cache (`HostDescriptor`).
With DEVICE_DESCRIPTORS each program makes them, and a launch allocates 256 bytes a program for them
through Triton's allocator (`triton.set_allocator`); where the calling thread has none, a run sets one.
The grid is persistent (a program an SM, each taking the units `plan_walk` gives it: (query tile,
head) items, or parts of an item's key tiles whose softmax states the last part to end merges), and
a program runs three warp-specialized parts on 128-row query tiles:
- a producer warp walks each tile's lists and copies its key tiles' K and V by TMA, page by page
  (`PAGE_ROWS` rows a copy), into a ring of `STAGES` shared-memory slots: a slot is refilled as soon
  as both consumers have released it, across query tiles, so no compute warp issues a copy or waits
  for one it does not need yet, and the next query tile's first keys arrive during this one's end;
- two consumer warp groups (4 warps, `CONSUMER_REGISTERS` registers a thread) take 64 rows each and
  share every slot: each runs its scores, softmax and P.V, and the warp scheduler overlaps one's
  softmax with the other's matrix products. A group takes its full tiles two slots at a time (one
  softmax update, one wait and one release a pair, `_attend_pairs`), with its Q in registers.
The lists are built for 128-row tiles, so a key tile is full only when it is full for both halves;
a partial one may be nothing or everything to one half, or need no layout mask, which each partial
entry says for each half (the lists' `halves` modes, kernels/tile_lists.py, fixed at planning): the
group then skips it, takes it unmasked, or masks it by causality and the sequence end alone.
Not on this path: float32 (scores in float64), head dims other than 64 and 128, pages of fewer than
8 rows or of sizes that neither divide nor are multiples of `BLOCK_N`, and caches whose rows are not
contiguous (a TMA descriptor needs `[num_pages * page_size, num_kv_heads * head_dim]` rows).
"""

import functools
import heapq
import math

import numpy as np
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import tile_lists
from kernels._common import BoundLaunch, interpreted

# On: 1.39-1.56x faster than the Triton kernel on the H200 at every row of reports/hopper_ab.py
# (reports/gpu/kernel-ab.md §14), and its launch enqueues within 5 µs of the Triton kernel's (§11).
ENABLED = True
# A consumer takes its full tiles two at a time and so holds two slots of the ring: 4 slots keep the
# producer a pair ahead (3 were up to 6% slower with pairs, reports/gpu/kernel-ab.md §13).
BLOCK_M, BLOCK_N, STAGES = 128, 64, 4
# The caches' TMA descriptors are made on the host and encoded once per cache (`HostDescriptor`): the
# programs' first copies then come 1.7-2 µs sooner than with the descriptors each program makes from
# the caches' pointers (DEVICE_DESCRIPTORS, the default before): 0.7-3.7% less time at 8k with 832 and
# 2048 queries in every round, the other rows within the A/B's spread (reports/gpu/kernel-ab.md §25).
DEVICE_DESCRIPTORS = False
# Registers are set per warp group (setmaxnreg): the two consumers' and the producer's (one warp of a
# group of 4) fill the register file at 168 a thread on average, one program an SM.
MAX_REGISTERS, CONSUMER_REGISTERS, PRODUCER_REGISTERS = 168, 240, 24
# Program p takes items p, p + num_programs, ... of the head-major walk, except in the last
# BALANCED_ROUNDS rounds, which `plan_walk` deals by cost (each round's costliest item to its
# least-loaded program). Dealing every round moved which items run side by side and slowed the full
# tiles (2-3% slower at 8k, reports/gpu/kernel-ab.md §17, §22); the last round alone keeps them and
# evens the programs' ends. An item's cost in full key tiles: a partial tile counts as PARTIAL_COST,
# its set-up and epilogue as ITEM_COST (the timeline's cycles at 8k, §22).
BALANCED_WALK = True
BALANCED_ROUNDS = 1
PARTIAL_COST, ITEM_COST = 1.7, 2.8
# With CHEAPEST_LAST, a walk of several rounds may instead keep its cheapest items (a full prefill's
# first query tiles, a few key tiles each) for its end: the other items in head-major rounds, then
# each of those, costliest first, to the program least loaded so far. `plan_walk` takes it where the
# cost model ends the programs sooner. The dealt last round holds items of every cost (at 8k, all of
# the last head's), so its programs end up to an item apart: by the model the most-loaded program is
# 3.6% over the mean at 8k and 2.1% at 32k (the timeline's: 3.3-4.9% and 1.9-2.1%), 0.8% and 0.1%
# with the cheapest last. Measured, 8k ran 1.5-2.3% faster, 32k alike (reports/gpu/kernel-ab.md
# §26): a unit's own time spreads enough that the programs still end about 15 µs apart at 8k.
CHEAPEST_LAST = True
CHEAPEST_LAST_ROUNDS = 8  # and not below: at 2k (the engine's prefill steps) it won 1.4% at 0.2 ms a plan
# ... and only where the model's busiest program ends at least this much sooner: a walk changed for
# less (32k with 8192 queries, 0.1%) ran 1% slower in both calls of reports/gpu/kernel-ab.md §26.
CHEAPEST_LAST_GAIN = 0.005
# Whole items end up to an item apart (at 8k with 832 queries, 224 items on 132 programs, the mean
# program idled 17% of the kernel's span, §22). SPLIT_LAST splits the last round's items across
# programs instead, into parts of at least MIN_SPLIT_TILES key tiles, where the cost model ends the
# programs sooner: a part's state store and merge cost SPLIT_COST more than a whole item's epilogue
# (6600 cycles, 4 full tiles). Off: the programs then end together, but at 8k with 832 queries the
# kernel was 7% slower (2-3% faster at 32k with 3328 and 8192 queries; reports/gpu/kernel-ab.md §23).
SPLIT_LAST = False
MIN_SPLIT_TILES, SPLIT_COST = 4, 4.0
# A walk of one round that leaves programs idle (an engine's step over a cached prefix: 208 queries
# of a 2k prompt are 64 items on 132 programs, 42 µs a layer on the H200) splits its items over
# them, a part a program, where the cost model ends it sooner (SPLIT_ONE_ROUND, `split_one_round`).
# A launch that a plan of at most about a round's tokens makes (`split_slots`) holds the states of
# such a walk, so that its replans (an engine's prefill graphs) split too. Its walk was the host's until
# the thirty-third session (0.5 ms more host time a step on an H100 than its kernels saved, kernel-ab.md
# §27) and is the GPU's now (kernels/device_walk.py): on the H200 the 2k step with 90% cached took 5.89
# ms against 6.30 with the items whole (reports/gpu/ttft-h200-split.txt).
SPLIT_ONE_ROUND = True
# A masked tile's weights times the slot's V as it is, the tile taken again with V checked and copied
# only when that product is not finite (V is nearly always finite): its masked tiles cost 1200 cycles
# less. It was 0.7-4.2% faster than the tile checked first at every row of issue 16's table up to 32k
# (5 rounds, one process; reports/gpu/kernel-ab.md §24), though its rare path's code makes the kernel
# 13% longer (the scores taken again rather than kept live, which spilled more).
V_CHECK_AFTER = True
# A diagnostic, None in production: an int64 tensor [units + programs, 2, TIMELINE_FIELDS]
# (`timeline_shape`) that each consumer fills with clock stamps of its units' phases and of their first
# PARTIAL_STAMPS partial tiles, and each partition with its entry and exit (reports/hopper_timeline.py).
TIMELINE = None
PARTIAL_STAMPS = 4
ITEM_FIELDS = 8  # an item's own stamps and list lengths; then each stamped partial tile's end and mode
TIMELINE_FIELDS = ITEM_FIELDS + 2 * PARTIAL_STAMPS
# Then a row a program (`timeline_shape`), of the device's nanosecond timer: each consumer's entry and
# exit at fields PROGRAM_CONSUMER and + 1 of its part, the producer's at PROGRAM_PRODUCER and + 1 of
# the first consumer's part, and the issue of its first copy at PROGRAM_FIRST_COPY there.
PROGRAM_CONSUMER, PROGRAM_PRODUCER, PROGRAM_FIRST_COPY = 0, 2, 4
FALLBACK_WARPS = 8  # the Triton kernel's warps on these 128-row tiles (a run with misaligned caches)
HEAD_DIMS = (64, 128)
MIN_PAGE_ROWS = 8  # the 128-byte swizzle's atom: a TMA copy into a slot starts on one
GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# Runtime integers that may be 1 (a compiled-in 1 cannot be handed to a warp-specialized partition).
NOT_SPECIALIZED = [
    "page_size", "num_blocks", "sparse_block", "group", "stride_list_head", "cache_rows", "stride_bt",
    "stride_mask_head", "num_heads",
]  # fmt: skip

CONSUMER_THREADS = gl.constexpr(4 * 32)  # a consumer warp group
# What a partial entry says a group sees of its tile (tile_lists.HALF_*), above the key tile's bits.
SKIP, WHOLE = gl.constexpr(tile_lists.HALF_SKIP), gl.constexpr(tile_lists.HALF_WHOLE)
CAUSAL = gl.constexpr(tile_lists.HALF_CAUSAL)
TILE_BITS, TILE_MASK = gl.constexpr(tile_lists.TILE_BITS), gl.constexpr(tile_lists.TILE_MASK)
# The twins of kernels/_common.py's constants (a Gluon function reads only Gluon constexprs).
FINITE_MIN = gl.constexpr(-3.4028234663852886e38)
NEG_INF = gl.constexpr(float("-inf"))
LN2 = gl.constexpr(0.6931471805599453)
TIMELINE_FIELDS_C = gl.constexpr(TIMELINE_FIELDS)
PARTIAL_STAMPS_C = gl.constexpr(PARTIAL_STAMPS)
ITEM_FIELDS_C = gl.constexpr(ITEM_FIELDS)
PROGRAM_CONSUMER_C, PROGRAM_PRODUCER_C = gl.constexpr(PROGRAM_CONSUMER), gl.constexpr(PROGRAM_PRODUCER)
PROGRAM_FIRST_COPY_C = gl.constexpr(PROGRAM_FIRST_COPY)


def on_hopper(device: torch.device) -> bool:
    """Whether the device is an sm_90 GPU, the one target of this path (and not the interpreter)."""
    return device.type == "cuda" and not interpreted() and torch.cuda.get_device_capability(device) == (9, 0)


def num_sms(device: torch.device) -> int:
    """The device's multiprocessor count: the persistent grid's size."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def supports(batch, q: torch.Tensor, cache_contiguous: bool) -> bool:
    """Whether a validated prefill call takes this path (a run's caches must also be `aligned`)."""
    page = batch.page_size
    return (
        ENABLED
        and on_hopper(q.device)
        and q.dtype in GL_DTYPES
        and q.stride(-1) == 1
        and 1 not in q.stride()[:2]  # strides of 1 compile in (see NOT_SPECIALIZED)
        and batch.head_dim in HEAD_DIMS
        and page >= MIN_PAGE_ROWS
        and (page % BLOCK_N == 0 or BLOCK_N % page == 0)
        and cache_contiguous
        and batch.num_pages * page < 2**31
    )


def aligned(*tensors: torch.Tensor) -> bool:
    """TMA reads from 16-byte aligned bases only."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


UNIT_FIELDS = 6  # a walk's unit: item, begin, end, slot, first slot, parts (see `Walk`)
# What the kernel reads of a unit, all fixed at planning, so that a unit's loads do not wait on one
# another: its item's sequence, absolute query tile, head and full tiles' count, its tiles begin ..
# end - 1, its slot, first slot and parts, its sequence's first query token, context and length.
ROW_FIELDS = 12
ROW_FIELDS_C = gl.constexpr(ROW_FIELDS)
STAND_IN = (-1, 0, 0, -1, 0, 1)  # a unit of no item: no tiles, a whole item's slot and parts


class Walk:
    """Which program takes what, in order: `units` int32 [num_units, UNIT_FIELDS], program p's being
    rows offsets[p] .. offsets[p + 1] - 1 (`offsets` int32 [programs + 1]). A unit (w, begin, end,
    slot, first, parts) is item w (`_work`'s head-major numbering: head w // T, query tile
    T - 1 - w % T) over tiles begin .. end - 1 of its lists (its full tiles, then its partial ones).
    An item taken whole has slot -1; one split into `parts` units has their softmax states at slots
    first .. first + parts - 1 of the launch's `num_slots`, and the last of them to end merges them.
    A unit of item -1 is a program's stand-in when it has no work (`plan_walk`'s `every_program`):
    no tiles, no query rows."""

    def __init__(self, offsets: np.ndarray, units: np.ndarray, num_slots: int):
        self.offsets, self.units, self.num_slots = offsets.astype(np.int32), units.astype(np.int32), num_slots

    @property
    def programs(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def size(self) -> int:
        """The length of `flat()`."""
        return self.offsets.shape[0] + self.units.shape[0] * ROW_FIELDS

    def flat(
        self, counts: torch.Tensor, query_tiles: list, seq_lens: list, query_starts: list, out=None
    ) -> np.ndarray:
        """int32: the offsets, then each unit's ROW_FIELDS (what the kernel's `walk` points at), for
        lists with these counts [2, tiles, 1 or num_heads] over these (sequence, absolute query tile)
        query tiles of sequences of these lengths and first query tokens (query_starts: [seqs + 1]);
        written into the front of `out` (int32) when given. A stand-in's row is zero but for its
        unit's fields: sequence 0, tile 0, no query rows, no tiles."""
        programs, units = self.offsets.shape[0], self.units
        size = programs + units.shape[0] * ROW_FIELDS
        flat = np.empty(size, dtype=np.int32) if out is None else out[:size]
        flat[:programs] = self.offsets
        rows = flat[programs:].reshape(-1, ROW_FIELDS)
        # A row's fields of its query tile (sequence, absolute tile, first query token, context, length),
        # by the walk's numbering of tiles (the last first), then a row of zeros for the stand-ins. A
        # step's host runs this cold, where its cost follows its count of numpy calls (docs/engine-notes.md).
        tiles = len(query_tiles)
        starts, ends = query_starts[:-1], query_starts[1:]
        rows_of_tiles = [
            (b, t, *[0] * 7, starts[b], seq_lens[b] - ends[b] + starts[b], seq_lens[b])
            for b, t in reversed(query_tiles)
        ]
        by_tile = np.array(rows_of_tiles + [(0,) * ROW_FIELDS], dtype=np.int32)
        w = units[:, 0]
        stand_in = w < 0
        np.take(by_tile, np.where(stand_in, tiles, w % max(tiles, 1)), axis=0, out=rows)
        head = w // max(tiles, 1)
        rows[:, 2] = head
        rows[:, 3] = counts.numpy()[0, rows[:, 1], head if counts.shape[2] > 1 else 0]
        rows[:, 4 : 4 + UNIT_FIELDS - 1] = units[:, 1:]
        rows[stand_in, 2:4] = 0
        return flat


def plan_walk(
    counts: torch.Tensor,
    query_tiles: list,
    num_heads: int,
    programs: int,
    dealt_rounds: int,
    split: bool,
    every_program: bool = False,
    cheapest_last: bool = False,
) -> Walk:
    """The programs' work. Program p takes items p, p + programs, ... of the head-major walk, except in
    the last `dealt_rounds` rounds (0: none), where each round's costliest item goes to its
    least-loaded program. With `split`, the last round is dealt (whatever `dealt_rounds`), tile by
    tile so that the programs end together (`_deal_split`). Else, with `cheapest_last`, a walk of
    several rounds keeps its cheapest items for the end where the cost model ends it sooner so
    (`_cheapest_last`). `counts`: the lists' counts [2, tiles, 1 or num_heads] (CPU); `query_tiles`:
    the (sequence, absolute query tile) of each query tile. With `every_program`, a program left
    without work gets a stand-in unit (item -1): a launch planned for more items keeps its grid (a
    program reads its first unit's row before its loop)."""
    walk = _plan_walk(
        counts, query_tiles, num_heads, programs, dealt_rounds, split, every_program, cheapest_last
    )
    idle = np.nonzero(np.diff(walk.offsets) == 0)[0] if every_program else ()
    if len(idle):  # a split last round (a single round takes the stand-ins in `_plan_walk`)
        units = np.insert(walk.units, walk.offsets[idle], STAND_IN, axis=0)
        offsets = walk.offsets + np.concatenate([[0], np.cumsum(np.diff(walk.offsets) == 0)])
        walk = Walk(offsets, units, walk.num_slots)
    return walk


def settled_walk(
    counts: torch.Tensor, query_tiles: list, num_heads: int, programs: int, fits: tuple | None = None
) -> Walk:
    """A plan's walk under this module's settings, a unit for every program (`plan_walk`): a single
    round that leaves programs idle split over them with SPLIT_ONE_ROUND (`split_one_round`), else
    its last round split with SPLIT_LAST. `fits`: at a replan, (split states, units) that the plan's
    launch and buffer hold; a split walk that needs more is taken unsplit (which they always hold).
    counts, query_tiles: `plan_walk`'s."""
    args = (counts, query_tiles, num_heads, programs, BALANCED_ROUNDS if BALANCED_WALK else 0)
    options = dict(every_program=True, cheapest_last=BALANCED_WALK and CHEAPEST_LAST)
    may_split, walk = fits is None or fits[0] > 0, None
    if may_split and SPLIT_ONE_ROUND and len(query_tiles) * num_heads < programs:
        walk = split_one_round(counts, query_tiles, num_heads, programs)
    if walk is None:
        walk = plan_walk(*args, may_split and SPLIT_LAST, **options)
    if fits is not None and (walk.num_slots > fits[0] or walk.units.shape[0] > fits[1]):
        walk = plan_walk(*args, False, **options)
    return walk


def split_slots(num_tokens: int, num_heads: int, programs: int) -> int:
    """The split states that the launch of a plan over `num_tokens` queries holds for its replans'
    walks (`settled_walk`): with SPLIT_ONE_ROUND, where its queries would take about one round, the
    most a `split_one_round` walk takes (a part a program), else 0."""
    return programs if SPLIT_ONE_ROUND and num_tokens * num_heads <= programs * BLOCK_M else 0


def split_one_round(counts: torch.Tensor, query_tiles: list, num_heads: int, programs: int) -> Walk | None:
    """A walk of fewer items than programs, items split over the programs left: with the costliest
    item in u parts, every item in as many as bring its parts' shares down to the costliest's
    (ceil(u * cost / costliest)), but none in more than leave each a share of MIN_SPLIT_TILES + 1
    partial tiles' cost; u the most whose parts the programs hold. An item's parts cut its tiles (full,
    then partial) at equal shares of its cost, each cut at the nearest tile (half up), and take
    consecutive programs, the items in their order; the programs left take stand-ins. The split items'
    parts take consecutive state slots, in the same order. None where an item ends no sooner than the
    costliest item whole, by the cost model (a part: its share, SPLIT_COST and a tile's rounding).
    Costs are integer tenths of a full tile (`cost_tenths`), so that kernels/device_walk.py writes the
    same walk on the GPU. counts, query_tiles: `plan_walk`'s. Every part runs at once: where a part
    runs does not matter."""
    full, partial = _item_tiles(counts, query_tiles, num_heads)
    num_items = full.shape[0]
    partial_cost, split_cost = cost_tenths(PARTIAL_COST), cost_tenths(SPLIT_COST)
    cost = 10 * full + partial_cost * partial
    costliest = cost.max(initial=0)
    if not costliest:
        return None
    most = cost // (partial_cost * (MIN_SPLIT_TILES + 1))
    u = np.arange(1, programs + 1)[:, None]  # each number of parts of the costliest item, a row
    parts = np.maximum(
        np.minimum((u * cost + costliest - 1) // costliest, most), 1
    )  # an item without tiles too
    k = parts[np.nonzero(parts.sum(1) <= programs)[0][-1]]
    # An item ends no sooner than the costliest whole: its part's share, SPLIT_COST and a partial tile's
    # rounding at least that cost, or it is whole and that costly.
    late = np.where(k > 1, cost + k * (split_cost + partial_cost) - k * costliest, cost - costliest) >= 0
    if late.any():
        return None
    starts = np.cumsum(k) - k
    split_parts = np.where(k > 1, k, 0)  # the split items' parts take the slots, in order
    slots = np.cumsum(split_parts) - split_parts
    w = np.repeat(np.arange(num_items), k)
    p = np.arange(w.shape[0])
    i, kw, f, c, first = p - starts[w], k[w], full[w], cost[w], slots[w]

    def cut(x):  # the tile at cost x (tenths) of an item: in its full tiles, then in its partial ones
        return np.where(
            x <= 10 * f, (x + 5) // 10, f + (2 * (x - 10 * f) + partial_cost) // (2 * partial_cost)
        )

    split = kw > 1
    units = np.full((programs, UNIT_FIELDS), STAND_IN, dtype=np.int64)
    units[: p.shape[0]] = np.stack(
        [
            w,
            cut(c * i // kw),
            cut(c * (i + 1) // kw),
            np.where(split, first + i, -1),
            np.where(split, first, 0),
            kw,
        ],
        1,
    )
    return Walk(np.arange(programs + 1), units, int(split_parts.sum()))


def cost_tenths(cost: float) -> int:
    """A cost model's constant (PARTIAL_COST, SPLIT_COST) in integer tenths of a full tile; ValueError
    for one that is not a whole number of tenths."""
    tenths = round(cost * 10)
    if tenths < 0 or abs(tenths - cost * 10) > 1e-9:
        raise ValueError(f"a cost must be a non-negative whole number of tenths of a tile, got {cost}")
    return tenths


def _item_tiles(counts: torch.Tensor, query_tiles: list, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Each item's full and partial tiles (int64 [items] each, `_work`'s head-major numbering), from
    `plan_walk`'s counts and query tiles."""
    # [2, tiles, 1 or num_heads], the last query tile first; numpy's indexing, several times cheaper
    # than torch's on these few elements (a plan's host time, every step of an engine).
    taken = counts.numpy()[:, [t for _, t in reversed(query_tiles)]]
    if taken.shape[2] != num_heads:
        taken = taken.repeat(num_heads, axis=2)
    full, partial = taken.transpose(0, 2, 1).reshape(2, -1).astype(np.int64)
    return full, partial


def _plan_walk(
    counts, query_tiles, num_heads, programs, dealt_rounds, split, every_program, cheapest_last
) -> Walk:
    """`plan_walk`'s walk, with its single round's stand-ins (`every_program`)."""
    full, partial = _item_tiles(counts, query_tiles, num_heads)
    num_items = full.shape[0]
    rounds = -(-num_items // programs)
    if rounds <= 1 and not split:  # an item a program, what the rounds below come to (a step's ~0.1 ms)
        # Head-major even when dealt: every program runs at once, and every load is 0 when it is dealt
        # (kernels/device_walk.py writes this walk on the device).
        units = np.empty((programs if every_program else num_items, UNIT_FIELDS), dtype=np.int64)
        units[:num_items, 0], units[:num_items, 2] = np.arange(num_items), full + partial
        units[:, 1], units[:, 3], units[:, 4], units[:, 5] = 0, -1, 0, 1
        units[num_items:] = STAND_IN  # the idle programs', with `every_program`
        return Walk(np.minimum(np.arange(programs + 1), units.shape[0]), units, 0)
    cost = full + PARTIAL_COST * partial + ITEM_COST  # an item's, in full tiles
    fixed = max(rounds - max(dealt_rounds, int(split)), 0)  # rounds taken in head-major order
    taken = np.full((rounds, programs), -1, dtype=np.int64)
    head_major = np.arange(fixed * programs).reshape(fixed, programs)
    taken[:fixed] = np.where(head_major < num_items, head_major, -1)
    fixed_costs = np.zeros(fixed * programs)  # not np.pad: ~30 µs a call
    fixed_costs[: min(num_items, fixed * programs)] = cost[: fixed * programs]
    loads = fixed_costs.reshape(fixed, programs).sum(0)
    for r in range(fixed, rounds):
        items = np.arange(r * programs, min(num_items, (r + 1) * programs))
        items = items[np.argsort(-cost[items], kind="stable")]
        takers = np.argsort(loads, kind="stable")[: items.shape[0]]
        taken[r, takers] = items
        loads[takers] += cost[items]
    split_units, num_slots = [], 0
    if split and rounds:  # the last round split instead, where the cost model says it ends sooner
        items = taken[-1][taken[-1] >= 0]
        before = loads.copy()
        np.subtract.at(before, np.nonzero(taken[-1] >= 0)[0], cost[items])
        split_units, num_slots, split_loads = _deal_split(
            items[np.argsort(-cost[items], kind="stable")], cost, full, partial, before
        )
        if split_loads.max() < loads.max():
            taken[-1] = -1
        else:
            split_units, num_slots = [], 0
    # The rounds' units, program by program, then each program's units of a split last round.
    program, w = np.nonzero(taken.T >= 0)[0], taken.T[taken.T >= 0]
    if cheapest_last and not split_units and rounds >= CHEAPEST_LAST_ROUNDS:
        cheap = _cheapest_last(cost, programs)
        if cheap is not None and cheap[2].max() < loads.max() * (1 - CHEAPEST_LAST_GAIN):
            program, w, _ = cheap
    units = np.stack([w, np.zeros_like(w), full[w] + partial[w], np.full_like(w, -1), 0 * w, 1 + 0 * w], 1)
    if split_units:
        program = np.concatenate([program, [p for p, _ in split_units]])
        units = np.concatenate([units, np.array([u for _, u in split_units], dtype=np.int64)])
    order = np.argsort(program, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(program, minlength=programs))])
    return Walk(offsets, units[order], num_slots)


def _cheapest_last(cost: np.ndarray, programs: int) -> tuple | None:
    """`plan_walk`'s walk with the cheapest items last, as (program, item) pairs in each program's
    order and the programs' loads, by the items' costs (head-major numbering): the other items in
    head-major rounds (program p takes the p-th of each round), then the cheapest ones, costliest
    first, each to the program least loaded so far. The cheapest items are the fewest, past whole
    rounds, that can fill every program up to the most loaded one; None when that takes more than a
    quarter of the rounds."""
    num_items = cost.shape[0]
    order = np.argsort(cost, kind="stable")  # the cheapest first
    level = cost.sum() / programs  # the programs' mean load at the end
    kept = np.ones(num_items, dtype=bool)
    # At most a quarter of the rounds (the fill needed 1 of 15 at 8k, 5 of 62 at 32k, 11 of 248 at 128k).
    rounds = num_items // programs
    for last in range(num_items % programs, num_items % programs + (rounds // 4 + 1) * programs, programs):
        kept[order[:last]] = False
        rest = np.nonzero(kept)[0]
        loads = cost[rest].reshape(-1, programs).sum(0)
        if loads.max() <= level:  # the cheapest items can fill every program up to the busiest
            break
    else:
        return None
    heap = [(load, p) for p, load in enumerate(loads.tolist())]
    heapq.heapify(heap)
    tail = order[:last][::-1]
    takers = []
    for c in cost[tail].tolist():
        load, p = heap[0]
        heapq.heapreplace(heap, (load + c, p))
        takers.append(p)
    for load, p in heap:
        loads[p] = load
    program = np.concatenate([np.tile(np.arange(programs), rest.shape[0] // programs), takers])
    return program.astype(np.int64), np.concatenate([rest, tail]), loads


def _deal_split(items, cost, full, partial, loads) -> tuple:
    """`plan_walk`'s last round: the items, in this order, as one stream of tiles that the programs
    (least-loaded first) take in turn, each up to a common end; an item that would take a program past
    it is split there (parts of at least MIN_SPLIT_TILES tiles). The end starts at the programs' mean
    and rises until the stream fits, since each part adds a unit's set-up and SPLIT_COST. Returns the
    (program, unit) pairs, the slots the split items take and the programs' loads then. `cost`: each
    item's whole cost, `full` and `partial` its lists' counts (all items, by `_work`'s numbering)."""
    cost = cost[items]
    full, partial = full[items].tolist(), partial[items].tolist()
    order = np.argsort(loads, kind="stable").tolist()
    sorted_loads = loads[order].tolist()
    end = (loads.sum() + cost.sum()) / len(order)
    for _ in range(8):  # the end's rises: it fits in 2 or 3 at issue 16's rows
        units, left = _fill(full, partial, sorted_loads, end)
        if left == 0:
            break
        end += left / len(order)
    else:  # what is left of the stream goes, whole, to the least-loaded program after all
        units = _fill(full, partial, sorted_loads + [-math.inf], end)[0]  # room: inf
        order.append(int(np.argmin(loads)))
    parts: dict = {}
    for i, j, begin, stop in units:
        parts.setdefault(j, []).append((order[i], begin, stop))
    split_units, num_slots, loads = [], 0, loads.copy()
    for j, taken in parts.items():
        whole = len(taken) == 1
        for k, (p, begin, stop) in enumerate(taken):
            slots = (-1, 0, 1) if whole else (num_slots + k, num_slots, len(taken))
            split_units.append((p, (items[j], begin, stop) + slots))
            loads[p] += ITEM_COST + _cost(full[j], begin, stop) + (0 if whole else SPLIT_COST)
        num_slots += 0 if whole else len(taken)
    return split_units, num_slots, loads


def _cost(full: int, begin: int, end: int) -> float:
    """Tiles begin .. end - 1 of an item with `full` full tiles, in full tiles."""
    fulls = min(end, full) - min(begin, full)
    return fulls + PARTIAL_COST * (end - begin - fulls)


def _fill(full: list, partial: list, loads: list, end: float) -> tuple:
    """`_deal_split`'s stream over programs with these loads, in turn, each up to `end`: the units
    (program index, item index, begin, stop) and the cost of the stream left over."""
    units = []
    j, begin = 0, 0
    for i, load in enumerate(loads):
        room = end - load - ITEM_COST
        while j < len(full):
            f, n = full[j], full[j] + partial[j]
            rest = _cost(f, begin, n) + (SPLIT_COST if begin else 0)
            # Taken whole when it overshoots by less than half a split's set-up, or is too short to split.
            if rest <= room + ITEM_COST / 2 or n - begin < 2 * MIN_SPLIT_TILES:
                if rest > room + ITEM_COST / 2 and room < rest / 2:
                    break  # a short rest that does not fit: the next program's
                units.append((i, j, begin, n))
                room -= rest + ITEM_COST
                j, begin = j + 1, 0
                continue
            # The most tiles that fit, leaving a part behind.
            fulls, space = max(f - begin, 0), room - SPLIT_COST
            fit = int(space) if space <= fulls else fulls + int((space - fulls) / PARTIAL_COST)
            stop = min(begin + fit, n - MIN_SPLIT_TILES)
            if stop - begin >= MIN_SPLIT_TILES:
                units.append((i, j, begin, stop))
                begin = stop
            break
    left = sum(_cost(full[k], 0, full[k] + partial[k]) + ITEM_COST for k in range(j, len(full)))
    left += SPLIT_COST - _cost(full[j], 0, begin) if begin else 0
    return units, left


def num_programs(grid, device: torch.device) -> int:
    """The persistent grid's size for a grid of (query tiles, heads): a program an SM, at most."""
    return min(grid[0] * grid[1], num_sms(device))


def timeline_shape(walk: Walk) -> tuple:
    """The TIMELINE buffer's shape for a plan's walk: (units + programs, consumers, fields), a unit's
    stamps at its row of the walk, then a row a program."""
    return (walk.units.shape[0] + walk.offsets.shape[0] - 1, 2, TIMELINE_FIELDS)


def launch(
    grid, device: torch.device, planned: dict, descriptors: "CacheDescriptors", walk: Walk, slots: int
) -> BoundLaunch:
    """The bound launch of `hopper_prefill_kernel`, from the Triton kernel's planned arguments and grid
    (query tiles, heads): its planned tiles buffer holds that many (sequence, tile) pairs, then the
    walk's `flat()` entries. The launch owns the states and counts of `slots` split items' parts (at
    least the walk's): a plan's runs must not overlap (one stream)."""
    names = set(hopper_prefill_kernel.arg_names)
    num_tiles, num_heads = grid
    if TIMELINE is not None:  # the kernel writes every stamp it may take: the buffer must hold them all
        shape = timeline_shape(walk)
        if TIMELINE.dtype != torch.int64 or tuple(TIMELINE.shape) != shape or TIMELINE.device != device:
            raise ValueError(f"hopper_prefill.TIMELINE: expected int64 {list(shape)} on {device}")
    head_dim = descriptors.block[1]
    if slots < walk.num_slots:
        raise ValueError(f"launch: {slots} split slots for a walk of {walk.num_slots}")
    if slots:
        # A consumer's state a slot: accumulator [ROWS, head_dim], then rows' maxima, sums, seen flags;
        # and a consumer's parts ended, a slot.
        split_state = torch.empty(slots * BLOCK_M * (head_dim + 3), dtype=torch.float32, device=device)
        split_done = torch.zeros(slots * 2, dtype=torch.int32, device=device)
    else:  # unread (SPLIT off): no allocation, no fill launch a plan
        split_state, split_done = _unread_split_buffers(device)
    return BoundLaunch(
        hopper_prefill_kernel,
        (walk.offsets.shape[0] - 1,),
        device,
        **{name: value for name, value in planned.items() if name in names},
        num_heads=num_heads,
        cache_rows=descriptors.shape[0],
        HEAD_DIM=head_dim,
        PAGE_ROWS=descriptors.block[0],
        STAGES=STAGES,
        DEVICE_DESCRIPTORS=descriptors.on_device,
        walk=planned["tiles"][2 * num_tiles :],
        split_state=split_state,
        split_done=split_done,
        SPLIT=slots > 0,  # compiled in only for launches that may split items (its code costs, §23)
        timeline=planned["tiles"] if TIMELINE is None else TIMELINE,
        TIMELINE=TIMELINE is not None,
        V_CHECK_AFTER=V_CHECK_AFTER,
        CONSUMER_REGISTERS=CONSUMER_REGISTERS,
        PRODUCER_REGISTERS=PRODUCER_REGISTERS,
        num_warps=4,  # the default partition: the first consumer
        maxnreg=MAX_REGISTERS,
    )


@functools.cache
def _shared_layout(block: tuple, dtype: torch.dtype):
    """The host descriptors' shared layout of a block (made once: ~30 µs of every plan otherwise)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])


_UNREAD: dict = {}


def _unread_split_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """split_state and split_done of a walk without split items, which the kernel never reads: one
    pair a device (in a CUDA graph's capture, the graph's own, as `_scratch` does)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    pair = None if capturing else _UNREAD.get(device)
    if pair is None:
        pair = (
            torch.empty(1, dtype=torch.float32, device=device),
            torch.empty(1, dtype=torch.int32, device=device),
        )
        if not capturing:
            _UNREAD[device] = pair
    return pair


class CacheDescriptors:
    """What the kernel takes for the K and V caches of a run (their base pointers change per layer):
    host-made TMA descriptors (`HostDescriptor`), or with DEVICE_DESCRIPTORS the caches themselves,
    whose descriptors each program makes. Fixed at planning."""

    def __init__(self, k_cache: torch.Tensor):
        num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
        self.shape = [num_pages * page_size, num_kv_heads * head_dim]
        self.strides = [num_kv_heads * head_dim, 1]
        self.block = [min(page_size, BLOCK_N), head_dim]
        self.layout = _shared_layout(tuple(self.block), k_cache.dtype)
        self.on_device = DEVICE_DESCRIPTORS
        if not self.on_device:  # Triton's checks of a descriptor, once a plan (a run's caches match k's)
            TensorDescriptor(k_cache, self.shape, self.strides, self.block, self.layout)

    def __call__(self, cache: torch.Tensor) -> "HostDescriptor | torch.Tensor":
        if self.on_device:
            # The launch takes the programs' descriptor scratch from Triton's allocator, a context
            # variable: set in each thread on its first run, unless the caller has set one.
            if triton.runtime._allocation._allocator.get() is triton.runtime._allocation._NULL_ALLOCATOR:
                triton.set_allocator(_scratch)
            return cache
        # Built without the dataclass's checks (made once above): µs of every run otherwise.
        desc = object.__new__(HostDescriptor)
        desc.base, desc.shape, desc.strides = cache, self.shape, self.strides
        desc.block_shape, desc.layout, desc.padding = self.block, self.layout, "zero"
        return desc


class HostDescriptor(TensorDescriptor):
    """A cache's host-made TMA descriptor. Triton's launcher would encode it on every run
    (`make_tensordesc_arg`); `launcher_args` encodes it once per cache, and `BoundLaunch` passes those
    arguments as they are."""

    def launcher_args(self, meta: dict) -> list:
        """Triton's launcher arguments for this descriptor under a compiled kernel's `meta` (an entry of
        its `tensordesc_meta`): the encoded map, then the shape and strides."""
        key = (self.base.data_ptr(), self.base.dtype, *self.shape, *self.block_shape)
        args = _ENCODED.get(key)
        if args is None:
            if len(_ENCODED) >= MAX_ENCODED:  # caches come and go (tests, engines): keep the newest
                _ENCODED.clear()
            from triton.backends.nvidia.driver import make_tensordesc_arg

            args = _ENCODED[key] = make_tensordesc_arg(self, meta)
        return args


# (cache address, dtype, shape, block) -> launcher arguments (the kernel's descriptor metadata follows
# from the dtype and block). A map holds an address, no tensor: a cache freed and another made at its
# address with its shape and dtype has the same map.
_ENCODED: dict = {}
MAX_ENCODED = 4096


_SCRATCH: dict = {}


def _scratch(size: int, alignment: int, stream: int) -> torch.Tensor:
    """A launch's descriptor scratch: one buffer a (device, stream, size), since a stream runs its
    launches one after another and each program writes its descriptors before it reads them (a fresh
    torch allocation cost µs of every launch); torch's blocks are 512-byte aligned. A launch captured
    in a CUDA graph gets its own, from the graph's pool: a replay may run beside eager launches."""
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.int8, device="cuda")
    key = (torch.cuda.current_device(), stream, size)
    buffer = _SCRATCH.get(key)
    if buffer is None:
        buffer = _SCRATCH[key] = torch.empty(size, dtype=torch.int8, device="cuda")
    return buffer


@gluon.constexpr_function
def _io_layout(head_dim, num_warps):
    # 16-byte vectors along the head dim, a row per 16 (or 8) threads: coalesced rows of Q and out.
    lanes_d = head_dim // 8
    return gl.BlockedLayout([1, 8], [32 // lanes_d, lanes_d], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _mma_layout(n, num_warps):
    # A warp group's wgmma accumulator of N = n columns: 64 rows, 16 a warp.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _clock(x, GLOBAL: gl.constexpr = False):
    """The SM's cycle counter, or GLOBAL the device's nanosecond timer (comparable across programs),
    read once x is known."""
    register: gl.constexpr = "%globaltimer" if GLOBAL else "%clock64"
    return gl.inline_asm_elementwise(
        f"mov.u64 $0, {register};", "=l,r", [x], dtype=gl.int64, is_pure=False, pack=1
    )


@gluon.jit
def _stamp(p_stamp, x, GLOBAL: gl.constexpr = False):
    """The timeline's stamp at p_stamp, read once x is known (`_clock`)."""
    gl.store(p_stamp, _clock(x, GLOBAL))


@gluon.jit
def _program_stamps(timeline, walk, ns_entry, field: gl.constexpr, CONSUMER: gl.constexpr):
    """A partition's entry time (`_clock`, taken at its start) and its exit time (now), at its
    program's row of the timeline (after the units' rows: the walk's last offset): fields field and
    field + 1 of consumer CONSUMER's part."""
    num_units = gl.load(walk + gl.num_programs(0))
    row = (num_units + gl.program_id(0)) * 2 + CONSUMER
    p_stamp = timeline + row.to(gl.int64) * TIMELINE_FIELDS_C + field
    gl.store(p_stamp, ns_entry)
    _stamp(p_stamp + 1, num_units, True)
    return p_stamp


@gluon.jit
def _tile_ptr(p_full, p_partial, t, n_full):
    """Where the t-th tile of the walk is listed: the full list, then the partial one."""
    return gl.where(t < n_full, p_full + 1 + t, p_partial + 1 + (t - n_full))


@gluon.jit
def _work(u, tile_lists, stride_list_kind, stride_list_tile, stride_list_head, units):
    """Unit u of the walk (`Walk`, its row of ROW_FIELDS): its item's sequence, absolute query tile,
    head, lists and full tiles' count, and the tiles it takes, begin .. end - 1."""
    p_unit = units + u * ROW_FIELDS_C
    i_b = gl.load(p_unit).to(gl.int64)
    i_qt = gl.load(p_unit + 1)
    i_h = gl.load(p_unit + 2).to(gl.int64)
    p_full = tile_lists + i_qt.to(gl.int64) * stride_list_tile + i_h * stride_list_head
    p_partial = p_full + stride_list_kind
    return i_b, i_qt, i_h, p_full, p_partial, gl.load(p_unit + 3), gl.load(p_unit + 4), gl.load(p_unit + 5)


@gluon.jit
def _units(walk):
    """The program's units of the walk: their first and end rows, and the units' base."""
    return (
        gl.load(walk + gl.program_id(0)),
        gl.load(walk + gl.program_id(0) + 1),
        walk + gl.num_programs(0) + 1,
    )


@gluon.jit
def _page_rows(n, p_bt, seq_len, page_size, cache_rows, pred, o_box, PAGE_ROWS: gl.constexpr):
    """[BOXES]: the cache row where each `PAGE_ROWS`-row box of the key tile at position n starts.
    Pages at or past the sequence end are never looked up: their boxes start past the cache's last
    row, which TMA reads as zeros (and counts, so a tile's byte count is always the same)."""
    pos = n + o_box * PAGE_ROWS
    valid = pred & (pos < seq_len)
    page = gl.load(p_bt + pos // page_size, mask=valid, other=0)
    return gl.where(valid, page * page_size + pos % page_size, cache_rows)


@gluon.jit
def _producer(
    k_cache, v_cache, k_smem, v_smem, ready, empty, block_tables, tile_lists, stride_bt, stride_list_kind,
    stride_list_tile, stride_list_head, page_size, group, cache_rows, num_heads, walk, timeline,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_ROWS: gl.constexpr, STAGES: gl.constexpr,
    DEVICE_DESCRIPTORS: gl.constexpr, TIMELINE: gl.constexpr,
):  # fmt: skip
    """Copies the key tiles of the program's work items, in walk order, into the ring: the k-th tile
    goes to slot k % STAGES once both consumers have released it (`empty`), and completes on `ready`.
    With TIMELINE, its entry and exit times and its first copy's issue (`PROGRAM_*`)."""
    if TIMELINE:
        ns_entry = _clock(gl.program_id(0), True)
        first_copy = ns_entry
    if DEVICE_DESCRIPTORS:  # the caches are pointers: their descriptors are made here, once a program
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAGE_ROWS, HEAD_DIM], k_smem.dtype)
        width = (num_heads // group) * HEAD_DIM
        shape = [cache_rows, width]
        k_desc = tma.make_tensor_descriptor(k_cache, shape, [width, 1], [PAGE_ROWS, HEAD_DIM], layout)
        v_desc = tma.make_tensor_descriptor(v_cache, shape, [width, 1], [PAGE_ROWS, HEAD_DIM], layout)
    else:
        k_desc, v_desc = k_cache, v_cache
    BOXES: gl.constexpr = BLOCK_N // PAGE_ROWS
    # Every thread holds every box's row: picking one out is a register select, not a reduction.
    box_layout: gl.constexpr = gl.BlockedLayout([BOXES], [32], [gl.num_warps()], [0])
    o_box = gl.arange(0, BOXES, layout=box_layout)
    k = 0
    u_begin, u_end, units = _units(walk)
    for u in range(u_begin, u_end):
        i_b, _, i_h, p_full, p_partial, n_full, begin, end = _work(
            u, tile_lists, stride_list_kind, stride_list_tile, stride_list_head, units
        )
        seq_len = gl.load(units + u * ROW_FIELDS_C + 11)
        kv_col = ((i_h // group) * HEAD_DIM).to(gl.int32)
        p_bt = block_tables + i_b * stride_bt
        entry = gl.load(_tile_ptr(p_full, p_partial, begin, n_full), mask=begin < end, other=0)
        rows = _page_rows((entry & TILE_MASK) * BLOCK_N, p_bt, seq_len, page_size, cache_rows, begin < end,
                          o_box, PAGE_ROWS)  # fmt: skip
        for t in range(begin, end):
            # The next tile's page rows, looked up before waiting for this tile's slot.
            t_next = t + 1
            entry = gl.load(_tile_ptr(p_full, p_partial, t_next, n_full), mask=t_next < end, other=0)
            n_next = (entry & TILE_MASK) * BLOCK_N
            rows_next = _page_rows(
                n_next, p_bt, seq_len, page_size, cache_rows, t_next < end, o_box, PAGE_ROWS
            )
            slot = k % STAGES
            # A slot's first wait passes at once (a fresh barrier's phase before 0 counts as complete).
            mbarrier.wait(empty.index(slot), ((k // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, 2 * k_desc.block_type.nbytes * BOXES)
            for j in gl.static_range(BOXES):
                row = gl.sum(gl.where(o_box == j, rows, 0), 0)
                k_box = k_smem.index(slot).slice(j * PAGE_ROWS, PAGE_ROWS)
                v_box = v_smem.index(slot).slice(j * PAGE_ROWS, PAGE_ROWS)
                tma.async_copy_global_to_shared(k_desc, [row, kv_col], bar, k_box)
                tma.async_copy_global_to_shared(v_desc, [row, kv_col], bar, v_box)
            if TIMELINE:  # noqa: SIM102 (a compile-time if around a runtime one)
                if k == 0:
                    first_copy = _clock(k, True)
            rows = rows_next
            k += 1
    if TIMELINE:
        p_stamp = _program_stamps(timeline, walk, ns_entry, PROGRAM_PRODUCER_C, 0)
        gl.store(p_stamp + PROGRAM_FIRST_COPY_C - PROGRAM_PRODUCER_C, first_copy)


@gluon.jit
def _attend_tile(
    b_m, b_l, b_seen, b_acc, k, n, q_op, k_smem, v_smem, v_own, ready, empty, o_m, m_m, p_mask_row,
    layout_on, seq_len, sparse_block, qk_scale,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LAYOUT_MASK: gl.constexpr, PARTIAL: gl.constexpr,
    V_CHECK_AFTER: gl.constexpr = False,
):  # fmt: skip
    """The k-th key tile of the ring (starting at key n) into the online softmax state, as
    `attend` (kernels/_common.py); then its slot is released. A PARTIAL tile reads the layout's mask
    (LAYOUT_MASK) only when layout_on: else causality and the sequence end alone mask it."""
    HEAD_DIM: gl.constexpr = q_op.type.shape[1]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = q_op.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, NUM_WARPS)
    o_layout: gl.constexpr = b_acc.type.layout
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = _io_layout(HEAD_DIM, NUM_WARPS)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    if PARTIAL:  # the masks first: their loads land while the tile's copy and scores do
        o_n = n + gl.arange(0, BLOCK_N, layout=col_s)
        m_row = m_m
        if LAYOUT_MASK == 1:  # MASK_ROWS
            m_row = m_row & (gl.load(p_mask_row + n // sparse_block, mask=m_m & layout_on, other=1) != 0)
        # [ROWS]: the last key each row may see, by causality, the sequence end and its row's mask
        b_last = gl.where(m_row, gl.minimum(o_m, seq_len - 1), -1)
        m_s = o_n[None, :] <= b_last[:, None]
        if LAYOUT_MASK == 0:  # MASK_ELEMENTS
            p_mask = p_mask_row[:, None] + o_n[None, :] // sparse_block
            m_s = m_s & (gl.load(p_mask, mask=m_s & layout_on, other=1) != 0)
            b_seen = gl.maximum(b_seen, gl.max(m_s.to(gl.int32), 1))
        else:
            b_seen = gl.maximum(b_seen, (b_last >= n).to(gl.int32))
    else:
        b_seen = gl.full(b_seen.shape, 1, gl.int32, b_seen.type.layout)
    slot = k % STAGES
    mbarrier.wait(ready.index(slot), (k // STAGES) & 1)
    b_s = _scores(q_op, k_smem.index(slot), s_layout)
    v_buf = v_smem.index(slot)
    if PARTIAL and V_CHECK_AFTER:
        # The slot's V as it is first: a NaN or Inf in V makes its whole column of the product
        # non-finite (a weight of 0 times NaN is NaN), so a finite product proves the tile's V finite.
        # Else (rare: non-finite V, or a row that sees a non-finite score) the tile is taken again
        # with V checked, as below.
        b_s = gl.where(m_s, b_s, NEG_INF)
        b_m_new, b_alpha, b_psum, b_pv = _weigh(b_s, m_s, b_m, qk_scale, v_buf, o_layout)
        if gl.max((gl.sum(b_pv * 0.0, 1) != 0.0).to(gl.int32), 0) != 0:
            # The scores again (K is still in the slot): kept live across the product, they spilled.
            b_s = _v_checked(_scores(q_op, k_smem.index(slot), s_layout), m_s, v_buf, v_own, io_layout)
            b_m_new, b_alpha, b_psum, b_pv = _weigh(b_s, m_s, b_m, qk_scale, v_own, o_layout)
        b_l = b_l * b_alpha + b_psum
        b_acc = b_acc * gl.convert_layout(b_alpha, row_o)[:, None] + b_pv
        async_copy.mbarrier_arrive(empty.index(slot), increment_count=False)
        return b_m_new, b_l, b_seen, b_acc
    if PARTIAL:
        b_s = _v_checked(b_s, m_s, v_buf, v_own, io_layout)
    b_m_new = gl.maximum(b_m, gl.max(b_s, 1))
    b_alpha = gl.exp2((b_m - b_m_new) * qk_scale)
    b_p = gl.exp2(b_s * qk_scale - (b_m_new * qk_scale)[:, None])  # one FMA an element
    if PARTIAL:
        # (-inf) * 0 is NaN when scale == 0: masked weights are set, not computed.
        b_p = gl.where(m_s, b_p, 0.0)
    b_l = b_l * b_alpha + gl.sum(b_p, 1)
    b_acc = b_acc * gl.convert_layout(b_alpha, row_o)[:, None]
    b_p = gl.convert_layout(b_p.to(dtype), p_layout)
    if PARTIAL:
        b_acc = warpgroup_mma(b_p, v_own, b_acc, is_async=True)
    else:
        b_acc = warpgroup_mma(b_p, v_buf, b_acc, is_async=True)
    b_acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(b_acc, b_p))
    # Every thread arrives for itself, as FlashAttention-3's consumers do: `mbarrier.arrive` is one
    # thread's, so the compiler puts a barrier of the group before and after it (two a tile). This
    # arrival (the cp.async one, with no copy outstanding) is each thread's own.
    async_copy.mbarrier_arrive(empty.index(slot), increment_count=False)
    return b_m_new, b_l, b_seen, b_acc


@gluon.jit
def _scores(q_op, k_tile, s_layout: gl.constexpr):
    """[ROWS, BLOCK_N] in s_layout: q_op [ROWS, HEAD_DIM] times the tile's K [BLOCK_N, HEAD_DIM]
    (shared memory) transposed, with the NaN rule: an infinite score is seen as NaN."""
    ROWS: gl.constexpr = q_op.type.shape[0]
    BLOCK_N: gl.constexpr = k_tile.type.shape[0]
    b_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    b_s = warpgroup_mma(q_op, k_tile.permute((1, 0)), b_zero, use_acc=False, is_async=True)
    b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s,))
    return b_s + b_s * 0.0


@gluon.jit
def _v_checked(b_s, m_s, v_buf, v_own, io_layout: gl.constexpr):
    """A masked tile's scores b_s [ROWS, BLOCK_N] with its V checked: keys whose V [BLOCK_N, HEAD_DIM]
    (the shared slot v_buf) holds NaN or Inf (past the sequence end too: the rest of its last page may
    hold anything) get a NaN score instead, and zeros in the group's own copy v_own, since a masked
    weight of 0 times a non-finite V would make NaN; masked scores (m_s False) are -inf. The slot is
    shared with the other group, so it is only read."""
    col_s: gl.constexpr = gl.SliceLayout(0, b_s.type.layout)
    b_v = v_buf.load(io_layout)
    m_v_bad = gl.max(((b_v != b_v) | (gl.abs(b_v) == float("inf"))).to(gl.int32), 1) > 0
    v_own.store(gl.where(m_v_bad[:, None], gl.zeros_like(b_v), b_v))
    fence_async_shared()
    gl.thread_barrier()
    b_s = gl.where(gl.convert_layout(m_v_bad, col_s)[None, :], float("nan"), b_s)
    return gl.where(m_s, b_s, NEG_INF)


@gluon.jit
def _weigh(b_s, m_s, b_m, qk_scale, v, o_layout: gl.constexpr):
    """A masked tile's softmax update from its scores b_s [ROWS, BLOCK_N] (masked ones -inf): the new
    row maxima and rescale factors, the weights' row sums and their product with v [BLOCK_N,
    HEAD_DIM] (shared memory), [ROWS, HEAD_DIM] in o_layout."""
    ROWS: gl.constexpr = b_s.type.shape[0]
    HEAD_DIM: gl.constexpr = v.type.shape[1]
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    b_m_new = gl.maximum(b_m, gl.max(b_s, 1))
    b_alpha = gl.exp2((b_m - b_m_new) * qk_scale)
    # (-inf) * 0 is NaN when scale == 0: masked weights are set, not computed.
    b_p = gl.where(m_s, gl.exp2(b_s * qk_scale - (b_m_new * qk_scale)[:, None]), 0.0)
    b_x = gl.convert_layout(b_p.to(v.dtype), p_layout)
    b_zero = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    b_pv = warpgroup_mma(b_x, v, b_zero, use_acc=False, is_async=True)
    b_pv, _ = warpgroup_mma_wait(num_outstanding=0, deps=(b_pv, b_x))
    return b_m_new, b_alpha, gl.sum(b_p, 1), b_pv


@gluon.jit
def _attend_pairs(
    b_m, b_l, b_acc, k, num_pairs, q_op, k_smem, v_smem, ready, empty, qk_scale,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """Full key tiles k .. k + 2 * num_pairs - 1 of the ring into the online softmax state, two at a
    time, as unmasked `_attend_tile`s: one softmax update, one wait for the products and one release
    of both slots a pair."""
    ROWS: gl.constexpr = q_op.type.shape[0]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, gl.num_warps())
    o_layout: gl.constexpr = b_acc.type.layout
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    b_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    for j in range(num_pairs):
        i = k + 2 * j
        slot0 = i % STAGES
        slot1 = (i + 1) % STAGES
        mbarrier.wait(ready.index(slot0), (i // STAGES) & 1)
        b_s0 = warpgroup_mma(q_op, k_smem.index(slot0).permute((1, 0)), b_zero, use_acc=False, is_async=True)
        mbarrier.wait(ready.index(slot1), ((i + 1) // STAGES) & 1)
        b_s1 = warpgroup_mma(q_op, k_smem.index(slot1).permute((1, 0)), b_zero, use_acc=False, is_async=True)
        b_s0, b_s1 = warpgroup_mma_wait(num_outstanding=0, deps=(b_s0, b_s1))
        b_s0 = b_s0 + b_s0 * 0.0  # the NaN rule, as in `_attend_tile`
        b_s1 = b_s1 + b_s1 * 0.0
        b_m_new = gl.maximum(b_m, gl.max(gl.maximum(b_s0, b_s1), 1))
        b_alpha = gl.exp2((b_m - b_m_new) * qk_scale)
        b_shift = (b_m_new * qk_scale)[:, None]
        b_p0 = gl.exp2(b_s0 * qk_scale - b_shift)
        b_p1 = gl.exp2(b_s1 * qk_scale - b_shift)
        b_l = b_l * b_alpha + gl.sum(b_p0 + b_p1, 1)
        b_m = b_m_new
        b_x0 = gl.convert_layout(b_p0.to(q_op.dtype), p_layout)
        b_x1 = gl.convert_layout(b_p1.to(q_op.dtype), p_layout)
        b_acc = b_acc * gl.convert_layout(b_alpha, row_o)[:, None]
        b_acc = warpgroup_mma(b_x0, v_smem.index(slot0), b_acc, is_async=True)
        b_acc = warpgroup_mma(b_x1, v_smem.index(slot1), b_acc, is_async=True)
        # The register operands are kept alive until their products retire.
        b_acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(b_acc, b_x0, b_x1))
        async_copy.mbarrier_arrive(empty.index(slot0), increment_count=False)
        async_copy.mbarrier_arrive(empty.index(slot1), increment_count=False)
    return b_m, b_l, b_acc


@gluon.jit
def _item(u, tile_lists, stride_list_kind, stride_list_tile, stride_list_head, units):
    """Unit u's scalars, its loads issued together (a unit's are loaded during the one before): its
    item's query tile, head and lists, the tiles it takes (`_work`), its part's slot, its item's
    first slot and parts (`Walk`), and its sequence's first query token, context and length."""
    i_b, i_qt, i_h, p_full, p_partial, n_full, begin, end = _work(
        u, tile_lists, stride_list_kind, stride_list_tile, stride_list_head, units
    )
    p_unit = units + u * ROW_FIELDS_C
    split = (gl.load(p_unit + 6), gl.load(p_unit + 7), gl.load(p_unit + 8))
    q_begin = gl.load(p_unit + 9)
    context = gl.load(p_unit + 10)
    seq_len = gl.load(p_unit + 11)
    return i_qt, i_h, p_full, p_partial, n_full, begin, end, split, q_begin, context, seq_len


@gluon.jit
def _query_rows(
    i_qt, q_begin, context, seq_len, CONSUMER: gl.constexpr, ROWS: gl.constexpr, layout: gl.constexpr
):
    """[ROWS] in `layout`: consumer CONSUMER's rows of query tile i_qt, as absolute positions, whether
    each is one of its sequence's queries, and token indices."""
    o_m = i_qt * (2 * ROWS) + CONSUMER * ROWS + gl.arange(0, ROWS, layout=layout)
    m_m = (o_m >= context) & (o_m < seq_len)
    return o_m, m_m, (q_begin + o_m - context).to(gl.int64)


@gluon.jit
def _consumer(
    q, out, lse, k_smem, v_smem, q_smem, v_own_smem, ready, empty, stride_qt, stride_qh, qk_scale,
    tile_lists, block_mask, stride_list_kind, stride_list_tile, stride_list_head, stride_mask_head,
    num_blocks, sparse_block, num_heads, walk, split_state, split_done, timeline, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, LAYOUT_MASK: gl.constexpr, CONSUMER: gl.constexpr, SPLIT: gl.constexpr,
    TIMELINE: gl.constexpr, V_CHECK_AFTER: gl.constexpr,
):  # fmt: skip
    """Rows CONSUMER * ROWS .. + ROWS - 1 of each of the program's units: the walk over the shared ring
    (the full tiles unmasked, then the partial ones as their entries' modes say), then the outputs, or
    for a part of a split item its softmax state, merged by the last part to end (`_merge`). With
    TIMELINE, a unit's stamps: its start on both clocks, the cycle counter after its full tiles,
    after its partial tiles and once its stores are issued, the nanosecond timer then, its tiles'
    counts, then the cycle counter after each of its first PARTIAL_STAMPS partial tiles and those
    tiles' modes; and its entry and exit times (`PROGRAM_CONSUMER`)."""
    if TIMELINE:
        ns_entry = _clock(gl.program_id(0), True)
    ROWS: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, NUM_WARPS)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)
    io_layout: gl.constexpr = _io_layout(HEAD_DIM, NUM_WARPS)
    q_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    row_io: gl.constexpr = gl.SliceLayout(1, io_layout)
    col_io: gl.constexpr = gl.SliceLayout(0, io_layout)
    u_begin, u_end, units = _units(walk)
    # What `_item` reads: the walk's tiles and lists, and the sequences' lengths and query starts.
    item_args = (tile_lists, stride_list_kind, stride_list_tile, stride_list_head, units)
    q_buf = q_smem.index(CONSUMER)
    v_own = v_own_smem.index(CONSUMER)
    o_d_io = gl.arange(0, HEAD_DIM, layout=col_io)

    # The first unit and its Q [ROWS, HEAD_DIM] (rows outside the queries zero); each unit loads the
    # next one's scalars and Q during its epilogue.
    item = _item(gl.minimum(u_begin, u_end - 1), *item_args)
    i_qt, i_h, p_full, p_partial, n_full, begin, end, split, q_begin, context, seq_len = item
    _, m_m_io, o_tok_io = _query_rows(i_qt, q_begin, context, seq_len, CONSUMER, ROWS, row_io)
    p_q = q + o_tok_io[:, None] * stride_qt + i_h * stride_qh + o_d_io[None, :]
    b_q = gl.load(p_q, mask=m_m_io[:, None], other=0.0)
    k = 0
    for u in range(u_begin, u_end):
        p_stamp = timeline + (u * 2 + CONSUMER).to(gl.int64) * TIMELINE_FIELDS_C
        f_begin, f_end = gl.minimum(begin, n_full), gl.minimum(end, n_full)
        t_begin, t_end = gl.maximum(begin, n_full) - n_full, gl.maximum(end, n_full) - n_full
        if TIMELINE:
            _stamp(p_stamp, u, True)
            _stamp(p_stamp + 1, u)
            gl.store(p_stamp + 6, (f_end - f_begin).to(gl.int64))
            gl.store(p_stamp + 7, (end - begin).to(gl.int64))
        # Every warp of the group is past the previous unit's last product (a wait covers the group).
        q_buf.store(b_q)
        fence_async_shared()
        gl.thread_barrier()

        o_m, m_m, _ = _query_rows(i_qt, q_begin, context, seq_len, CONSUMER, ROWS, row_s)
        qb = gl.minimum(o_m // sparse_block, num_blocks - 1)
        p_mask_row = block_mask + i_h * stride_mask_head + qb * num_blocks
        # The full tiles' scores read Q from registers, and only K from shared memory.
        q_op = q_buf.load(q_op_layout)
        b_m = gl.full([ROWS], FINITE_MIN, gl.float32, row_s)
        b_l = gl.zeros([ROWS], gl.float32, row_s)
        # A full tile is seen by every row.
        b_seen = gl.zeros([ROWS], gl.int32, row_s) + (f_end > f_begin).to(gl.int32)
        b_acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        num_pairs = (f_end - f_begin) // 2  # then one more tile when their count is odd
        b_m, b_l, b_acc = _attend_pairs(
            b_m, b_l, b_acc, k, num_pairs, q_op, k_smem, v_smem, ready, empty, qk_scale, BLOCK_N, STAGES
        )
        for t in range(f_begin + 2 * num_pairs, f_end):
            b_m, b_l, b_seen, b_acc = _attend_tile(
                b_m, b_l, b_seen, b_acc, k + t - f_begin, gl.load(p_full + 1 + t) * BLOCK_N, q_op, k_smem,
                v_smem, v_own, ready, empty, o_m, m_m, p_mask_row, False, seq_len, sparse_block, qk_scale,
                BLOCK_N, STAGES, LAYOUT_MASK, False,
            )  # fmt: skip
        k += f_end - f_begin
        if TIMELINE:
            _stamp(p_stamp + 2, k)
        # A tile partial for the 128-row query tile is often none of this group's business, or whole
        # for it (the local window's edge blocks, the diagonal's halves), or masked by causality alone
        # (the diagonal): those read no layout mask. Their scores read Q from shared memory: the
        # registers go to the masks and V's copy.
        for t in range(t_begin, t_end):
            entry = gl.load(p_partial + 1 + t)
            n = (entry & TILE_MASK) * BLOCK_N
            mode = (entry >> (TILE_BITS + 2 * CONSUMER)) & 3
            i = k + t - t_begin
            if mode == SKIP:
                slot = i % STAGES
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)  # the copy lands before reuse
                async_copy.mbarrier_arrive(empty.index(slot), increment_count=False)
            elif mode == WHOLE:
                b_m, b_l, b_seen, b_acc = _attend_tile(
                    b_m, b_l, b_seen, b_acc, i, n, q_buf, k_smem, v_smem, v_own, ready, empty, o_m, m_m,
                    p_mask_row, False, seq_len, sparse_block, qk_scale, BLOCK_N, STAGES, LAYOUT_MASK, False,
                )  # fmt: skip
            else:  # one copy for both masked modes: with two, 8k with 832 queries ran 2-3% slower (§22)
                b_m, b_l, b_seen, b_acc = _attend_tile(
                    b_m, b_l, b_seen, b_acc, i, n, q_buf, k_smem, v_smem, v_own, ready, empty, o_m, m_m,
                    p_mask_row, mode != CAUSAL, seq_len, sparse_block, qk_scale, BLOCK_N, STAGES,
                    LAYOUT_MASK, True, V_CHECK_AFTER,
                )  # fmt: skip
            if TIMELINE:  # noqa: SIM102 (a compile-time if around a runtime one)
                if t - t_begin < PARTIAL_STAMPS_C:
                    _stamp(p_stamp + ITEM_FIELDS_C + t - t_begin, i)
                    gl.store(p_stamp + ITEM_FIELDS_C + PARTIAL_STAMPS_C + t - t_begin, mode.to(gl.int64))
        k += t_end - t_begin
        if TIMELINE:
            _stamp(p_stamp + 3, k)

        # The next unit's scalars and Q, loading during this one's epilogue.
        u_next = u + 1
        item = _item(gl.minimum(u_next, u_end - 1), *item_args)
        n_qt, n_h, _, _, _, _, _, _, n_q_begin, n_context, n_seq_len = item
        _, m_next, tok_next = _query_rows(n_qt, n_q_begin, n_context, n_seq_len, CONSUMER, ROWS, row_io)
        p_q = q + tok_next[:, None] * stride_qt + n_h * stride_qh + o_d_io[None, :]
        b_q = gl.load(p_q, mask=(m_next & (u_next < u_end))[:, None], other=0.0)

        b_l = gl.convert_layout(b_l, row_o)
        b_m = gl.convert_layout(b_m, row_o)
        b_seen = gl.convert_layout(b_seen, row_o)
        # A part of a split item leaves its state at its slot; the last part to end takes all of them.
        part_slot, first_slot, parts = split
        last = part_slot < 0
        if SPLIT and part_slot >= 0:  # noqa: SIM102 (a compile-time if around a runtime one)
            _put_state(split_state, part_slot, CONSUMER, b_m, b_l, b_seen, b_acc)
            gl.thread_barrier()  # every thread's stores, before the count says they are there
            p_done = split_done + 2 * first_slot + CONSUMER
            last = gl.atomic_add(p_done, 1, sem="acq_rel", scope="gpu") == parts - 1
            if last:
                gl.store(p_done, 0)  # for the next launch
                b_m, b_l, b_seen, b_acc = _merge(
                    split_state, first_slot, parts, qk_scale, CONSUMER, ROWS, HEAD_DIM, o_layout
                )

        # finalize (kernels/_common.py): the NaN rule, rows with no key.
        seen = b_seen != 0
        # A row's sum of zeros is NaN when its accumulator holds NaN or Inf; a row with no key has an
        # accumulator of zeros, which its factor 0 keeps. One product an element, where a division
        # and two selects cost 11% of the time at 8k with 832 queries (reports/gpu/kernel-ab.md §13).
        m_bad = (b_l != b_l) | (gl.sum(b_acc * 0.0, 1) != 0.0)
        b_l_safe = gl.where(seen, b_l, 1.0)
        b_norm = gl.where(m_bad, float("nan"), gl.where(seen, 1.0 / b_l_safe, 0.0))
        b_out = b_acc * b_norm[:, None]
        b_lse = gl.where(seen, (b_m * qk_scale + gl.log2(b_l_safe)) * LN2, NEG_INF)
        b_lse = gl.where(m_bad, float("nan"), b_lse)

        _, m_m_io, o_tok_io = _query_rows(i_qt, q_begin, context, seq_len, CONSUMER, ROWS, row_io)
        m_m_io = m_m_io & last
        b_out = gl.convert_layout(b_out.to(dtype), io_layout)
        o_out = o_tok_io[:, None] * num_heads + i_h
        gl.store(out + o_out * HEAD_DIM + o_d_io[None, :], b_out, mask=m_m_io[:, None])
        gl.store(lse + o_tok_io * num_heads + i_h, gl.convert_layout(b_lse, row_io), mask=m_m_io)
        if TIMELINE:
            _stamp(p_stamp + 4, k)
            _stamp(p_stamp + 5, k, True)
        i_qt, i_h, p_full, p_partial, n_full, begin, end, split, q_begin, context, seq_len = item
    if TIMELINE:
        _program_stamps(timeline, walk, ns_entry, PROGRAM_CONSUMER_C, CONSUMER)


@gluon.jit
def _state_ptrs(
    split_state,
    slot,
    CONSUMER: gl.constexpr,
    ROWS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    o_layout: gl.constexpr,
):
    """Where slot's softmax state for the consumer's rows lies (a record of ROWS * (HEAD_DIM + 3)
    float32s): its accumulator [ROWS, HEAD_DIM] in o_layout, then its rows' maxima, sums and seen
    flags [ROWS] each."""
    o_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    p_rec = split_state + (slot * 2 + CONSUMER).to(gl.int64) * (ROWS * (HEAD_DIM + 3))
    p_rows = p_rec + ROWS * HEAD_DIM + o_r
    return p_rec + o_r[:, None] * HEAD_DIM + o_d[None, :], p_rows, p_rows + ROWS, p_rows + 2 * ROWS


@gluon.jit
def _put_state(split_state, slot, CONSUMER: gl.constexpr, b_m, b_l, b_seen, b_acc):
    """A part's softmax state (rows' maxima, sums and seen flags [ROWS], accumulator [ROWS,
    HEAD_DIM]) to its slot."""
    ROWS: gl.constexpr = b_acc.type.shape[0]
    HEAD_DIM: gl.constexpr = b_acc.type.shape[1]
    o_layout: gl.constexpr = b_acc.type.layout
    p_acc, p_m, p_l, p_seen = _state_ptrs(split_state, slot, CONSUMER, ROWS, HEAD_DIM, o_layout)
    gl.store(p_acc, b_acc)
    gl.store(p_m, b_m)
    gl.store(p_l, b_l)
    gl.store(p_seen, b_seen.to(gl.float32))


@gluon.jit
def _merge(
    split_state, first_slot, parts, qk_scale, CONSUMER: gl.constexpr, ROWS: gl.constexpr,
    HEAD_DIM: gl.constexpr, o_layout: gl.constexpr,
):  # fmt: skip
    """A split item's softmax state from its parts' (slots first_slot .. + parts - 1, in that order,
    so the result does not depend on which part ended last), as `attend` merges tiles."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    b_m = gl.full([ROWS], FINITE_MIN, gl.float32, row_o)
    b_l = gl.zeros([ROWS], gl.float32, row_o)
    b_seen = gl.zeros([ROWS], gl.int32, row_o)
    b_acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    for j in range(parts):
        p_acc, p_m, p_l, p_seen = _state_ptrs(split_state, first_slot + j, CONSUMER, ROWS, HEAD_DIM, o_layout)
        b_m_part = gl.load(p_m)
        b_m_new = gl.maximum(b_m, b_m_part)
        b_alpha = gl.exp2((b_m - b_m_new) * qk_scale)
        b_beta = gl.exp2((b_m_part - b_m_new) * qk_scale)
        b_l = b_l * b_alpha + gl.load(p_l) * b_beta
        b_acc = b_acc * b_alpha[:, None] + gl.load(p_acc) * b_beta[:, None]
        b_seen = gl.maximum(b_seen, gl.load(p_seen).to(gl.int32))
        b_m = b_m_new
    return b_m, b_l, b_seen, b_acc


# Persistent: a program an SM (the grid's size), work items in the walk order of `_work`.
@gluon.jit(do_not_specialize=NOT_SPECIALIZED)
def hopper_prefill_kernel(
    q,
    out,
    lse,
    k_cache,
    v_cache,
    stride_qt,
    stride_qh,
    qk_scale,
    block_tables,
    tile_lists,
    block_mask,
    stride_bt,
    stride_list_kind,
    stride_list_tile,
    stride_list_head,
    stride_mask_head,
    num_blocks,
    sparse_block,
    page_size,
    group,
    cache_rows,
    num_heads,
    walk,
    split_state,
    split_done,
    timeline,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    PAGE_ROWS: gl.constexpr,
    STAGES: gl.constexpr,
    LAYOUT_MASK: gl.constexpr,
    DEVICE_DESCRIPTORS: gl.constexpr,
    SPLIT: gl.constexpr,
    TIMELINE: gl.constexpr,
    V_CHECK_AFTER: gl.constexpr,
    CONSUMER_REGISTERS: gl.constexpr,
    PRODUCER_REGISTERS: gl.constexpr,
):
    dtype: gl.constexpr = q.dtype.element_ty
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAGE_ROWS, HEAD_DIM], dtype)
    ROWS: gl.constexpr = BLOCK_M // 2
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_layout)
    v_own_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], v_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2 * CONSUMER_THREADS)  # every consumer thread arrives
    fence_async_shared()  # the barriers' initialization, before TMA signals them

    # The default partition (the launch's 4 warps) is the first consumer.
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    q, out, lse, k_smem, v_smem, q_smem, v_own_smem, ready, empty, stride_qt, stride_qh,
                    qk_scale, tile_lists, block_mask, stride_list_kind, stride_list_tile, stride_list_head,
                    stride_mask_head, num_blocks, sparse_block, num_heads, walk, split_state, split_done,
                    timeline, BLOCK_N, STAGES, LAYOUT_MASK, 0, SPLIT, TIMELINE, V_CHECK_AFTER,
                ),
            ),
            (
                _consumer,
                (
                    q, out, lse, k_smem, v_smem, q_smem, v_own_smem, ready, empty, stride_qt, stride_qh,
                    qk_scale, tile_lists, block_mask, stride_list_kind, stride_list_tile, stride_list_head,
                    stride_mask_head, num_blocks, sparse_block, num_heads, walk, split_state, split_done,
                    timeline, BLOCK_N, STAGES, LAYOUT_MASK, 1, SPLIT, TIMELINE, V_CHECK_AFTER,
                ),
            ),
            (
                _producer,
                (
                    k_cache, v_cache, k_smem, v_smem, ready, empty, block_tables, tile_lists, stride_bt,
                    stride_list_kind, stride_list_tile, stride_list_head, page_size, group, cache_rows,
                    num_heads, walk, timeline, HEAD_DIM, BLOCK_N, PAGE_ROWS, STAGES, DEVICE_DESCRIPTORS,
                    TIMELINE,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS],
    )  # fmt: skip
