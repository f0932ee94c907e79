"""The engine's host work before a prefill step's first graph replay, timed on the CPU (issue 17).

With 90% of a 2k prompt cached, the 32-layer model's time to first token is the step's graphs plus what the
host does from `generate`'s call to the first replay: admission's check, the lookup, the allocation, the
packing and the inputs' copy (0.55 ms on the thirty-seventh session's H100, ttft-phases-h100-s37.txt).
That path does not depend on the model's size, so this script times it without a GPU: the tiny model, the
triton backend under the interpreter, whole prefill graphs through `rerun_capture` (the graphs' CPU stand-in),
a 2k prompt whose first 90% was cached and, before each timed request, a short one, as in a served stream
(the step before leaves the host's caches cold, as on the GPU's host). The timed request's first replay
raises, so nothing past it runs.

Prints µs, medians of the requests after three warm-up ones: `until the first replay`, and with --phases the
host's steps of reports/ttft_phases.py (each wrapper costs about a µs a call, so those overstate a little).
A process's median moves by tens of µs from one process to the next: an A/B takes processes in turns, each
pair with the same PYTHONHASHSEED, the other tree's engine first on the path:
`PYTHONHASHSEED=1 PYTHONPATH=OTHER TRITON_INTERPRET=1 python3 reports/host_proxy.py` from this tree's root.

`TRITON_INTERPRET=1 python3 -m reports.host_proxy [--requests N] [--length L] [--phases]`: a CPU run.
"""

import argparse
import os
import random
import statistics
import time

from engine import LLM, SamplingParams, cuda_graphs
from reports.ttft_phases import HIT, STEPS, Clock

WARMUP = 3


class FirstReplay(Exception):
    """Raised by the timed request's first replay."""


class StandIn:
    """Stops a request at its first prefill graph replay while `armed`, noting when (`at`)."""

    def __init__(self):
        self.armed, self.at = False, None

    def wrap(self, llm: LLM) -> None:
        """Wraps the replays of every prefill graph that `llm` has made (the CPU's, `rerun_capture`)."""
        for graph in llm.runner.graphs.prefill.values():
            graph.replays = [self._stopping(replay) for replay in graph.replays]

    def _stopping(self, replay):
        def stopping():
            if self.armed:
                self.at = time.perf_counter()
                raise FirstReplay
            replay()

        return stopping


def engine(length: int) -> LLM:
    """The tiny model's engine: whole prefill graphs through `rerun_capture`, room for `length` tokens."""
    pages = 2 * length // 16 + 64
    llm = LLM(
        "tiny",
        backend="triton",
        page_size=16,
        num_pages=pages,
        max_num_batched_tokens=length,
        dtype="float32",
    )
    llm.runner.graphs = cuda_graphs.StepGraphs(
        llm.runner, whole_decode=True, capture=cuda_graphs.rerun_capture
    )
    llm.runner.graphs.whole_prefill = True
    return llm


def until_first_replay(llm: LLM, stand_in: StandIn, prompt: list[int]) -> float:
    """µs from `generate([prompt])`'s call to its first replay (`generate` drops the request when the
    replay raises)."""
    stand_in.armed, stand_in.at = True, None
    start = time.perf_counter()
    try:
        llm.generate([prompt], SamplingParams(max_tokens=1))
    except FirstReplay:
        pass
    finally:
        stand_in.armed = False
    if stand_in.at is None:
        raise RuntimeError("the request replayed no prefill graph made before it")
    return (stand_in.at - start) * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="timed requests, warm-up included")
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--phases", action="store_true", help="also time the host's steps")
    args = parser.parse_args(argv)
    if args.requests <= WARMUP:
        parser.error(f"--requests must exceed the {WARMUP} warm-up requests, got {args.requests}")
    if os.environ.get("TRITON_INTERPRET") != "1":  # read when triton compiles, at import
        raise SystemExit("host_proxy is a CPU run: TRITON_INTERPRET=1 python3 -m reports.host_proxy")
    llm, stand_in, rng = engine(args.length), StandIn(), random.Random(0)
    vocab, one = llm.args.vocab_size, SamplingParams(max_tokens=1)
    prefix = [rng.randrange(vocab) for _ in range(int(HIT * args.length))]
    llm.generate([prefix], one)  # cached: every request hits it
    llm.generate([prefix + [0] * (args.length - len(prefix))], one)  # the timed requests' graph made
    stand_in.wrap(llm)
    clock = Clock()
    if args.phases:
        for module, path in STEPS:
            clock.wrap(module, path)
    rows = []
    for run in range(args.requests):
        prompt = prefix + [rng.randrange(vocab) for _ in range(args.length - len(prefix))]
        llm.generate([prefix[:100] + [rng.randrange(vocab) for _ in range(20 + run % 5)]], one)
        clock.spent.clear()
        row = {"until the first replay": until_first_replay(llm, stand_in, prompt)}
        rows.append(row | {path: s * 1e6 for path, s in clock.spent.items()})
    print(f"host_proxy L={args.length} h={HIT}, µs, medians of {args.requests - WARMUP}:")
    for label in rows[-1]:
        print(f"    {label:34s} {statistics.median(r.get(label, 0.0) for r in rows[WARMUP:]):8.1f}")


if __name__ == "__main__":
    main()
