"""A lone round's walk, written by the GPU: the Hopper prefill plan's replan without the host's walk.

A replan (`kernels.paged_prefill.PrefillPlan.replan`) writes the new batch's walk into the plan's tiles
buffer: on the host (`hopper_prefill.settled_walk` and `Walk.flat`, then a copy) that took 0.2-0.4 ms a
plan on the device's hosts, while the GPU, started on a step's first graph, waited for it (an engine's
2k step with 90% cached: 0.9 ms of the GPU idle after its first replay on an H100's host,
reports/gpu/ttft-phases-h100-walk.txt). Where the batch's items fit one round (`lone_round`: a (query
tile, head) item a program, the programs left over taking stand-ins, or with SPLIT_ONE_ROUND the items'
parts), the walk is a pure function of the sequences' lengths and query counts and of the layout's
list counts, which the plan's tensors hold on the device: `lone_round_walk_kernel` writes it there,
the same int32 entries as the host's walk (tests/kernels/test_device_walk.py), for one launch and no
copy. The kernel reads the batch from the device alone and writes nothing for a batch of more than a
round, so that a CUDA graph can hold it: an engine's prefill graph launches it in its lead, and a step
of a lone round then needs no replan on the host at all (engine/cuda_graphs.py).

spec: `hopper_prefill.settled_walk(...).flat(...)` after the (sequence, absolute query tile) pairs of
`paged_prefill._query_tiles`, where `lone_round` holds; nothing written where it does not.
"""

import triton
import triton.language as tl

from kernels import hopper_prefill
from kernels._common import BoundLaunch

# Off: every replan's walk made on the host and copied (the A/B's other arm, reports/host_ab.py).
ENABLED = True


def num_query_tiles(seq_lens: list[int], query_starts: list[int], block_m: int) -> int:
    """How many query tiles of `block_m` positions a batch's queries touch (`paged_prefill._query_tiles`'
    count): a sequence with queries spans its context's tile to its last position's."""
    tiles = 0
    for b, seq_len in enumerate(seq_lens):
        queries = query_starts[b + 1] - query_starts[b]
        if queries:
            tiles += (seq_len - 1) // block_m - (seq_len - queries) // block_m + 1
    return tiles


def active() -> bool:
    """Whether lone rounds have their walks written by the GPU: ENABLED, and SPLIT_LAST (whose dealt
    split stays the host's) off."""
    return ENABLED and not hopper_prefill.SPLIT_LAST


def lone_round(num_tiles: int, num_heads: int, programs: int) -> bool:
    """Whether a batch of `num_tiles` query tiles (of `num_heads` heads each) has its walk written by
    the GPU: `active()`, and at most a round of items."""
    return active() and 0 < num_tiles * num_heads <= programs


