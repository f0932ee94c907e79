"""Rendering of the accuracy report (reports/accuracy.py): the markdown page and its PNG curves."""

import math
import pathlib
import platform

import torch


def plot_title(file_name: str) -> str:
    """ "seq_len-dense.png" -> "Error against sequence length, dense layout"."""
    sweep, family = file_name.removesuffix(".png").split("-", 1)
    return f"Error against {CURVE_NAMES[sweep]}, {family} layout"


CURVE_NAMES = {"seq_len": "sequence length", "sparsity": "sparsity", "prefix_share": "cached-prefix share"}
CURVE_TITLES = {
    "seq_len": ("sequence length (tokens, no cached prefix)", True),
    "sparsity": ("share of causal blocks kept (random block mask)", False),
    "prefix_share": ("cached-prefix share of the sequence (context / length)", False),
}


def plot_curves(curve_data: dict, folder: pathlib.Path, p, where: str, footnote: str) -> list[str]:
    from reports.plots import error_curves

    files = []
    for sweep, series in curve_data.items():
        for family, entry in series.items():
            name = f"{sweep}-{family}.png"
            xlabel, logx = CURVE_TITLES[sweep]
            error_curves(
                folder / name,
                title=f"paged_prefill, {family} layout, {p.curve_dtype}, on {where}",
                xlabel=xlabel,
                xs=entry["x"],
                series=entry["backends"],
                base=entry["base"],
                footnote=footnote,
                logx=logx,
            )
            files.append(name)
    return files


def _fmt(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        return f"{x:.{digits}g}" if x == 0 or 1e-3 <= abs(x) < 1e4 else f"{x:.{digits - 1}e}"
    return str(x)


def verdict(row: dict) -> str:
    if "cases" not in row:
        return row["error"]
    return "pass" if row["passed"] else "**FAIL**"


COLUMNS = (
    "operator | layout | dtype | backend | verdict | max abs err | mean abs err | max / base | mean / base "
    "| gate (<=1) | lse gate | max ULP | over tol | NaN/Inf"
)


def table(rows: list[dict]) -> list[str]:
    lines = [f"| {COLUMNS} |", "|" + "---|" * (COLUMNS.count("|") + 1)]
    for r in rows:
        head = f"| {r['operator']} | {r['layout']} | {r['dtype']} | {r['backend']} | {verdict(r)} |"
        if "cases" not in r:
            lines.append(head + " - |" * 9)
            continue
        cells = [
            r["max_err"],
            r["mean_err"],
            r["max_to_base"],
            r["mean_to_base"],
            r["gate"],
            r.get("lse_gate"),
        ]
        cells = [_fmt(c) for c in cells] + [
            _fmt(r["max_ulp"]),
            f"{r['over_share']:.2%}",
            f"{r['nan']}/{r['inf']}",
        ]
        lines.append(head + "".join(f" {c} |" for c in cells))
    return lines


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}), Triton interpreter (TRITON_INTERPRET=1)"


def versions() -> dict:
    from fuzz.case_file import versions as v

    return v()


def markdown(meta: dict, rows: list[dict], plots: list[str], p) -> str:
    shown = [r for r in rows if not r.get("error", "").startswith("n/a")]
    kernel = [r for r in shown if r["backend"] == "triton"]
    other = [r for r in shown if r["backend"] != "triton"]
    fails = [r for r in kernel if not r.get("passed")]
    other_fails = [r for r in other if not r.get("passed")]
    v = meta["versions"]
    lines = [
        f"# Accuracy report: {meta['device_name']}",
        "",
        f"Every number and figure here comes from **{meta['device_name']}**; torch {v['torch']}, triton "
        f"{v['triton']}, Python {v['python']}; generated {meta['generated']} in {meta['elapsed_s']:.0f} s by "
        f"`{meta['command']}`. JSON twin: `accuracy.json`.",
        "",
        f"**Verdict: {len(kernel) - len(fails)} of {len(kernel)} Triton kernel rows pass SPEC section 5's "
        "rule**"
        + (f" (failing or crashing: {', '.join(_row_name(r) for r in fails)})" if fails else "")
        + f"; comparison backends: {len(other) - len(other_fails)} of {len(other)} rows pass."
        + (f" Unavailable backends: {meta['unavailable']}." if meta["unavailable"] else ""),
        "",
        "How to read it: `ref` is the float64 oracle, `base` the same oracle computed in the input dtype. "
        "*max / base* and *mean / base* are max|out-ref| / max|base-ref| and the same for the means; a row "
        "passes when max err <= 2 x base max err + floor and mean err <= 1.5 x base mean err + floor, i.e. "
        "*gate* <= 1 (worst case of the row; *lse gate* is the same test on the log-sum-exp). *max ULP*: "
        "distance to the oracle rounded to the output dtype, where |ref| >= 2^-10 max|ref|. *over tol*: "
        "share of elements over the allowed max. Each row aggregates 3 batches (worst case for ratios, "
        "element-weighted mean error).",
        "",
        "## Summary: Triton kernels",
        "",
        *table(kernel),
        "",
        "## Comparison backends (the same columns)",
        "",
        "`sdpa`: torch scaled_dot_product_attention over gathered K/V, dense only, no lse. `flex`: "
        "FlexAttention, eager (uncompiled), with a mask_mod reproducing each layout.",
        "",
        *table(other),
        "",
        "## Error curves (paged_prefill)",
        "",
        "Left: max |out - ref| per backend, with the same-dtype oracle dashed; right: its ratio to that "
        "oracle (SPEC section 5 allows 2x). Points at 0 error are not drawn on the log axes (see the JSON).",
        "",
        *[line for name in plots for line in (f"### {plot_title(name)}", "", f"![{name}]({name})", "")],
        "",
        "## Cases",
        "",
        f"Heads {p.num_heads} (KV heads {p.num_kv_heads}), head_dim {p.head_dim}, page size {p.page_size}, "
        f"sparse block {p.block_size}; local_strided: {p.local_blocks} local blocks, vertical stride "
        f"{p.vert_stride}, per-head columns; block_mask: random, density {p.block_mask_density}. Batches "
        f"(sequence lengths / cached contexts): "
        + "; ".join(f"{lens} / {ctx}" for lens, ctx in p.batches)
        + ". paged_decode uses the same sequences with one query each. Inputs: randn, scale 1, "
        "pages scattered over the cache, unused slots NaN.",
    ]
    if meta["device"] == "cpu":
        lines += [
            "",
            "bfloat16 Triton rows are not run on the CPU: Triton's interpreter computes bfloat16 on raw bits "
            "(TRITON-CPU.md); the GPU report has them.",
        ]
    return "\n".join(lines) + "\n"


def _row_name(r: dict) -> str:
    return f"{r['operator']}/{r['layout']}/{r['dtype']}"
