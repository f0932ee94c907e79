"""One campaign worker: hypothesis drives the draws, shrinks each failure, and the case is saved.

The worker is a driver: it never calls the implementation itself. Every case runs in a child process
(harness/isolation.py), so a case that kills its process, leaves the device unusable or overruns the
per-case limit (`case_timeout`) is a failure like any other (`crashed`, `hung`): its case file is
written at once, before any shrinking, then hypothesis shrinks it with each candidate in a fresh
child (bounded by CRASH_SHRINK_S of wall time), and the campaign goes on with a new child.

The worker loads the implementation by its registry name itself (it is a spawned process), then runs
`@given` in short chunks (a fresh seed each), rotating over its targets and, within a target, over
the dtypes to draw: each chunk draws with ONE dtype and ONE compile-time key fixed (the target's
`keys` strategy, sampled by hypothesis in batches, so every key stays reachable), so the shrinker can
never move a failure into another dtype, and a chunk compiles its kernels once and reuses them for
all its draws. Before each chunk, the failures other campaigns saved in the example database are
replayed (fuzz/saved_failures.py). Seeds derive from the campaign's seed, its shard and the worker;
a shard's cases draw only its own tensor seeds (harness.strategies.case_seeds), so shards never draw
the same case. It stops drawing when the time box is over (`end_time`, if any), when a target
has drawn its quota of cases (`max_cases`, this worker's share of --max-cases), or when a target has
saved `max_failures` failures.

Inside the test function a case is judged once and memoised. Past the time box or the quota, unseen
draws pass without running, so that a chunk ends at once. After a failure the shrinker runs
unhindered, bounded by hypothesis itself (at most 500 successful shrinks and five minutes) and, with
`max_shrinks`, by a number of shrink candidates, past which unseen candidates pass; hypothesis then
replays its smallest failing case, which the memo answers, and that case is saved. Progress goes to
the parent through a queue as plain tuples.

Imported only after the parent set TRITON_INTERPRET / CUDA_VISIBLE_DEVICES (fuzz/campaign.py).
"""

import hashlib
import json
import random
import time
from collections import defaultdict

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings

from backends import layout_families, registry
from fuzz import backend_names, case_file, saved_failures, targets
from fuzz.ledger import Ledger
from harness.isolation import DEFAULT_CASE_TIMEOUT_S, InProcess, Isolated
from harness.judge import Verdict
from harness.strategies import sample

# Draws per @given run (a chunk): one compile-time key each, before rotating to the next target. On a
# GPU a key's first case compiles (about 2 s on the H200) and the others reuse it (tens of ms each).
CHUNK_EXAMPLES = {"cpu": 8, "cuda": 24}
KEYS_PER_BATCH = 16  # compile-time keys drawn at once per target and dtype
MEMO_LIMIT = 20_000
# Shrinking a crash or a hang restarts a child per failing candidate: at most this long per failure.
CRASH_SHRINK_S = 90.0
# A target whose chunks keep drawing nothing new (a filter nothing passes, an exhausted space) stops.
MAX_IDLE_CHUNKS = 20


class _Found(Exception):
    """Raised inside the hypothesis test for a failing case (its message is the verdict)."""


