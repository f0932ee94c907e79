"""The markdown page of the accuracy report (reports/accuracy.py); the PNG curves are reports/plots.py's.

Section numbers (contract §5) are those of docs/contract.md, the suite's own statement of what it checks.
"""

import math
from collections import Counter

from harness.cases import PADDING_SLOT_SHARE
from harness.tolerance import LAMBDA
from reports.accuracy_measure import NOT_PROVIDED, ULP_MAGNITUDE_CUTOFF
from reports.plots import plot_title

MESSAGE_CHARS = 400  # failure messages are cut here; the JSON twin keeps them whole
COLUMNS = (
    "operator | layout | dtype | verdict | cases judged | max abs err | mean abs err | max gate "
    "| mean gate | gate (<=1) | lse gate | max ULP | over tol | NaN/Inf"
)
FLEX_NOTE = (
    "**FlexAttention on CUDA, torch 2.11.** torch 2.11's FlexAttention had a bug on CUDA: its internal "
    "compile reused a cached graph whose mask function took an integer default argument, so an old "
    "block count stayed baked in and later calls at other lengths went wrong "
    "([pytorch issue 178365](https://github.com/pytorch/pytorch/issues/178365)). A fresh process "
    "passed at 4096 tokens, and the order of calls decided which lengths failed. The suite's flex adapter "
    "(`backends/comparison.py`) writes its mask functions without default arguments (they capture their "
    "values in closures), so it is not hit; `tests/harness/test_comparison.py` fails if the pattern comes "
    "back. If you call FlexAttention yourself on torch 2.11, do not give a `mask_mod` default arguments."
)


def cell(row: dict) -> str:
    """A row's verdict in one cell: pass, **FAIL**, unsupported, or "-" (operator not provided)."""
    status, judged = row["status"], row["passed"] + row["failed"]
    if status == NOT_PROVIDED:
        return "-"
    if status == "unsupported":
        return "unsupported"
    if status == "failed":
        text = f"**FAIL** ({row['failed']} of {judged})" if judged > 1 else "**FAIL**"
    else:
        text = "pass"
    return text + (f", {row['unsupported']} unsupported" if row["unsupported"] else "")


def implementation_verdict(rows: list[dict]) -> dict:
    """One implementation's verdict over its rows: FAIL if any case failed, pass if any passed."""
    counts = {k: sum(r[k] for r in rows) for k in ("passed", "failed", "unsupported")}
    verdict = "**FAIL**" if counts["failed"] else "pass" if counts["passed"] else "unsupported"
    return counts | {"verdict": verdict}


