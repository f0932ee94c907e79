"""reports/hopper_timeline.summarize reads a timeline of known phases back (CPU: the timeline itself is
the Hopper kernel's, GPU only)."""

import pytest
import torch

from reports import hopper_timeline as ht

FULL_TILE, ITEM_START, EPILOGUE, BETWEEN = 100, 50, 40, 10
# A partial tile's cycles by mode (ht.MODES); an item's partial tiles cycle through them.
MODE_CYCLES = (6, 30, 42, 56)


def partial_cycles(n_partial):
    """An item's partial phase: its n_partial tiles' modes cycle through MODE_CYCLES."""
    return sum(MODE_CYCLES[i % len(MODE_CYCLES)] for i in range(n_partial))


def synthetic(items_per_program, n_full, n_partial, ghz=2.0):
    """A timeline [programs, 2, rounds, fields] whose consumers run items of n_full and n_partial tiles
    back to back with the phase costs above (cycles), both clocks starting together at 1000 ns."""
    rounds = max(items_per_program)
    t = torch.zeros(len(items_per_program), 2, rounds, ht.hopper_prefill.TIMELINE_FIELDS, dtype=torch.int64)
    for p, items in enumerate(items_per_program):
        for c in range(2):
            clock = 0
            for r in range(items):
                after_full = clock + ITEM_START + FULL_TILE * n_full[r]
                modes = [i % len(MODE_CYCLES) for i in range(n_partial[r])]
                tile_ends = (after_full + torch.tensor([MODE_CYCLES[m] for m in modes]).cumsum(0)).tolist()
                after_partial = tile_ends[-1] if tile_ends else after_full
                end = after_partial + EPILOGUE
                t[p, c, r, : ht.PARTIAL_END] = torch.tensor(
                    [1000 + clock / ghz, clock, after_full, after_partial, end, 1000 + end / ghz, n_full[r],
                     n_full[r] + n_partial[r]]
                )  # fmt: skip
                stamped = min(n_partial[r], ht.hopper_prefill.PARTIAL_STAMPS)
                t[p, c, r, ht.PARTIAL_END : ht.PARTIAL_END + stamped] = torch.tensor(tile_ends[:stamped])
                t[p, c, r, ht.PARTIAL_MODE : ht.PARTIAL_MODE + stamped] = torch.tensor(modes[:stamped])
                clock = end + BETWEEN
    return t


def test_summary_reads_back_the_phases():
    n_full, n_partial = [3, 7, 5], [3, 0, 6]  # the last item's last two partial tiles go unstamped
    s = ht.summarize(synthetic([3, 2], n_full, n_partial))
    cycles = s["cycles"]
    assert cycles["full_tile"] == pytest.approx(FULL_TILE)
    assert cycles["full_phase_intercept"] == pytest.approx(ITEM_START)
    items = n_partial + n_partial[:2]  # the first program's three, the second's two
    assert cycles["partial_tile"] == pytest.approx(sum(map(partial_cycles, items)) / sum(items))
    assert cycles["epilogue_item"] == pytest.approx(EPILOGUE)
    assert cycles["between_items"] == pytest.approx(BETWEEN)
    assert s["ghz"] == pytest.approx(2.0)
    assert s["items"] == 5
    assert sum(s["share"].values()) == pytest.approx(1.0)
    # The program with two items ends one gap and one third item before the other.
    third = BETWEEN + ITEM_START + FULL_TILE * n_full[2] + partial_cycles(n_partial[2]) + EPILOGUE
    assert s["imbalance"]["end_gap_us_max"] == pytest.approx(third / 2.0 / 1e3)
    assert s["tiles_per_item"]["full"] == pytest.approx(sum(n_full + n_full[:2]) / 5)
    assert s["consumer_skew_cycles"] == 0
    # Stamped: three items' first three partial tiles (skip, whole, causal) and one fourth (masked).
    for mode, name in ht.MODES.items():
        assert s["partial_modes"][name]["cycles"] == pytest.approx(MODE_CYCLES[mode])
    assert s["partial_modes"]["skip"]["tiles_per_item"] == pytest.approx(2 * 3 / 10)
    assert s["partial_modes"]["masked"]["tiles_per_item"] == pytest.approx(2 * 1 / 10)


def test_by_program_lays_each_programs_units_out_in_order():
    offsets = torch.tensor([0, 3, 3, 5]).numpy()  # program 1 takes nothing
    units = torch.arange(5 * 2 * 4).view(5, 2, 4)
    t = ht.by_program(units, offsets)
    assert t.shape == (3, 2, 3, 4)
    assert torch.equal(t[0].transpose(0, 1), units[:3])
    assert (t[1] == 0).all()
    assert torch.equal(t[2, :, :2].transpose(0, 1), units[3:])
    assert (t[2, :, 2] == 0).all()


def test_outside_units_reads_back_entries_and_exits():
    t = synthetic([2, 1], [3, 7], [3, 0])  # both clocks at 1000 ns when the first unit starts
    programs = torch.zeros(2, 2, ht.hopper_prefill.TIMELINE_FIELDS, dtype=torch.int64)
    consumer, producer = ht.hopper_prefill.PROGRAM_CONSUMER, ht.hopper_prefill.PROGRAM_PRODUCER
    last_end = t[..., ht.NS_END].amax(dim=2)
    programs[:, :, consumer] = torch.tensor([[400, 500], [600, 600]])
    programs[:, :, consumer + 1] = last_end + torch.tensor([[100, 300], [200, 200]])
    programs[:, 0, producer] = torch.tensor([300, 700])
    programs[:, 0, producer + 1] = last_end[:, 0] + 50
    programs[:, 0, ht.hopper_prefill.PROGRAM_FIRST_COPY] = torch.tensor([900, 1100])
    s = ht.outside_units(t, programs)
    assert s["entry_spread_us"] == pytest.approx(0.3)  # the first program at 300 ns, the second at 600
    assert s["to_first_unit_us"]["mean"] == pytest.approx((600 + 500 + 400 + 400) / 4 / 1e3)
    assert s["to_first_unit_us"]["max"] == pytest.approx(0.6)
    assert s["to_first_copy_us"]["mean"] == pytest.approx(0.5)
    assert s["after_last_unit_us"]["max"] == pytest.approx(0.3)
    assert s["inside_us"] == pytest.approx((last_end.max().item() + 300 - 300) / 1e3)
    assert s["units_span_us"] == pytest.approx((last_end.max().item() - 1000) / 1e3)
