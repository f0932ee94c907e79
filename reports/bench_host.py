"""Host cost of admitting one request: hashing, prefix-cache lookup, allocation and scheduling.

No model runs: a `BlockPool` and a `Scheduler` with the tiny `EngineConfig` admit one fresh request of
N pages (page size 16) whose first `hit share * N` pages are cached already. The cache is warmed
through the scheduler (schedule, postprocess, finish), either by one request holding the whole prefix
or by one request per page, each extending the prefix of the one before by a page, as a conversation
does; the second way gives every cached page another parent chain, the case where a collision check
that compares whole prefixes costs O(N^2). Each part is timed on its own fresh request, as the median
of many repetitions after warm-up, taken in rounds interleaved over all rows (the machine is shared):

    hash      `BlockPool.page_keys`: the chained sha256 key of every full page (a cached page's read from
              `BlockPool.digests`, the others hashed);
    lookup    `BlockPool.lookup` with the keys built: hash map walk and collision defence;
    allocate  `can_allocate` and `allocate`: touching the hits, taking the new pages;
    total     `Scheduler.schedule()` admitting the request, all of the above included;
    rest      total - hash - lookup - allocate: the scheduler's own work.

Beside them, `sha256` times 512 chained hashlib.sha256 digests of one page's encoding alone: the floor of
*hash* for a request with no page cached, on this machine at this moment (contract §6 names sha256), for
reading the rows against.

Targets (issue: host cost of admission): linear in pages, and total <= 0.5 ms for 512 pages.
`python -m reports.bench_host [--out DIR]` writes DIR/admission.md and DIR/admission.json
(default DIR: reports/cpu) and prints the table.
"""

import argparse
import gc
import hashlib
import json
import os
import pathlib
import platform
import random
import statistics
import sys
import time

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence

PAGE_SIZE = 16
PAGES = (128, 512, 2048)
# (hit share, how the prefix was cached)
CASES = ((0.0, "none"), (0.9, "one request"), (0.9, "one request per page"))
WARMUP = 5
REPEATS = 55
ROUNDS = 5  # REPEATS are taken in ROUNDS interleaved rounds over all rows
VOCAB = 128  # the tiny model's
TARGET_PAGES, TARGET_MS = 512, 0.5
LINEAR_SLACK = 1.25  # linear: 4x the pages costs at most 4 x 1.25 the time
TIMED = ("hash", "lookup", "allocate", "total")
PARTS = ("hash", "lookup", "allocate", "rest", "total")


class Admission:
    """One pool and scheduler whose cache holds the first `num_hit_pages` pages of `prompt`."""

    def __init__(self, num_pages: int, share: float, warm: str, seed: int = 0):
        self.config = EngineConfig(
            model="tiny",
            page_size=PAGE_SIZE,
            num_pages=2 * num_pages + 16,
            max_num_batched_tokens=num_pages * PAGE_SIZE,  # the whole prompt in one step
            max_num_seqs=4,
            backend="reference",
        )
        self.pool = BlockPool(self.config.num_pages, PAGE_SIZE, seed=seed)
        self.scheduler = Scheduler(self.config, self.pool)
        rng = random.Random(num_pages)
        self.prompt = [rng.randrange(VOCAB) for _ in range(num_pages * PAGE_SIZE)]
        self.num_pages = num_pages
        self.num_hit_pages = int(share * num_pages)
        self._next_id = 0
        if warm == "one request":
            self._run(self.num_hit_pages)
        elif warm == "one request per page":
            for n in range(1, self.num_hit_pages + 1):
                self._run(n)

    def _run(self, num_prefix_pages: int) -> None:
        """Admits, computes (no model) and finishes a request of the prompt's first pages."""
        seq = self.fresh(num_prefix_pages * PAGE_SIZE)
        self.scheduler.add(seq)
        batch = self.scheduler.schedule()
        self.scheduler.advance(batch)  # no tokens sampled
        self.scheduler.finish(seq)

    def fresh(self, num_tokens: int | None = None) -> Sequence:
        """A new request of the prompt (or its first `num_tokens` tokens), not yet hashed."""
        self._next_id += 1
        return Sequence(self._next_id, self.prompt[:num_tokens], SamplingParams(max_tokens=1))

    def time_hash(self) -> float:
        """Seconds to build the page keys of a fresh request."""
        seq = self.fresh()
        start = time.perf_counter()
        self.pool.page_keys(seq)
        return time.perf_counter() - start

    def time_lookup(self) -> float:
        """Seconds to look a fresh, hashed request up in the cache."""
        seq = self.fresh()
        self.pool.page_keys(seq)
        start = time.perf_counter()
        self.pool.lookup(seq)
        return time.perf_counter() - start

    def time_allocate(self) -> float:
        """Seconds to check and allocate a fresh request's pages (freed after)."""
        seq = self.fresh()
        hits = self.pool.lookup(seq)
        start = time.perf_counter()
        self.pool.can_allocate(hits, self.num_pages - len(hits))
        table = self.pool.allocate(hits, self.num_pages - len(hits), num_query_tokens=len(seq))
        elapsed = time.perf_counter() - start
        self.pool.free(table)
        return elapsed

    def time_schedule(self) -> float:
        """Seconds of the `schedule()` call that admits a fresh request (finished after)."""
        seq = self.fresh()
        self.scheduler.add(seq)
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        elapsed = time.perf_counter() - start
        if len(batch) != 1 or len(seq.block_table) != self.num_pages:
            raise RuntimeError(f"schedule() did not admit the whole {self.num_pages}-page request at once")
        self.scheduler.finish(seq)
        return elapsed


