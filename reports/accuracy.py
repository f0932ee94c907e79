"""`nox -s report` (or `python3 -m reports.accuracy --device cuda`): the numerical accuracy report.

    python -m reports.accuracy [--backend NAME[,NAME...]] [--layout-family NAME] [--device cpu|cuda]
                               [--profile P] [--out DIR]

Each implementation (a registry name: triton, reference, sdpa, flex, package.module:attr or
path/file.py:attr; contract §9) gets one verdict. Every case is run and judged by
`harness.judge` against the float64 oracle, computed once per case for all implementations; a case
outside an implementation's declared capabilities, or one it refuses with NotImplementedError, is
*unsupported*, counted apart and never a failure. The report writes reports/<cpu|gpu>/accuracy.md
(verdicts, the conformance matrix, per-implementation tables, error curves, the cases), the PNG
curves and accuracy.json (every number of the markdown, and more), and names every file it wrote on
stdout; progress goes to stderr. CPU shapes are interpreter-sized; `--device cuda` uses Phi-3-small's
heads (32/8, D 128, S 64) and a few thousand tokens; `--profile tiny` shrinks everything to seconds.
Shapes and cases live in reports/accuracy_cases.py, measurements in reports/accuracy_measure.py, the
markdown in reports/accuracy_render.py and the plots in reports/plots.py.
"""

import argparse
import json
import os
import pathlib
import platform
import sys
import time
from dataclasses import asdict

import torch

from backends import layout_families, registry
from backends.registry import LAYOUT_KINDS
from harness.records import jsonable, versions
from reports.accuracy_cases import PROFILES, Profile, curve_cases, kept_share, summary_cases
from reports.accuracy_measure import Runner, aggregate, load_implementations
from reports.accuracy_render import cell, markdown
from reports.plots import plot_curves

DEVICE_FOLDERS = {"cpu": "cpu", "cuda": "gpu"}
DEFAULT_BACKENDS = ("triton", "sdpa", "flex")
OPERATORS = ("paged_prefill", "paged_decode", "write_kv")

_T0 = time.time()


