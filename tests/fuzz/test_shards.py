"""A campaign split into shards (`--shard K/N`), run side by side as N processes on one machine, and
merged (`--merge`): the shards draw disjoint cases, find the planted failure one campaign finds, and
merge into one summary; a failure saved by one shard is replayed first by another through the
example database. Every run is bounded by case counts."""

import json
import os
import subprocess
import sys

import pytest

from fuzz import case_file
from fuzz.merge import merge
from tests.fuzz.conftest import REPO, SAFETY_CAP_S
from tests.fuzz.implementations import named

# Off on every case with a non-empty row, whatever its compile-time key: each shard meets it early.
ONE_PERCENT_OFF = named("ONE_PERCENT_OFF")
SHARDS = 4


def start(*args) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "fuzz", *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=SAFETY_CAP_S)
    return proc.returncode, out, err


def campaign(tmp_path, label: str, *extra) -> list:
    return [
        "--backend", ONE_PERCENT_OFF, "--target", "prefill", "--workers", "1", "--max-failures", "1",
        "--max-shrinks", "40", "--failures-dir", tmp_path / f"failures-{label}",
        "--summary", tmp_path / f"{label}.json", *extra,
    ]  # fmt: skip


def failure_kinds(summary: dict) -> set:
    """What the failures are, whatever case shows them: target, status, and the output that is off."""
    return {(f["target"], f["status"], f["message"].split(":")[0]) for f in summary["failures"]}


def test_four_shards_find_what_one_campaign_finds_and_merge_into_one_summary(tmp_path):
    one = start(*campaign(tmp_path, "one", "--max-cases", "16", "--example-db", "none"))
    shards = [
        start(
            *campaign(
                tmp_path, f"shard{k}", "--max-cases", "4", "--shard", f"{k}/{SHARDS}", "--example-db", "none"
            )
        )
        for k in range(1, SHARDS + 1)
    ]
    for proc in [one, *shards]:
        code, out, err = finish(proc)
        assert code == 1, err[-3000:]  # the planted failure was found
    single = json.loads((tmp_path / "one.json").read_text())
    parts = [json.loads((tmp_path / f"shard{k}.json").read_text()) for k in range(1, SHARDS + 1)]
    assert failure_kinds(single) == {("prefill", "failed", "paged_prefill out")}
    for k, part in enumerate(parts, 1):
        assert part["shard"] == [k, SHARDS]
        assert failure_kinds(part) == failure_kinds(single), part["failures"]
    # Disjoint draws: every saved case's seed belongs to its own shard.
    for k in range(1, SHARDS + 1):
        for f in (tmp_path / f"failures-shard{k}").glob("*.json"):
            assert case_file.load(f)["case"]["seed"] % SHARDS == k - 1
    merged_path = tmp_path / "merged.json"
    code, out, err = finish(
        start(
            "--merge", *[tmp_path / f"shard{k}.json" for k in range(1, SHARDS + 1)], "--summary", merged_path
        )
    )
    assert code == 1, err[-2000:]
    merged = json.loads(merged_path.read_text())
    assert merged["shards"] == [f"shard {k}/{SHARDS}" for k in range(1, SHARDS + 1)]
    total = lambda s: sum(sum(v for k, v in c.items() if k != "by_dtype") for c in s["counts"].values())
    assert total(merged) == sum(total(p) for p in parts)
    assert failure_kinds(merged) == failure_kinds(single)
    assert len(merged["failures"]) == sum(len(p["failures"]) for p in parts)  # distinct cases, kept apart
    assert set(merged["time_split"]) == {"prefill"} and merged["first_failure_s"] is not None
    assert "merged: backend" in out and "FAILURE prefill" in out and "found by: shard" in out


def test_a_failure_one_shard_saved_is_replayed_first_by_another(tmp_path):
    db = tmp_path / "examples"
    code, _, err = finish(
        start(*campaign(tmp_path, "first", "--max-cases", "8", "--shard", "1/2", "--example-db", db))
    )
    assert code == 1, err[-2000:]
    [found] = json.loads((tmp_path / "first.json").read_text())["failures"]
    code, _, err = finish(
        start(*campaign(tmp_path, "second", "--max-cases", "8", "--shard", "2/2", "--example-db", db))
    )
    assert code == 1, err[-2000:]
    second = json.loads((tmp_path / "second.json").read_text())
    replayed = [f for f in second["failures"] if "replayed first" in f["message"]]
    assert len(replayed) == 1 and "saved by shard 1/2" in replayed[0]["message"], second["failures"]
    assert case_file.load(replayed[0]["file"])["case"] == case_file.load(found["file"])["case"]
    merged, _ = merge([tmp_path / "first.json", tmp_path / "second.json"])
    [once] = [f for f in merged["failures"] if f["file"] == found["file"]]
    assert once["found_by"] == "shard 1/2" and once["also_found_by"] == ["shard 2/2"]


def test_merge_names_a_missing_shard_and_refuses_another_campaign(tmp_path):
    summary = {
        "backend": "x",
        "seed": 0,
        "targets": ["prefill"],
        "dtypes": [],
        "elapsed_s": 1.0,
        "exit_code": 0,
    }
    (tmp_path / "a.json").write_text(json.dumps(summary | {"shard": [1, 3]}))
    (tmp_path / "b.json").write_text(json.dumps(summary | {"shard": [3, 3]}))
    (tmp_path / "c.json").write_text(json.dumps(summary | {"shard": [2, 3], "seed": 1}))

    merged, _ = merge([tmp_path / "a.json", tmp_path / "b.json"])
    assert merged["exit_code"] == 1 and any("shard(s) 2/3 missing" in n for n in merged["notes"])
    with pytest.raises(ValueError, match="another campaign"):
        merge([tmp_path / "a.json", tmp_path / "c.json"])
