"""Where the 32-layer model's time to first token goes on the host, outside any profiler (issue 17).

Two parts, each printed as `label value` lines (ms, medians of the runs after two warm-up ones):
    ttft    TTFT through `LLM.generate` at 2k and 8k with nothing and 90% cached, and the ratio, as
            reports/bench_engine.py measures it (its ratio, lighter: no 32k, no 4-layer model);
    phases  (--phases) the same 90% cached requests with `time.perf_counter` wrappers around the host's
            steps (admission's check, the page keys, the lookup, the packing, each plan's replan and walk,
            the copies, the sampler's wait) and the time from `generate`'s call to the first CUDA graph
            replay, the replays' launches, and what follows them (the GPU's work, the read); then the
            same request's graphs replayed back to back (CUDA events around them: the GPU's time for the
            step with no host between its graphs), and what the step spends beyond that after its
            first replay (`after the first replay, beyond the graphs`: the GPU waiting for the host's
            replans and launches, the sampler's read).
A wrapper costs about a µs a call, so the phases overstate a little; ttft runs before the steps'
wrappers are set (with --phases, the replays' marks are set before the engine: a µs a replay).
Steps that a tree lacks are skipped: the script runs against another tree's engine as an A/B,
`PYTHONPATH=OTHER python3 reports/ttft_phases.py --tag base` (run from this tree's root).

`python3 -m reports.ttft_phases [--tag T] [--phases]`: a GPU run (CUDA graphs, the triton backend).
"""

import argparse
import collections
import functools
import importlib
import math
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams

PROMPTS = (2048, 8192)
HIT = 0.9
RUNS, WARMUP = 8, 2
# (module, attribute path) of the host steps timed by --phases
STEPS = (
    ("engine.engine", "LLM._check_prompt"),
    ("engine.engine", "_packed"),
    ("engine.scheduler", "Scheduler.schedule"),
    ("engine.block_pool", "BlockPool.page_keys"),
    ("engine.block_pool", "encode_pages"),
    ("engine.block_pool", "page_digest"),
    ("engine.block_pool", "BlockPool.lookup"),
    ("engine.block_pool", "BlockPool.allocate"),
    ("engine.model_runner", "flatten"),
    ("engine.model_runner", "ModelRunner.launch"),
    ("engine.cuda_graphs", "PrefillGraph.run"),
    ("engine.cuda_graphs", "StaticInputs.copy"),
    ("kernels.paged_prefill", "PrefillPlan.replan"),
    ("kernels.paged_prefill", "PrefillPlan._fill"),
    ("kernels.hopper_prefill", "settled_walk"),
    ("kernels.hopper_prefill", "Walk.flat"),
    ("engine.model_runner", "ModelRunner._sample"),
    ("engine.scheduler", "Scheduler.advance"),
)


def engine() -> LLM:
    """bench_engine's engine for the 32-layer model, sized for 8k prompts."""
    return LLM(
        "phi3-small",
        backend="triton",
        page_size=16,
        num_pages=2 * math.ceil(max(PROMPTS) / 16) + 8,
        max_num_batched_tokens=max(PROMPTS),
        max_num_seqs=4,
    )


def timed_request(llm: LLM, length: int, share: float, run: int, clock: "Clock | None" = None) -> tuple:
    """(start, end) perf_counter s of one generate() of a `length`-token prompt whose first share*length
    tokens were cached (bench_engine's prompts); `clock` emptied just before it."""
    rng = random.Random(length * 1000 + run)
    prompt = [rng.randrange(llm.args.vocab_size) for _ in range(length)]
    llm.reset_prefix_cache()
    if share:
        llm.generate([prompt[: int(share * length)]], SamplingParams(max_tokens=1))
    torch.cuda.synchronize()
    if clock is not None:
        clock.spent.clear()
        clock.marks.clear()
        clock.replayed.clear()
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1))
    torch.cuda.synchronize()
    return start, time.perf_counter()


def ttft(llm: LLM, tag: str) -> None:
    for length in PROMPTS:
        base = None
        for share in (0.0, HIT):
            spans = [timed_request(llm, length, share, run) for run in range(RUNS)]
            median = statistics.median(1e3 * (end - start) for start, end in spans[WARMUP:])
            base = base or median
            print(f"ttft {tag} L={length} h={share}: {median:.2f} ms, ratio {median / base:.4f}", flush=True)


class Clock:
    """Summed perf_counter time of each wrapped step within one request, and the graph replays' marks."""

    def __init__(self):
        self.spent: dict[str, float] = collections.defaultdict(float)
        self.marks: dict[str, float] = {}
        self.replayed: list = []  # the graphs of the request, in order

    def wrap(self, module: str, path: str) -> None:
        owner = importlib.import_module(module)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        fn = getattr(owner, name, None)
        if fn is None:  # a tree without this step
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[path] += time.perf_counter() - start

        setattr(owner, name, timed)

    def wrap_replays(self) -> None:
        """Marks the first graph replay's start and the last one's return (before any capture: a graph
        keeps the bound `replay` of its capture)."""
        replay = torch.cuda.CUDAGraph.replay

        def marked(graph):
            self.marks.setdefault("first", time.perf_counter())
            self.replayed.append(graph)
            out = replay(graph)
            self.marks["last"] = time.perf_counter()
            return out

        marked.__wrapped__ = replay
        torch.cuda.CUDAGraph.replay = marked


def back_to_back(graphs: list, runs: int = 5) -> float:
    """ms of the GPU's time for these CUDA graphs replayed in order with nothing between them, the median
    of `runs` (they replay the request's last step again: its K/V writes rewrite the same values)."""
    replay = torch.cuda.CUDAGraph.replay.__wrapped__
    spans = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for graph in graphs:
            replay(graph)
        end.record()
        end.synchronize()
        spans.append(start.elapsed_time(end))
    return statistics.median(spans)


def phases(llm: LLM, clock: Clock, tag: str) -> None:
    for length in PROMPTS:
        rows = []
        for run in range(RUNS):
            start, end = timed_request(llm, length, HIT, 100 + run, clock)  # other prompts than ttft's
            row = {path: s * 1e3 for path, s in clock.spent.items()}
            row["ttft"] = (end - start) * 1e3
            row["until the first replay"] = (clock.marks["first"] - start) * 1e3
            row["first to last replay"] = (clock.marks["last"] - clock.marks["first"]) * 1e3
            row["after the last replay"] = (end - clock.marks["last"]) * 1e3
            row["graphs back to back"] = back_to_back(clock.replayed)
            row["after the first replay, beyond the graphs"] = (
                row["first to last replay"] + row["after the last replay"] - row["graphs back to back"]
            )
            rows.append(row)
        print(f"phases {tag} L={length} h={HIT}, ms, medians of {RUNS - WARMUP}:")
        for label in rows[-1]:
            print(f"    {label:34s} {statistics.median(r.get(label, 0.0) for r in rows[WARMUP:]):8.3f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="tree", help="a label for the printed lines")
    parser.add_argument("--phases", action="store_true", help="also time the host's steps")
    args = parser.parse_args(argv)
    clock = Clock()
    if args.phases:
        clock.wrap_replays()
    llm = engine()
    ttft(llm, args.tag)
    if args.phases:
        for module, path in STEPS:
            clock.wrap(module, path)
        phases(llm, clock, args.tag)


if __name__ == "__main__":
    main()
