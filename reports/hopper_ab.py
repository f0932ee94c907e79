"""Same-process A/B of the planned prefill's Hopper path (kernels/hopper_prefill.py) against the Triton
kernel it replaces on sm_90 (GPU only).

`python3 -m reports.hopper_ab --out DIR [--only times,host,profile,timeline,durations] [--variants [NAME,...]]
[--previous DIR] [--vllm DIR] [--rounds N] [--max-tokens N] [--min-tokens N] [--rows issue|engine|all]`: the
planned times of both paths (and of the variants, of the previous commit's Hopper path, and of vLLM's kernel
on the Phi-3 rows, reports/vllm_baseline.py) on rows of the kernel benchmark (reports/bench_kernels.py; or
the engine's prefill step over a cached 2k prompt, `--rows engine`), in one process, each
timed once a round in turn, each round starting one path later (`--rounds`: the same-process spread); with
`--vllm` the ratios to vLLM are to its time in this process, otherwise to issue 16's (bench_kernels.VLLM_MS);
`host` breaks down the Hopper run's host time at 8k; `profile` runs each path once on the 8k Phi-3 prefill,
for ncu; `timeline` summarizes the Hopper paths' own timelines (reports/hopper_timeline.py); `durations`
sets the 8k rows' do_bench times beside the kernels' own (the profiler's). Writes hopper-ab.json under DIR
and prints a table. The Hopper path's verdicts: tests/kernels/test_hopper_prefill.py.
"""

import argparse
import contextlib
import functools
import importlib
import json
import pathlib
import statistics
import sys

import torch

from reports import bench_kernels as bk
from reports import hopper_timeline
from reports.vllm_baseline import VllmPrefill


@contextlib.contextmanager
def hopper_path(enabled: bool, package: str = "kernels", **settings):
    """Within the block, plans of `package` (`kernels`, or `kernels_prev` of --previous) take the Hopper
    path iff `enabled` (and the call supports it), with these module settings of its hopper_prefill.py
    (STAGES, DEVICE_DESCRIPTORS, ...)."""
    module = importlib.import_module(f"{package}.hopper_prefill")
    settings["ENABLED"] = enabled
    original = {name: getattr(module, name) for name in settings}
    for name, value in settings.items():
        setattr(module, name, value)
    prefill = importlib.import_module(f"{package}.paged_prefill")
    prefill._LAST_PLAN.last = None  # the op's remembered plan would keep the other path
    try:
        yield prefill
    finally:
        for name, value in original.items():
            setattr(module, name, value)


# (name, package, takes the Hopper path, settings of its hopper_prefill.py)
PATHS = [
    ("hopper", "kernels", True, {}),
    ("triton", "kernels", False, {}),
]
# --variants: the kernel walking head-major in every round, with its last round split where the cost
# model says it pays, with every round dealt by cost, checking V before a masked tile's product, and
# with the descriptors each program makes (the default before the nineteenth session), and with the
# last round dealt where the cheapest items would go last (the default before the twentieth), and with
# a lone round's items split over the programs it leaves idle (by the cost model's defaults, and with
# parts of two tiles or more at half the set-up)
VARIANTS = [
    ("head_major", "kernels", True, {"BALANCED_WALK": False}),
    ("split", "kernels", True, {"SPLIT_LAST": True}),
    ("balanced_all", "kernels", True, {"BALANCED_ROUNDS": 10**6}),
    ("v_checked_first", "kernels", True, {"V_CHECK_AFTER": False}),
    ("device_descriptors", "kernels", True, {"DEVICE_DESCRIPTORS": True}),
    ("dealt_last", "kernels", True, {"CHEAPEST_LAST": False}),
    ("split_one_round", "kernels", True, {"SPLIT_ONE_ROUND": True}),
    (
        "split_one_round_fine",
        "kernels",
        True,
        {"SPLIT_ONE_ROUND": True, "MIN_SPLIT_TILES": 2, "SPLIT_COST": 2.0},
    ),
]
# --previous DIR: the Hopper path of the commit in DIR/kernels_prev (reports/previous_kernels.sh)
PREVIOUS = ("previous", "kernels_prev", True, {})
# (tokens, queries, layout, page size): the issue's table (reports/bench_kernels.py's ISSUE_TABLE), with
# pages of 64 and dense causal at 8k before the slow 128k rows.
PHI3_ROWS = [(n, q, "phi3", 16) for n, q in bk.ISSUE_TABLE]
TIME_ROWS = (
    [row for row in PHI3_ROWS if row[0] < 131072]
    + [(8192, 8192, "phi3", 64), (8192, 8192, "dense", 16)]
    + [row for row in PHI3_ROWS if row[0] >= 131072]
)
# --rows engine: an engine's prefill step over a cached 2k prompt (208 queries, h 0.9; issue 17), whose
# single round of 64 items leaves most of the H200's 132 programs idle.
ENGINE_ROWS = [(2048, 208, "phi3", 16), (2048, 208, "dense", 16)]
ROWS = {"issue": TIME_ROWS, "engine": ENGINE_ROWS, "all": ENGINE_ROWS + TIME_ROWS}
ENQUEUE_TOKENS = 8192  # enqueue times are taken at these rows only (the queue is slow to fill at 128k)


