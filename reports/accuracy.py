"""`nox -s report` (or `python3 -m reports.accuracy --device cuda`): the numerical accuracy report.

Writes reports/<cpu|gpu>/accuracy.md (summary table first, then the plots), the PNG plots and
accuracy.json (every number of the markdown, and more). For each operator x dtype x layout family
and each backend (the Triton kernels, then the comparison backends sdpa and flex of fuzz/backends.py)
it measures SPEC section 5's quantities against the float64 oracle: max and mean |out - ref|, their
ratios to the same-dtype oracle `base`, the tolerance gate (<= 1 passes), the max ULP distance in the
output dtype, the share of elements over tolerance and NaN/Inf counts; then curves of the error
against sequence length, block sparsity and cached-prefix share. CPU shapes are interpreter-sized;
`--device cuda` uses Phi-3-small's heads (32/8, D 128, S 64) and a few thousand tokens.
Measurements live in reports/accuracy_measure.py, the markdown and plots in reports/accuracy_render.py.
"""

import argparse
import json
import math
import os
import pathlib
import sys
import time
from dataclasses import asdict, dataclass

import torch

from reports.accuracy_measure import Runner, aggregate
from reports.accuracy_render import device_name, markdown, plot_curves, verdict, versions

DEVICE_FOLDERS = {"cpu": "cpu", "cuda": "gpu"}
BACKENDS = ("triton", "sdpa", "flex")
OPERATORS = ("paged_prefill", "paged_decode", "write_kv")
LAYOUT_FAMILIES = ("dense", "local_strided", "block_mask")
SUMMARY_SEEDS = (11, 12, 13)
CURVE_SEED = 21


_T0 = time.time()


