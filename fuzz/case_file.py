"""Failure case files: one small, self-contained JSON per failing case, and its replay.

A file holds the target, the implementation's registry name (canonical form, fuzz/backend_names.py,
so that `--replay FILE` needs no other flag, from any working directory), the dtype, the case's plain
values (seed included: the tensors are rebuilt from it), the case in words, the verdict that was
measured, the versions and device it was measured with, and the one-line command that replays it.
"""

import json
import os
import pathlib
import time
import zlib
from typing import NamedTuple

from fuzz import backend_names
from harness.records import jsonable, versions

FORMAT = 1
REPLAY_COMMAND = "nox -s kernel-fuzz -- --replay {path}"
# How each target rebuilds its inputs from the saved case (all from the seed; no tensors are stored).
REBUILD = {
    "prefill": "harness.cases.build_inputs(harness.cases.AttentionCase.from_dict(case), device)",
    "decode": "harness.cases.build_inputs(harness.cases.AttentionCase.from_dict(case), device)",
    "write_kv": "harness.cases.write_kv_inputs(harness.cases.AttentionCase.from_dict(case), device)",
    "engine": "harness.cases.EngineCase.from_dict(case), run by fuzz/engine_target.py (no tensors)",
}
# replay exit codes
REPRODUCED, NOT_REPRODUCED, NOT_RUN = 1, 0, 2


def file_name(target: str, backend: str, dtype: str, case: dict) -> str:
    digest = zlib.crc32(json.dumps(case, sort_keys=True).encode())
    return f"{target}-{backend_names.slug(backend)}-{dtype}-{digest:08x}.json"


def display_path(path) -> str:
    """The path relative to the working directory when it lies below it (replay runs from the root)."""
    path = pathlib.Path(path).absolute()
    try:
        return str(path.relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)


def save(folder, *, target: str, backend: str, case: dict, dtype: str, words: str, verdict, device: str):
    """Writes the case file (atomically) and returns its path. `backend` is the canonical name."""
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
        "case_in_words": words,
        "rebuild": REBUILD.get(target, ""),
        "verdict": {
            "status": verdict.status,
            "ratio": verdict.ratio,
            "message": verdict.message,
            "stats": verdict.stats,
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


class Replay(NamedTuple):
    """A replayed case file: its JSON, the implementation it ran on, and the verdict now."""

    data: dict
    backend: str
    verdict: object


def replay(path, backend: str | None = None, case_timeout: float | None = None) -> Replay:
    """Re-runs a saved case, in a child process, on the implementation the file names (or `backend`).

    A case that kills the child or overruns `case_timeout` comes back `crashed` or `hung`.
    """
    import torch

    from backends import registry
    from fuzz import targets
    from harness import isolation
    from harness.judge import Verdict

    data = load(path)
    name = backend_names.canonical(backend) if backend else data["backend"]
    target = targets.all_targets()[data["target"]]
    try:
        impl = registry.load(backend_names.loadable(name))
    except Exception as exc:  # noqa: BLE001  (whatever the user's module raises on import)
        return Replay(
            data, name, Verdict("unsupported", message=f"cannot load {name}: {type(exc).__name__}: {exc}")
        )
    # A case outside what the implementation declares is refused by the judge itself (unsupported).
    reason = target.refusal(impl)
    if reason:
        return Replay(data, name, Verdict("unsupported", message=reason))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    child = isolation.Isolated(name, device, case_timeout=case_timeout or isolation.DEFAULT_CASE_TIMEOUT_S)
    try:
        return Replay(data, name, child.run(data["target"], data["case"]))
    finally:
        child.close()


def main_replay(path, backend: str | None = None, case_timeout: float | None = None) -> int:
    """The `--replay` entry: prints the verdict; exit 1 when the case still fails, crashes or hangs."""
    data, name, verdict = replay(path, backend, case_timeout)
    print(f"replay {path}: target {data['target']}, backend {name}, dtype {data.get('dtype')}")
    if data.get("case_in_words"):
        print(f"  case:   {data['case_in_words']}")
    saved = data.get("verdict", {})
    print(f"  saved:  {saved.get('status')} ratio {saved.get('ratio')}  {saved.get('message', '')}")
    print(f"  now:    {verdict.status} ratio {verdict.ratio:.4g}  {verdict.message}")
    if verdict.status == "crashed":
        print("CRASHED: the case still kills its process or leaves the device unusable")
        return REPRODUCED
    if verdict.status == "hung":
        print("HUNG: the case still runs past the per-case limit")
        return REPRODUCED
    if verdict.failed:
        print("REPRODUCED: the case still fails")
        return REPRODUCED
    if verdict.status == "unsupported":
        print("NOT RUN: the implementation cannot be loaded, does not declare the case, or refused it")
        return NOT_RUN
    print("NOT REPRODUCED: the case passes now")
    return NOT_REPRODUCED
