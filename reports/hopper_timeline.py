"""Where a Hopper prefill's time goes, item by item (GPU only): the kernel's diagnostic timeline
(`kernels.hopper_prefill.TIMELINE`), summarized.

Each consumer stamps each unit of its walk it takes (a (query tile, head) item, or a part of a split
one) with the SM's cycle counter at its start, after its full key tiles, after its partial ones and
after its output stores, and with the device's nanosecond timer at its start and end; and after each
of its first partial tiles, with that tile's mode. `summarize` turns that into: the programs'
imbalance (how long each one's last unit ends before the kernel's last), the share of a consumer's
time in each phase, the cycles a full and a partial key tile cost (a partial one by mode: skipped,
taken whole, masked by causality alone, masked by the layout too), and the cycles a unit spends
outside its key tiles. Each partition also stamps its entry and exit: `outside_units` says, for a run after
an L2 flush (as do_bench times it), how long the programs take to start their first unit and to exit
after their last.
Run through `python3 -m reports.hopper_ab --only timeline` (hopper-ab.json's `timeline` part).
"""

import statistics

import torch

from kernels import hopper_prefill, tile_lists
from reports import bench_kernels as bk

# (tokens, queries, layout): the 8k rows short of issue 16's target, 32k, and dense causal 8k.
ROWS = [
    (8192, 8192, "phi3"),
    (8192, 4096, "phi3"),
    (8192, 2048, "phi3"),
    (8192, 832, "phi3"),
    (32768, 32768, "phi3"),
    (8192, 8192, "dense"),
]
L2_FLUSH_BYTES = 256 * 2**20  # do_bench's
# The stamps' fields (TIMELINE_FIELDS of them an item).
NS_START, START, AFTER_FULL, AFTER_PARTIAL, END, NS_END, N_FULL, COUNT = range(hopper_prefill.ITEM_FIELDS)
# Then a field a stamped partial tile: its end, and after those its mode.
PARTIAL_END = hopper_prefill.ITEM_FIELDS
PARTIAL_MODE = PARTIAL_END + hopper_prefill.PARTIAL_STAMPS
MODES = {  # a stamped tile's mode (kernels/tile_lists.py's HALF_*) -> its name in the summary
    tile_lists.HALF_SKIP: "skip",
    tile_lists.HALF_WHOLE: "whole",
    tile_lists.HALF_CAUSAL: "causal",
    tile_lists.HALF_MASKED: "masked",
}


