"""Where the kernels spend their time (GPU only): variants and A/Bs timed in one process.

`python3 -m reports.kernel_probe [--out DIR] [--previous .ab] [--only enqueue,decode,prefill]` times
the planned path (`plan.run`, metadata planned outside the timed region) of the working tree's
kernels against
    enqueue   Triton's own launch path (`BoundLaunch.direct` off) on the same plans, host µs a call,
              and a cProfile of the planned runs;
    decode    the previous commit's kernels (`--previous`, from reports/previous_kernels.sh), configs
              and split counts, at batch 64;
    prefill   configs, page sizes and diagnostic variants: copies of kernels/ with one edit each
              (`variant`), e.g. without the NaN rule's FMA, to price a line (never shipped).
It writes kernel-probe.json (and kernel-probe-host.txt); it guides kernel changes, while the targets
live in reports/bench_kernels.py.
"""

import argparse
import cProfile
import importlib
import io
import json
import pathlib
import pstats
import shutil
import sys
import tempfile

import torch

import kernels
import reference as ref
from reports.bench_kernels import bench, enqueue_us

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = 1.0 / 128
common = importlib.import_module("kernels._common")
prefill_module = importlib.import_module("kernels.paged_prefill")
decode_module = importlib.import_module("kernels.paged_decode")
# Sparse prefill (BLOCK_M, BLOCK_N, num_warps, num_stages) tried beside the chosen one.
PREFILL_SWEEP = (
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 64, 8, 2),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (64, 32, 4, 3),
)
PREFILL_PAGES = (64, 256)
# Decode (BLOCK_N, warps, stages) and programs per SM (the split count), Phi-3 and dense.
DECODE_SWEEP = ((64, 2, 3), (64, 2, 4), (32, 2, 3), (64, 4, 3), (32, 1, 3))
DECODE_PROGRAMS = (8, 24, 32, 48)
DECODE_MIN_SPLIT_KEYS = (128, 512)
# Diagnostic variants of kernels/_common.py: name -> (old text, new text).
VARIANTS = {
    "no_nan_fma": ("        b_s = b_s + b_s * 0.0\n", ""),
    "scale_in_one_ffma": (
        "b_p = tl.exp2(((b_s - b_m_new[:, None]) * qk_scale).to(tl.float32))",
        "b_p = tl.exp2((b_s * qk_scale - (b_m_new * qk_scale)[:, None]).to(tl.float32))",
    ),
}


def layout():
    return ref.LocalStridedLayout(64, 16, 8, num_heads_total=HEADS)