def time_sha256(num_pages: int) -> float:
    """Seconds of `num_pages` chained sha256 digests of one page's encoding, without building any."""
    page = bytes(8 * (PAGE_SIZE + 2))  # count, token ids, no extra keys: encode_page's length
    digest = hashlib.sha256(page).digest()
    gc.collect()
    start = time.perf_counter()
    for _ in range(num_pages):
        digest = hashlib.sha256(digest + page).digest()
    return time.perf_counter() - start


def sample(bench: Admission, times: dict, repeats: int) -> None:
    """Appends `repeats` timings (seconds) of each part to `times[part]`; the parts take turns."""
    timers = dict(
        hash=bench.time_hash,
        lookup=bench.time_lookup,
        allocate=bench.time_allocate,
        total=bench.time_schedule,
    )
    for _ in range(repeats):
        for name, timer in timers.items():
            gc.collect()  # each call starts from the same heap, not from the previous one's garbage
            times[name].append(timer())


def measure_all() -> tuple[list[dict], float]:
    """Every row: the median ms of each part of admitting one request, over all rounds; and the median
    ms of time_sha256(TARGET_PAGES), sampled once a round.

    Rows are sampled in interleaved rounds, so that a burst of load from other processes on the machine
    spreads over every row instead of skewing one.
    """
    cases = [(n, share, warm) for n in PAGES for share, warm in CASES]
    benches = [Admission(*case) for case in cases]
    times = [{name: [] for name in TIMED} for _ in cases]
    for bench in benches:
        sample(bench, {name: [] for name in TIMED}, WARMUP)
    sha256 = []
    for _ in range(ROUNDS):
        for bench, t in zip(benches, times, strict=True):
            sample(bench, t, REPEATS // ROUNDS)
        sha256 += [time_sha256(TARGET_PAGES) for _ in range(REPEATS // ROUNDS)]
    rows = []
    for (num_pages, share, warm), bench, t in zip(cases, benches, times, strict=True):
        row = dict(
            pages=num_pages, hit_share=share, warm=warm, hit_pages=len(bench.pool.lookup(bench.fresh()))
        )
        row.update({name: statistics.median(t[name]) * 1e3 for name in TIMED})
        row["rest"] = max(0.0, row["total"] - row["hash"] - row["lookup"] - row["allocate"])
        row["total_us_per_page"] = row["total"] * 1e3 / num_pages
        rows.append(row)
    return rows, statistics.median(sha256) * 1e3


def verdicts(rows: list[dict], sha256_ms: float) -> dict:
    """Whether every case grows linearly in pages, whether 512 pages admit in <= 0.5 ms, and the floor."""
    linear = True
    for share, warm in CASES:
        totals = {r["pages"]: r["total"] for r in rows if (r["hit_share"], r["warm"]) == (share, warm)}
        for small, large in zip(PAGES, PAGES[1:], strict=False):
            linear &= totals[large] <= totals[small] * large / small * LINEAR_SLACK
    at_target = [r["total"] for r in rows if r["pages"] == TARGET_PAGES]
    return dict(
        linear=linear,
        worst_target_ms=max(at_target),
        meets_target=max(at_target) <= TARGET_MS,
        sha256_ms=sha256_ms,
    )


def table(rows: list[dict]) -> list[str]:
    """The markdown table of all rows."""
    lines = [
        "| pages | hit share | prefix cached by | hit pages | hash ms | lookup ms | allocate ms | rest ms "
        "| total ms | total us / page |",
        "| ---: | ---: | :-- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        parts = " | ".join(f"{r[p]:.3f}" for p in PARTS)
        lines.append(
            f"| {r['pages']} | {r['hit_share']:.1f} | {r['warm']} | {r['hit_pages']} | {parts} "
            f"| {r['total_us_per_page']:.2f} |"
        )
    return lines


def environment() -> dict:
    """Where and when the numbers were taken (the machine is shared: load average included)."""
    return dict(
        python=platform.python_version(),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        load_average=[round(x, 2) for x in os.getloadavg()],
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        command=" ".join(["python -m reports.bench_host", *sys.argv[1:]]),
    )


def write_markdown(path: pathlib.Path, rows: list[dict], verdict: dict, env: dict) -> None:
    """admission.md: setup, the table and the two target lines."""
    linear = "yes" if verdict["linear"] else "NO"
    target = "yes" if verdict["meets_target"] else "NO"
    lines = [
        "# Host cost of admitting one request",
        "",
        f"CPU only, no model: {env['machine']}, Python {env['python']}, load average "
        f"{env['load_average']} at the start; generated {env['date']} by `{env['command']}`. "
        "JSON twin: `admission.json`.",
        f"Page size {PAGE_SIZE}; median of {REPEATS} repetitions ({ROUNDS} rounds interleaved over the rows) "
        f"after {WARMUP} warm-up ones, each part on "
        "a fresh request (module docstring of `reports/bench_host.py`). *total* is `Scheduler.schedule()` "
        "admitting the request, hashing, lookup and allocation included; *rest* is total minus those.",
        "",
        *table(rows),
        "",
        f"- Linear in pages (4x the pages costs <= {4 * LINEAR_SLACK:g}x the time, in every case): {linear}.",
        f"- {TARGET_PAGES} pages admitted in <= {TARGET_MS} ms: {target} "
        f"(worst case {verdict['worst_target_ms']:.3f} ms).",
        f"- sha256 alone, {TARGET_PAGES} chained digests of a page's encoding: {verdict['sha256_ms']:.3f} ms "
        f"({verdict['sha256_ms'] * 1e3 / TARGET_PAGES:.2f} us a page), the floor of *hash* here with no page "
        "cached.",
    ]
    path.write_text("\n".join(lines) + "\n")


def main(out_dir: pathlib.Path) -> None:
    """Measures every row, writes admission.md and admission.json under `out_dir`, prints the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    # Imports (torch among them) leave many long-lived objects; frozen, they cost no gc.collect() time.
    gc.collect()
    gc.freeze()
    rows, sha256_ms = measure_all()
    verdict = verdicts(rows, sha256_ms)
    (out_dir / "admission.json").write_text(
        json.dumps(dict(environment=env, verdict=verdict, rows=rows), indent=2) + "\n"
    )
    write_markdown(out_dir / "admission.md", rows, verdict, env)
    print("\n".join(table(rows)))
    print(f"linear: {verdict['linear']}; {TARGET_PAGES} pages <= {TARGET_MS} ms: {verdict['meets_target']}")
    print(f"sha256 alone, {TARGET_PAGES} chained digests: {sha256_ms:.3f} ms")
    print(f"admission: wrote {out_dir}/admission.{{md,json}}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("reports/cpu"))
    main(parser.parse_args().out)
