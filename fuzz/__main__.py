"""`python -m fuzz` (or `nox -s kernel-fuzz -- ...`): a time-boxed fuzz campaign, or one replay.

python -m fuzz --minutes 1 --target prefill          # campaign; exit 1 on any new failure
python -m fuzz --backend flex --target prefill        # put another implementation under test
python -m fuzz --replay fuzz/failures/FILE.json       # exit 1 when the saved case still fails
"""

import argparse
import os
import pathlib
import sys

TARGETS = ("prefill", "decode", "write_kv", "engine")
BACKENDS = ("triton", "sdpa", "flex", "reference")
DEFAULT_BACKEND = "triton"
DEFAULT_MINUTES = 2.0
DEFAULT_SHRINK_SECONDS = 60.0
DEFAULT_MAX_FAILURES = 3
HERE = pathlib.Path(__file__).parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fuzz", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help="time budget (default %(default)s)")
    p.add_argument("--target", action="append", choices=TARGETS, help="repeatable; default: all")
    p.add_argument(
        "--backend", choices=BACKENDS, help="implementation under test (default: triton; replay: the file's)"
    )
    p.add_argument("--workers", type=int, default=None, help="default: one per CPU core, or one per GPU")
    p.add_argument("--seed", type=int, default=0, help="base seed of the draws")
    p.add_argument("--replay", type=pathlib.Path, help="re-run one saved case file and exit")
    p.add_argument("--summary", type=pathlib.Path, default=None, help="also write the JSON summary here")
    p.add_argument("--failures-dir", type=pathlib.Path, default=HERE / "failures")
    p.add_argument("--ledger", type=pathlib.Path, default=HERE / "ledger.json")
    p.add_argument("--shrink-seconds", type=float, default=DEFAULT_SHRINK_SECONDS, help="per failure")
    p.add_argument("--max-failures", type=int, default=DEFAULT_MAX_FAILURES, help="per target and worker")
    args = p.parse_args(argv)
    args.target = args.target or list(TARGETS)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch  # does not import triton

    # Triton must know before its first import whether to use the CPU interpreter.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.replay:
        from fuzz.case_file import main_replay

        return main_replay(args.replay, args.backend)
    from fuzz.campaign import run

    args.backend = args.backend or DEFAULT_BACKEND
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
