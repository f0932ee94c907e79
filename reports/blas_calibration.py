"""What engine/blas_choice.py measures and chooses for the 32-layer model on this GPU (issue 17).

For each token bucket of the engine's graphs, it prints the µs a call of each weight through each
library (`time_linears`). Then it runs a fresh calibration, as a runner's first prefill does, and
prints its wall time, the buckets kept and each bucket's libraries. Everything is also written as JSON.

`python3 -m reports.blas_calibration [--out FILE.json]` (a GPU; about a minute).
"""

import argparse
import json
import pathlib
import time

import torch

from reports.ttft_phases import engine


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("blas-calibration.json"))
    args = parser.parse_args(argv)
    graphs = engine().runner.graphs
    times = {}
    for rows in graphs.token_buckets:
        times[rows] = graphs.timer(rows)
        cells = ", ".join(
            f"{name} " + "/".join(f"{us:.1f}" for us in by_library.values())
            for name, by_library in times[rows].items()
        )
        print(f"{rows} rows, µs by library: {cells}", flush=True)
    start = time.perf_counter()
    graphs._bucket(1)  # the calibration, as a runner's first prefill step runs it
    spent = time.perf_counter() - start
    print(f"calibration: {spent:.2f} s over {len(graphs.choices)} buckets; kept {graphs.token_buckets}")
    for rows, choice in graphs.choices.items():
        print(f"libraries at {rows} rows: {choice}")
    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        times_us=times,
        calibration_s=spent,
        kept=graphs.token_buckets,
        choices=graphs.choices,
    )
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
