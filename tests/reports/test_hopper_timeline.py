"""reports/hopper_timeline.summarize reads a timeline of known phases back (CPU: the timeline itself is
the Hopper kernel's, GPU only)."""

import pytest
import torch

from reports import hopper_timeline as ht

FULL_TILE, ITEM_START, PARTIAL_TILE, EPILOGUE, BETWEEN = 100, 50, 30, 40, 10


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
                after_partial = after_full + PARTIAL_TILE * n_partial[r]
                end = after_partial + EPILOGUE
                t[p, c, r] = torch.tensor(
                    [1000 + clock / ghz, clock, after_full, after_partial, end, 1000 + end / ghz, n_full[r],
                     n_full[r] + n_partial[r]]
                )  # fmt: skip
                clock = end + BETWEEN
    return t


def test_summary_reads_back_the_phases():
    n_full, n_partial = [3, 7, 5], [2, 1, 4]
    s = ht.summarize(synthetic([3, 2], n_full, n_partial))
    cycles = s["cycles"]
    assert cycles["full_tile"] == pytest.approx(FULL_TILE)
    assert cycles["full_phase_intercept"] == pytest.approx(ITEM_START)
    assert cycles["partial_tile"] == pytest.approx(PARTIAL_TILE)
    assert cycles["epilogue_item"] == pytest.approx(EPILOGUE)
    assert cycles["between_items"] == pytest.approx(BETWEEN)
    assert s["ghz"] == pytest.approx(2.0)
    assert s["items"] == 5
    assert sum(s["share"].values()) == pytest.approx(1.0)
    # The program with two items ends one gap and one third item before the other.
    third = BETWEEN + ITEM_START + FULL_TILE * n_full[2] + PARTIAL_TILE * n_partial[2] + EPILOGUE
    assert s["imbalance"]["end_gap_us_max"] == pytest.approx(third / 2.0 / 1e3)
    assert s["tiles_per_item"]["full"] == pytest.approx(sum(n_full + n_full[:2]) / 5)
    assert s["consumer_skew_cycles"] == 0
