"""`python -m fuzz` (or `nox -s kernel-fuzz -- ...`): a fuzz campaign against the oracle, or one replay.

examples:
  python -m fuzz --minutes 1 --target prefill              a one-minute campaign of paged_prefill
  python -m fuzz --max-cases 40 --target decode --dtype float16
                                                           exactly 40 drawn float16 decode cases
  python -m fuzz --backend flex --target prefill           another built-in implementation
  python -m fuzz --backend ~/my_kernel.py:impl             anyone's implementation (contract §9)
  python -m fuzz --replay fuzz/failures/FILE.json          re-run a saved case on the backend it names
  python -m fuzz --shard 3/8 --summary s3.json             shard 3 of an 8-way campaign (one job of
                                                           a Slurm array, a Kubernetes Job, a CI matrix)
  python -m fuzz --merge s*.json --summary all.json        the shards as one report

how it works:
  Workers (spawned processes; one per CPU core, or, on a GPU host, the cores shared out over every
  visible GPU, several per GPU so that compilations run in parallel) load the implementation by its
  name, draw cases within what it declares (capabilities, harness/strategies.py) and run each in a
  child process of their own (harness/isolation.py), which judges it against the float64 oracle by
  contract §5's tolerance rule (docs/contract.md): out and, where declared, lse; write_kv bit for
  bit; the engine cold vs warm (harness/engine_check.py). Each chunk of draws fixes one dtype and one
  compile-time key (heads, head dim, page size, layout family, block size: what kernels compile for;
  the engine's page size) and varies everything else, so a chunk compiles once, and a failure keeps
  its dtype and key while hypothesis shrinks the rest; keys are drawn from the whole domain. Compiled
  kernels persist in --kernel-cache for the next campaign. The smallest failing case is saved under
  --failures-dir as a small JSON file that records the backend name, so `--replay FILE` needs no
  other flag, and in the example database (--example-db), from which every campaign, every shard of
  one included, replays the saved failures first. A case the implementation refuses with NotImplementedError
  counts as unsupported, never as passed or failed; a ValueError or TypeError on a valid case is a
  failure ("rejected a valid input"). A case that kills its child process or leaves the GPU unusable
  is a CRASH, one that runs past --case-timeout a HANG: both are failures, saved before they are
  shrunk (each candidate in a fresh child), and the campaign goes on with a new child. Known failures
  live in the ledger (fuzz/ledger.py); a wrong-answer entry whose case passes again fails the run.

  The campaign ends when the time box is over or, with --max-cases, when every target has drawn its
  cases (whichever comes first). Cases in flight and a shrink in progress are finished after the time
  box; the progress line says so.

  The summary says where the workers' time went per target: compiling, the implementation, the
  oracle, child-process start-up and the rest of the harness (harness/timing.py).

  worst ratio: contract §5's worst gate ratio, error / allowed error over the max and mean gates of
  every judged output (out, lse). <= 1 passes; inf is a crash or a NaN/Inf where the oracle is finite.

exit codes:
  campaign: 0 no new failure; 1 a new failure, a stale ledger entry or an incomplete run;
            2 no requested target can run here (the reasons are printed).
  replay:   1 the case still fails, crashes or hangs (reproduced); 0 it passes now; 2 it could not run.
  merge:    as a campaign, over all shards (a missing shard fails it); 2 the summaries do not belong
            together.
"""

import argparse
import os
import pathlib
import sys

