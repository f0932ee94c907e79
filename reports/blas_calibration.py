"""What engine/blas_choice.py measures and chooses for the 32-layer model on this GPU (issue 17).

For each token bucket of the engine's graphs, it prints the µs a call of each weight through each
library (`time_linears`). Then it runs a fresh calibration (`calibrate`, what a runner's first prefill
runs with `blas_choice.ENABLED`) and prints its wall time, the buckets kept and each bucket's libraries.
Everything is also written as JSON.

`python3 -m reports.blas_calibration [--out FILE.json]` (a GPU; about a minute).
"""

import argparse
import json
import pathlib
import time

import torch

from engine import blas_choice
from engine.cuda_graphs import linear_timer
from reports.ttft_phases import engine


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("blas-calibration.json"))
    args = parser.parse_args(argv)
    llm = engine()
    timer = linear_timer(llm.runner)
    buckets = llm.runner.graphs.token_buckets
    times = {}
    for rows in buckets:
        times[rows] = timer(rows)
        cells = ", ".join(
            f"{name} " + "/".join(f"{us:.1f}" for us in by_library.values())
            for name, by_library in times[rows].items()
        )
        print(f"{rows} rows, µs by library: {cells}", flush=True)
    start = time.perf_counter()
    kept, choices = blas_choice.calibrate(buckets, timer)
    spent = time.perf_counter() - start
    print(f"calibration: {spent:.2f} s over {len(buckets)} buckets; kept {kept}")
    for rows, choice in choices.items():
        print(f"libraries at {rows} rows: {choice}")
    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        times_us=times,
        calibration_s=spent,
        kept=kept,
        choices=choices,
    )
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
