"""PNG curves of the accuracy report (reports/accuracy.py): error against one swept quantity."""

import math
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FIGSIZE = (10, 3.6)
DPI = 80
BASE_STYLE = dict(color="black", linestyle="--", marker="x")
CURVE_NAMES = {"seq_len": "sequence length", "sparsity": "sparsity", "prefix_share": "cached-prefix share"}
# sweep -> (x-axis label, logarithmic x axis)
CURVE_AXES = {
    "seq_len": ("sequence length (tokens, no cached prefix)", True),
    "sparsity": ("share of causal blocks kept (random block mask)", False),
    "prefix_share": ("cached-prefix share of the sequence (context / length)", False),
}


def plot_title(file_name: str) -> str:
    """ "seq_len-dense.png" -> "Error against sequence length, dense layout"."""
    sweep, kind = file_name.removesuffix(".png").split("-", 1)
    return f"Error against {CURVE_NAMES[sweep]}, {kind} layout"


def _positive(values):
    """Log axes cannot show 0 or inf: such points are dropped (the JSON twin keeps them)."""
    return [v if isinstance(v, (int, float)) and 0 < v < math.inf else math.nan for v in values]


def error_curves(
    path, *, title: str, xlabel: str, xs, series: dict, allowed: list, footnote: str, logx=False
):
    """Two panels: max |out - ref| (with the largest allowance dashed) and the worst error / allowance.

    Args:
        series: label -> list of (max_err, worst ratio) per x, None where the case was not judged.
        allowed: the largest per-element allowance of contract §5 per x.
    """
    fig, (ax_err, ax_ratio) = plt.subplots(1, 2, figsize=FIGSIZE, dpi=DPI)
    ax_err.plot(xs, _positive(allowed), label="largest allowance (contract §5)", **BASE_STYLE)
    for label, points in series.items():
        if not any(points):
            continue
        errs = [p[0] if p else None for p in points]
        ratios = [p[1] if p else None for p in points]
        ax_err.plot(xs, _positive(errs), marker="o", label=label)
        ax_ratio.plot(xs, _positive(ratios), marker="o", label=label)
    ax_ratio.axhline(1.0, color="red", linewidth=0.8, linestyle=":", label="the allowance (ratio 1)")
    ax_err.set_ylabel("max |out - ref|")
    ax_ratio.set_ylabel("worst |out - ref| / allowance")
    for ax in (ax_err, ax_ratio):
        ax.set_xlabel(xlabel)
        ax.set_yscale("log")
        if logx:
            ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.text(0.01, 0.01, footnote, fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(path)
    plt.close(fig)


def plot_curves(curve_data: dict, folder: pathlib.Path, dtype: str, where: str, footnote: str) -> list[str]:
    """One PNG per sweep and layout kind of `curve_data` (reports.accuracy.curves); returns the names."""
    files = []
    for sweep, series in curve_data.items():
        for kind, entry in series.items():
            name = f"{sweep}-{kind}.png"
            xlabel, logx = CURVE_AXES[sweep]
            error_curves(
                folder / name,
                title=f"paged_prefill, {kind} layout, {dtype}, on {where}",
                xlabel=xlabel,
                xs=entry["x"],
                series=entry["implementations"],
                allowed=entry["allowed"],
                footnote=footnote,
                logx=logx,
            )
            files.append(name)
    return files
