"""One campaign worker: hypothesis drives the draws, shrinks each failure, and the case is saved.

The worker runs `@given` in short chunks (a fresh seed each) and rotates through its targets until
the time budget is spent. Inside the test function a case is checked once and memoised: after the
budget, unseen cases pass without running so that a chunk ends quickly, and after a failure the
shrinker gets its own, separate budget, past which unseen candidates pass too; hypothesis then
replays its smallest failing case, which the memo answers. The shrinker works within what is left
of the budget (at least MIN_SHRINK_S, at most --shrink-seconds). Progress goes to the parent through a
queue as plain tuples.

Imported only after the parent set TRITON_INTERPRET / CUDA_VISIBLE_DEVICES (fuzz/campaign.py).
"""

import json
import time
import zlib

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings

from fuzz import case_file
from fuzz.backends import get_backend, load_ops
from fuzz.ledger import Ledger
from fuzz.targets import all_targets

CHUNK_EXAMPLES = 8  # draws per @given run, before rotating to the next target
MIN_SHRINK_S = 30.0  # a failure found near the end of the budget still gets this long to shrink
MEMO_LIMIT = 20_000


class _Found(Exception):
    """Raised inside the hypothesis test for a failing case (its message is the verdict)."""


def _key(case) -> str:
    return json.dumps(case.to_dict(), sort_keys=True)


class Worker:
    """The state of one worker process; `run()` does the campaign and returns when time is up."""

    def __init__(self, cfg: dict, queue):
        self.cfg, self.queue = cfg, queue
        # cfg["device"] pins the device (the smoke tests keep CPU-sized cases on a GPU machine).
        self.device = cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        self.backend = get_backend(cfg["backend"])
        self.ledger = Ledger.load(cfg["ledger"])
        self.memo: dict[str, object] = {}
        self.end = cfg["end_time"]
        self.failures: dict[str, int] = {}
        self.shrink_end = 0.0

    def send(self, *msg) -> None:
        self.queue.put((self.cfg["worker_id"], *msg))

    def run(self) -> None:
        ops, reason = load_ops(self.backend.name)
        targets = all_targets()
        active = []
        for name in self.cfg["targets"]:
            target = targets[name]
            why = reason or target.supported(ops, self.backend.name)
            if why:
                self.send("unavailable", name, why)
            else:
                active.append(target)
        chunk = 0
        while active and time.time() < self.end:
            target = active[(chunk + self.cfg["worker_id"]) % len(active)]
            self.run_chunk(
                target, ops, zlib.crc32(f"{self.cfg['seed']}/{self.cfg['worker_id']}/{chunk}".encode())
            )
            chunk += 1
            if self.failures.get(target.name, 0) >= self.cfg["max_failures"]:
                active.remove(target)
                self.send("note", target.name, "stopped after max failures")
        self.send("done")

    def check(self, target, ops, case, shrinking: bool):
        """Runs (or recalls) one case; returns its Result, or None when time is up for new cases."""
        key = _key(case)
        if key in self.memo:
            return self.memo[key]
        if time.time() > (self.shrink_end if shrinking else self.end):
            return None
        entry = self.ledger.match(target.name, self.backend.name, case)
        if entry is not None and entry.kind == "crash":
            self.send("case", target.name, target.dtype_of(case), 0.0, "skipped")
            return None
        result = target.run(case, ops, self.backend, self.device)
        if entry is not None and not result.passed:
            result.status = "known"
        if len(self.memo) < MEMO_LIMIT:
            self.memo[key] = result
        if not shrinking:
            self.send("case", target.name, target.dtype_of(case), result.ratio, result.status)
        return result

    def run_chunk(self, target, ops, chunk_seed: int) -> None:
        found = {}

        @seed(chunk_seed)
        @settings(
            max_examples=CHUNK_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=False,
            report_multiple_bugs=False,
            phases=[Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
            print_blob=False,
        )
        @given(case=target.strategy(self.backend, self.device))
        def test(case):
            result = self.check(target, ops, case, shrinking=bool(found))
            if result is not None and result.status == "failed":
                if not found:
                    now = time.time()
                    # Shrink within what is left of the budget, but never for less than MIN_SHRINK_S.
                    self.shrink_end = min(now + self.cfg["shrink_seconds"], max(self.end, now + MIN_SHRINK_S))
                    self.send("shrinking", target.name)
                found["case"], found["result"] = case, result
                raise _Found(result.message)

        try:
            test()
        except _Found:
            pass
        except Exception as exc:  # noqa: BLE001  (hypothesis errors must not end the campaign)
            self.send("note", target.name, f"hypothesis error: {type(exc).__name__}: {exc}")
        if found:
            self.save(target, found["case"], found["result"])

    def save(self, target, case, result) -> None:
        path = case_file.save(
            self.cfg["failures_dir"],
            target=target.name,
            backend=self.backend.name,
            case=case.to_dict(),
            dtype=target.dtype_of(case),
            result=result,
            device=self.device,
        )
        self.failures[target.name] = self.failures.get(target.name, 0) + 1
        self.send("failure", target.name, str(path), result.message, result.ratio)


def main(cfg: dict, queue) -> None:
    """Process entry (after the environment is set)."""
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    worker = Worker(cfg, queue)
    try:
        worker.run()
    except BaseException as exc:
        worker.send("note", "*", f"worker crashed: {type(exc).__name__}: {exc}")
        worker.send("done")
        raise
