"""The campaign worker (fuzz/worker.py) in-process, on implementations loaded by name: it finds,
shrinks and saves a planted bug, keeps a failure's dtype, never asks a narrow implementation for what
it did not declare, and counts refusals as unsupported. Every run is bounded by case counts."""

import json

from fuzz import case_file, summary
from tests.fuzz.implementations import named

HEAD_ONE_ZEROED = named("HEAD_ONE_ZEROED")


def statuses(log, target: str) -> dict:
    """Status -> count of the cases the worker judged for `target`."""
    out = dict.fromkeys(summary.STATUSES, 0)
    for _, t, _, _, status in log.of("case"):
        if t == target:
            out[status] += 1
    return out


def test_worker_finds_shrinks_and_saves(run_worker):
    log = run_worker(HEAD_ONE_ZEROED, ["prefill"])
    failures = log.of("failure")
    assert len(failures) == 1
    data = case_file.load(failures[0][1]["file"])
    # Shrunk: one sequence of one token. The heads are part of the chunk's compile-time key
    # (harness.cases.AttentionShape), which shrinking keeps, as it keeps the dtype.
    assert data["case"]["num_heads"] >= 2 and data["case"]["seq_lens"] == [1]
    assert data["backend"] == HEAD_ONE_ZEROED
    assert case_file.replay(failures[0][1]["file"]).verdict.status == "failed"


def test_worker_shrink_keeps_the_dtype_of_the_failure(run_worker):
    # Worker 1 starts its rotation at the second dtype: the first chunk draws float16 only.
    log = run_worker(HEAD_ONE_ZEROED, ["prefill"], dtypes=("float32", "float16"), worker_id=1)
    first_failed = next(dtype for _, _, dtype, _, status in log.of("case") if status == "failed")
    assert first_failed == "float16"  # else the test says nothing: float32 is the shrinker's minimum
    [(_, failure)] = log.of("failure")
    saved = case_file.load(failure["file"])
    assert saved["case"]["dtype"] == saved["dtype"] == failure["dtype"] == "float16"


def test_worker_draws_only_the_requested_dtype(run_worker):
    log = run_worker(named("REFUSES_ODD_TOKENS"), ["prefill", "decode"], dtypes=("float16",))
    drawn = {dtype for _, _, dtype, _, _ in log.of("case")}
    assert drawn == {"float16"}


def test_narrow_implementation_is_asked_only_for_what_it_declares(run_worker):
    # NARROW raises AssertionError (a crash, hence a failure) for anything it did not declare.
    log = run_worker(named("NARROW"), ["prefill", "decode", "write_kv", "engine"], max_cases=24)
    assert not log.of("failure")
    for target in ("prefill", "decode", "write_kv"):
        counts = statuses(log, target)
        assert counts["passed"] == 24 and counts["failed"] == 0, (target, counts)
    assert {dtype for _, _, dtype, _, _ in log.of("case")} == {"float16"}
    [(_, target, reason)] = log.of("unavailable")
    assert target == "engine" and "float32" in reason


def test_not_implemented_counts_as_unsupported(run_worker):
    log = run_worker(named("REFUSES_ODD_TOKENS"), ["prefill"], max_cases=24)
    tally = summary.Tally()
    for message in log:
        tally.on(message)
    counts = summary.summary_dict(tally, elapsed=1.0)["counts"]["prefill"]
    assert counts["failed"] == 0 and not log.of("failure")
    assert counts["unsupported"] > 0 and counts["passed"] > 0
    assert counts["unsupported"] + counts["passed"] == 24
    assert sum(by["unsupported"] for by in counts["by_dtype"].values()) == counts["unsupported"]


def test_worker_poisons_the_implementation_allocations(run_worker):
    # An output element an implementation allocates and never writes is NaN, so it fails.
    log = run_worker(named("EXPECTS_POISON"), ["prefill"], max_cases=8)
    assert statuses(log, "prefill")["passed"] == 8 and not log.of("failure")


def test_failure_line_gives_the_case_in_words(run_worker):
    log = run_worker(HEAD_ONE_ZEROED, ["prefill"])
    tally = summary.Tally()
    for message in log:
        tally.on(message)
    [failure] = tally.failures
    text = summary.failure_text(failure, HEAD_ONE_ZEROED, "nox -s kernel-fuzz -- --replay X")
    line = text.splitlines()[0]
    assert line.startswith(f"FAILURE prefill ({HEAD_ONE_ZEROED}, ")
    for words in ("context 0", "queries [1]", "heads ", "page size", "float"):
        assert words in line, (words, line)
    errors = text.splitlines()[1]
    assert "out: max err" in errors and "lse: max err" in errors and "(allowed " in errors
    assert "worst ratio" in errors and "<= 1 passes" in errors


def test_ledger_entries_make_failures_known(run_worker, tmp_path):
    known = tmp_path / "known.json"
    known.write_text(json.dumps({"format": 1, "case": {"dtype": "float32"}}))
    ledger = tmp_path / "ledger.json"
    entry = dict(
        id="one-percent",
        reason="planted",
        issue=1,
        kind="wrong-answer",
        target="prefill",
        backend=named("ONE_PERCENT_OFF"),
        match={"dtype": "float32"},
        case="known.json",
    )
    ledger.write_text(json.dumps({"entries": [entry]}))
    log = run_worker(entry["backend"], ["prefill"], dtypes=("float32",), ledger=str(ledger), max_cases=16)
    counts = statuses(log, "prefill")
    assert counts["known"] > 0 and counts["failed"] == 0 and not log.of("failure")
