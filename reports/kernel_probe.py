"""Where the kernels spend their time (GPU only): variants and an A/B timed in one process.

`python3 -m reports.kernel_probe [--out DIR] [--previous .ab]` times the planned path (launch only;
metadata planned outside the timed region) and the public op of the working tree's kernels, the
previous commit's kernels (`--previous`, prepared by reports/previous_kernels.sh) at the same
points, register-capped variants, and profiles the op's host path (cProfile). It writes
kernel-probe.md / .json; it guides kernel changes, while the targets live in bench_kernels.py.
"""

import argparse
import cProfile
import importlib
import io
import json
import pathlib
import pstats
import sys

import torch
import triton

import kernels
import reference as ref

prefill_module = importlib.import_module("kernels.paged_prefill")
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = 1.0 / 128
WARMUP_MS, REP_MS = 25, 100
REGISTER_CAPS = (168, 192)
# Sparse prefill (BLOCK_M, BLOCK_N, num_warps, num_stages) tried beside the chosen one: the tile lists
# make sparse and dense the same loop, so the dense configs are candidates too.
PREFILL_SWEEP = ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3))
DECODE_SWEEP = ((64, 2, 3), (64, 4, 3), (128, 4, 3), (32, 2, 3))
DENSE_SWEEP = ((128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2))
common = importlib.import_module("kernels._common")
decode_module = importlib.import_module("kernels.paged_decode")


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def layout():
    return ref.LocalStridedLayout(64, 16, 8, num_heads_total=HEADS)


