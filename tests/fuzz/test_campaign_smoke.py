"""Smoke tests of `python -m fuzz`: a tiny campaign on the oracle itself, and a worker that must find,
shrink and save a planted bug."""

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import reference
from fuzz import backends, case_file
from fuzz.worker import Worker

SMOKE_MINUTES = "0.1"


def _wrong_prefill(*args, **kwargs):
    """The oracle with query head 1 zeroed: wrong whenever a case has 2+ heads and a non-empty row."""
    out = reference.paged_prefill(*args, **kwargs)
    out, lse = out if isinstance(out, tuple) else (out, None)
    out = out.clone()
    if out.shape[1] > 1:
        out[:, 1] = 0
    return (out, lse) if lse is not None else out


class ListQueue(list):
    put = list.append


def run_worker(tmp_path, backend: str, target: str) -> list:
    """One in-process worker, stopping at its first (shrunk, saved) failure."""
    cfg = dict(
        worker_id=0,
        backend=backend,
        targets=[target],
        seed=0,
        # Caps, not durations: the worker stops at its first failure once hypothesis has shrunk it
        # (a second or two here); loaded machines (xdist on many cores) need the headroom.
        end_time=time.time() + 90,
        shrink_seconds=45.0,
        max_failures=1,
        failures_dir=str(tmp_path),
        ledger=str(tmp_path / "none.json"),
        threads=0,
        device="cpu",  # CPU-sized cases, so that shrinking reaches the minimum within budget anywhere
    )
    queue = ListQueue()
    Worker(cfg, queue).run()
    return [m for m in queue if m[1] == "failure"]


def test_worker_finds_shrinks_and_saves(tmp_path, monkeypatch):
    ops = SimpleNamespace(write_kv=None, paged_prefill=_wrong_prefill, paged_decode=None)
    monkeypatch.setitem(backends.BACKENDS, "planted", backends.Backend("planted", lambda: ops))
    failures = run_worker(tmp_path, "planted", "prefill")
    assert len(failures) == 1
    data = case_file.load(failures[0][3])
    # Shrunk: the smallest failing case has exactly two query heads and one sequence.
    assert data["case"]["num_heads"] == 2 and len(data["case"]["seq_lens"]) == 1
    _, result = case_file.replay(failures[0][3])
    assert result.status == "failed"


def test_engine_target_catches_a_pool_that_frees_head_first(tmp_path, monkeypatch):
    from engine.block_pool import BlockPool

    def free_head_first(self, block_table):
        for page_id in block_table:  # the bug: SPEC section 6 frees the tail first
            self.pages[page_id].ref_count -= 1
            if self.pages[page_id].ref_count == 0:
                self.lru[page_id] = None

    monkeypatch.setattr(BlockPool, "free", free_head_first)
    failures = run_worker(tmp_path, "reference", "engine")
    assert len(failures) == 1 and "block pool vs model" in failures[0][4]


def test_campaign_entry_point_on_the_oracle(tmp_path):
    summary = tmp_path / "summary.json"
    # No GPU for the subprocess: CPU-sized cases, so some finish within the smoke budget anywhere.
    env = os.environ | {"PYTHONPATH": ".", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        sys.executable,
        "-m",
        "fuzz",
        "--minutes",
        SMOKE_MINUTES,
        "--backend",
        "reference",
        "--workers",
        "1",
    ]
    cmd += ["--target", "prefill", "--target", "write_kv", "--summary", str(summary)]
    cmd += ["--failures-dir", str(tmp_path / "failures")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(summary.read_text())
    assert data["exit_code"] == 0 and not data["failures"]
    assert sum(data["cases"]["prefill"].values()) > 0
    assert data["cases_per_minute"]["total"] > 0


@pytest.mark.parametrize("name", sorted(backends.BACKENDS))
def test_backends_load_or_say_why(name):
    ops, reason = backends.load_ops(name)
    assert (ops is None) != (reason is None)
