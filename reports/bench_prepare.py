"""Host cost of turning a scheduled batch into a step's inputs (`ModelRunner.prepare`), on the CPU.

A tiny-model runner on the CPU (no model runs) prepares batches of a step's shapes, page size 16, block
tables of random pages: 64 decodes at 2k context, one 2k prompt, one 2k prompt with 90% of it cached,
and 16 decodes beside a 2k prompt. Median of 51 calls after 5 warm-up ones, in microseconds.

`python -m reports.bench_prepare [--out DIR] [--previous CHECKOUT]` writes DIR/prepare.md and
DIR/prepare.json (default DIR: reports/cpu) and prints the table; with `--previous`, the `engine` of
another checkout (`git worktree add CHECKOUT COMMIT`) is measured too, in a subprocess run just before.
"""

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import time

from engine.config import EngineConfig
from engine.model import ModelArgs
from engine.model_runner import ModelRunner, ScheduledSeq
from engine.sequence import SamplingParams, Sequence

PAGE_SIZE, NUM_PAGES = 16, 8192
WARMUP, REPEATS = 5, 51


def _row(context: int, new: int, seq_id: int, rng: random.Random) -> ScheduledSeq:
    seq = Sequence(seq_id, [rng.randrange(100) for _ in range(context + new)], SamplingParams())
    seq.block_table = rng.sample(range(NUM_PAGES), -(-(context + new) // PAGE_SIZE))
    seq.num_computed_tokens = context
    return ScheduledSeq(seq, new)


def batches() -> dict:
    rng = random.Random(0)
    return {
        "64 decodes, 2k context": [_row(2047, 1, i, rng) for i in range(64)],
        "one 2k prompt": [_row(0, 2048, 0, rng)],
        "one 2k prompt, 90% cached": [_row(1840, 208, 0, rng)],
        "16 decodes and a 2k prompt": [_row(1000, 1, i, rng) for i in range(16)] + [_row(0, 2048, 99, rng)],
    }


def measure() -> dict:
    config = EngineConfig(
        model="tiny", page_size=PAGE_SIZE, num_pages=NUM_PAGES, backend="reference", device="cpu"
    )
    runner = ModelRunner(config, ModelArgs.from_name("tiny"))
    result = {}
    for name, batch in batches().items():
        for _ in range(WARMUP):
            runner.prepare(batch)
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            runner.prepare(batch)
            times.append(time.perf_counter() - start)
        result[name] = statistics.median(times) * 1e6
    return result


def previous(checkout: pathlib.Path) -> dict:
    """measure() with the `engine` package of another checkout."""
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    run = subprocess.run(
        [sys.executable, __file__, "--json"], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("reports/cpu"))
    parser.add_argument("--previous", type=pathlib.Path, help="a checkout of an earlier commit, measured too")
    parser.add_argument("--json", action="store_true", help="print measure() as JSON only")
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps(measure()))
        return 0
    before = previous(args.previous) if args.previous else None
    rows = measure()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    env = f"{platform.machine()}, Python {platform.python_version()}, generated {when}"
    cols = ["batch", "µs"] + ([f"µs at {args.previous.name}", "ratio"] if before else [])
    lines = [
        "# Host cost of a step's inputs (`ModelRunner.prepare`)",
        "",
        f"CPU only, no model: {env}, by `python -m reports.bench_prepare`. Median of {REPEATS} calls.",
        "",
        "| " + " | ".join(cols) + " |",
        "| --- |" + " ---: |" * (len(cols) - 1),
    ]
    for name, us in rows.items():
        extra = f" | {before[name]:.0f} | {before[name] / us:.1f}x" if before else ""
        lines.append(f"| {name} | {us:.0f}{extra} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prepare.md").write_text("\n".join(lines) + "\n")
    (args.out / "prepare.json").write_text(json.dumps({"now": rows, "previous": before}, indent=1) + "\n")
    print("\n".join(lines[4:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