def prefill_inputs(n, queries, gen, batch=1):
    pages = n // PAGE
    order = torch.randperm(pages * batch, generator=gen).cuda()
    k = torch.randn(pages * batch, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    tables = order.view(batch, pages).to(torch.int32)
    q = torch.randn(queries * batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    seq_lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * queries
    return q, k, v, tables, seq_lens, qsl


def prefill_row(n, queries, lay, name, previous, gen) -> dict:
    q, k, v, t, sl, qsl = prefill_inputs(n, queries, gen)
    plan = kernels.plan_prefill(q, k, v, t, sl, qsl, scale=SCALE, layout=lay)
    row = dict(what=f"prefill {name} {n} tokens, {queries} queries", planned=bench(lambda: plan.run(q, k, v)))
    row["op"] = bench(lambda: kernels.paged_prefill(q, k, v, t, sl, qsl, scale=SCALE, layout=lay))
    if previous is not None:
        module = importlib.import_module("kernels_prev.paged_prefill")
        old_plan = module.plan_prefill(q, k, v, t, sl, qsl, scale=SCALE, layout=lay)
        row["previous"] = bench(lambda: old_plan.run(q, k, v))
        new, old = plan.run(q, k, v), old_plan.run(q, k, v)
        row["max_diff_vs_previous"] = float((new.float() - old.float()).abs().max())
    if queries in (8192, 832):
        row |= sweep_prefill(q, k, v, t, sl, qsl, lay)
    if name == "phi3" and queries == n == 8192:
        for cap in REGISTER_CAPS:
            prefill_module.MAX_REGISTERS = cap
            capped = kernels.plan_prefill(q, k, v, t, sl, qsl, scale=SCALE, layout=lay)
            row[f"planned_maxnreg_{cap}"] = bench(lambda capped=capped: capped.run(q, k, v))
        prefill_module.MAX_REGISTERS = None
    print(row, flush=True)
    return row


def runtime_page_size(page_size: int, block_n: int) -> int:
    """page_size_constexpr with the page size left to a runtime division (no shift-and-mask variant)."""
    return block_n if page_size % block_n == 0 else 0


def sweep_prefill(q, k, v, t, sl, qsl, lay) -> dict:
    """Planned times of the prefill (sparse or dense) under each config of its sweep, and with the page
    size a runtime division (same process, same inputs)."""
    key = (lay is None, True)
    row, chosen = {}, prefill_module.CONFIGS_GPU[key]
    try:
        for cfg in PREFILL_SWEEP if lay is not None else DENSE_SWEEP:
            prefill_module.CONFIGS_GPU[key] = cfg
            plan = kernels.plan_prefill(q, k, v, t, sl, qsl, scale=SCALE, layout=lay)
            row["planned_" + "x".join(map(str, cfg))] = bench(lambda plan=plan: plan.run(q, k, v))
        prefill_module.CONFIGS_GPU[key] = chosen
        pages, common.page_size_constexpr = common.page_size_constexpr, runtime_page_size
        try:
            plan = kernels.plan_prefill(q, k, v, t, sl, qsl, scale=SCALE, layout=lay)
            row["planned_runtime_page_size"] = bench(lambda: plan.run(q, k, v))
        finally:
            common.page_size_constexpr = pages
    finally:
        prefill_module.CONFIGS_GPU[key] = chosen
    return row


def sweep_decode(q, k, v, t, sl, lay) -> dict:
    """Planned decode times under each DECODE_SWEEP config (BLOCK_N, warps, stages)."""
    row, chosen = {}, decode_module.CONFIG_GPU
    try:
        for cfg in DECODE_SWEEP:
            decode_module.CONFIG_GPU = cfg
            plan = kernels.plan_decode(q, k, v, t, sl, scale=SCALE, layout=lay)
            row["planned_" + "x".join(map(str, cfg))] = bench(lambda plan=plan: plan.run(q, k, v))
    finally:
        decode_module.CONFIG_GPU = chosen
    return row


def decode_row(lay, name, previous, gen) -> dict:
    q, k, v, t, sl, _ = prefill_inputs(8192, 1, gen, batch=64)
    plan = kernels.plan_decode(q, k, v, t, sl, scale=SCALE, layout=lay)
    row = dict(what=f"decode {name} B64 8k", planned=bench(lambda: plan.run(q, k, v)))
    row["op"] = bench(lambda: kernels.paged_decode(q, k, v, t, sl, scale=SCALE, layout=lay))
    row |= sweep_decode(q, k, v, t, sl, lay)
    if previous is not None:
        module = importlib.import_module("kernels_prev.paged_decode")
        old_plan = module.plan_decode(q, k, v, t, sl, scale=SCALE, layout=lay)
        row["previous"] = bench(lambda: old_plan.run(q, k, v))
    print(row, flush=True)
    return row


def profile_one(lay, decode, gen, text) -> None:
    q, k, v, t, sl, qsl = prefill_inputs(8192, 1 if decode else 8192, gen, batch=64 if decode else 1)

    def call():
        if decode:
            return kernels.paged_decode(q, k, v, t, sl, scale=SCALE, layout=lay)
        return kernels.paged_prefill(q, k, v, t, sl, qsl, scale=SCALE, layout=lay)

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(30):
        call()
    torch.cuda.synchronize()
    profile.disable()
    text.write(f"\n## {'decode B64' if decode else 'prefill'} {'phi3' if lay else 'dense'} 8k, 30 calls\n")
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("reports/gpu"))
    parser.add_argument("--previous", type=pathlib.Path, default=None, help="folder holding kernels_prev")
    args = parser.parse_args(argv)
    if args.previous is not None:
        sys.path.insert(0, str(args.previous.resolve()))
    gen = torch.Generator().manual_seed(0)
    rows = [
        prefill_row(n, queries, lay, name, args.previous, gen)
        for n, queries, lay, name in (
            (8192, 8192, layout(), "phi3"),
            (8192, 832, layout(), "phi3"),
            (32768, 32768, layout(), "phi3"),
            (8192, 8192, None, "dense"),
        )
    ]
    rows += [decode_row(lay, name, args.previous, gen) for lay, name in ((None, "dense"), (layout(), "phi3"))]
    profile = io.StringIO()
    for lay, decode in ((layout(), False), (layout(), True), (None, True)):
        profile_one(lay, decode, gen, profile)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel-probe.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "kernel-probe-host.txt").write_text(profile.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