class Worker:
    """The state of one worker process; `run()` does the campaign and returns when it is over."""

    def __init__(self, cfg: dict, queue):
        self.cfg, self.queue = cfg, queue
        # cfg["device"] pins the device (the smoke tests keep CPU-sized cases on a GPU machine).
        self.device = cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
        self.name = cfg["backend"]  # canonical (fuzz/backend_names.py)
        self.ledger = Ledger.load(cfg["ledger"])
        self.end = cfg.get("end_time")  # None: no time box
        self.quota = cfg.get("max_cases")  # drawn cases per target for this worker; None: no bound
        self.max_shrinks = cfg.get("max_shrinks")  # None: hypothesis's own bounds only
        self.shard = tuple(cfg["shard"]) if cfg.get("shard") else None  # (k, n)
        self.chunk_examples = cfg.get("chunk_examples") or CHUNK_EXAMPLES[torch.device(self.device).type]
        self.memo: dict[tuple, Verdict] = {}
        self.drawn: dict[str, int] = defaultdict(int)
        self.keys: dict[tuple, list] = defaultdict(list)  # (target, dtype) -> compile-time keys to come
        self.key_batches: dict[tuple, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)  # phase -> seconds, of the current chunk
        self.examples = saved_failures.open_database(cfg.get("example_db"))
        self.replayed: set[int] = set()
        self.failures: dict[str, int] = defaultdict(int)
        self.shrink_runs = 0
        self.shrink_deadline = None  # wall-clock end of a crash's shrink
        self.impl = None
        # cfg["in_process"]: the suite's own tests that patch the engine in place run without a child.
        runner = InProcess if cfg.get("in_process") else Isolated
        self.isolated = runner(
            self.name, self.device, case_timeout=cfg.get("case_timeout") or DEFAULT_CASE_TIMEOUT_S
        )

    def send(self, *msg) -> None:
        self.queue.put((self.cfg["worker_id"], *msg))

    def time_over(self) -> bool:
        return self.end is not None and time.time() >= self.end

    def quota_reached(self, target) -> bool:
        return self.quota is not None and self.drawn[target.name] >= self.quota

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.isolated.close()

    def _run(self) -> None:
        try:
            self.impl = registry.load(backend_names.loadable(self.name))
        except Exception as exc:  # noqa: BLE001  (whatever the user's module raises on import)
            for name in self.cfg["targets"]:
                self.send("unavailable", name, f"cannot load {self.name}: {type(exc).__name__}: {exc}")
            self.send("done")
            return
        families = [
            layout_families.load(backend_names.loadable(n)) for n in self.cfg.get("layout_families", ())
        ]
        plan, unavailable = targets.plan(
            self.impl, self.cfg["targets"], self.cfg.get("dtypes") or (), families
        )
        for name, reason in unavailable.items():
            self.send("unavailable", name, reason)
        active = [name for name in plan if self.quota is None or self.quota > 0]
        wid = self.cfg["worker_id"]
        chunk, chunks_of, idle = 0, defaultdict(int), defaultdict(int)
        while active and not self.time_over():
            name = active[(chunk + wid) % len(active)]
            target, dtypes = plan[name]
            started = time.perf_counter()
            self.replay_saved(target)
            dtype = dtypes[(chunks_of[name] + wid) % len(dtypes)]
            chunks_of[name] += 1
            try:
                strategy = target.strategy(
                    self.impl, self.device, dtype, self.next_key(target, dtype), self.shard
                )
            except Exception as exc:  # noqa: BLE001  (nothing to draw within what is declared)
                self.send("note", name, f"stopped: cannot draw {dtype} cases: {type(exc).__name__}: {exc}")
                active.remove(name)
                continue
            new = self.run_chunk(target, strategy, self.seed_of("chunk", chunk))
            chunk += 1
            self.send_seconds(name, time.perf_counter() - started)
            idle[name] = 0 if new else idle[name] + 1
            why = None
            if self.failures[name] >= self.cfg["max_failures"]:
                why = f"stopped after {self.failures[name]} saved failure(s) (--max-failures)"
            elif idle[name] >= MAX_IDLE_CHUNKS:
                why = f"stopped: {MAX_IDLE_CHUNKS} chunks in a row drew no new case"
            if why:
                self.send("note", name, why)
            if why or self.quota_reached(target):
                active.remove(name)
        self.send("done")

    def seed_of(self, *parts) -> int:
        """A seed of this campaign, shard and worker for `parts`: distinct shards never share one."""
        shard = "" if self.shard is None else f"/shard{self.shard[0]}of{self.shard[1]}"
        text = "/".join(map(str, (self.cfg["seed"], shard, self.cfg["worker_id"], *parts)))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")

    def next_key(self, target, dtype: str):
        """The compile-time key of the next chunk of `target` and `dtype`, drawn by hypothesis from the
        target's key strategy in batches (every key of the domain stays reachable)."""
        queue = self.keys[(target.name, dtype)]
        if not queue:
            batch = self.key_batches[(target.name, dtype)]
            self.key_batches[(target.name, dtype)] += 1
            seed_value = self.seed_of("keys", target.name, dtype, batch)
            keys = sample(target.keys(self.impl, self.device, dtype), KEYS_PER_BATCH, seed_value)
            # Hypothesis tries the simplest value first: shuffled, it does not open every worker's run.
            random.Random(seed_value).shuffle(keys)
            queue.extend(keys)
        return queue.pop(0)

    def send_seconds(self, target_name: str, wall: float) -> None:
        """Sends where a chunk's wall time went; what no phase claims is the harness's."""
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        seconds["harness"] = max(0.0, wall - sum(seconds.values()))
        self.send("seconds", target_name, seconds)

    def run_isolated(self, target_name: str, case: dict) -> Verdict:
        """One case in the child process, its time added to the current chunk's phases."""
        starts, started = self.isolated.starts, time.perf_counter()
        verdict = self.isolated.run(target_name, case)
        wall = time.perf_counter() - started
        if verdict.seconds:
            for name, seconds in verdict.seconds.items():
                self.seconds[name] += seconds
        elif verdict.status in ("crashed", "hung"):
            self.seconds["implementation"] += wall  # it died or overran inside the implementation
        if self.isolated.starts != starts:
            self.seconds["startup"] += self.isolated.last_start_s
        return verdict

    def replay_saved(self, target) -> None:
        """Runs first the failures that other campaigns (other shards) saved in the example database,
        each once per campaign, by one worker; one that still fails is this campaign's failure too,
        one that passes now leaves the database (fuzz/saved_failures.py)."""
        for entry in saved_failures.fetch(self.examples, self.name, target.name):
            if entry.digest in self.replayed or entry.run_id == self.cfg.get("run_id"):
                continue
            self.replayed.add(entry.digest)
            if entry.owner(self.cfg.get("workers", 1)) != self.cfg["worker_id"]:
                continue
            case = target.case_from_dict(entry.case)
            verdict = self.check(target, case, shrinking=False)
            if verdict is None:
                return
            if verdict.failed:
                verdict.message = f"{verdict.message} (replayed first: saved by {entry.finder})"
                self.save(target, case, verdict, remember=False)
            elif verdict.status == "passed":
                saved_failures.forget(self.examples, self.name, target.name, entry)

    def check(self, target, case, shrinking: bool) -> Verdict | None:
        """Judges (or recalls) one case; None when it is not run (time box over, quota, shrink cap)."""
        key = (target.name, json.dumps(case.to_dict(), sort_keys=True))
        if key in self.memo:
            return self.memo[key]
        if shrinking:
            if self.max_shrinks is not None and self.shrink_runs >= self.max_shrinks:
                return None
            if self.shrink_deadline is not None and time.time() >= self.shrink_deadline:
                return None
            self.shrink_runs += 1
        else:
            if self.time_over() or self.quota_reached(target):
                return None
            self.drawn[target.name] += 1
        entry = self.ledger.match(target.name, self.name, case)
        if entry is not None and entry.kind == "crash":
            verdict = Verdict("skipped", message=f"ledger entry {entry.id} (crash): not launched")
        else:
            verdict = self.run_isolated(target.name, case.to_dict())
            if entry is not None and verdict.failed:
                verdict = Verdict("known", verdict.ratio, f"ledger entry {entry.id}: {verdict.message}")
        verdict.outputs = None  # the memo keeps verdicts, not tensors
        if len(self.memo) < MEMO_LIMIT:
            self.memo[key] = verdict
        if not shrinking:
            self.send("case", target.name, target.dtype_of(case), verdict.ratio, verdict.status)
        return verdict

    def run_chunk(self, target, strategy, chunk_seed: int) -> int:
        """One @given run of up to CHUNK_EXAMPLES draws; returns how many new cases it drew."""
        found, before = {}, self.drawn[target.name]
        self.shrink_runs = 0

        @seed(chunk_seed)
        @settings(
            max_examples=self.chunk_examples,
            deadline=None,
            database=None,
            derandomize=False,
            report_multiple_bugs=False,
            phases=[Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
            print_blob=False,
        )
        @given(case=strategy)
        def test(case):
            verdict = self.check(target, case, shrinking=bool(found))
            if verdict is not None and verdict.failed:
                if not found:
                    self.send("shrinking", target.name)
                    if verdict.status in ("crashed", "hung"):
                        # Saved before anything else; the shrunk case replaces it when smaller.
                        found["first"] = self.save(target, case, verdict, report=False)
                        self.shrink_deadline = time.time() + CRASH_SHRINK_S
                found["case"], found["verdict"] = case, verdict
                raise _Found(verdict.message)

        try:
            test()
        except _Found:
            pass
        except Exception as exc:  # noqa: BLE001  (hypothesis errors must not end the campaign)
            # The chunk's cases were not all judged: the run cannot claim it found nothing.
            self.send("note", target.name, f"INCOMPLETE: hypothesis error: {type(exc).__name__}: {exc}")
        self.shrink_deadline = None
        if found:
            path = self.save(target, found["case"], found["verdict"])
            if found.get("first") not in (None, path):
                found["first"].unlink(missing_ok=True)
        return self.drawn[target.name] - before

    def save(self, target, case, verdict, report: bool = True, remember: bool = True):
        """Writes the case file (and, with `report`, tells the parent and, with `remember`, puts the
        case in the example database); returns its path."""
        words = target.describe(case)
        path = case_file.save(
            self.cfg["failures_dir"],
            target=target.name,
            backend=self.name,
            case=case.to_dict(),
            dtype=target.dtype_of(case),
            words=words,
            verdict=verdict,
            device=self.device,
        )
        if not report:
            return path
        if remember:
            saved_failures.remember(self.examples, self.name, target.name, case.to_dict(), self.found_by())
        self.failures[target.name] += 1
        failure = dict(
            target=target.name,
            dtype=target.dtype_of(case),
            file=str(path),
            case=words,
            errors=targets.errors_in_words(verdict),
            message=verdict.message,
            ratio=verdict.ratio,
            status=verdict.status,
        )
        self.send("failure", failure)
        return path

    def found_by(self) -> dict:
        shard = None if self.shard is None else f"{self.shard[0]}/{self.shard[1]}"
        return {"run_id": self.cfg.get("run_id"), "shard": shard, "seed": self.cfg["seed"]}


def main(cfg: dict, queue) -> None:
    """Process entry (after the environment, OMP_NUM_THREADS included, is set)."""
    worker = Worker(cfg, queue)
    try:
        worker.run()
    except BaseException as exc:
        worker.send("note", "*", f"worker crashed: {type(exc).__name__}: {exc}")
        worker.send("done")
        raise
