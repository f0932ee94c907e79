"""The known-failure ledger (fuzz/ledger.json, or the user's own file: --ledger), which never goes stale.

Each entry names a known failure and why it is tolerated (STYLE 16):

    {"id": "prefill-fp16-empty-rows", "reason": "...", "issue": 12, "kind": "wrong-answer",
     "target": "prefill", "backend": "triton", "match": {"dtype": "float16", "layout.kind": "block_mask"},
     "case": "failures/prefill-triton-float16-0123abcd.json"}

- `kind` "wrong-answer": matching cases still run; their failures count as known, not new. The entry's
  `case` file (required) is replayed at the end of every campaign: if it passes, the entry is stale and
  the run fails, so a fixed bug leaves the ledger.
- `kind` "crash": matching cases are never launched (a crash may take the process down).
- `match`: dotted case fields that must all be equal (`layout.kind`, `dtype`, `page_size`, ...). Left
  out, an entry matches exactly the case in its `case` file.
- `backend`: a registry name (backends/registry.py). Paths in an entry, the `case` file and a
  `file.py:attr` backend alike, are relative to the ledger file's folder, so a ledger may live anywhere.
Every entry needs an id, a reason and an issue number.
"""

import json
import pathlib
from dataclasses import dataclass, field

from fuzz import backend_names

KINDS = ("wrong-answer", "crash")
REQUIRED = ("id", "reason", "issue", "kind", "target", "backend")


def flatten(d: dict, prefix: str = "") -> dict:
    """{"layout": {"kind": "dense"}} -> {"layout.kind": "dense"}; lists become tuples."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
    return out


@dataclass(frozen=True)
class Entry:
    """One known failure."""

    id: str
    reason: str
    issue: int
    kind: str
    target: str
    backend: str  # canonical (fuzz/backend_names.py)
    match: dict = field(default_factory=dict)
    case: str | None = None  # path of the case file, relative to the ledger's folder
    case_dict: dict | None = None  # the loaded case, when `case` is given

    def matches(self, target: str, backend: str, case: dict) -> bool:
        """Whether this entry covers `case` (a plain dict) of `target` on the canonical `backend`."""
        if (target, backend) != (self.target, self.backend):
            return False
        flat = flatten(case)
        want = {k: tuple(v) if isinstance(v, list) else v for k, v in self.match.items()}
        if not want and self.case_dict is not None:
            want = flatten(self.case_dict)
        return bool(want) and all(flat.get(k) == v for k, v in want.items())


def parse_entry(raw: dict, folder: pathlib.Path) -> Entry:
    """An Entry from its JSON; ValueError naming what is missing or wrong."""
    name = raw.get("id", "<no id>")
    missing = [k for k in REQUIRED if raw.get(k) in (None, "")]
    if missing:
        raise ValueError(f"ledger entry {name}: missing {', '.join(missing)}")
    if raw["kind"] not in KINDS:
        raise ValueError(f"ledger entry {name}: kind must be one of {KINDS}, got {raw['kind']!r}")
    if isinstance(raw["issue"], bool) or not isinstance(raw["issue"], int) or raw["issue"] < 1:
        raise ValueError(f"ledger entry {name}: issue must be an issue number, got {raw['issue']!r}")
    if raw["kind"] == "wrong-answer" and not raw.get("case"):
        raise ValueError(f"ledger entry {name}: a wrong-answer entry needs a case file (to detect staleness)")
    if not raw.get("match") and not raw.get("case"):
        raise ValueError(f"ledger entry {name}: needs a match or a case file")
    unknown = set(raw) - set(REQUIRED) - {"match", "case"}
    if unknown:
        raise ValueError(f"ledger entry {name}: unknown fields {sorted(unknown)}")
    case_dict = None
    if raw.get("case"):
        path = folder / raw["case"]
        if not path.exists():
            raise ValueError(f"ledger entry {name}: case file {path} does not exist")
        case_dict = json.loads(path.read_text())["case"]
    values = {k: raw[k] for k in REQUIRED} | {"backend": backend_names.canonical(raw["backend"], folder)}
    return Entry(
        **values,
        match=raw.get("match") or {},
        case=raw.get("case"),
        case_dict=case_dict,
    )


@dataclass
class Ledger:
    """The loaded ledger file."""

    path: pathlib.Path
    entries: list[Entry]

    @classmethod
    def load(cls, path) -> "Ledger":
        """The ledger at `path` (no entries when the file does not exist); ValueError for a bad entry."""
        path = pathlib.Path(path).expanduser().resolve()
        if not path.exists():
            return cls(path, [])
        data = json.loads(path.read_text())
        entries = [parse_entry(raw, path.parent) for raw in data.get("entries", [])]
        ids = [e.id for e in entries]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"{path}: duplicate ledger ids {duplicates}")
        return cls(path, entries)

    def match(self, target: str, backend: str, case) -> Entry | None:
        """The first entry covering this case, else None. `case`: a dataclass with to_dict, or a dict."""
        d = case if isinstance(case, dict) else case.to_dict()
        return next((e for e in self.entries if e.matches(target, backend, d)), None)

    def case_path(self, entry: Entry) -> pathlib.Path:
        """The entry's case file: relative to the ledger's folder, wherever the campaign runs from."""
        return self.path.parent / entry.case

    def stale_entries(self, replay, available_backends=None) -> list[tuple[Entry, str]]:
        """Wrong-answer entries whose case now passes, as (entry, verdict).

        `replay(path, backend) -> Verdict` runs a case file on the (canonical) backend name; crash
        entries are never launched, and entries of backends not in `available_backends` (when given)
        are not replayed.
        """
        stale = []
        for entry in self.entries:
            if entry.kind != "wrong-answer":
                continue
            if available_backends is not None and entry.backend not in available_backends:
                continue
            result = replay(self.case_path(entry), entry.backend)
            if result.status == "passed":
                stale.append(
                    (entry, f"{entry.id} (issue #{entry.issue}) passes now: remove it from the ledger")
                )
        return stale
