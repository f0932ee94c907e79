"""The campaign's parent process: start the workers, draw the progress bar, write the summary.

Workers are spawned processes (fuzz/worker.py). On the CPU each gets TRITON_INTERPRET=1 and one
thread; on a GPU host there is one worker per GPU, each seeing only its own through
CUDA_VISIBLE_DEVICES. This module imports nothing heavy at import time (spawned children import it).
"""

import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
from collections import defaultdict

BAR_INTERVAL_S = 0.5  # redraw period of the progress bar on a terminal
LOG_INTERVAL_S = 15.0  # period of a progress line when stderr is not a terminal
NOTHING_TO_FUZZ = 2  # exit code when every requested target is unavailable
JOIN_GRACE_S = 30.0  # how long a worker may overrun its budget (a case in flight, a shrink)


def worker_entry(env: dict, cfg: dict, queue) -> None:
    """Child process entry: set the environment first, then import torch/triton (via fuzz.worker)."""
    os.environ.update(env)
    from fuzz import worker

    worker.main(cfg, queue)


def plan_workers(requested: int | None) -> tuple[int, list[dict]]:
    """(worker count, per-worker environment): one per GPU when there are GPUs, else one per core."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        n = requested or gpus
        return n, [{"CUDA_VISIBLE_DEVICES": str(i % gpus)} for i in range(n)]
    n = requested or os.cpu_count() or 1
    return n, [{"TRITON_INTERPRET": "1"} for _ in range(n)]


class Tally:
    """What the parent has heard: counts per target and dtype, worst ratios, failures."""

    def __init__(self):
        self.cases = defaultdict(lambda: defaultdict(int))
        self.status = defaultdict(lambda: defaultdict(int))
        self.worst = defaultdict(dict)  # target -> dtype -> worst ratio among run cases
        self.failures: list[dict] = []
        self.unavailable: dict[str, str] = {}
        self.notes: list[str] = []
        self.shrinking = 0
        self.start = time.time()
        self.first_failure_s: float | None = None  # when the first failing case was run

    def on(self, msg: tuple) -> bool:
        """Applies one worker message; True when it says the worker is done."""
        kind, rest = msg[1], msg[2:]
        if kind == "case":
            target, dtype, ratio, status = rest
            self.status[target][status] += 1
            if status == "failed" and self.first_failure_s is None:
                self.first_failure_s = round(time.time() - self.start, 1)
            if status in ("passed", "failed", "known"):
                self.cases[target][dtype] += 1
                prev = self.worst[target].get(dtype, 0.0)
                self.worst[target][dtype] = max(prev, ratio)
        elif kind == "shrinking":
            self.shrinking += 1
        elif kind == "failure":
            target, path, message, ratio = rest
            self.shrinking = max(0, self.shrinking - 1)
            if path not in (f["file"] for f in self.failures):
                saved = round(time.time() - self.start, 1)
                self.failures.append(
                    {
                        "target": target,
                        "file": path,
                        "message": message,
                        "ratio": ratio,
                        "saved_after_s": saved,
                    }
                )
        elif kind == "unavailable":
            self.unavailable[rest[0]] = rest[1]
        elif kind == "note":
            self.notes.append(f"worker {msg[0]} {rest[0]}: {rest[1]}")
        return kind == "done"

    @property
    def total(self) -> int:
        return sum(sum(d.values()) for d in self.cases.values())

    def worst_overall(self) -> tuple[float, str]:
        best = (0.0, "-")
        for target, by_dtype in self.worst.items():
            for dtype, r in by_dtype.items():
                if r > best[0]:
                    best = (r, f"{target}/{dtype}")
        return best


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def bar_line(tally: Tally, elapsed: float, budget: float) -> str:
    """One status line: cases per target, failures, worst ratio, elapsed / budget."""
    per = " ".join(f"{t} {sum(d.values())}" for t, d in sorted(tally.cases.items())) or "starting"
    worst, where = tally.worst_overall()
    width = 20
    done = min(width, int(width * elapsed / budget)) if budget else width
    shrink = f"  shrinking {tally.shrinking}" if tally.shrinking else ""
    return (
        f"[{'#' * done}{'.' * (width - done)}] {_clock(elapsed)}/{_clock(budget)}  cases {tally.total} "
        f"({per})  failures {len(tally.failures)}  worst ratio {worst:.3g} ({where}){shrink}"
    )


def run(args) -> int:
    """Runs the campaign described by the parsed CLI `args`; returns the exit code."""
    import torch  # the parent needs it only to count GPUs and for the ledger replay

    from fuzz.backends import get_backend

    backend = get_backend(args.backend)
    n, envs = plan_workers(args.workers)
    budget = args.minutes * 60.0
    start = time.time()
    cfg = dict(
        backend=backend.name,
        targets=args.target,
        seed=args.seed,
        end_time=start + budget,
        shrink_seconds=args.shrink_seconds,
        max_failures=args.max_failures,
        failures_dir=str(args.failures_dir),
        ledger=str(args.ledger),
        threads=1 if not torch.cuda.is_available() else 0,
    )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=worker_entry, args=(envs[i], dict(cfg, worker_id=i), queue), daemon=True)
        for i in range(n)
    ]
    for p in procs:
        p.start()
    tally = Tally()
    tally.start = start
    live, tty, last_draw = n, sys.stderr.isatty(), 0.0
    print(
        f"fuzz: backend {backend.name}, targets {', '.join(args.target)}, {n} worker(s) on "
        f"{'GPU' if torch.cuda.is_available() else 'CPU'}, {args.minutes:g} min, seed {args.seed}",
        file=sys.stderr,
    )
    while live:
        try:
            live -= tally.on(queue.get(timeout=BAR_INTERVAL_S))
        except queue_mod.Empty:
            if time.time() > start + budget + args.shrink_seconds + JOIN_GRACE_S:
                tally.notes.append("workers overran the budget and were stopped")
                break
            if not any(p.is_alive() for p in procs):
                break
        now = time.time()
        if now - last_draw >= (BAR_INTERVAL_S if tty else LOG_INTERVAL_S):
            line = bar_line(tally, now - start, budget)
            print(f"\r{line}\033[K" if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
            last_draw = now
    for p in procs:
        p.join(timeout=1.0)
        if p.is_alive():
            p.terminate()
    print(("\r" if tty else "") + bar_line(tally, time.time() - start, budget), file=sys.stderr)
    return finish(args, tally, time.time() - start, n)


def finish(args, tally: Tally, elapsed: float, workers: int) -> int:
    """Ledger staleness check, failure lines, summary JSON; returns the exit code."""
    from fuzz import case_file
    from fuzz.backends import load_ops
    from fuzz.ledger import Ledger

    ledger = Ledger.load(args.ledger)
    available = {b for b in {e.backend for e in ledger.entries} if load_ops(b)[1] is None}
    stale = ledger.stale_entries(lambda path, backend: case_file.replay(path, backend)[1], available)
    for note in tally.notes:
        print(f"note: {note}", file=sys.stderr)
    for target, reason in sorted(tally.unavailable.items()):
        print(f"unavailable: {target}: {reason}", file=sys.stderr)
    for f in tally.failures:
        replay = case_file.REPLAY_COMMAND.format(path=case_file.display_path(f["file"]))
        print(f"FAILURE {f['target']}: {f['message']}\n  replay: {replay}")
    if tally.first_failure_s is not None:
        print(f"first failing case after {tally.first_failure_s} s")
    for _, why in stale:
        print(f"STALE LEDGER ENTRY: {why}")
    minutes = max(elapsed, 1e-9) / 60.0
    summary = {
        "backend": args.backend,
        "targets": args.target,
        "workers": workers,
        "seed": args.seed,
        "elapsed_s": round(elapsed, 1),
        "cases": {t: dict(d) for t, d in tally.cases.items()},
        "cases_per_minute": {t: round(sum(d.values()) / minutes, 1) for t, d in tally.cases.items()}
        | {"total": round(tally.total / minutes, 1)},
        "statuses": {t: dict(d) for t, d in tally.status.items()},
        "worst_ratio": {
            t: {k: (r if math.isfinite(r) else "inf") for k, r in d.items()} for t, d in tally.worst.items()
        },
        "first_failure_s": tally.first_failure_s,
        "failures": tally.failures,
        "stale_ledger_entries": [e.id for e, _ in stale],
        "unavailable": tally.unavailable,
        "notes": tally.notes,
    }
    nothing_ran = tally.total == 0 and set(args.target) <= set(tally.unavailable)
    code = 1 if tally.failures or stale else (NOTHING_TO_FUZZ if nothing_ran else 0)
    summary["exit_code"] = code
    text = json.dumps(case_file.jsonable(summary), indent=1)
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(text + "\n")
    print(text)
    return code
