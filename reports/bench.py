"""`nox -s bench` (or `python3 -m reports.bench` where nox is absent): the suite's benchmarks.

Sections:
    kernels   GPU: prefill, prefix-cached prefill, decode and the ceilings (reports/bench_kernels.py)
    engine    GPU: time to first token against the prefix-cache hit share (reports/bench_engine.py)
    host      any machine: host cost of admitting a request (reports/bench_host.py)
GPU sections write under reports/gpu/ (or --out), the host section under reports/<cpu|gpu>/. On a
machine without a GPU the GPU sections say why they are skipped: timings under the CPU
interpreter mean nothing.
"""

import argparse
import importlib
import pathlib
import sys

import torch

GPU_SECTIONS = ("kernels", "engine")
SECTIONS = (*GPU_SECTIONS, "host")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", choices=SECTIONS, action="append", help="run only these sections (repeatable)"
    )
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder of the GPU sections' files")
    parser.add_argument(
        "--previous",
        type=pathlib.Path,
        default=None,
        help="kernels: a folder holding the previous commit's kernels as kernels_prev "
        "(reports/previous_kernels.sh), timed against the working tree's in the same process",
    )
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    for section in args.only or SECTIONS:
        if section in GPU_SECTIONS and not gpu:
            print(
                f"bench {section}: no CUDA device here; GPU timings under the CPU interpreter mean nothing."
            )
            continue
        module = importlib.import_module(f"reports.bench_{section}")
        if section == "host":
            module.main(pathlib.Path("reports") / ("gpu" if gpu else "cpu"))
        elif section == "kernels":
            module.main(args.out or pathlib.Path("reports/gpu"), previous=args.previous)
        else:
            module.main(args.out or pathlib.Path("reports/gpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