DEFAULT_MINUTES = 2.0
DEFAULT_MAX_FAILURES = 3
HERE = pathlib.Path(__file__).parent


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _shard(text: str) -> tuple[int, int]:
    k, sep, n = text.partition("/")
    if not sep or not k.strip().isdigit() or not n.strip().isdigit() or not 1 <= int(k) <= int(n):
        raise argparse.ArgumentTypeError(f"expected K/N with 1 <= K <= N, got {text!r}")
    return int(k), int(n)


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m fuzz`; its epilog is this module's docstring."""
    from backends import registry
    from fuzz.targets import TARGETS
    from harness import isolation
    from harness.cases import DTYPES

    p = argparse.ArgumentParser(
        prog="python -m fuzz",
        description="A fuzz campaign of an implementation against the float64 oracle, or one replay.",
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bounds = p.add_argument_group("how long")
    bounds.add_argument(
        "--minutes",
        type=_positive(float),
        help=f"time box in minutes (default {DEFAULT_MINUTES:g}; none when only --max-cases is given)",
    )
    bounds.add_argument(
        "--max-cases",
        type=_positive(int),
        metavar="N",
        help="draw at most N cases per target over the whole campaign, split evenly among the "
        "workers; shrink candidates do not count. Without --minutes there is no time box",
    )
    what = p.add_argument_group("what")
    what.add_argument(
        "--backend",
        metavar="NAME",
        help=f"the implementation under test (default {registry.DEFAULT_BACKEND}; with --replay, the "
        f"file's): {registry.describe_names()}",
    )
    what.add_argument(
        "--target",
        action="append",
        choices=TARGETS,
        help="repeatable; default: all four. engine needs an implementation with all three operators",
    )
    what.add_argument(
        "--dtype",
        action="append",
        choices=tuple(DTYPES),
        help="repeatable; draw only these of the dtypes the implementation declares (default: all it "
        "declares). Each chunk of draws fixes one dtype, so shrinking never changes a failure's dtype",
    )
    what.add_argument(
        "--layout-family",
        action="append",
        metavar="NAME",
        help="repeatable; prefill and decode draw their layouts from these families only: "
        "package.module:attribute or path/to/file.py:attribute, a callable num_heads -> hypothesis strategy "
        "of layouts (backends/layout_families.py; e.g. examples/sliding_window_sinks.py:family)",
    )
    what.add_argument("--seed", type=int, default=0, help="base seed of the draws (default %(default)s)")
    what.add_argument(
        "--shard",
        type=_shard,
        metavar="K/N",
        help="run shard K of N (1 <= K <= N) of this campaign: seeds and draws disjoint from the other "
        "shards', each shard a complete campaign with its own summary; --merge combines them",
    )
    how = p.add_argument_group("workers and failures")
    how.add_argument(
        "--workers",
        type=_positive(int),
        metavar="N",
        help="worker processes (default: one per CPU core; on a GPU host the cores shared out over every "
        "visible GPU, at most one per 8 GiB of its memory)",
    )
    how.add_argument(
        "--max-failures",
        type=_positive(int),
        default=DEFAULT_MAX_FAILURES,
        metavar="N",
        help="a worker stops a target after N saved failures (default %(default)s)",
    )
    how.add_argument(
        "--case-timeout",
        type=_positive(float),
        default=isolation.DEFAULT_CASE_TIMEOUT_S,
        metavar="SECONDS",
        help="a case that runs longer (compilation included) is killed and counts as HANG, a failure "
        "(default %(default)g)",
    )
    how.add_argument(
        "--max-shrinks",
        type=_positive(int),
        metavar="N",
        help="run at most N shrink candidates per failure (default: hypothesis's own bound, 500 "
        "shrinks or five minutes)",
    )
    files = p.add_argument_group("files")
    files.add_argument(
        "--failures-dir",
        type=pathlib.Path,
        default=HERE / "failures",
        metavar="DIR",
        help="where failing cases are saved (default: fuzz/failures)",
    )
    files.add_argument(
        "--ledger",
        type=pathlib.Path,
        default=HERE / "ledger.json",
        metavar="FILE",
        help="the known-failure ledger; may be your own file anywhere, its paths relative to it "
        "(default: fuzz/ledger.json)",
    )
    files.add_argument(
        "--kernel-cache",
        type=pathlib.Path,
        metavar="DIR",
        help="where compiled kernels are kept for the next campaign (Triton's and torch.compile's "
        "caches; default: TRITON_CACHE_DIR when set, else .cache/kernels in the repository)",
    )
    files.add_argument(
        "--example-db",
        metavar="DIR|MODULE:ATTR",
        help="the hypothesis example database where failures are saved and from which the saved ones "
        "are replayed first: a directory (shared storage for shards on many hosts), a "
        "hypothesis ExampleDatabase named package.module:attr, or `none` (default: "
        ".hypothesis/examples/<implementation>, the tests' own)",
    )
    files.add_argument(
        "--summary", type=pathlib.Path, metavar="FILE", help="also write the JSON summary here"
    )
    files.add_argument(
        "--merge",
        type=pathlib.Path,
        nargs="+",
        metavar="SUMMARY",
        help="combine the JSON summaries of a campaign's shards (their failures and ledger entries) "
        "into one report (and --summary FILE) and exit",
    )
    files.add_argument(
        "--replay",
        type=pathlib.Path,
        metavar="FILE",
        help="re-run one saved case file on the backend it names (or --backend) and exit",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parsed and completed arguments; the parser exits with a message on a bad one."""
    from fuzz.targets import TARGETS

    p = parser()
    args = p.parse_args(argv)
    args.target = args.target or list(TARGETS)
    if args.minutes is None and args.max_cases is None:
        args.minutes = DEFAULT_MINUTES
    if args.replay is not None and not args.replay.is_file():
        p.error(f"--replay: {args.replay} is not a file")
    for path in args.merge or ():
        if not path.is_file():
            p.error(f"--merge: {path} is not a file")
    if args.ledger != HERE / "ledger.json" and not args.ledger.is_file():
        p.error(f"--ledger: {args.ledger} is not a file")
    return args


def main(argv=None) -> int:
    """The entry point; returns the exit code (see the module docstring)."""
    import torch  # does not import triton

    # Triton must know before its first import whether to use the CPU interpreter.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args = parse_args(argv)
    if args.merge:
        from fuzz.merge import main_merge

        return main_merge(args.merge, args.summary)
    if args.replay:
        from fuzz.case_file import main_replay

        return main_replay(args.replay, args.backend, args.case_timeout)
    from backends.registry import DEFAULT_BACKEND
    from fuzz.campaign import run

    args.backend = args.backend or DEFAULT_BACKEND
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
