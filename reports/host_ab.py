"""Same-process A/B of the engine's host-side changes for issue 17: the 32-layer model's time to first token
at 2k and 8k with nothing and 90% cached (reports/ttft_phases.py's requests), each cached request taken in
turns by every arm, on one engine. An arm is the tree with some changes undone:
    keys whole         a lookup hashes every page of the prompt (`page_keys` without known_only)
    digests forgotten  keys whole, and `BlockPool.digests` keeps nothing: every page key is a sha256 digest
                       again (a lookup that stops hashing at the first unknown digest rests on them)
    no lead            prefill graphs without their lead (`StepGraph.LEAD`): the GPU waits for the first
                       replan (graphs of their own: a second `StepGraphs`)
    host walk          every replan's walk made on the host and copied in (kernels/device_walk.py off:
                       graphs of their own, whose lead writes no walk)
    whole round        a lone round's items whole, half the programs idle at the 2k step
                       (hopper_prefill.SPLIT_ONE_ROUND off: graphs of their own)
    blas default       graphs whose linear layers take torch's default library at every token bucket,
                       every bucket kept (engine/blas_choice.py: graphs of their own, nothing timed)
    blas chosen        graphs whose linear layers take each bucket's faster library, and whose buckets
                       a larger one undercuts are dropped (`blas_choice.calibrate`, whatever
                       `blas_choice.ENABLED` says: graphs of their own)
    no dependent launch  the small kernels between the products launched plainly, not as programmatic
                       dependents (kernels/_common.py's DEPENDENT_LAUNCH off: graphs of their own)
    dependent launch   those kernels launched as programmatic dependents (DEPENDENT_LAUNCH on, whatever
                       the tree says: graphs of their own where the tree has it off)
Prints `label value` lines: medians of the runs after two warm-up ones of each arm's TTFT(0) and TTFT(h),
their ratio, and the tokens its requests found cached (the same in every arm, or the script stops); then
each set of graphs' token buckets and the libraries it took at the buckets used.

`python3 -m reports.host_ab [--runs N] [--arms A,B]`: a GPU run (CUDA graphs, the triton backend).
"""

import argparse
import contextlib
import statistics

from engine import block_pool
from engine.cuda_graphs import PrefillGraph, StepGraphs, linear_timer
from kernels import _common, device_walk, hopper_prefill
from reports.ttft_phases import HIT, PROMPTS, WARMUP, engine, timed_request


class Forgetful(dict):
    """A digests map that keeps nothing: every page key is a sha256 digest again."""

    def __setitem__(self, key, value):
        pass

    def __delitem__(self, key):
        pass


ARMS = {
    "tree": (),
    "keys whole": ("keys whole",),
    "digests forgotten": ("keys whole", "digests forgotten"),
    "no lead": ("no lead",),
    "host walk": ("host walk",),
    "whole round": ("whole round",),
    "all undone": ("keys whole", "digests forgotten", "no lead", "host walk", "whole round"),
    "blas default": ("blas default",),
    "blas chosen": ("blas chosen",),
    "no dependent launch": ("no dependent launch",),
    "dependent launch": ("dependent launch",),
}


@contextlib.contextmanager
def undone(llm, undo: tuple, graphs: dict):
    """The tree with the changes named in `undo` undone, for one request (it resets the cache first)."""
    page_keys, lead, on_device = block_pool.BlockPool.page_keys, PrefillGraph.LEAD, device_walk.ENABLED
    split, dependent = hopper_prefill.SPLIT_ONE_ROUND, _common.DEPENDENT_LAUNCH
    if "dependent launch" in undo or "no dependent launch" in undo:
        _common.DEPENDENT_LAUNCH = "dependent launch" in undo
    device_walk.ENABLED = on_device and "host walk" not in undo
    hopper_prefill.SPLIT_ONE_ROUND = split and "whole round" not in undo
    if "digests forgotten" in undo:
        llm.pool.digests = Forgetful()
    if "keys whole" in undo:
        block_pool.BlockPool.page_keys = lambda pool, seq, known_only=False: page_keys(pool, seq)
    blas = next((arm for arm in ("blas default", "blas chosen") if arm in undo), None)
    key = ("no lead" in undo, blas, "host walk" in undo, "whole round" in undo, _common.DEPENDENT_LAUNCH)
    if key not in graphs:  # captured on first use under the arm's settings
        timers = {
            None: None,
            "blas default": lambda rows: {},
            "blas chosen": linear_timer(llm.runner),
        }
        graphs[key] = StepGraphs(
            llm.runner, whole_decode=llm.runner.ops.capabilities.graphs, timer=timers[blas]
        )
    PrefillGraph.LEAD, llm.runner.graphs = not key[0], graphs[key]
    try:
        yield
    finally:
        llm.pool.digests = {}  # consistent again at the next request's cache reset
        block_pool.BlockPool.page_keys, PrefillGraph.LEAD, device_walk.ENABLED = page_keys, lead, on_device
        hopper_prefill.SPLIT_ONE_ROUND, _common.DEPENDENT_LAUNCH = split, dependent


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=12, help="requests a cell and arm, warm-up included")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    llm = engine()
    tree = (False, None, False, False, _common.DEPENDENT_LAUNCH)
    graphs = {tree: llm.runner.graphs}
    for length in PROMPTS:
        times, cached = {(arm, share): [] for arm in arms for share in (0.0, HIT)}, set()
        for run in range(args.runs):
            for i, arm in enumerate(arms):
                for share in (0.0, HIT):
                    hits = llm.pool.stats.hits  # the prefix's own request finds nothing cached
                    with undone(llm, ARMS[arm], graphs):
                        start, end = timed_request(llm, length, share, len(arms) * run + i)
                    times[arm, share].append(1e3 * (end - start))
                    if share:
                        cached.add(llm.pool.stats.hits - hits)
        if len(cached) != 1:
            raise SystemExit(f"the arms found different cached tokens: {sorted(cached)}")
        (tokens,) = cached
        for arm in arms:
            base, median = (statistics.median(times[arm, share][WARMUP:]) for share in (0.0, HIT))
            print(
                f"ttft L={length} {arm}: h=0.0 {base:.2f} ms, h={HIT} {median:.2f} ms, "
                f"ratio {median / base:.4f}, cached {tokens}",
                flush=True,
            )
        llm.runner.graphs = graphs[tree]
    for (no_lead, blas, host_walk, whole_round, dependent), taken in graphs.items():
        names = ("no lead" if no_lead else None, blas, "host walk" if host_walk else None)
        if dependent != tree[-1]:
            names += ("dependent launch" if dependent else "no dependent launch",)
        names += ("whole round" if whole_round else None,)
        label = ", ".join(name for name in names if name) or "tree"
        print(f"{label} token buckets: {taken.token_buckets}")
        for tokens in sorted(taken.prefill):
            print(f"{label} libraries at {tokens} rows: {taken.choices.get(tokens)}")


if __name__ == "__main__":
    main()
