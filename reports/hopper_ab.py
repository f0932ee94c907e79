"""Same-process A/B of the planned prefill's Hopper path (kernels/hopper_prefill.py) against the Triton
kernel it replaces on sm_90 (GPU only).

`python3 -m reports.hopper_ab --out DIR [--only times,profile]`: the planned times of both paths
on rows of the kernel benchmark (reports/bench_kernels.py),
in one process; `profile` runs each path once on the 8k Phi-3 prefill, for ncu. Writes hopper-ab.json
under DIR and prints a table. The Hopper path's verdicts: tests/kernels/test_hopper_prefill.py.
"""

import argparse
import contextlib
import functools
import importlib
import json
import pathlib
import sys

import torch

from reports import bench_kernels as bk

hopper = importlib.import_module("kernels.hopper_prefill")
prefill = importlib.import_module("kernels.paged_prefill")


@contextlib.contextmanager
def hopper_path(enabled: bool, **settings):
    """Within the block, plans take the Hopper path iff `enabled` (and the call supports it), with
    these module settings of kernels/hopper_prefill.py (STAGES, CONSUMER_REGISTERS, ...)."""
    settings["ENABLED"] = enabled
    original = {name: getattr(hopper, name) for name in settings}
    for name, value in settings.items():
        setattr(hopper, name, value)
    prefill._LAST_PLAN.last = None  # the op's remembered plan would keep the other path
    try:
        yield
    finally:
        for name, value in original.items():
            setattr(hopper, name, value)


# (name, takes the Hopper path, settings of kernels/hopper_prefill.py)
PATHS = (
    ("hopper", True, {}),
    ("triton", False, {}),
)
# (tokens, queries, layout, page size): the rows (reports/bench_kernels.py's VLLM_MS), with pages
# of 64 and dense causal at 8k before the slow 128k rows.
PHI3_ROWS = [(n, q, "phi3", 16) for n, q in bk.VLLM_MS]
TIME_ROWS = (
    [row for row in PHI3_ROWS if row[0] < 131072]
    + [(8192, 8192, "phi3", 64), (8192, 8192, "dense", 16)]
    + [row for row in PHI3_ROWS if row[0] >= 131072]
)


def times(save) -> list[dict]:
    """The rows' times; `save(rows)` after each row (a run cut short keeps what it measured)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, queries, layout_name, page in TIME_ROWS:
        layout = bk.phi3_layout() if layout_name == "phi3" else None
        bk.PAGE_SIZE = page
        p = bk.Prefill(n, queries, layout, gen)
        row = {"n": n, "queries": queries, "layout": layout_name, "page": page}
        outs = {}
        for path, on, settings in PATHS:
            with hopper_path(on, **settings):
                plan = prefill.plan_prefill(*p.args(), scale=bk.SCALE, layout=layout)
            row[f"{path}_took_hopper"] = plan.hopper is not None
            run = functools.partial(plan.run, p.q, p.k, p.v)
            outs[path] = run()
            row[f"{path}_ms"] = bk.bench(run)
            row[f"{path}_enqueue_us"] = bk.enqueue_us(run)
        row["max_abs_diff"] = max((outs[k].float() - outs["triton"].float()).abs().max().item() for k in outs)
        vllm = bk.VLLM_MS.get((n, queries)) if layout is not None else None
        line = f"{layout_name} {n} q{queries} P{page}:"
        for path, _, _ in PATHS:
            row[f"vllm_over_{path}"] = vllm / row[f"{path}_ms"] if vllm else None
            ms, us = row[f"{path}_ms"], row[f"{path}_enqueue_us"]
            line += f" {path} {ms:.3f} ms ({p.tflops(ms):.0f} TF/s, {us:.0f} us)"
        print(line + f" diff {row['max_abs_diff']:.1e} vllm {vllm}", flush=True)
        rows.append(row)
        save(rows)
    bk.PAGE_SIZE = 16
    return rows


def profile(save) -> list[dict]:
    """One run of each path on the 8k Phi-3 prefill, for ncu (-k regex:prefill_kernel)."""
    p = bk.Prefill(8192, 8192, bk.phi3_layout(), torch.Generator().manual_seed(0))
    for on in (True, False):
        with hopper_path(on):
            prefill.plan_prefill(*p.args(), scale=bk.SCALE, layout=p.layout).run(p.q, p.k, p.v)
    torch.cuda.synchronize()
    return []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--only", default="times")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name()}

    def save(part, rows):
        result[part] = rows
        (args.out / "hopper-ab.json").write_text(json.dumps(result, indent=1))

    for part in args.only.split(","):
        save(part, {"times": times, "profile": profile}[part](functools.partial(save, part)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