def variant(name: str, root: pathlib.Path):
    """The package `kernels_<name>`: a copy of kernels/ with VARIANTS[name] applied to _common.py."""
    old, new = VARIANTS[name]
    dest = root / f"kernels_{name}"
    shutil.copytree(pathlib.Path(kernels.__file__).parent, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for path in dest.glob("*.py"):
        text = path.read_text().replace("from kernels.", f"from kernels_{name}.")
        text = text.replace("from kernels import", f"from kernels_{name} import")
        if path.name == "_common.py":
            if old not in text:
                raise ValueError(f"variant {name}: text not found")
            text = text.replace(old, new)
        path.write_text(text)
    return importlib.import_module(f"kernels_{name}")


def inputs(n, queries, gen, batch=1, page=PAGE):
    pages = n // page
    order = torch.randperm(pages * batch, generator=gen).cuda()
    k = torch.randn(pages * batch, page, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    tables = order.view(batch, pages).to(torch.int32)
    q = torch.randn(queries * batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    seq_lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * queries
    return q, k, v, tables, seq_lens, qsl


def time_run(plan, q, k, v) -> float:
    """Median ms of plan.run(q, k, v)."""
    return bench(lambda: plan.run(q, k, v))


def registers(plan, *per_run) -> str:
    """'regs/spills' of the plan's compiled kernel (a cache hit of Triton's own launch path)."""
    launch = plan.launch or plan.triton_launch()
    compiled = launch.kernel[launch.grid](*per_run, **launch.planned)
    return f"{compiled.n_regs}/{compiled.n_spills}"


def prefill_args(plan, q, k, v):
    """The per-run tensors plan.run hands its kernel."""
    out, lse = plan.inputs.outputs()
    q_in, k_in, v_in = plan.inputs(q, k, v)
    return (q_in, out, lse, k_in, v_in)


def enqueue_rows(gen, profile_text) -> list[dict]:
    return [
        enqueue_row(what, n, queries, lay, decode, gen, profile_text)
        for what, n, queries, lay, decode in (
            ("prefill phi3 8k", 8192, 8192, layout(), False),
            ("prefill phi3 8k, 832 queries", 8192, 832, layout(), False),
            ("decode dense B64 8k", 8192, 1, None, True),
            ("decode phi3 B64 8k", 8192, 1, layout(), True),
        )
    ]


def enqueue_row(what, n, queries, lay, decode, gen, profile_text) -> dict:
    """Host µs of a planned run with the direct launch and with Triton's own, and of the op."""
    q, k, v, t, sl, qsl = inputs(n, queries, gen, batch=64 if decode else 1)
    if decode:
        plan = kernels.plan_decode(q, k, v, t, sl, scale=SCALE, layout=lay)
        launches = (plan.launch, plan.reduce)

        def op():
            return kernels.paged_decode(q, k, v, t, sl, scale=SCALE, layout=lay)
    else:
        plan = kernels.plan_prefill(q, k, v, t, sl, qsl, scale=SCALE, layout=lay)
        launches = (plan.hopper or plan.launch,)

        def op():
            return kernels.paged_prefill(q, k, v, t, sl, qsl, scale=SCALE, layout=lay)

    def run():
        return plan.run(q, k, v)

    def outputs():
        return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(q.shape[:2], device=q.device)

    row = dict(what=what, direct_us=enqueue_us(run), op_us=enqueue_us(op))
    # Beside the launches: two allocations (out and lse; a run without return_lse now makes only the
    # first, lse going to plan scratch) and the guard's check.
    row["outputs_us"] = enqueue_us(outputs)
    row["guard_us"] = enqueue_us(lambda: plan.guard.check(q=q, k_cache=k, v_cache=v))
    want = run()
    for launch in launches:
        launch.direct = False
    row["triton_launch_us"] = enqueue_us(run)
    row["same_result"] = torch.equal(want, run())
    for launch in launches:
        launch.direct = True
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    profile.enable()
    for _ in range(200):
        run()
    profile.disable()
    torch.cuda.synchronize()
    profile_text.write(f"\n## {what}: 200 planned runs, direct launch\n")
    pstats.Stats(profile, stream=profile_text).sort_stats("tottime").print_stats(12)
    print(row, flush=True)
    return row


def decode_rows(previous, gen) -> list[dict]:
    rows = []
    for what, n, lay in (
        ("phi3 8k", 8192, layout()),
        ("phi3 32k", 32768, layout()),
        ("dense 8k", 8192, None),
    ):
        q, k, v, t, sl, _ = inputs(n, 1, gen, batch=64)
        plan = kernels.plan_decode(q, k, v, t, sl, scale=SCALE, layout=lay)
        row = dict(what=f"decode {what} B64", planned=time_run(plan, q, k, v))
        row["splits"] = plan.num_splits
        if previous is not None:
            old = importlib.import_module("kernels_prev.paged_decode").plan_decode(
                q, k, v, t, sl, scale=SCALE, layout=lay
            )
            row["previous"] = time_run(old, q, k, v)
            row["max_diff_vs_previous"] = float(
                (plan.run(q, k, v).float() - old.run(q, k, v).float()).abs().max()
            )
        chosen = decode_module.CONFIG_GPU, decode_module.PROGRAMS_PER_SM, decode_module.MIN_SPLIT_KEYS
        try:
            for cfg in DECODE_SWEEP:
                decode_module.CONFIG_GPU = cfg
                p = kernels.plan_decode(q, k, v, t, sl, scale=SCALE, layout=lay)
                row["cfg_" + "x".join(map(str, cfg))] = time_run(p, q, k, v)
            decode_module.CONFIG_GPU = chosen[0]
            for programs in DECODE_PROGRAMS:
                decode_module.PROGRAMS_PER_SM = programs
                p = kernels.plan_decode(q, k, v, t, sl, scale=SCALE, layout=lay)
                row[f"programs_{programs}"] = (time_run(p, q, k, v), p.num_splits)
            decode_module.PROGRAMS_PER_SM = chosen[1]
            for keys in DECODE_MIN_SPLIT_KEYS:
                decode_module.MIN_SPLIT_KEYS = keys
                p = kernels.plan_decode(q, k, v, t, sl, scale=SCALE, layout=lay)
                row[f"min_split_keys_{keys}"] = (time_run(p, q, k, v), p.num_splits)
        finally:
            decode_module.CONFIG_GPU, decode_module.PROGRAMS_PER_SM, decode_module.MIN_SPLIT_KEYS = chosen
        rows.append(row)
        print(row, flush=True)
        del q, k, v
    return rows


def prefill_rows(gen, root) -> list[dict]:
    rows = []
    variants = {name: variant(name, root) for name in VARIANTS}
    for n, queries in ((8192, 8192), (8192, 832), (32768, 32768)):
        q, k, v, t, sl, qsl = inputs(n, queries, gen)
        lay = layout()
        plan = kernels.plan_prefill(q, k, v, t, sl, qsl, scale=SCALE, layout=lay)
        want = plan.run(q, k, v)
        row = dict(what=f"prefill phi3 {n} tokens, {queries} queries", planned=time_run(plan, q, k, v))
        row["regs"] = registers(plan, *prefill_args(plan, q, k, v))
        for name, module in variants.items():
            p = module.plan_prefill(q, k, v, t, sl, qsl, scale=SCALE, layout=lay)
            row[f"variant_{name}"] = time_run(p, q, k, v)
            row[f"variant_{name}_max_diff"] = float((p.run(q, k, v).float() - want.float()).abs().max())
        key = (False, True)
        chosen = prefill_module.CONFIGS_GPU[key]
        try:
            for cfg in PREFILL_SWEEP if n == 8192 else PREFILL_SWEEP[:4]:
                prefill_module.CONFIGS_GPU[key] = cfg
                p = kernels.plan_prefill(q, k, v, t, sl, qsl, scale=SCALE, layout=lay)
                name = "cfg_" + "x".join(map(str, cfg))
                row[name] = time_run(p, q, k, v)
                row[name + "_regs"] = registers(p, *prefill_args(p, q, k, v))
        finally:
            prefill_module.CONFIGS_GPU[key] = chosen
        del k, v
        for page in PREFILL_PAGES:
            _, k2, v2, t2, sl2, qsl2 = inputs(n, queries, gen, page=page)
            p = kernels.plan_prefill(q, k2, v2, t2, sl2, qsl2, scale=SCALE, layout=lay)
            row[f"page_{page}"] = time_run(p, q, k2, v2)
            del k2, v2
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("reports/gpu"))
    parser.add_argument("--previous", type=pathlib.Path, default=None, help="folder holding kernels_prev")
    parser.add_argument("--only", default="enqueue,decode,prefill")
    args = parser.parse_args(argv)
    if args.previous is not None:
        sys.path.insert(0, str(args.previous.resolve()))
    root = pathlib.Path(tempfile.mkdtemp(prefix="kernel-variants-"))
    sys.path.insert(0, str(root))
    gen = torch.Generator().manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    result, profile = {}, io.StringIO()
    for part in args.only.split(","):
        if part == "enqueue":
            result[part] = enqueue_rows(gen, profile)
        elif part == "decode":
            result[part] = decode_rows(args.previous, gen)
        elif part == "prefill":
            result[part] = prefill_rows(gen, root)
        else:
            raise SystemExit(f"unknown part {part!r}")
        (args.out / "kernel-probe.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "kernel-probe-host.txt").write_text(profile.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
