"""Round trip of fuzz case files (fuzz/case_file.py): save, load and replay, with the oracle and with
a deliberately wrong implementation loaded by name."""

import json

import pytest

from backends import registry
from fuzz import case_file, targets
from harness.cases import AttentionCase, LayoutSpec
from harness.judge import Verdict
from tests.fuzz.implementations import named

CASE = AttentionCase(
    seed=3,
    seq_lens=(9, 20),
    query_lens=(4, 20),
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    page_size=5,
    dtype="float32",
    layout=LayoutSpec(kind="local_strided", block_size=4, local_blocks=1, vert_stride=3),
)
ONE_PERCENT_OFF = named("ONE_PERCENT_OFF")


def save(tmp_path, backend: str, verdict: Verdict):
    return case_file.save(
        tmp_path,
        target="prefill",
        backend=backend,
        case=CASE.to_dict(),
        dtype=CASE.dtype,
        words=CASE.describe(),
        verdict=verdict,
        device="cpu",
    )


def test_case_file_round_trip(tmp_path):
    path = save(tmp_path, "reference", Verdict("failed", float("inf"), "boom", {"out": {"max_err": 1.0}}))
    data = case_file.load(path)
    assert AttentionCase.from_dict(data["case"]) == CASE
    assert data["backend"] == "reference" and data["case_in_words"] == CASE.describe()
    assert data["verdict"]["ratio"] == "inf"  # JSON has no infinity
    assert data["replay"] == f"nox -s kernel-fuzz -- --replay {path}"
    assert set(data["versions"]) >= {"torch", "python"}
    json.loads(path.read_text())  # strict JSON
    assert not list(tmp_path.glob("*.tmp"))


def test_case_file_name_is_safe_for_any_backend_name(tmp_path):
    path = save(tmp_path, "/somewhere/else/my_kernel.py:impl", Verdict("failed", 2.0))
    assert path.parent == tmp_path and path.name.startswith("prefill-my_kernel-impl-float32-")


def test_replay_of_the_oracle_passes(tmp_path):
    path = save(tmp_path, "reference", Verdict("failed", 2.0))
    replayed = case_file.replay(path)
    assert replayed.backend == "reference"
    assert replayed.verdict.status == "passed" and replayed.verdict.ratio <= 1.0
    assert case_file.main_replay(path) == case_file.NOT_REPRODUCED


def test_replay_reproduces_a_wrong_backend(tmp_path, capsys):
    found = targets.run_case("prefill", registry.load(ONE_PERCENT_OFF), CASE.to_dict(), "cpu")
    assert found.status == "failed"
    path = save(tmp_path, ONE_PERCENT_OFF, found)
    assert case_file.main_replay(path) == case_file.REPRODUCED
    assert "REPRODUCED" in capsys.readouterr().out
    # The same file replays on another implementation by name.
    assert case_file.main_replay(path, "reference") == case_file.NOT_REPRODUCED


def test_replay_says_why_it_cannot_run(tmp_path, capsys):
    path = save(tmp_path, str(tmp_path / "gone.py") + ":impl", Verdict("failed", 2.0))
    assert case_file.main_replay(path) == case_file.NOT_RUN
    assert "gone.py" in capsys.readouterr().out
    # Nor is an implementation asked for a dtype it does not declare.
    assert case_file.main_replay(path, named("NARROW")) == case_file.NOT_RUN


def test_load_rejects_other_json(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"format": 1}))
    with pytest.raises(ValueError, match="missing"):
        case_file.load(bad)
    bad.write_text(json.dumps({"format": 99, "target": "p", "backend": "b", "case": {}}))
    with pytest.raises(ValueError, match="format"):
        case_file.load(bad)