@triton.jit
def _sequence_tiles(seq_lens, query_start_loc, b, BLOCK_M: tl.constexpr):
    """(context, query tiles) of sequence b: its queries span its context's tile to its last position's."""
    seq_len = tl.load(seq_lens + b)
    context = seq_len - (tl.load(query_start_loc + b + 1) - tl.load(query_start_loc + b))
    return context, tl.where(context < seq_len, (seq_len - 1) // BLOCK_M - context // BLOCK_M + 1, 0)


@triton.jit
def _item_fields(w, num_seqs, num_tiles, seq_lens, query_start_loc, BLOCK_M: tl.constexpr):
    """(sequence, absolute query tile, head) of items w (`hopper_prefill._item_tiles`' head-major
    numbering: head w // num_tiles, the batch's query tile num_tiles - 1 - w % num_tiles); 0s where w
    is negative."""
    item_tile = tl.where(w >= 0, num_tiles - 1 - w % num_tiles, -1)  # a stand-in's matches no tile
    item_seq = tl.zeros(w.shape, tl.int32)
    item_abs = tl.zeros(w.shape, tl.int32)
    first = 0
    for b in range(num_seqs):
        context, count = _sequence_tiles(seq_lens, query_start_loc, b, BLOCK_M)
        mine = (item_tile >= first) & (item_tile < first + count)
        item_seq = tl.where(mine, b, item_seq)
        item_abs = tl.where(mine, context // BLOCK_M + item_tile - first, item_abs)
        first += count
    return item_seq, item_abs, tl.where(w >= 0, w // num_tiles, 0)


@triton.jit
def _cut(x, full, PARTIAL_TENTHS: tl.constexpr):
    """The tile at cost x (tenths of a full tile) of items with `full` full tiles, then partial ones:
    the nearest, half up."""
    partial_tile = full + (2 * (x - 10 * full) + PARTIAL_TENTHS) // (2 * PARTIAL_TENTHS)
    return tl.where(x <= 10 * full, (x + 5) // 10, partial_tile)


@triton.jit
def lone_round_walk_kernel(
    tiles,
    seq_lens,
    query_start_loc,
    tile_lists,
    stride_list_kind,
    stride_list_tile,
    stride_list_head,
    num_seqs,
    num_heads,
    programs,
    walk_start,
    split_slots,
    BLOCK_M: tl.constexpr,
    ROW_FIELDS: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
    PARTIAL_TENTHS: tl.constexpr,
    SPLIT_TENTHS: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
):
    """One program, over the plan's `num_seqs` metadata rows (rows past a batch's own have no queries).
    Where the batch's items fit a round, writes into `tiles` the (sequence, absolute query tile) of each
    query tile at its front, the walk from `walk_start`: the offsets 0 .. programs, then a row of
    ROW_FIELDS a program (`hopper_prefill.Walk.flat`). Item w takes programs from the sum of the parts
    of the items before it: one, whole; or with SPLIT, as many as `hopper_prefill.split_one_round` cuts
    it into, where it splits and `split_slots` states hold the parts. The programs left take stand-ins.
    BLOCK: a power of two > programs."""
    num_tiles = 0
    for b in range(num_seqs):
        num_tiles += _sequence_tiles(seq_lens, query_start_loc, b, BLOCK_M)[1]
    num_items = num_tiles * num_heads
    if (num_items > 0) & (num_items <= programs):
        p = tl.arange(0, BLOCK)
        # The query tiles in the batch's forward order: tile k's fields are item k's of head 0, by the
        # walk's numbering (the last tile first).
        k = tl.where(p < num_tiles, num_tiles - 1 - p, -1)
        seq, tile, _ = _item_fields(k, num_seqs, num_tiles, seq_lens, query_start_loc, BLOCK_M)
        pairs = p < num_tiles
        tl.store(tiles + 2 * p, seq, mask=pairs)
        tl.store(tiles + 2 * p + 1, tile, mask=pairs)
        # Lane j: item j, its cost in tenths of a full tile and its parts.
        item = p < num_items
        item_seq, item_abs, head = _item_fields(
            tl.where(item, p, -1), num_seqs, num_tiles, seq_lens, query_start_loc, BLOCK_M
        )
        lists = tile_lists + item_abs * stride_list_tile + head * stride_list_head
        full = tl.load(lists, mask=item, other=0)
        partial = tl.load(lists + stride_list_kind, mask=item, other=0)
        cost = 10 * full + PARTIAL_TENTHS * partial
        parts = item.to(tl.int32)
        if SPLIT:
            costliest = tl.max(cost, 0)
            top = tl.maximum(costliest, 1)
            most = cost // (PARTIAL_TENTHS * (MIN_SPLIT_TILES + 1))
            # The most parts u of the costliest item whose items' parts the programs hold (the sum grows
            # with u): a bisection, 16 steps for up to 65535 programs.
            lo = programs * 0 + 1
            hi = programs * 0 + programs
            for _ in tl.static_range(16):
                mid = (lo + hi + 1) // 2
                held = tl.maximum(tl.minimum((mid * cost + top - 1) // top, most), 1)
                fits = tl.sum(tl.where(item, held, 0), 0) <= programs
                lo = tl.where(fits, mid, lo)
                hi = tl.where(fits, hi, mid - 1)
            split = tl.where(item, tl.maximum(tl.minimum((lo * cost + top - 1) // top, most), 1), 0)
            shares = cost + split * (SPLIT_TENTHS + PARTIAL_TENTHS) - split * costliest
            late = item & (tl.where(split > 1, shares, cost - costliest) >= 0)
            sooner = (costliest > 0) & (tl.max(late.to(tl.int32), 0) == 0)
            held = tl.sum(tl.where(split > 1, split, 0), 0)  # the states of the split items' parts
            parts = tl.where(sooner & (held <= split_slots), split, parts)
        starts = tl.cumsum(parts, 0) - parts
        split_parts = tl.where(parts > 1, parts, 0)  # the split items' parts take the slots, in order
        slots = tl.cumsum(split_parts, 0) - split_parts
        walk = tiles + walk_start
        tl.store(walk + p, p, mask=p <= programs)
        # Each program's row: its item's (sequence, tile, head, full tiles, begin, end, slot, first slot,
        # parts, first query, context, length), part by part of every item at once; then the stand-ins'.
        rows = walk + programs + 1
        seq_len = tl.load(seq_lens + item_seq, mask=item, other=0)
        start = tl.load(query_start_loc + item_seq, mask=item, other=0)
        stop = tl.load(query_start_loc + item_seq + 1, mask=item, other=0)
        divisor = tl.maximum(parts, 1)
        for i in range(tl.max(parts, 0)):
            row = rows + (starts + i) * ROW_FIELDS
            mine = i < parts
            split_part = mine & (parts > 1)
            tl.store(row, item_seq, mask=mine)
            tl.store(row + 1, item_abs, mask=mine)
            tl.store(row + 2, head, mask=mine)
            tl.store(row + 3, full, mask=mine)
            tl.store(row + 4, _cut(cost * i // divisor, full, PARTIAL_TENTHS), mask=mine)
            tl.store(row + 5, _cut(cost * (i + 1) // divisor, full, PARTIAL_TENTHS), mask=mine)
            tl.store(row + 6, tl.where(split_part, slots + i, -1), mask=mine)
            tl.store(row + 7, tl.where(split_part, slots, 0), mask=mine)
            tl.store(row + 8, parts, mask=mine)
            tl.store(row + 9, start, mask=mine)
            tl.store(row + 10, seq_len - (stop - start), mask=mine)
            tl.store(row + 11, seq_len, mask=mine)
        stand_in = (p >= tl.sum(parts, 0)) & (p < programs)
        row = rows + p * ROW_FIELDS
        for field in tl.static_range(ROW_FIELDS):  # (-1, 0, 0, -1, 0, 1) as a unit: slot -1, 1 part
            tl.store(row + field, 0 * p, mask=stand_in)
        tl.store(row + 6, 0 * p - 1, mask=stand_in)
        tl.store(row + 8, 0 * p + 1, mask=stand_in)


def bind(
    planned: dict, num_seqs: int, num_heads: int, programs: int, max_tiles: int, split_slots: int
) -> BoundLaunch:
    """The launch of `lone_round_walk_kernel` over a plan's planned arguments (its tiles buffer, seq_lens,
    query_start_loc and lists, `num_seqs` rows of metadata): called with no argument, it writes the walk of
    the batch that those tensors then hold (stream-ordered), if that batch is a lone round. SPLIT_ONE_ROUND
    and the cost model's constants are read here, once."""
    own = dict(
        num_seqs=num_seqs,
        num_heads=num_heads,
        programs=programs,
        walk_start=2 * max_tiles,
        split_slots=split_slots,
        ROW_FIELDS=hopper_prefill.ROW_FIELDS,
        BLOCK=triton.next_power_of_2(programs + 1),
        SPLIT=hopper_prefill.SPLIT_ONE_ROUND,
        PARTIAL_TENTHS=hopper_prefill.cost_tenths(hopper_prefill.PARTIAL_COST),
        SPLIT_TENTHS=hopper_prefill.cost_tenths(hopper_prefill.SPLIT_COST),
        MIN_SPLIT_TILES=hopper_prefill.MIN_SPLIT_TILES,
    )
    names = set(lone_round_walk_kernel.arg_names) - own.keys()
    shared = {name: value for name, value in planned.items() if name in names}
    return BoundLaunch(lone_round_walk_kernel, (1,), planned["tiles"].device, **shared, **own)