def _fmt(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        return f"{x:.{digits}g}" if x == 0 or 1e-3 <= abs(x) < 1e4 else f"{x:.{digits - 1}e}"
    return str(x)


def table(rows: list[dict]) -> list[str]:
    """The columns of one implementation's judged rows, as markdown table lines."""
    lines = [f"| {COLUMNS} |", "|" + "---|" * (COLUMNS.count("|") + 1)]
    for r in rows:
        nan_inf = "-" if r.get("nan") is None else f"{r['nan']}/{r['inf']}"
        cells = [
            r["operator"],
            r["layout"],
            r["dtype"],
            cell(r),
            str(r["passed"] + r["failed"]),
            *(_fmt(r.get(k)) for k in ("max_err", "mean_err", "max_ratio", "mean_ratio", "gate")),
            _fmt(r.get("lse_gate")),
            _fmt(r.get("max_ulp")),
            f"{r['over_share']:.2%}" if "over_share" in r else "-",
            nan_inf,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _declares(caps: dict) -> str:
    parts = [f"dtypes {', '.join(caps['dtypes'])}", f"layouts {', '.join(caps['layouts'])}"]
    parts += [f"{k} {'yes' if caps[k] else 'no'}" for k in ("lse", "context")]
    parts += [
        f"{k} {', '.join(map(str, v))}" for k in ("block_sizes", "page_sizes", "head_dims") if (v := caps[k])
    ]
    return "; ".join(parts)


def _cut(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MESSAGE_CHARS else message[: MESSAGE_CHARS - 3] + "..."


def _in_cell(text: str) -> str:
    # A "|" inside a table cell would end the cell.
    return _cut(text).replace("|", "\\|")


def _row_name(r: dict) -> str:
    return f"{r['operator']} / {r['layout']} / {r['dtype']}"


def verdict_section(implementations: list[dict], by_impl: dict) -> list[str]:
    """One verdict per implementation, unavailable ones with the reason."""
    lines = [
        "| implementation | verdict | cases passed | cases failed | cases unsupported | what it is |",
        "|---|---|---|---|---|---|",
    ]
    for info in implementations:
        name = info["name"]
        if not info["available"]:
            lines.append(
                f"| `{name}` | unavailable | - | - | - | could not be loaded: {_in_cell(info['reason'])} |"
            )
            continue
        v = implementation_verdict(by_impl[name])
        what = _in_cell(info["description"] or "(no description)")
        lines.append(
            f"| `{name}` | {v['verdict']} | {v['passed']} | {v['failed']} | {v['unsupported']} | {what} |"
        )
    return lines


def matrix(names: list[str], rows: list[dict]) -> list[str]:
    """The conformance matrix: (operator, layout, dtype) down, implementations across."""
    lines = ["| operator | layout | dtype | " + " | ".join(f"`{n}`" for n in names) + " |"]
    lines.append("|" + "---|" * (3 + len(names)))
    cells = {(r["operator"], r["layout"], r["dtype"], r["implementation"]): r for r in rows}
    for key in dict.fromkeys((r["operator"], r["layout"], r["dtype"]) for r in rows):
        lines.append("| " + " | ".join([*key, *(cell(cells[(*key, n)]) for n in names)]) + " |")
    return lines


def implementation_section(info: dict, rows: list[dict]) -> list[str]:
    """One implementation's declarations, its table of judged rows, its failures and its refusals."""
    judged = [r for r in rows if r["passed"] + r["failed"]]
    what = (info["description"] or "(no description)").rstrip(".")
    what = what[0].upper() + what[1:]
    lines = [f"## `{info['name']}`", "", f"{what}. Declares {_declares(info['capabilities'])} (contract §9)."]
    lines += ["", *(table(judged) if judged else ["No case was judged: every cell is unsupported or -."])]
    failures = [(r, m) for r in rows for m in r["failures"]]
    if failures:
        lines += [
            "",
            f"Failures, one line per distinct message (cut at {MESSAGE_CHARS} characters; whole in "
            "`accuracy.json`):",
            "",
        ]
        lines += [f"- {_row_name(r)}: {_cut(m)}" for r, m in failures]
    refusals = Counter(m for r in rows for m in r["refusals"])
    if refusals:
        lines += ["", "Not judged (unsupported, or `-` where the operator is not provided), by reason:", ""]
        lines += [f"- {_cut(m)}: {n} row(s)" for m, n in refusals.items()]
    return [*lines, ""]


def markdown(meta: dict, implementations: list[dict], rows: list[dict], plots: list[str], p) -> str:
    """The report's markdown page."""
    names = [i["name"] for i in implementations if i["available"]]
    by_impl = {n: [r for r in rows if r["implementation"] == n] for n in names}
    v = meta["versions"]
    lines = [
        f"# Accuracy report: {meta['device_name']}",
        "",
        f"Every number and figure here comes from **{meta['device_name']}**; torch {v['torch']}, triton "
        f"{v['triton']}, Python {v['python']}; profile `{meta['profile']}`; generated {meta['generated']} in "
        f"{meta['elapsed_s']:.0f} s by `{meta['command']}`. JSON twin: `accuracy.json`. Section numbers "
        "(contract §5 and so on) refer to `docs/contract.md`.",
        "",
        "## Verdicts",
        "",
        "One verdict per implementation: **FAIL** when any case fails contract §5's tolerance rule or "
        "crashes, pass otherwise. A case outside an implementation's declared capabilities, or one it "
        "refuses with `NotImplementedError` (contract §9), is *unsupported*: counted apart, never a failure.",
        "",
        *verdict_section(implementations, by_impl),
        "",
        "## Conformance matrix",
        "",
        f"Each cell covers {len(p.batches)} batches (see Cases): pass, **FAIL** (with how many of the judged "
        "cases failed), unsupported, or `-` where the implementation does not provide the operator.",
        "",
        *(matrix(names, rows) if names else ["No implementation could be loaded."]),
        "",
        *(
            ["On the CPU, `triton`'s bfloat16 cells are unsupported by its own declaration (see Notes).", ""]
            if meta["device"] == "cpu" and "triton" in names
            else []
        ),
        "How to read the tables below: `ref` is the float64 oracle, which also evaluates, per element, how "
        "far any kernel of contract §5's admissible family may land from it (the allowance). *max gate* is "
        f"the worst |out - ref| / allowance over the elements (lambda = {LAMBDA:g}), *mean gate* the mean "
        "error over the mean gate's allowance. A case passes when both are <= 1 (*gate*, the larger) and no "
        "NaN or Inf appears where the oracle is finite, or is missing where it is NaN (contract §5); the "
        "table shows the worst case of the row, and *lse gate* is the same test on the log-sum-exp. Well "
        "inside the family a kernel's gates stay far below 1; the one rounding of `out` alone can reach "
        "about 0.5. *max ULP*: distance to the oracle rounded to the output dtype, where |ref| >= "
        f"2^{math.log2(ULP_MAGNITUDE_CUTOFF):g} max|ref|. *over tol*: share of elements over the allowed max "
        "(for write_kv: cache elements that differ from the oracle's write). *mean abs err* is "
        "element-weighted over the row's cases. Rows with no judged case appear only in the matrix.",
        "",
    ]
    info = {i["name"]: i for i in implementations}
    for name in names:
        lines += implementation_section(info[name], by_impl[name])
    lines += [
        "## Error curves (paged_prefill)",
        "",
        "Left: max |out - ref| per implementation, with the case's largest per-element allowance dashed; "
        "right: the worst |out - ref| / allowance over the elements (contract §5 allows 1). Points at 0 "
        "error, and cases not judged, are not drawn on the log axes (see the JSON).",
        "",
        *[line for name in plots for line in (f"### {plot_title(name)}", "", f"![{name}]({name})", "")],
        "## Cases",
        "",
        f"Heads {p.num_heads} (KV heads {p.num_kv_heads}), head_dim {p.head_dim}, page size {p.page_size}, "
        f"sparse block {p.block_size}; local_strided: local_blocks {p.local_blocks}, vert_stride "
        f"{p.vert_stride}, per-head columns; block_mask: random, density {p.block_mask_density}. Batches "
        "(sequence lengths / cached contexts): "
        + "; ".join(f"{lens} / {ctx}" for lens, ctx in p.batches)
        + ". paged_decode uses the same sequences with one query each. write_kv writes new K/V for the "
        f"query tokens of the same batches, {PADDING_SLOT_SHARE:.1%} of them with slot -1, and is compared "
        "bit for bit with the oracle's write. Inputs: randn, scale 1, pages scattered over the cache, unused "
        "slots NaN, block-table padding out of range.",
        "",
        *_notes(meta, names),
    ]
    return "\n".join(lines).rstrip() + "\n"


def _notes(meta: dict, names: list[str]) -> list[str]:
    lines = ["## Notes", ""]
    if meta["device"] == "cpu" and "triton" in names:
        lines += [
            "- **bfloat16 on the CPU.** Triton's interpreter computes bfloat16 on raw bits "
            "(`docs/triton-interpreter.md`), so under `TRITON_INTERPRET=1` the `triton` implementation "
            "declares only float32 and float16 and its bfloat16 cells read unsupported here (contract §5). "
            "bfloat16 is checked on the GPU (`reports/gpu/`).",
        ]
    if "flex" in meta["requested"]:
        lines += [f"- {FLEX_NOTE}"]
    return lines + [""] if len(lines) > 2 else []