def log(message: str) -> None:
    """A progress line on stderr, stamped with seconds since start (to see where GPU time goes)."""
    print(f"[{time.time() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Profile:
    """Shapes of one device's report."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    block_size: int
    local_blocks: int
    vert_stride: int
    dtypes: tuple[str, ...]
    curve_dtype: str
    # Summary cases: (seq_lens, context_lens) per case.
    batches: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    seq_lens: tuple[int, ...]  # sequence-length curve
    curve_len: int  # length of the sparsity and cached-prefix curves
    block_mask_density: float = 0.5  # of the summary's block_mask rows
    densities: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 1.0)
    prefix_shares: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 0.9, 0.97)


PROFILES = {
    "cpu": Profile(
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        block_size=16,
        local_blocks=2,
        vert_stride=3,
        dtypes=("float32", "float16", "bfloat16"),
        curve_dtype="float16",
        batches=(((128,), (0,)), ((200, 37), (100, 0)), ((96, 17, 150), (90, 16, 64))),
        seq_lens=(16, 32, 64, 128, 256),
        curve_len=192,
    ),
    "cuda": Profile(
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        block_size=64,
        local_blocks=16,
        vert_stride=8,
        dtypes=("float32", "float16", "bfloat16"),
        curve_dtype="bfloat16",
        batches=(((2048,), (0,)), ((1500, 700), (1000, 0)), ((3000, 64, 1000), (2900, 0, 512))),
        seq_lens=(128, 256, 512, 1024, 2048, 4096),
        curve_len=2048,
    ),
}


def layout_spec(family: str, p: Profile, density: float, seed: int):
    from tests.strategies import LayoutSpec

    if family == "dense":
        return LayoutSpec(block_size=p.block_size)
    if family == "local_strided":
        return LayoutSpec("local_strided", p.block_size, p.local_blocks, p.vert_stride)
    return LayoutSpec("block_mask", p.block_size, density=density, mask_seed=seed)


def make_case(
    p: Profile, seq_lens, context_lens, dtype: str, family: str, seed: int, density: float | None = None
):
    from tests.strategies import AttentionCase

    return AttentionCase(
        seed=seed,
        seq_lens=tuple(seq_lens),
        query_lens=tuple(n - c for n, c in zip(seq_lens, context_lens, strict=True)),
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        page_size=p.page_size,
        dtype=dtype,
        layout=layout_spec(family, p, p.block_mask_density if density is None else density, seed),
    )


def summary_rows(runner: Runner, p: Profile, backends) -> list[dict]:
    """One row per operator x layout family x dtype x backend, each over the profile's batches."""
    rows = []
    for op in OPERATORS:
        families = ("dense",) if op == "write_kv" else LAYOUT_FAMILIES
        for family in families:
            for dtype in p.dtypes:
                measures = {name: [] for name in backends if name in runner.ops}
                # Cases outermost, so that the oracle of a case is computed once for every backend.
                for (lens, ctx), s in zip(p.batches, SUMMARY_SEEDS, strict=True):
                    context = tuple(n - 1 for n in lens) if op == "paged_decode" else ctx
                    case = make_case(p, lens, context, dtype, family, s)
                    for name in measures:
                        if op == "write_kv":
                            measures[name].append(runner.write_kv(name, case))
                        else:
                            measures[name].append(runner.attention(name, case, op == "paged_decode"))
                for name, got in measures.items():
                    if name != "triton" and all(m.get("error", "").startswith("n/a") for m in got):
                        continue
                    layout = "-" if op == "write_kv" else family
                    rows.append(dict(operator=op, layout=layout, dtype=dtype, backend=name) | aggregate(got))
                    log(f"{op:13s} {family:13s} {dtype:8s} {name:6s} {verdict(rows[-1])}")
    return rows


def _point(measure_: dict):
    """(max_err, max_err / base max_err) of one curve point, or None when the backend did not run."""
    out = measure_.get("out")
    return (out["max_err"], out["max_to_base"]) if out else None


def curves(runner: Runner, p: Profile, backends) -> dict:
    """Error of prefill against sequence length, sparsity and cached-prefix share, in p.curve_dtype."""
    dt, n = p.curve_dtype, p.curve_len
    sweeps = {
        "seq_len": [
            (L, make_case(p, (L,), (0,), dt, family, CURVE_SEED), family)
            for family in ("dense", "local_strided")
            for L in p.seq_lens
        ],
        "sparsity": [
            (d, make_case(p, (n,), (0,), dt, "block_mask", CURVE_SEED, density=d), "block_mask")
            for d in p.densities
        ],
        "prefix_share": [
            (share, make_case(p, (n,), (min(n - 1, round(share * n)),), dt, family, CURVE_SEED), family)
            for family in ("dense", "local_strided")
            for share in p.prefix_shares
        ],
    }
    result = {}
    for sweep, points in sweeps.items():
        series: dict[str, dict] = {}
        for x, case, family in points:
            _, ((ref_out, _), (base_out, _)) = runner.oracle(case, False)
            entry = series.setdefault(family, {"x": [], "base": [], "backends": {b: [] for b in backends}})
            if sweep == "sparsity":
                x = kept_share(case)
            entry["x"].append(x)
            entry["base"].append(float((base_out.double() - ref_out).abs().max()))
            for name in backends:
                m = runner.attention(name, case, False) if name in runner.ops else {"error": "unavailable"}
                entry["backends"][name].append(_point(m))
        result[sweep] = series
        log(f"curve {sweep} done")
    return result


def kept_share(case) -> float:
    """Share of the causal (query block, key block) pairs a block-mask layout keeps."""
    nb = math.ceil(max(case.seq_lens) / case.layout.block_size)
    mask = case.layout.build(case.num_heads, max(case.seq_lens)).block_mask(case.num_heads, nb)
    causal = nb * (nb + 1) // 2 * case.num_heads
    return round(float(mask.sum()) / causal, 3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", choices=tuple(DEVICE_FOLDERS), default="cpu")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="default: reports/<cpu|gpu>")
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help="comma-separated, from " + ", ".join(BACKENDS)
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    out = args.out or pathlib.Path(__file__).parent / DEVICE_FOLDERS[args.device]
    out.mkdir(parents=True, exist_ok=True)
    backends = tuple(b for b in args.backends.split(",") if b)
    p = PROFILES[args.device]
    start = time.time()
    runner = Runner(args.device, backends)
    print(
        f"report: {args.device}, backends {list(runner.ops)} (unavailable: {runner.unavailable})",
        file=sys.stderr,
    )
    rows = summary_rows(runner, p, backends)
    curve_data = curves(runner, p, backends)
    meta = dict(
        device=args.device,
        device_name=device_name(args.device),
        versions=versions(),
        generated=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        command=" ".join(["python -m reports.accuracy", *(argv if argv is not None else sys.argv[1:])]),
        unavailable=runner.unavailable,
    )
    footnote = (
        f"{meta['device_name']}; torch {meta['versions']['torch']}, triton {meta['versions']['triton']}"
    )
    plots = plot_curves(curve_data, out, p, meta["device_name"], footnote)
    meta["elapsed_s"] = time.time() - start
    from fuzz.case_file import jsonable

    data = dict(meta=meta, profile=asdict(p), rows=rows, curves=curve_data, plots=plots)
    (out / "accuracy.json").write_text(json.dumps(jsonable(data), indent=1) + "\n")
    (out / "accuracy.md").write_text(markdown(meta, rows, plots, p))
    print(f"wrote {out / 'accuracy.md'} ({meta['elapsed_s']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
