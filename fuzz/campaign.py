"""The campaign's parent process: start the workers, draw the progress line, check the ledger, and
print the summary.

The parent loads the implementation once, only to fail early on a bad name and to say which targets
can run; the workers are spawned processes that load it again by name (fuzz/worker.py). On the CPU
each gets TRITON_INTERPRET=1 and one thread; on a GPU host the cores are shared out over every
visible GPU (`plan_workers`), each worker seeing only its own GPU through CUDA_VISIBLE_DEVICES:
most of a case's CPU time is compiling, which then runs in parallel while the cases share the GPU.
Every worker keeps its compiled kernels in one directory (`cache_environment`), which the next
campaign reuses. `--max-cases N` is a count per target over the whole campaign, split evenly among
the workers; `--shard K/N` makes the campaign one of N disjoint ones (fuzz/worker.py), merged
afterwards by fuzz/merge.py.
"""

import json
import multiprocessing as mp
import os
import pathlib
import queue as queue_mod
import sys
import time
import uuid

from fuzz import backend_names, case_file, saved_failures, summary
from fuzz.ledger import Ledger
from harness.records import jsonable

BAR_INTERVAL_S = 0.5  # redraw period of the progress line on a terminal
LOG_INTERVAL_S = 15.0  # period of a progress line when stderr is not a terminal
NOTHING_TO_FUZZ = 2  # exit code when no requested target can run
# How long workers may run past the time box: hypothesis stops a shrink after five minutes, so
# beyond that (plus a slow case) a worker is stuck, and it is stopped with a loud note.
OVERRUN_LIMIT_S = 6 * 60.0
# GPU memory per worker: its CUDA context and the largest campaign case's float64 oracle, with room.
WORKER_GPU_BYTES = 8 * 2**30
KERNEL_CACHE = pathlib.Path(__file__).resolve().parent.parent / ".cache" / "kernels"


def worker_entry(env: dict, cfg: dict, queue) -> None:
    """Child process entry: set the environment first, then import torch/triton (via fuzz.worker)."""
    os.environ.update(env)
    from fuzz import worker

    worker.main(cfg, queue)


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES entries (its own list when it has one)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def gpu_memory_bytes(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).total_memory