def log(message: str) -> None:
    """A progress line on stderr, stamped with seconds since start (to see where GPU time goes)."""
    print(f"[{time.time() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


def summary_rows(runner: Runner, p: Profile, impls: dict, families=()) -> list[dict]:
    """One row per operator x layout x dtype x implementation, each over the profile's batches; the
    layouts are the built-in kinds and the outside `families` (backends.layout_families.Family)."""
    rows = []
    for op in OPERATORS:
        layouts = [(kind, None) for kind in LAYOUT_KINDS] + [(family_label(f), f) for f in families]
        for kind, family in [("dense", None)] if op == "write_kv" else layouts:
            for dtype in p.dtypes:
                measures = {name: [] for name in impls}
                # Cases outermost, so that a case's oracle is computed once for every implementation.
                for case in summary_cases(p, op, kind, dtype, family):
                    for name, impl in impls.items():
                        if op == "write_kv":
                            measures[name].append(runner.write_kv(impl, case))
                        else:
                            measures[name].append(runner.attention(impl, case, op == "paged_decode"))
                layout = "-" if op == "write_kv" else kind
                for name, got in measures.items():
                    rows.append(
                        dict(operator=op, layout=layout, dtype=dtype, implementation=name) | aggregate(got)
                    )
                    log(f"{op:13s} {layout:13s} {dtype:8s} {name:10s} {cell(rows[-1])}")
    return rows


def family_label(family) -> str:
    """A family's name in the report's layout column: its file (or module) and attribute."""
    where, _, attr = family.name.rpartition(":")
    return f"{pathlib.Path(where).name}:{attr}"


def curves(runner: Runner, p: Profile, impls: dict) -> dict:
    """Error of prefill against sequence length, sparsity and cached-prefix share, in p.curve_dtype.

    Returns {sweep: {layout kind: {"x": [...], "allowed": [...], "implementations": {name: points}}}},
    "allowed" being the largest per-element allowance of the case (contract §5) and a point
    (max_err, worst error / allowance ratio), or None where the case was not judged.
    """
    result = {}
    for sweep, points in curve_cases(p).items():
        series = {}
        for x, case, kind in points:
            _, truth = runner.oracle(case)
            entry = series.setdefault(
                kind, {"x": [], "allowed": [], "implementations": {m: [] for m in impls}}
            )
            entry["x"].append(kept_share(case) if sweep == "sparsity" else x)
            entry["allowed"].append(float(truth.bounds["out"][0].max()))
            for name, impl in impls.items():
                out = runner.attention(impl, case, False).get("out")
                entry["implementations"][name].append((out["max_err"], out["max_ratio"]) if out else None)
        result[sweep] = series
        log(f"curve {sweep} done")
    return result


def device_name(device: str) -> str:
    """The device in words, as every figure of the report is labelled."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}), Triton interpreter (TRITON_INTERPRET=1)"


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--backend",
        default=",".join(DEFAULT_BACKENDS),
        help="comma-separated implementations (default: %(default)s): " + registry.describe_names(),
    )
    parser.add_argument(
        "--layout-family",
        action="append",
        default=[],
        metavar="NAME",
        help="repeatable; also judge the layouts of this family (package.module:attribute or "
        "path/to/file.py:attribute, backends/layout_families.py), one row per operator and dtype",
    )
    parser.add_argument("--device", choices=tuple(DEVICE_FOLDERS), default="cpu")
    parser.add_argument("--profile", choices=tuple(PROFILES), default=None, help="default: the device's")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="default: reports/<cpu|gpu>")
    args = parser.parse_args(argv)
    args.names = tuple(dict.fromkeys(b.strip() for b in args.backend.split(",") if b.strip()))
    unknown = [b for b in args.names if b not in registry.BUILTINS and ":" not in b]
    if not args.names or unknown:
        parser.error(f"--backend: unknown {unknown or args.backend!r}; use {registry.describe_names()}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    args.profile = args.profile or args.device
    if args.out is None and args.profile != args.device:
        # The committed reports/<device>/ holds the device's own profile only.
        parser.error(f"--profile {args.profile} needs --out")
    return args


def main(argv=None) -> int:
    """Measures, writes the report's files and names each of them on stdout."""
    args = _parse(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    out = args.out or pathlib.Path(__file__).parent / DEVICE_FOLDERS[args.device]
    out.mkdir(parents=True, exist_ok=True)
    p = PROFILES[args.profile]
    start = time.time()
    impls, unavailable = load_implementations(args.names)
    log(f"report: {args.device}, profile {args.profile}, {list(impls)} (unavailable: {unavailable})")
    implementations = [
        dict(
            name=n,
            available=True,
            description=impls[n].description,
            capabilities=impls[n].capabilities.as_dict(),
        )
        if n in impls
        else dict(name=n, available=False, reason=unavailable[n])
        for n in args.names
    ]
    families = [layout_families.load(name) for name in args.layout_family]
    runner = Runner(args.device)
    rows = summary_rows(runner, p, impls, families)
    curve_data = curves(runner, p, impls)
    meta = dict(
        device=args.device,
        device_name=device_name(args.device),
        profile=args.profile,
        requested=list(args.names),
        versions=versions(),
        generated=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        command=" ".join(["python -m reports.accuracy", *(argv if argv is not None else sys.argv[1:])]),
    )
    footnote = (
        f"{meta['device_name']}; torch {meta['versions']['torch']}, triton {meta['versions']['triton']}"
    )
    plots = plot_curves(curve_data, out, p.curve_dtype, meta["device_name"], footnote)
    meta["elapsed_s"] = time.time() - start
    files = [out / "accuracy.md", out / "accuracy.json", *(out / name for name in plots)]
    data = dict(
        meta=meta,
        profile=asdict(p),
        implementations=implementations,
        rows=rows,
        curves=curve_data,
        plots=plots,
        files=[f.name for f in files],
    )
    files[1].write_text(json.dumps(jsonable(data), indent=1) + "\n")
    files[0].write_text(markdown(meta, implementations, rows, plots, p))
    log(f"done in {meta['elapsed_s']:.0f} s")
    for path in files:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
