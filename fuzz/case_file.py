"""Failure case files: one small, self-contained JSON per failing case, and its replay.

A file holds the target, the backend, the case's plain values (seed included: the tensors are
rebuilt from it by `tests.strategies.build_inputs`), the verdict that was measured, the versions and
device it was measured with, and the one-line command that replays it.
"""

import json
import math
import os
import pathlib
import platform
import time
import zlib

FORMAT = 1
REPLAY_COMMAND = "nox -s kernel-fuzz -- --replay {path}"
# How each target rebuilds its inputs from the saved case (all from the seed; no tensors are stored).
REBUILD = {
    "prefill": "tests.strategies.build_inputs(tests.strategies.AttentionCase.from_dict(case), device)",
    "decode": "tests.strategies.build_inputs(tests.strategies.AttentionCase.from_dict(case), device)",
    "write_kv": "fuzz.targets.write_kv_inputs(tests.strategies.AttentionCase.from_dict(case), device)",
    "engine": "tests.strategies.EngineCase.from_dict(case), run by fuzz.engine_target (no tensors)",
}


def versions() -> dict:
    """Versions of what produced a result (triton only when importable)."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    import hypothesis

    out["hypothesis"] = hypothesis.__version__
    return out


def jsonable(x):
    """JSON has no inf/nan: store them as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def file_name(target: str, backend: str, dtype: str, case: dict) -> str:
    digest = zlib.crc32(json.dumps(case, sort_keys=True).encode())
    return f"{target}-{backend}-{dtype}-{digest:08x}.json"


def display_path(path) -> str:
    """The path relative to the working directory when it lies below it (replay runs from the root)."""
    path = pathlib.Path(path).absolute()
    try:
        return str(path.relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)


def save(folder, *, target: str, backend: str, case: dict, dtype: str, result, device: str) -> pathlib.Path:
    """Writes the case file (atomically) and returns its path."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(target, backend, dtype, case)
    data = {
        "format": FORMAT,
        "target": target,
        "backend": backend,
        "dtype": dtype,
        "device": device,
        "case": case,
        "rebuild": REBUILD.get(target, ""),
        "verdict": {
            "status": result.status,
            "ratio": result.ratio,
            "message": result.message,
            "stats": result.stats,
        },
        "versions": versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "replay": REPLAY_COMMAND.format(path=display_path(path)),
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(jsonable(data), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load(path) -> dict:
    """The file's JSON; ValueError when it is not a case file this code can replay."""
    data = json.loads(pathlib.Path(path).read_text())
    missing = [k for k in ("format", "target", "backend", "case") if k not in data]
    if missing:
        raise ValueError(f"{path}: not a fuzz case file (missing {', '.join(missing)})")
    if data["format"] != FORMAT:
        raise ValueError(f"{path}: case file format {data['format']}, this code reads {FORMAT}")
    return data


def replay(path, backend: str | None = None):
    """Re-runs a saved case (optionally on another backend); returns (data, Result)."""
    import torch

    from fuzz.backends import get_backend, load_ops
    from fuzz.targets import Result, all_targets

    data = load(path)
    name = backend or data["backend"]
    target = all_targets()[data["target"]]
    ops, reason = load_ops(name)
    reason = reason or target.supported(ops, name)
    if reason:
        return data, Result("unsupported", message=f"backend {name} unavailable: {reason}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return data, target.run(target.case_from_dict(data["case"]), ops, get_backend(name), device)


def main_replay(path, backend: str | None = None) -> int:
    """The `--replay` entry: prints the verdict; exit 1 when the case still fails (reproduced)."""
    data, result = replay(path, backend)
    name = backend or data["backend"]
    print(f"replay {path}: target {data['target']}, backend {name}, dtype {data.get('dtype')}")
    saved = data.get("verdict", {})
    print(f"  saved:  {saved.get('status')} ratio {saved.get('ratio')}  {saved.get('message', '')}")
    print(f"  now:    {result.status} ratio {result.ratio:.4g}  {result.message}")
    if result.status == "failed":
        print("REPRODUCED: the case still fails")
        return 1
    if result.status == "unsupported":
        print("NOT RUN: the backend is unavailable or rejects the case")
        return 2
    print("NOT REPRODUCED: the case passes now")
    return 0
