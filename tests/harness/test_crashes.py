"""A crash or a hang is a finding (contract §9): named, saved, replayable, and survived.

Two kernels of tests/fuzz/implementations.py misbehave on some cases only: SEGFAULTS kills its process
(SIGSEGV) on any sequence over 40 tokens, HANGS never returns for three query heads or three
sequences. Under
`pytest -n 2` the test that was running is reported by name with its case, the case file and the
replay command, and the other tests still run; the campaign saves, shrinks (each candidate in a fresh
child) and goes on; `--replay` runs the saved case in a child and says CRASHED or HUNG.
"""

import json
import os
import re
import subprocess
import sys

from fuzz import case_file
from tests.fuzz.conftest import without_example_db
from tests.fuzz.implementations import named

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A hang guard, not a budget: every run below is bounded by its cases.
SAFETY_CAP_S = 900
SEGFAULTS, HANGS = named("SEGFAULTS"), named("HANGS")


def run(*args) -> subprocess.CompletedProcess:
    """`python *args` in the repository, on the CPU under the interpreter even on a GPU host. There the
    campaign draws GPU-sized cases (harness.strategies.FUZZ_CAPS): on the H200 a case that does not
    hang overran the 2 s per-case limit below, and a crash shrank to 42 tokens, not 41, in its time."""
    env = os.environ | {"PYTHONPATH": REPO, "TRITON_INTERPRET": "1", "HYPOTHESIS_PROFILE": "smoke"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("SUITE_INFLIGHT_DIR", None)
    cmd = [sys.executable, *map(str, args)]
    if cmd[1:3] == ["-m", "fuzz"]:
        cmd += without_example_db(args)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=SAFETY_CAP_S)


def saved_files(folder) -> list:
    return sorted(folder.glob("*.json"))


def test_pytest_names_a_crashing_test_with_its_case_and_goes_on(tmp_path):
    proc = run(
        "-m", "pytest", "tests/kernels/test_paged_prefill.py", "-n", "2", "-p", "no:cacheprovider",
        "-k", "named", "--backend", SEGFAULTS, "--failures-dir", tmp_path,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    crash = re.search(r"CRASH: the worker process died while running the case\n  test:   (\S+)", out)
    assert crash and "test_paged_prefill_named[" in crash.group(1), out[-3000:]
    assert "  case:   " in out and "  replay: nox -s kernel-fuzz -- --replay " in out
    # The tests that follow a crash run on a fresh worker: the short case passes.
    assert re.search(r"(\d+) passed", out) and "sequence-without-queries" not in out.split("short test")[1]
    files = saved_files(tmp_path)
    assert files and all(case_file.load(f)["verdict"]["status"] == "crashed" for f in files)


def test_pytest_names_a_hanging_test(tmp_path):
    proc = run(
        "-m", "pytest", "tests/kernels/test_paged_prefill.py", "-n", "2", "-p", "no:cacheprovider",
        "-k", "bad_input and (gqa or head_dim)", "--backend", HANGS, "--case-timeout", "3",
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert "HANG: no result within the per-case limit of 3 s (--case-timeout)" in out, out[-3000:]
    assert "test:   tests/kernels/test_paged_prefill.py::test_paged_prefill_bad_input[gqa-ratio]" in out
    assert "1 passed" in out  # [head_dim], on a fresh worker


def test_campaign_saves_shrinks_and_survives_a_crash(tmp_path):
    failures = tmp_path / "failures"
    proc = run(
        "-m", "fuzz", "--backend", SEGFAULTS, "--workers", "1", "--max-cases", "24", "--target", "prefill",
        "--max-failures", "2", "--failures-dir", failures, "--summary", tmp_path / "summary.json",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "CRASH prefill (" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    counts = summary["counts"]["prefill"]
    assert counts["crashed"] >= 2 and counts["passed"] >= 1, counts  # the campaign went on
    files = saved_files(failures)
    assert len(files) == 2, files  # the unshrunk first sightings were replaced by the shrunk cases
    for f in files:
        data = case_file.load(f)
        assert data["verdict"]["status"] == "crashed" and "SIGSEGV" in data["verdict"]["message"]
        assert data["case"]["seq_lens"] == [41], data["case"]  # shrunk to the smallest crashing length
    replay = run("-m", "fuzz", "--replay", files[0])
    assert replay.returncode == 1 and "CRASHED" in replay.stdout, replay.stdout + replay.stderr[-2000:]


def test_campaign_saves_a_hang_and_replay_says_hung(tmp_path):
    failures = tmp_path / "failures"
    proc = run(
        "-m", "fuzz", "--backend", HANGS, "--workers", "1", "--max-cases", "16", "--target", "prefill",
        "--max-failures", "1", "--case-timeout", "2", "--max-shrinks", "3", "--failures-dir", failures,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "HANG prefill (" in proc.stdout
    [saved] = saved_files(failures)
    data = case_file.load(saved)
    assert data["verdict"]["status"] == "hung" and 3 in (
        data["case"]["num_heads"],
        len(data["case"]["seq_lens"]),
    )
    replay = run("-m", "fuzz", "--replay", saved, "--case-timeout", "2")
    assert replay.returncode == 1 and "HUNG" in replay.stdout, replay.stdout + replay.stderr[-2000:]
