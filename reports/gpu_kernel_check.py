"""Runs tests and tabulates them: pass counts per module, worst error ratio per dtype and operator.

`python3 -m reports.gpu_kernel_check [--out reports/gpu] [-- PYTEST_ARGS]` (default `tests/kernels`)
writes kernels-tests.md and kernels-tests.json. A ratio is error / allowed error of contract §5
(<= 1 passes), the larger of the max and mean gates. Figures come from whatever device the tests ran
on, named in the table.
"""

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import torch

from harness.stats_log import STATS_ENV


def _device_name() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"CPU, TRITON_INTERPRET=1 (torch {torch.__version__})"


def _junit_counts(path: pathlib.Path) -> dict:
    counts = collections.defaultdict(lambda: collections.Counter())
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        counts[module][outcome] += 1
    return {m: dict(c) for m, c in sorted(counts.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("reports/gpu"))
    parser.add_argument("pytest_args", nargs="*", help="after --; default: tests/kernels")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stats_path = args.out / "kernels-stats.jsonl"
    junit = args.out / "kernels-junit.xml"
    stats_path.unlink(missing_ok=True)
    env = dict(os.environ, **{STATS_ENV: str(stats_path.resolve())})
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
    ]
    pytest_args = args.pytest_args or ["tests/kernels"]
    rc = subprocess.run(cmd + pytest_args, env=env).returncode
    counts = _junit_counts(junit)
    worst = {}
    for line in stats_path.read_text().splitlines() if stats_path.exists() else []:
        s = json.loads(line)
        key = (s["op"], s["output"], s["dtype"])
        ratio = max(s["max_ratio"], s["mean_ratio"])
        n, best = worst.get(key, (0, None))
        worst[key] = (
            n + 1,
            s if best is None or ratio > max(best["max_ratio"], best["mean_ratio"]) else best,
        )
    lines = [
        "# Kernel tests",
        "",
        f"Device: {_device_name()}. Command: `{' '.join(cmd[1:] + pytest_args)}`, "
        f"HYPOTHESIS_PROFILE={os.environ.get('HYPOTHESIS_PROFILE', '(default)')}; pytest exit code {rc}.",
        "",
        "| test module | passed | failed | skipped |",
        "| --- | --- | --- | --- |",
    ]
    for module, c in counts.items():
        lines.append(f"| {module} | {c.get('passed', 0)} | {c.get('failed', 0)} | {c.get('skipped', 0)} |")
    lines += [
        "",
        "Worst error ratio per operator, output and dtype (error / allowed, contract §5; <= 1 passes).",
        "",
        "| operator | output | dtype | comparisons | worst max-gate | worst mean-gate | worst case |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (op, output, dtype), (n, s) in sorted(worst.items()):
        where = (
            f"{s['layout']}, L={s['max_seq_len']}, H={s['num_heads']}, D={s['head_dim']}, P={s['page_size']}"
        )
        lines.append(
            f"| {op} | {output} | {dtype} | {n} | {s['max_ratio']:.3f} | {s['mean_ratio']:.3f} | {where} |"
        )
    (args.out / "kernels-tests.md").write_text("\n".join(lines) + "\n")
    summary = dict(
        device=_device_name(),
        exit_code=rc,
        counts=counts,
        worst={"/".join(k): v[1] | {"comparisons": v[0]} for k, v in worst.items()},
    )
    (args.out / "kernels-tests.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(lines))
    return rc


if __name__ == "__main__":
    sys.exit(main())
