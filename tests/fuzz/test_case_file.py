"""Round trip of fuzz case files: save, load and replay, with the oracle and a deliberately wrong backend."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
from tests.strategies import AttentionCase, LayoutSpec

import reference
from fuzz import backends, case_file
from fuzz.targets import AttentionTarget, Result

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


def _off_by_one_percent(*args, **kwargs):
    out, lse = reference.paged_prefill(*args, **kwargs)
    return out * 1.01, lse


@pytest.fixture
def toy_backend(monkeypatch):
    """A backend whose prefill is 1% off: every replay of its cases must fail."""
    ops = SimpleNamespace(write_kv=None, paged_prefill=_off_by_one_percent, paged_decode=None)
    monkeypatch.setitem(backends.BACKENDS, "toy-wrong", backends.Backend("toy-wrong", lambda: ops))
    return "toy-wrong"


def save(tmp_path, backend: str, result: Result):
    return case_file.save(
        tmp_path,
        target="prefill",
        backend=backend,
        case=CASE.to_dict(),
        dtype=CASE.dtype,
        result=result,
        device="cpu",
    )


def test_case_file_round_trip(tmp_path):
    path = save(tmp_path, "reference", Result("failed", float("inf"), "boom", {"out": {"max_err": 1.0}}))
    data = case_file.load(path)
    assert AttentionCase.from_dict(data["case"]) == CASE
    assert data["verdict"]["ratio"] == "inf"  # JSON has no infinity
    assert data["replay"] == f"nox -s kernel-fuzz -- --replay {path}"
    assert set(data["versions"]) >= {"torch", "python"}
    json.loads(path.read_text())  # strict JSON
    assert not list(tmp_path.glob("*.tmp"))


def test_replay_of_the_oracle_passes(tmp_path):
    path = save(tmp_path, "reference", Result("failed", 2.0))
    _, result = case_file.replay(path)
    assert result.status == "passed" and result.ratio <= 1.0
    assert case_file.main_replay(path) == 0


def test_replay_reproduces_a_wrong_backend(tmp_path, toy_backend, capsys):
    target = AttentionTarget("prefill", decode=False)
    ops = backends.get_backend(toy_backend).load()
    found = target.run(CASE, ops, backends.get_backend(toy_backend), "cpu")
    assert found.status == "failed"
    path = save(tmp_path, toy_backend, found)
    assert case_file.main_replay(path) == 1
    assert "REPRODUCED" in capsys.readouterr().out
    # The same file replays on another backend by name.
    assert case_file.main_replay(path, "reference") == 0


def test_load_rejects_other_json(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"format": 1}))
    with pytest.raises(ValueError, match="missing"):
        case_file.load(bad)
    bad.write_text(
        json.dumps(
            dataclasses.asdict(Result("passed")) | {"format": 99, "target": "p", "backend": "b", "case": {}}
        )
    )
    with pytest.raises(ValueError, match="format"):
        case_file.load(bad)
