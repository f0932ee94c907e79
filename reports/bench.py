"""`nox -s bench` (or `python3 -m reports.bench` where nox is absent): GPU benchmarks.

Runs the kernel benchmark (reports/bench_kernels.py) and the engine time-to-first-token benchmark
(reports/bench_engine.py), each writing its tables under reports/<device>/. On a machine without a
GPU it says why it does nothing and exits 0: timings under the CPU interpreter mean nothing.
"""

import argparse
import importlib
import pathlib
import sys

import torch

SECTIONS = ("kernels", "engine")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("reports/gpu"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench: no CUDA device here; GPU benchmarks are meaningless under the CPU interpreter. "
            "Nothing to do."
        )
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for section in args.only or SECTIONS:
        importlib.import_module(f"reports.bench_{section}").main(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
