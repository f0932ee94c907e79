"""Fixtures of the campaign's tests: an in-process worker and the `python -m fuzz` command line.

Both are bounded by case counts (--max-cases, and hypothesis's own bound on a shrink), never by
throughput, so no assertion depends on how fast the machine is. The command line keeps a generous
wall-clock safety cap only to turn a hang into a loud failure.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from fuzz.worker import Worker

REPO = pathlib.Path(__file__).resolve().parents[2]
# A hang guard, not a budget: every run below stops after a fixed number of cases.
SAFETY_CAP_S = 600


class WorkerLog(list):
    """A worker's queue: every message it sent, in order."""

    put = list.append

    def of(self, kind: str) -> list[tuple]:
        """The messages of one kind, without the worker id: ("case", target, dtype, ratio, status)..."""
        return [m[1:] for m in self if m[1] == kind]


@pytest.fixture
def run_worker(tmp_path):
    """`run_worker(backend, targets, **cfg)`: one in-process worker on the CPU; returns its messages.

    It draws at most `max_cases` cases per target and stops a target at its first saved (shrunk)
    failure unless `max_failures` says otherwise.
    """

    def run(backend: str, targets, **overrides) -> WorkerLog:
        cfg = dict(
            worker_id=0,
            backend=backend,
            targets=list(targets),
            dtypes=(),
            seed=0,
            end_time=None,
            max_cases=48,
            max_shrinks=None,
            max_failures=1,
            failures_dir=str(tmp_path / "failures"),
            ledger=str(tmp_path / "no-ledger.json"),
            device="cpu",  # CPU-sized cases on any machine
        )
        log = WorkerLog()
        Worker(cfg | overrides, log).run()
        return log

    return run


def without_example_db(args) -> list[str]:
    """`--example-db none` unless the command names one: saved failures of earlier runs in this
    checkout must not be replayed into a test's counts."""
    args = [str(a) for a in args]
    if any(a in args for a in ("--example-db", "--replay", "--merge")):
        return []
    return ["--example-db", "none"]


@pytest.fixture
def fuzz_cli():
    """`fuzz_cli(*args, cwd=REPO)`: runs `python -m fuzz` on the CPU; returns the CompletedProcess."""

    def run(*args, cwd=REPO) -> subprocess.CompletedProcess:
        env = os.environ | {"PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        cmd = [sys.executable, "-m", "fuzz", *map(str, args), *without_example_db(args)]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=SAFETY_CAP_S)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(
                f"`{' '.join(cmd)}` still ran after the {SAFETY_CAP_S} s safety cap. It is bounded by case "
                f"counts, so this is a hang, not a slow machine. stderr tail:\n{(exc.stderr or b'')[-2000:]}"
            )

    return run
