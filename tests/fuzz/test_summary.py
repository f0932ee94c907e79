"""The campaign's summary (fuzz/summary.py): counts per target, dtype and status, and a progress line
that says what is going on once the time box is over."""

from fuzz import summary


def tally_of(*cases) -> summary.Tally:
    tally = summary.Tally(start=0.0)
    for target, dtype, ratio, status in cases:
        tally.on((0, "case", target, dtype, ratio, status))
    return tally


def test_counts_per_target_dtype_and_status():
    tally = tally_of(
        ("prefill", "float16", 0.5, "passed"),
        ("prefill", "float16", 0.0, "unsupported"),
        ("prefill", "float32", 9.0, "failed"),
        ("decode", "float32", 0.1, "passed"),
        ("decode", "float16", float("inf"), "crashed"),
        ("decode", "float16", float("inf"), "hung"),
    )
    counts = summary.summary_dict(tally, elapsed=60.0)["counts"]
    assert counts["prefill"] | {"by_dtype": None} == {
        "passed": 1, "failed": 1, "unsupported": 1, "crashed": 0, "hung": 0, "known": 0, "skipped": 0,
        "by_dtype": None,
    }  # fmt: skip
    assert counts["prefill"]["by_dtype"]["float16"]["unsupported"] == 1
    assert counts["prefill"]["by_dtype"]["float32"]["failed"] == 1
    assert counts["decode"]["passed"] == 1 and counts["decode"]["crashed"] == counts["decode"]["hung"] == 1
    assert tally.failed == 3  # crashes and hangs are failures
    table = summary.status_table(tally)
    assert "prefill  float16   passed 1  failed 0  unsupported 1" in table
    assert "prefill  all       passed 1  failed 1  unsupported 1" in table
    assert "decode   float16   passed 0  failed 0  unsupported 0  crashed 1  hung 1" in table


def test_worst_ratio_ignores_unsupported_cases():
    tally = tally_of(("prefill", "float16", 0.5, "passed"), ("prefill", "float16", 7.0, "unsupported"))
    assert tally.worst_overall() == (0.5, "prefill/float16")


def test_progress_line_after_the_time_box_says_workers_are_finishing():
    tally = tally_of(("prefill", "float32", 0.5, "passed"))
    line = summary.progress_line(tally, elapsed=103.0, budget=60.0, planned=None, live=2)
    assert "time box of 1:00 over (1:43): 2 worker(s) finishing their last cases" in line
    assert "1:43/1:00" not in line
    assert "done in 1:43" in summary.progress_line(tally, elapsed=103.0, budget=60.0, planned=None, live=0)


def test_progress_line_explains_the_worst_ratio_and_counts_against_max_cases():
    tally = tally_of(("prefill", "float32", 0.5, "passed"))
    line = summary.progress_line(tally, elapsed=5.0, budget=None, planned=40, live=1)
    assert "cases 1/40" in line and "worst ratio 0.5 (prefill/float32; error/allowed, <= 1 passes)" in line
