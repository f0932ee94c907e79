"""Where a request's host time goes: cProfile of `LLM.generate` for one prompt with part of it cached.

`python3 -m reports.engine_profile [--model phi3-small-attn] [--prompt-len 2048] [--hit-share 0.9]
[--runs 5] [--out FILE]`: warms the cache with the shared prefix as `reports/bench_engine.py` does,
then profiles `--runs` timed requests (after one unprofiled warm-up) and prints the functions with
the most own time and the most cumulative time. GPU work is asynchronous, so the profile shows where
the host waits (synchronizing calls such as `.tolist()` or `.item()`) as time in those calls.
"""

import argparse
import cProfile
import io
import math
import pathlib
import pstats
import random
import sys
import time

import torch

from engine import LLM, SamplingParams


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default="phi3-small-attn")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--hit-share", type=float, default=0.9)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=pathlib.Path, help="also write the report here")
    args = parser.parse_args(argv)
    llm = LLM(
        args.model,
        backend="triton",
        num_pages=2 * math.ceil(args.prompt_len / 16) + 8,
        max_num_batched_tokens=args.prompt_len,
        max_num_seqs=4,
    )
    vocab, prefix = llm.args.vocab_size, int(args.hit_share * args.prompt_len)
    profile, times = cProfile.Profile(), []
    for run in range(args.runs + 1):
        rng = random.Random(run)
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        llm.reset_prefix_cache()
        if prefix:
            llm.generate([prompt[:prefix]], SamplingParams(max_tokens=1))
        torch.cuda.synchronize()
        start = time.perf_counter()
        if run:
            profile.enable()
        llm.generate([prompt], SamplingParams(max_tokens=1))
        torch.cuda.synchronize()
        profile.disable()
        if run:
            times.append((time.perf_counter() - start) * 1e3)
    text = io.StringIO()
    text.write(
        f"{args.model}, {args.prompt_len} tokens, {prefix} cached: TTFT ms {[round(t, 2) for t in times]}\n"
    )
    for key in ("tottime", "cumulative"):
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(args.top)
    print(text.getvalue())
    if args.out:
        args.out.write_text(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