# vLLM's CSR index widths: int64 as vLLM builds it; int32 checks that the width does not slow it.
VLLM_CSR = {"vllm": torch.int64, "vllm_int32": torch.int32}


def path_runs(p, n: int, layout, paths, vllm=None, csr=VLLM_CSR) -> tuple[dict, dict]:
    """Each path's plan of problem p (a bench_kernels.Prefill of n tokens) and its planned run, then
    vLLM's kernel with each of `csr`'s index widths when `vllm` names its directory and p has a layout."""
    plans, runs = {}, {}
    for path, package, on, settings in paths:
        with hopper_path(on, package, **settings) as prefill:
            plans[path] = prefill.plan_prefill(*p.args(), scale=bk.SCALE, layout=layout)
        runs[path] = functools.partial(plans[path].run, p.q, p.k, p.v)
    if vllm is not None and layout is not None:
        mask = layout.block_mask(bk.HEADS, n // bk.SPARSE_BLOCK)
        for name, dtype in csr.items():
            runs[name] = VllmPrefill(vllm, p.q, *p.gathered(), mask, bk.SPARSE_BLOCK, bk.SCALE, dtype)
    return plans, runs


def times(
    save, paths, rounds: int = 1, max_tokens=None, min_tokens=None, vllm=None, rows=TIME_ROWS
) -> list[dict]:
    """The times of `rows` (tokens, queries, layout, page size; from min_tokens up to max_tokens), each path
    timed once a round, in turn from a path one later each round (`{path}_ms`: the median of its rounds),
    with vLLM's kernel on the Phi-3 rows when `vllm` names its directory; `save(measured)` after each row
    (a run cut short keeps what it measured)."""
    gen = torch.Generator().manual_seed(0)
    measured = []
    for n, queries, layout_name, page in rows:
        if (max_tokens is not None and n > max_tokens) or (min_tokens is not None and n < min_tokens):
            continue
        layout = bk.phi3_layout() if layout_name == "phi3" else None
        bk.PAGE_SIZE = page
        p = bk.Prefill(n, queries, layout, gen)
        row = {"n": n, "queries": queries, "layout": layout_name, "page": page}
        plans, runs = path_runs(p, n, layout, paths, vllm)
        for path, plan in plans.items():
            row[f"{path}_took_hopper"] = plan.hopper is not None
        outs = {path: run() for path, run in runs.items()}
        order = list(runs.items())
        for r in range(rounds):
            # Each round starts one path later: a path's place in the round biased it (the same binary,
            # always timed first, ran up to 10% slower than when timed third, kernel-ab.md §24).
            for path, run in order[r % len(order) :] + order[: r % len(order)]:
                row.setdefault(f"{path}_ms_rounds", []).append(bk.bench(run))
        for path, run in runs.items():
            row[f"{path}_ms"] = statistics.median(row[f"{path}_ms_rounds"])
            row[f"{path}_enqueue_us"] = bk.enqueue_us(run) if n == ENQUEUE_TOKENS else None
        for path, out in outs.items():  # a sanity check; the verdicts are the tests'
            row[f"{path}_diff"] = (out.float() - outs["triton"].float()).abs().max().item()
        row["max_abs_diff"] = max(row[f"{path}_diff"] for path in outs)
        row["vllm_issue_ms"] = bk.VLLM_MS.get((n, queries)) if layout is not None else None
        vllm_ms = row.get("vllm_ms", row["vllm_issue_ms"])
        line = f"{layout_name} {n} q{queries} P{page}:"
        for path, *_ in paths:
            row[f"vllm_over_{path}"] = vllm_ms / row[f"{path}_ms"] if vllm_ms else None
            ms, us = row[f"{path}_ms"], row[f"{path}_enqueue_us"]
            line += f" {path} {ms:.3f} ms ({p.tflops(ms):.0f} TF/s" + (f", {us:.0f} us)" if us else ")")
        print(
            line + f" diff {row['max_abs_diff']:.1e} vllm {vllm_ms} (int32 CSR {row.get('vllm_int32_ms')}, "
            f"issue {row['vllm_issue_ms']})",
            flush=True,
        )
        measured.append(row)
        save(measured)
    bk.PAGE_SIZE = 16
    return measured


DURATION_QUERIES = (8192, 4096, 2048, 832)  # the 8k Phi-3 rows
DURATION_RUNS = 20


def durations(save, paths, vllm=None) -> list[dict]:
    """At the 8k Phi-3 rows, each path's do_bench time beside its kernels' own durations (the
    profiler's, medians of DURATION_RUNS runs, L2 flushed before each as do_bench does): what the
    timing adds to a kernel, for ours and for vLLM's (`vllm`: its directory)."""
    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(hopper_timeline.L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    rows = []
    n, layout = 8192, bk.phi3_layout()
    for queries in DURATION_QUERIES:
        p = bk.Prefill(n, queries, layout, gen)
        _, runs = path_runs(p, n, layout, paths, vllm, {"vllm": torch.int64})
        row = {"n": n, "queries": queries}
        for path, run in runs.items():
            run()
            row[f"{path}_ms"] = bk.bench(run)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(DURATION_RUNS):
                    flush.zero_()
                    run()
                torch.cuda.synchronize()
            kernels: dict = {}
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
            row[f"{path}_kernels_us"] = {
                name: statistics.median(us) for name, us in kernels.items() if len(us) >= DURATION_RUNS
            }
        print(row, flush=True)
        rows.append(row)
        save(rows)
    return rows


def host_parts(save, paths) -> list[dict]:
    """Host µs per call (medians) at 8k tokens: each path's whole run, and of the Hopper path's the
    host-made descriptors a run builds (two) and its lookup of their encoded maps (`launcher_args`,
    two; Triton's launcher would encode each, `make_tensordesc_arg`)."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    p = bk.Prefill(8192, 8192, bk.phi3_layout(), torch.Generator().manual_seed(0))
    row = {}
    for path, package, on, settings in paths:
        with hopper_path(on, package, **settings) as prefill:
            plan = prefill.plan_prefill(*p.args(), scale=bk.SCALE, layout=p.layout)
            row[f"{path}_run_us"] = bk.enqueue_us(functools.partial(plan.run, p.q, p.k, p.v))
        if path == "hopper":
            hopper = plan
    (compiled,) = hopper.hopper.compiled.values()
    meta = compiled.metadata.tensordesc_meta[0]
    desc = hopper.descriptors(p.k)
    row["descriptors_us"] = bk.enqueue_us(lambda: (hopper.descriptors(p.k), hopper.descriptors(p.v)))
    row["encoded_us"] = bk.enqueue_us(lambda: (desc.launcher_args(meta), desc.launcher_args(meta)))
    row["triton_encode_us"] = bk.enqueue_us(
        lambda: (make_tensordesc_arg(desc, meta), make_tensordesc_arg(desc, meta))
    )
    print(" ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    save([row])
    return [row]


def profile(save, paths) -> list[dict]:
    """One run of each path on the 8k Phi-3 prefill, for ncu (-k regex:prefill_kernel)."""
    p = bk.Prefill(8192, 8192, bk.phi3_layout(), torch.Generator().manual_seed(0))
    for _, package, on, settings in paths:
        with hopper_path(on, package, **settings) as prefill:
            prefill.plan_prefill(*p.args(), scale=bk.SCALE, layout=p.layout).run(p.q, p.k, p.v)
    torch.cuda.synchronize()
    return []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--only", default="times")
    parser.add_argument(
        "--variants", nargs="?", const="all", help="also the kernel's VARIANTS (all, or NAME,NAME...)"
    )
    parser.add_argument("--previous", type=pathlib.Path, help="a directory holding kernels_prev")
    parser.add_argument(
        "--vllm", type=pathlib.Path, help="times: vLLM's kernel, reports.vllm_baseline --fetch DIR"
    )
    parser.add_argument("--rounds", type=int, default=1, help="times: each path timed this many times")
    parser.add_argument("--max-tokens", type=int, help="times: only the rows of at most this many tokens")
    parser.add_argument("--min-tokens", type=int, help="times: only the rows of at least this many tokens")
    parser.add_argument(
        "--rows", choices=ROWS, default="issue", help="times, timeline: issue 16's rows, the engine's"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = set(args.variants.split(",")) if args.variants not in (None, "all") else None
    paths = PATHS + [v for v in VARIANTS if args.variants and (wanted is None or v[0] in wanted)]
    if args.previous:
        sys.path.insert(0, str(args.previous))
        paths.append(PREVIOUS)
    result = {"device": torch.cuda.get_device_name(), "paths": [path[0] for path in paths]}

    def save(part, rows):
        result[part] = rows
        (args.out / "hopper-ab.json").write_text(json.dumps(result, indent=1))

    timed = functools.partial(
        times,
        rounds=args.rounds,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        vllm=args.vllm,
        rows=ROWS[args.rows],
    )
    parts = {
        "times": timed,
        "profile": profile,
        "host": host_parts,
        "timeline": functools.partial(
            hopper_timeline.timeline,
            rows=hopper_timeline.ROWS if args.rows == "issue" else [row[:3] for row in ROWS[args.rows]],
        ),
        "durations": functools.partial(durations, vllm=args.vllm),
    }
    for part in args.only.split(","):
        save(part, parts[part](functools.partial(save, part), paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