def stamps(prefill, p, cold: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One run of the Hopper path on problem p (a reports.bench_kernels.Prefill) with the timeline on:
    its units' stamps, int64 [programs, 2, rounds, TIMELINE_FIELDS] (a program's units in its order;
    rounds it did not take are all zero), its programs' rows [programs, 2, TIMELINE_FIELDS]
    (`hopper_prefill.PROGRAM_*`) and its output. `cold`: L2 flushed before the run, as do_bench does."""
    walk = prefill.plan_prefill(*p.args(), scale=bk.SCALE, layout=p.layout).walk
    buffer = torch.zeros(hopper_prefill.timeline_shape(walk), dtype=torch.int64, device=p.q.device)
    hopper_prefill.TIMELINE = buffer
    try:
        plan = prefill.plan_prefill(*p.args(), scale=bk.SCALE, layout=p.layout)
    finally:
        hopper_prefill.TIMELINE = None
    for _ in range(3):  # compiled and warm
        plan.run(p.q, p.k, p.v)
    buffer.zero_()
    if cold:
        torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=p.q.device).zero_()
    out = plan.run(p.q, p.k, p.v)
    torch.cuda.synchronize()
    units = walk.units.shape[0]
    return by_program(buffer[:units].cpu(), walk.offsets), buffer[units:].cpu(), out


def by_program(units: torch.Tensor, offsets) -> torch.Tensor:
    """The stamps of a walk's units [units, 2, fields] as [programs, 2, rounds, fields]: program p's
    units offsets[p] .. offsets[p + 1] - 1 in order, then zeros."""
    counts = torch.from_numpy(offsets).diff().long()
    t = torch.zeros(counts.shape[0], int(counts.max()), *units.shape[1:], dtype=units.dtype)
    program = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    rank = torch.arange(units.shape[0]) - torch.from_numpy(offsets[:-1]).long()[program]
    t[program, rank] = units
    return t.transpose(1, 2)


def summarize(t: torch.Tensor) -> dict:
    """The timeline `t` [programs, 2, rounds, fields] in microseconds and cycles (see the docstring)."""
    taken = t[..., NS_START] > 0
    ns_start = t[..., NS_START][taken].min().item()
    ns_end = t[..., NS_END].max().item()
    span_us = (ns_end - ns_start) / 1e3
    # Each program's clock rate, from its own first start and last end on both clocks.
    prog_end_ns = t[..., NS_END].amax(dim=(1, 2)).double()
    prog_start_ns = torch.where(taken, t[..., NS_START], ns_end).amin(dim=(1, 2)).double()
    first = t[:, :, 0]
    last_round = taken.sum(dim=2) - 1  # [programs, 2]
    index = last_round.clamp(min=0)[:, :, None, None].expand(-1, -1, 1, t.shape[-1])
    last = t.gather(2, index)[:, :, 0]
    ghz = (last[..., END] - first[..., START]).double() / (last[..., NS_END] - first[..., NS_START]).double()
    cycles_per_us = statistics.median(ghz.flatten().tolist()) * 1e3
    phase = {
        "full": t[..., AFTER_FULL] - t[..., START],
        "partial": t[..., AFTER_PARTIAL] - t[..., AFTER_FULL],
        "epilogue": t[..., END] - t[..., AFTER_PARTIAL],
    }
    # Between an item's end and the next one's start (the loop's own work), per consumer.
    between = (t[:, :, 1:, START] - t[:, :, :-1, END])[taken[:, :, 1:]]
    n_full, n_partial = t[..., N_FULL][taken].double(), (t[..., COUNT] - t[..., N_FULL])[taken].double()
    full_cycles, partial_cycles = phase["full"][taken].double(), phase["partial"][taken].double()
    # Least squares of the full phase on its tile count (slope: a full tile; intercept: the item's start).
    a = torch.stack([n_full, torch.ones_like(n_full)], 1)
    slope, intercept = torch.linalg.lstsq(a, full_cycles[:, None]).solution[:, 0].tolist()
    # Each stamped partial tile's cycles (from the previous stamp) and mode.
    stamped = hopper_prefill.PARTIAL_STAMPS
    ends = t[..., PARTIAL_END : PARTIAL_END + stamped]
    tile_cycles = (ends - torch.cat([t[..., AFTER_FULL, None], ends[..., :-1]], -1)).double()
    modes = t[..., PARTIAL_MODE : PARTIAL_MODE + stamped]
    listed = taken[..., None] & (torch.arange(stamped) < (t[..., COUNT] - t[..., N_FULL])[..., None])
    by_mode = {}
    for mode, name in MODES.items():
        chosen = listed & (modes == mode)
        by_mode[name] = {
            "tiles_per_item": chosen.sum().item() / max(taken.sum().item(), 1),
            "cycles": tile_cycles[chosen].mean().item() if chosen.any() else 0.0,
        }
    busy = {name: cycles[taken].double().sum().item() for name, cycles in phase.items()}
    busy["between"] = between.double().sum().item()
    total = sum(busy.values())
    consumers = taken.any(dim=2).sum().item()
    return {
        "span_us": span_us,
        "ghz": cycles_per_us / 1e3,
        "programs": t.shape[0],
        "items": int(taken.sum().item()) // 2,
        "imbalance": {  # programs' ends against the kernel's last, and their starts against the first
            "end_gap_us_mean": (ns_end - prog_end_ns).mean().item() / 1e3,
            "end_gap_us_max": (ns_end - prog_end_ns).max().item() / 1e3,
            "start_gap_us_max": (prog_start_ns - ns_start).max().item() / 1e3,
            "busy_max_over_mean": (
                (prog_end_ns - prog_start_ns).max() / (prog_end_ns - prog_start_ns).mean()
            ).item(),
        },
        "share": {name: cycles / total for name, cycles in busy.items()},
        "consumer_us": total / consumers / cycles_per_us,
        "cycles": {
            "full_tile": slope,
            "full_phase_intercept": intercept,
            "partial_tile": partial_cycles.sum().item() / max(n_partial.sum().item(), 1),
            "partial_phase_item": partial_cycles.mean().item(),
            "epilogue_item": phase["epilogue"][taken].double().mean().item(),
            "between_items": between.double().mean().item() if between.numel() else 0.0,
        },
        "tiles_per_item": {"full": n_full.mean().item(), "partial": n_partial.mean().item()},
        "partial_modes": by_mode,  # of the first PARTIAL_STAMPS partial tiles of each item
        # How far apart the two consumers finish the same item.
        "consumer_skew_cycles": (t[:, 0, :, END] - t[:, 1, :, END])[taken[:, 0]].abs().double().mean().item(),
    }


def outside_units(t: torch.Tensor, programs: torch.Tensor) -> dict:
    """Where a run's time goes outside its units (`stamps`), in microseconds: the programs' entries'
    spread, each partition's time from its entry to its first unit's start (a consumer) or its first
    copy's issue (the producer), and from its last unit's end to its exit; and the kernel's span from
    the first entry to the last exit."""
    consumer = programs[:, :, hopper_prefill.PROGRAM_CONSUMER]  # [programs, 2]
    exits = programs[:, :, hopper_prefill.PROGRAM_CONSUMER + 1]
    producer = programs[:, 0, hopper_prefill.PROGRAM_PRODUCER]
    producer_exit = programs[:, 0, hopper_prefill.PROGRAM_PRODUCER + 1]
    first_copy = programs[:, 0, hopper_prefill.PROGRAM_FIRST_COPY]
    taken = t[..., NS_START] > 0
    first_start = t[:, :, 0, NS_START]
    last_end = t[..., NS_END].amax(dim=2)
    busy = taken.any(dim=2)  # [programs, 2]
    entry = torch.minimum(consumer.amin(dim=1), producer)
    last_exit = torch.maximum(exits.amax(dim=1), producer_exit)

    def us(x: torch.Tensor) -> dict:
        x = x.double() / 1e3
        return {"mean": x.mean().item(), "max": x.max().item()}

    return {
        "entry_spread_us": (entry.max() - entry.min()).item() / 1e3,
        "to_first_unit_us": us((first_start - consumer)[busy]),
        "to_first_copy_us": us((first_copy - producer)[busy[:, 0]]),
        "after_last_unit_us": us((exits - last_end)[busy]),
        "inside_us": (last_exit.max() - entry.min()).item() / 1e3,
        "units_span_us": (last_end.max() - first_start[busy].min()).item() / 1e3,
    }


def timeline(save, paths, rows=ROWS) -> list[dict]:
    """The timelines of `rows` ((tokens, queries, layout) each; ROWS) for each Hopper path of `paths` that
    has the diagnostic (this tree's)."""
    from reports.hopper_ab import hopper_path

    gen = torch.Generator().manual_seed(0)
    out = []
    for n, queries, layout_name in rows:
        layout = bk.phi3_layout() if layout_name == "phi3" else None
        p = bk.Prefill(n, queries, layout, gen)
        for path, package, on, settings in paths:
            if not on or package != "kernels":
                continue
            with hopper_path(True, package, **settings) as prefill:
                row = {"n": n, "queries": queries, "layout": layout_name, "path": path}
                row.update(summarize(stamps(prefill, p)[0]))
                row["cold"] = outside_units(*stamps(prefill, p, cold=True)[:2])
            print(row, flush=True)
            out.append(row)
            save(out)
    return out