def plan_workers(requested: int | None, cores: int | None = None, gpus=None) -> tuple[int, list[dict]]:
    """(worker count, per-worker environment).

    On a CPU: one worker per core, each under the interpreter with one thread. On GPUs: the cores
    shared out over every visible GPU, at most one worker per WORKER_GPU_BYTES of a GPU's memory,
    so that compilations (CPU work) run in parallel while the cases share the GPU; worker i sees only
    GPU i mod count (CUDA_VISIBLE_DEVICES) and gets its share of the cores as threads.
    """
    cores = cores or cpu_cores()
    gpus = visible_gpus() if gpus is None else gpus
    if not gpus:
        n = requested or cores
        return n, [{"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"} for _ in range(n)]
    per_gpu = [
        max(1, min(cores // len(gpus), gpu_memory_bytes(i) // WORKER_GPU_BYTES)) for i in range(len(gpus))
    ]
    n = requested or sum(per_gpu)
    threads = str(max(1, cores // n))
    # Round-robin over the GPUs, each up to its share: worker i on GPU i mod count while shares last.
    order = [g for k in range(max(per_gpu)) for g in range(len(gpus)) if k < per_gpu[g]]
    order = [order[i % len(order)] for i in range(n)]
    return n, [{"CUDA_VISIBLE_DEVICES": gpus[g], "OMP_NUM_THREADS": threads} for g in order]


def cache_environment(kernel_cache) -> dict:
    """Where the workers keep compiled kernels (Triton's and torch.compile's), so a second campaign
    reuses them: `kernel_cache`, else a TRITON_CACHE_DIR already set, else KERNEL_CACHE."""
    if kernel_cache is None and os.environ.get("TRITON_CACHE_DIR"):
        return {}
    root = pathlib.Path(kernel_cache or KERNEL_CACHE).expanduser().resolve()
    return {"TRITON_CACHE_DIR": str(root / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}


def share(total: int | None, workers: int, i: int) -> int | None:
    """Worker i's part of a count split evenly over `workers` (None: unbounded)."""
    return None if total is None else total // workers + (1 if i < total % workers else 0)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args) -> int:
    """Runs the campaign described by the parsed CLI `args`; returns the exit code."""
    import torch

    from backends import layout_families, registry
    from fuzz import targets

    name = backend_names.canonical(args.backend)
    try:
        impl = registry.load(backend_names.loadable(name))
    except Exception as exc:  # noqa: BLE001  (whatever the user's module raises on import)
        _say(f"fuzz: cannot load implementation {args.backend!r}: {type(exc).__name__}: {exc}")
        return NOTHING_TO_FUZZ
    try:
        family_names = [backend_names.canonical(n) for n in args.layout_family or ()]
        families = [layout_families.load(backend_names.loadable(n)) for n in family_names]
    except Exception as exc:  # noqa: BLE001  (whatever the family's module raises on import)
        _say(f"fuzz: cannot load layout family: {type(exc).__name__}: {exc}")
        return NOTHING_TO_FUZZ
    active, unavailable = targets.plan(impl, args.target, args.dtype or (), families)
    draws = ", ".join(f"{t} ({'/'.join(dtypes)})" for t, (_, dtypes) in active.items()) or "nothing"
    about = (impl.description or "no description").rstrip(".")
    draws += f"; layouts of {', '.join(f.name for f in families)}" if families else ""
    _say(f"fuzz: backend {name}, {about}; drawing {draws}")
    for target, reason in unavailable.items():
        _say(f"fuzz: target {target} unavailable: {reason}")
    if not active:
        tally = summary.Tally()
        tally.unavailable.update(unavailable)
        return finish(args, name, tally, 0.0, 0)
    n, envs = plan_workers(args.workers)
    if args.max_cases is not None:
        n = max(1, min(n, args.max_cases))
    caches = cache_environment(args.kernel_cache)
    envs = [env | caches for env in envs]
    example_db = args.example_db if args.example_db is not None else saved_failures.default_location(name)
    budget = None if args.minutes is None else args.minutes * 60.0
    start = time.time()
    cfg = dict(
        backend=name,
        targets=list(active),
        dtypes=args.dtype or (),
        layout_families=family_names,
        seed=args.seed,
        end_time=None if budget is None else start + budget,
        max_shrinks=args.max_shrinks,
        max_failures=args.max_failures,
        failures_dir=str(args.failures_dir.resolve()),
        ledger=str(args.ledger.resolve()),
        case_timeout=args.case_timeout,
        shard=args.shard,
        run_id=uuid.uuid4().hex,
        example_db=None if str(example_db) == "none" else str(example_db),
        workers=n,
    )
    bounds = [f"a time box of {args.minutes:g} min"] if budget is not None else []
    bounds += [f"{args.max_cases} drawn cases per target"] if args.max_cases is not None else []
    where = "CPU"
    if torch.cuda.is_available():
        gpus = sorted({env["CUDA_VISIBLE_DEVICES"] for env in envs})
        where = f"{len(gpus)} GPU(s) ({', '.join(gpus)})"
    shard = "" if args.shard is None else f", shard {args.shard[0]}/{args.shard[1]}"
    _say(
        f"fuzz: {n} worker(s) on {where}, {' and '.join(bounds)}, seed {args.seed}{shard}; "
        f"compiled kernels in {caches.get('TRITON_CACHE_DIR', os.environ.get('TRITON_CACHE_DIR'))}; "
        f"saved failures replayed from {cfg['example_db'] or 'no example database'}; {summary.WORST_RATIO}"
    )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=worker_entry,
            args=(envs[i], dict(cfg, worker_id=i, max_cases=share(args.max_cases, n, i)), queue),
            # Not a daemon: a worker starts the child processes that run its cases (harness/isolation.py).
            daemon=False,
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    tally = summary.Tally(start)
    tally.unavailable.update(unavailable)
    planned = None if args.max_cases is None else args.max_cases * len(active)
    try:
        _listen(tally, queue, procs, start, budget, planned)
    finally:
        for p in procs:
            p.join(timeout=1.0)
            if p.is_alive():
                p.terminate()
    return finish(args, name, tally, time.time() - start, n)


def _listen(tally, queue, procs, start: float, budget: float | None, planned: int | None) -> None:
    """Applies worker messages and redraws the progress line until every worker is done."""
    live, tty, last_draw = len(procs), sys.stderr.isatty(), 0.0
    while live:
        try:
            live -= tally.on(queue.get(timeout=BAR_INTERVAL_S))
        except queue_mod.Empty:
            if budget is not None and time.time() > start + budget + OVERRUN_LIMIT_S:
                tally.notes.append(
                    f"INCOMPLETE: {live} worker(s) still running {OVERRUN_LIMIT_S / 60:g} min after the time "
                    "box were stopped; their last cases and shrinks are lost"
                )
                return
            if not any(p.is_alive() for p in procs):
                tally.notes.append(f"INCOMPLETE: {live} worker(s) died without saying they were done")
                return
        now = time.time()
        if now - last_draw >= (BAR_INTERVAL_S if tty else LOG_INTERVAL_S):
            line = summary.progress_line(tally, now - start, budget, planned, live)
            print(f"\r{line}\033[K" if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
            last_draw = now
    line = summary.progress_line(tally, time.time() - start, budget, planned, 0)
    print(("\r" if tty else "") + line + ("\033[K" if tty else ""), file=sys.stderr, flush=True)


def stale_ledger_entries(ledger: Ledger, notes: list[str], args) -> list:
    """Replays the ledger's wrong-answer entries whose implementation loads; (entry, why) of each that
    passes now. Entries of implementations that cannot be loaded here are noted, not replayed."""
    from backends import registry

    available = set()
    for backend in {e.backend for e in ledger.entries if e.kind == "wrong-answer"}:
        try:
            registry.load(backend_names.loadable(backend))
            available.add(backend)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"ledger entries of {backend} not replayed: {type(exc).__name__}: {exc}")
    replay = lambda path, backend: (
        case_file.replay(path, backend_names.loadable(backend), args.case_timeout).verdict
    )
    return ledger.stale_entries(replay, available)


def finish(args, name: str, tally: summary.Tally, elapsed: float, workers: int) -> int:
    """Ledger staleness check, FAILURE lines, the summary table and JSON; returns the exit code."""
    stale = stale_ledger_entries(Ledger.load(args.ledger), tally.notes, args)
    for note in tally.notes:
        _say(f"note: {note}")
    for target, reason in sorted(tally.unavailable.items()):
        _say(f"unavailable: {target}: {reason}")
    for f in tally.failures:
        replay = case_file.REPLAY_COMMAND.format(path=case_file.display_path(f["file"]))
        print(summary.failure_text(f, name, replay))
    if tally.first_failure_s is not None:
        print(f"first failing case after {tally.first_failure_s} s")
    for _, why in stale:
        print(f"STALE LEDGER ENTRY: {why}")
    incomplete = any("INCOMPLETE" in n for n in tally.notes)
    nothing_ran = tally.total == 0 and set(args.target) <= set(tally.unavailable)
    failed = bool(tally.failures or tally.failed or stale or incomplete)
    code = 1 if failed else (NOTHING_TO_FUZZ if nothing_ran else 0)
    print(f"summary: backend {name}, {workers} worker(s), {elapsed:.1f} s; {summary.WORST_RATIO}")
    print(summary.status_table(tally) or "  no case ran")
    split = summary.time_split(tally)
    if split:
        print(summary.time_table(split))
    data = {
        "backend": name,
        "targets": args.target,
        "dtypes": list(args.dtype or ()),
        "layout_families": [backend_names.canonical(n) for n in args.layout_family or ()],
        "workers": workers,
        "seed": args.seed,
        "shard": None if args.shard is None else list(args.shard),
        "minutes": args.minutes,
        "max_cases": args.max_cases,
        "ledger": str(args.ledger),
    }
    data |= summary.summary_dict(tally, elapsed)
    data |= {"stale_ledger_entries": [e.id for e, _ in stale], "exit_code": code}
    text = json.dumps(jsonable(data), indent=1)
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(text + "\n")
    print(text)
    return code
