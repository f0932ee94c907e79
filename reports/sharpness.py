"""`python -m reports.sharpness`: how sharp contract §5's rule is, and how often it cries wolf.

    python -m reports.sharpness [--cases N] [--device cpu|cuda] [--out DIR]

Two sweeps over the campaign's own drawn cases (harness/strategies.py, prefill and decode, every
dtype the device computes right):

- planted semantic bugs (harness/planted_bugs.py): on each case where a bug changes the output at
  all (it differs from the same code without the bug), the verdict and its ratio, error / allowance.
  A sharp rule fails these by orders of magnitude; the cases it passes are those where the bug moves
  the output by less than a rounding (a key of weight 1e-30, a negligible tiny scale's sign).
- correct kernels that round differently (examples/rounding_family.py) and this repository's triton
  kernels: every case must pass; the table gives the worst ratio (how close a correct kernel comes).

Writes <out>/sharpness.md and sharpness.json (default reports/cpu or reports/gpu) and names them.
"""

import argparse
import json
import os
import pathlib
import sys
import time

DEFAULT_CASES = 300
FAMILY = ("fa2", "fused_exp2", "split_k", "normalize_first")
QUANTILES = (0.0, 0.1, 0.5)


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cases", type=int, default=DEFAULT_CASES, help="drawn cases per operator (default %(default)s)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", type=pathlib.Path, default=None)
    return p.parse_args(argv)


def _quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def _same(a, b) -> bool:
    """Equal, NaN where the other is NaN (the exact twin's output against the bug's)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _call(impl, op: str, positional, keywords, device):
    from harness.judge import guarded_call

    return guarded_call(lambda: impl.op(op)(*positional, **keywords), device)


def sweep(cases, device: str, bug_names, good_names):
    """(bug rows, good rows): per bug, its manifesting cases' verdicts; per good kernel, all verdicts."""
    from backends import registry
    from harness.cases import attention_args, build_inputs
    from harness.judge import judge_attention, oracle

    bugs = {b: registry.load(f"harness/planted_bugs.py:{b}") for b in bug_names}
    exact = registry.load("harness/planted_bugs.py:no_bug")
    good = {g: registry.load(g) for g in good_names}
    bug_hits = {b: [] for b in bugs}
    good_hits = {g: [] for g in good}
    for case, decode in cases:
        inputs = build_inputs(case, device)
        truth = oracle(inputs)
        op = "paged_decode" if decode else "paged_prefill"
        args = (
            attention_args(inputs, decode),
            dict(scale=inputs["scale"], layout=inputs["layout"], return_lse=True),
        )
        want = _call(exact, op, *args, device)
        for name, impl in bugs.items():
            got = _call(impl, op, *args, device)
            if _same(got[0], want[0]) and _same(got[1], want[1]):
                continue  # the bug does not touch this case
            v = judge_attention(impl, case, decode=decode, device=device, inputs=inputs, truth=truth)
            bug_hits[name].append((v.ratio, v.failed, case.dtype, op))
        for name, impl in good.items():
            v = judge_attention(impl, case, decode=decode, device=device, inputs=inputs, truth=truth)
            if v.status != "unsupported":
                good_hits[name].append((v.ratio, v.failed, case.dtype, op))
    return bug_hits, good_hits


def draw(n: int, device: str, dtypes):
    """n prefill and n decode cases of the campaign's strategies (seeded, so the report repeats)."""
    from hypothesis import HealthCheck, given, seed, settings

    from harness.strategies import fuzz_attention_cases

    cases = []

    def collect(decode: bool):
        @seed(1234 + decode)
        @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=fuzz_attention_cases(device=device, decode=decode, dtypes=dtypes))
        def keep(case):
            cases.append((case, decode))

        keep()

    collect(False)
    collect(True)
    return cases


def _fmt(x) -> str:
    if x is None:
        return "-"
    if x == float("inf"):
        return "inf"
    return f"{x:.3g}"


def markdown(meta, bug_hits, good_hits) -> str:
    lines = [
        f"# Sharpness and false alarms of contract §5's rule: {meta['device_name']}",
        "",
        f"Generated {meta['generated']} in {meta['elapsed_s']:.0f} s by `{meta['command']}`; torch "
        f"{meta['versions']['torch']}. {meta['cases']} drawn cases per operator (prefill and decode) from "
        "the campaign's strategies, dtypes " + ", ".join(meta["dtypes"]) + ". Ratio = error / allowance "
        "(the larger of the max and mean gates, contract §5); <= 1 passes.",
        "",
        "## Planted semantic bugs (harness/planted_bugs.py)",
        "",
        "*changed*: cases where the bug changes the output at all. *caught*: of those, the failed ones. "
        "The ratio columns are over the changed cases; the uncaught ones are those where the bug moves the "
        "output by less than a rounding.",
        "",
        "| bug | changed | caught | min ratio | p10 ratio | median ratio | uncaught, max ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, hits in bug_hits.items():
        ratios = [r for r, *_ in hits]
        missed = [r for r, failed, *_ in hits if not failed]
        cells = [f"`{name}`", str(len(hits)), str(sum(f for _, f, *_ in hits))]
        cells += [_fmt(_quantile(ratios, q)) for q in QUANTILES]
        cells.append(f"{len(missed)}, {_fmt(max(missed))}" if missed else "0")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Correct kernels (examples/rounding_family.py, and this repository's triton kernels)",
        "",
        "Every case must pass: *failed* is the count of false alarms.",
        "",
        "| implementation | cases | failed | worst ratio | worst ratio per dtype |",
        "|---|---|---|---|---|",
    ]
    for name, hits in good_hits.items():
        per = {}
        for r, _, dtype, _ in hits:
            per[dtype] = max(per.get(dtype, 0.0), r)
        by_dtype = ", ".join(f"{d} {_fmt(r)}" for d, r in sorted(per.items()))
        worst = max((r for r, *_ in hits), default=None)
        failed = sum(f for _, f, *_ in hits)
        lines.append(f"| `{name}` | {len(hits)} | {failed} | {_fmt(worst)} | {by_dtype} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = _args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    import torch

    from harness import planted_bugs
    from harness.records import jsonable, versions

    start = time.time()
    # Every dtype: under the CPU interpreter `triton` declares no bfloat16 (contract §5), so its
    # bfloat16 cases are unsupported and left out of its row.
    dtypes = ("float32", "float16", "bfloat16")
    cases = draw(args.cases, args.device, dtypes)
    good = [f"examples/rounding_family.py:{m}" for m in FAMILY] + ["triton"]
    bug_hits, good_hits = sweep(cases, args.device, planted_bugs.BUGS, good)
    meta = dict(
        device_name=torch.cuda.get_device_name() if args.device == "cuda" else "CPU, Triton interpreter",
        generated=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        command=" ".join(["python -m reports.sharpness", *(argv if argv is not None else sys.argv[1:])]),
        versions=versions(),
        cases=args.cases,
        dtypes=list(dtypes),
        elapsed_s=time.time() - start,
    )
    out = args.out or pathlib.Path(__file__).parent / ("cpu" if args.device == "cpu" else "gpu")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharpness.md").write_text(markdown(meta, bug_hits, good_hits))
    data = dict(meta=meta, bugs=bug_hits, correct=good_hits)
    (out / "sharpness.json").write_text(json.dumps(jsonable(data), indent=1) + "\n")
    for name in ("sharpness.md", "sharpness.json"):
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
