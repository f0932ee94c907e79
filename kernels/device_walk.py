"""A lone round's walk, written by the GPU: the Hopper prefill plan's replan without the host's walk.

A replan (`kernels.paged_prefill.PrefillPlan.replan`) writes the new batch's walk into the plan's tiles
buffer: on the host (`hopper_prefill.settled_walk` and `Walk.flat`, then a copy) that took 0.2-0.4 ms a
plan on the device's hosts, while the GPU, started on a step's first graph, waited for it (an engine's
2k step with 90% cached: 0.9 ms of the GPU idle after its first replay on an H100's host,
reports/gpu/ttft-phases-h100-walk.txt). Where the batch's items fit one round (`applies`: a (query
tile, head) item a program, the programs left over taking stand-ins), the walk is a pure function of
the sequences' lengths and query counts, which the plan's metadata tensors already hold on the device:
`lone_round_walk_kernel` writes it there, the same int32 entries as the host's `flat()` walk
(tests/kernels/test_device_walk.py), for one launch and no copy.

spec: `hopper_prefill.settled_walk(...).flat(...)` after the (sequence, absolute query tile) pairs of
`paged_prefill._query_tiles`, where `applies` holds.
"""

import triton
import triton.language as tl

from kernels import hopper_prefill
from kernels._common import BoundLaunch

# Off: every replan's walk made on the host and copied (the A/B's other arm, reports/host_ab.py).
ENABLED = True


def applies(num_tiles: int, num_heads: int, programs: int) -> bool:
    """Whether a batch of `num_tiles` query tiles (of `num_heads` heads each) has its walk written by
    the GPU: with ENABLED, at most a round of items, and none of the walks that split items
    (SPLIT_ONE_ROUND, SPLIT_LAST), which stay the host's."""
    return (
        ENABLED
        and 0 < num_tiles * num_heads <= programs
        and not hopper_prefill.SPLIT_ONE_ROUND
        and not hopper_prefill.SPLIT_LAST
    )


@triton.jit(do_not_specialize=["num_seqs", "num_tiles"])
def lone_round_walk_kernel(
    num_seqs,
    num_tiles,
    tiles,
    seq_lens,
    query_start_loc,
    tile_lists,
    stride_list_kind,
    stride_list_tile,
    stride_list_head,
    num_heads,
    programs,
    walk_start,
    BLOCK_M: tl.constexpr,
    ROW_FIELDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program. tiles: int32, (sequence, absolute query tile) of each of the `num_tiles` query
    tiles of the first `num_seqs` sequences at its front, the walk from `walk_start`: the offsets
    0 .. programs, then a row of ROW_FIELDS a program (`hopper_prefill.Walk.flat`): program p < items
    takes item p (head p // num_tiles, query tile num_tiles - 1 - p % num_tiles, whole), the others a
    stand-in. BLOCK: a power of two > programs."""
    p = tl.arange(0, BLOCK)
    # Query tile k of the batch's forward order: its sequence and absolute tile, from the sequences'
    # tile counts (a sequence with queries spans its context's tile to its last position's).
    k = tl.where(p < num_tiles, p, -1)
    item = p < num_tiles * num_heads
    item_tile = tl.where(item, num_tiles - 1 - p % num_tiles, -1)  # a stand-in's matches no tile
    seq = tl.zeros([BLOCK], tl.int32)
    tile = tl.zeros([BLOCK], tl.int32)
    item_seq = tl.zeros([BLOCK], tl.int32)
    item_abs = tl.zeros([BLOCK], tl.int32)
    first = 0
    for b in range(num_seqs):
        seq_len = tl.load(seq_lens + b)
        queries = tl.load(query_start_loc + b + 1) - tl.load(query_start_loc + b)
        context = seq_len - queries
        count = tl.where(queries > 0, (seq_len - 1) // BLOCK_M - context // BLOCK_M + 1, 0)
        mine = (k >= first) & (k < first + count)
        seq = tl.where(mine, b, seq)
        tile = tl.where(mine, context // BLOCK_M + k - first, tile)
        mine = (item_tile >= first) & (item_tile < first + count)
        item_seq = tl.where(mine, b, item_seq)
        item_abs = tl.where(mine, context // BLOCK_M + item_tile - first, item_abs)
        first += count
    pairs = p < num_tiles
    tl.store(tiles + 2 * p, seq, mask=pairs)
    tl.store(tiles + 2 * p + 1, tile, mask=pairs)
    walk = tiles + walk_start
    tl.store(walk + p, p, mask=p <= programs)
    # Each program's row: an item's (sequence, tile, head, full tiles, begin, end, slot -1, first slot
    # 0, 1 part, first query, context, length); a stand-in's zeros but for its whole-item fields.
    head = tl.where(item, p // num_tiles, 0)
    lists = tile_lists + item_abs * stride_list_tile + head * stride_list_head
    full = tl.load(lists, mask=item, other=0)
    partial = tl.load(lists + stride_list_kind, mask=item, other=0)
    seq_len = tl.load(seq_lens + item_seq, mask=item, other=0)
    start = tl.load(query_start_loc + item_seq, mask=item, other=0)
    end = tl.load(query_start_loc + item_seq + 1, mask=item, other=0)
    row = walk + programs + 1 + p * ROW_FIELDS
    rows = p < programs
    tl.store(row, item_seq, mask=rows)
    tl.store(row + 1, item_abs, mask=rows)
    tl.store(row + 2, head, mask=rows)
    tl.store(row + 3, full, mask=rows)
    tl.store(row + 4, 0 * p, mask=rows)
    tl.store(row + 5, full + partial, mask=rows)
    tl.store(row + 6, 0 * p - 1, mask=rows)
    tl.store(row + 7, 0 * p, mask=rows)
    tl.store(row + 8, 0 * p + 1, mask=rows)
    tl.store(row + 9, start, mask=rows)
    tl.store(row + 10, seq_len - (end - start), mask=rows)
    tl.store(row + 11, seq_len, mask=rows)


def bind(planned: dict, num_heads: int, programs: int, max_tiles: int) -> BoundLaunch:
    """The launch of `lone_round_walk_kernel` over a plan's planned arguments (its tiles buffer, seq_lens,
    query_start_loc and lists): called with (num_seqs, num_tiles) of the batch whose metadata the
    caller wrote into those tensors, it writes that batch's walk, stream-ordered before the next run."""
    own = dict(
        num_heads=num_heads,
        programs=programs,
        walk_start=2 * max_tiles,
        ROW_FIELDS=hopper_prefill.ROW_FIELDS,
        BLOCK=triton.next_power_of_2(programs + 1),
    )
    names = set(lone_round_walk_kernel.arg_names) - own.keys()
    shared = {name: value for name, value in planned.items() if name in names}
    return BoundLaunch(lone_round_walk_kernel, (1,), planned["tiles"].device, **shared, **own)
