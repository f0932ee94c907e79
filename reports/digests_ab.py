"""Same-process A/B of the block pool's known digests (issue 17, `BlockPool.digests`): the 32-layer model's
time to first token at 2k and 8k with nothing and 90% cached (reports/ttft_phases.py's requests), each
cached request taken in turns with the digests kept (the tree) and forgotten (every page key hashed, as
before them). Prints `label value` lines: medians of the runs after two warm-up ones, and the ratio
TTFT(h) / TTFT(0) of each arm.

`python3 -m reports.digests_ab [--runs N]`: a GPU run (CUDA graphs, the triton backend).
"""

import argparse
import statistics

from reports.ttft_phases import HIT, PROMPTS, WARMUP, engine, timed_request


class Forgetful(dict):
    """A digests map that keeps nothing: every page key is a sha256 digest again."""

    def __setitem__(self, key, value):
        pass

    def __delitem__(self, key):
        pass


ARMS = {"known": dict, "hashed": Forgetful}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=12, help="requests a cell and arm, warm-up included")
    args = parser.parse_args(argv)
    llm = engine()
    for length in PROMPTS:
        spans = [timed_request(llm, length, 0.0, run) for run in range(args.runs)]
        base = statistics.median(1e3 * (end - start) for start, end in spans[WARMUP:])
        print(f"ttft L={length} h=0.0: {base:.2f} ms", flush=True)
        times = {arm: [] for arm in ARMS}
        for run in range(args.runs):
            for i, (arm, digests) in enumerate(ARMS.items()):
                llm.pool.digests = digests()
                start, end = timed_request(llm, length, HIT, 2 * run + i)
                times[arm].append(1e3 * (end - start))
        for arm, ms in times.items():
            median = statistics.median(ms[WARMUP:])
            print(f"ttft L={length} h={HIT} {arm}: {median:.2f} ms, ratio {median / base:.4f}", flush=True)
    llm.pool.digests = {}


if __name__ == "__main__":
    main()
