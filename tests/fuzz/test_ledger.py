"""Unit tests of the known-failure ledger (fuzz/ledger.py): entries cite issues and never go stale."""

import json
import pathlib

import pytest

import fuzz
from fuzz.ledger import Ledger
from harness.judge import Verdict

CASE = {"seed": 7, "dtype": "float16", "layout": {"kind": "block_mask", "block_size": 16}}


def write_ledger(tmp_path, entries, case=CASE):
    (tmp_path / "failures").mkdir(exist_ok=True)
    (tmp_path / "failures" / "known.json").write_text(json.dumps({"format": 1, "case": case}))
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps({"entries": entries}))
    return path


def entry(**overrides):
    base = dict(
        id="prefill-fp16-mask",
        reason="fp16 rounding of empty rows",
        issue=12,
        kind="wrong-answer",
        target="prefill",
        backend="triton",
        case="failures/known.json",
    )
    return base | overrides


def test_ledger_loads_and_matches_exact_case(tmp_path):
    ledger = Ledger.load(write_ledger(tmp_path, [entry()]))
    assert ledger.match("prefill", "triton", CASE).id == "prefill-fp16-mask"
    assert ledger.match("prefill", "triton", CASE | {"seed": 8}) is None
    assert ledger.match("decode", "triton", CASE) is None
    assert ledger.match("prefill", "flex", CASE) is None


def test_ledger_matches_dotted_fields(tmp_path):
    ledger = Ledger.load(write_ledger(tmp_path, [entry(match={"layout.kind": "block_mask"})]))
    assert ledger.match("prefill", "triton", CASE | {"seed": 99}) is not None
    assert ledger.match("prefill", "triton", CASE | {"layout": {"kind": "dense"}}) is None


@pytest.mark.parametrize("missing", ["reason", "issue", "id", "kind"])
def test_ledger_entry_needs_reason_and_issue(tmp_path, missing):
    raw = entry()
    del raw[missing]
    with pytest.raises(ValueError, match=missing):
        Ledger.load(write_ledger(tmp_path, [raw]))


@pytest.mark.parametrize(
    "bad", [dict(issue="#12"), dict(issue=0), dict(kind="flaky"), dict(case=None), dict(surprise=1)]
)
def test_ledger_rejects_bad_entries(tmp_path, bad):
    with pytest.raises(ValueError):
        Ledger.load(write_ledger(tmp_path, [entry(**bad)]))


def test_ledger_rejects_duplicate_ids(tmp_path):
    with pytest.raises(ValueError, match="duplicate"):
        Ledger.load(write_ledger(tmp_path, [entry(), entry()]))


def test_stale_wrong_answer_entry_fails(tmp_path):
    ledger = Ledger.load(write_ledger(tmp_path, [entry()]))
    stale = ledger.stale_entries(lambda path, backend: Verdict("passed"))
    assert [e.id for e, _ in stale] == ["prefill-fp16-mask"]
    assert "issue #12" in stale[0][1]


def test_still_failing_entry_is_not_stale(tmp_path):
    ledger = Ledger.load(write_ledger(tmp_path, [entry()]))
    assert ledger.stale_entries(lambda path, backend: Verdict("failed", 3.0)) == []


def test_crash_entries_are_never_launched(tmp_path):
    crash = entry(kind="crash", case=None, match={"dtype": "float16"})
    ledger = Ledger.load(write_ledger(tmp_path, [crash]))

    def replay(path, backend):
        raise AssertionError("a crash entry was launched")

    assert ledger.stale_entries(replay) == []
    assert ledger.match("prefill", "triton", CASE).kind == "crash"


def test_unavailable_backend_entries_are_not_replayed(tmp_path):
    ledger = Ledger.load(write_ledger(tmp_path, [entry()]))
    assert ledger.stale_entries(lambda path, backend: Verdict("passed"), available_backends=set()) == []


def test_repository_ledger_is_valid():
    Ledger.load(pathlib.Path(fuzz.__file__).parent / "ledger.json")


def test_ledger_paths_are_relative_to_the_ledger_file(tmp_path, monkeypatch):
    path = write_ledger(
        tmp_path, [entry(), entry(id="mine", backend="../kernels/mine.py:impl", match={"seed": 1})]
    )
    monkeypatch.chdir(tmp_path / "failures")  # anywhere but the ledger's folder
    ledger = Ledger.load(pathlib.Path("..") / path.name)
    assert ledger.case_path(ledger.entries[0]) == tmp_path / "failures" / "known.json"
    assert ledger.entries[0].case_dict == CASE
    assert ledger.entries[1].backend == f"{tmp_path.parent / 'kernels' / 'mine.py'}:impl"
    seen = []
    ledger.stale_entries(lambda p, backend: seen.append(p.read_text()) or Verdict("failed", 2.0))
    assert len(seen) == 2 and all(json.loads(text)["case"] == CASE for text in seen)
