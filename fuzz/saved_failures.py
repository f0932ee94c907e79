"""Failing cases shared between campaigns through a hypothesis example database.

Every failure a campaign saves is also put in the example database (`--example-db`), under one key
per implementation and target, as the case's plain values and who found it. Every campaign, each
shard of a sharded one included, replays the entries first (fuzz/worker.py): a failure one shard
found is soon a failure of the others too, and one that passes now leaves the database. The database
is any hypothesis `ExampleDatabase`: a directory (the default, on shared storage for shards on many
hosts), or an object named `package.module:attr` (hypothesis's Redis or GitHub-artifact backends, a
`MultiplexedDatabase` of a local and a shared one, ...).
"""

import importlib
import json
import pathlib
import zlib
from dataclasses import dataclass

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from fuzz import backend_names

ROOT = pathlib.Path(__file__).resolve().parent.parent / ".hypothesis" / "examples"


def default_location(backend: str) -> pathlib.Path:
    """Where the failing examples of one implementation are kept (the tests' database too)."""
    return ROOT / backend_names.slug(backend_names.canonical(backend))


def open_database(spec) -> ExampleDatabase | None:
    """The database `spec` names: None (no database), a directory, or `package.module:attr`."""
    if spec is None or isinstance(spec, ExampleDatabase):
        return spec
    module, sep, attr = str(spec).partition(":")
    if sep and not module.endswith(".py") and "/" not in module and "\\" not in module:
        found = getattr(importlib.import_module(module), attr)
        db = found() if callable(found) and not isinstance(found, ExampleDatabase) else found
        if not isinstance(db, ExampleDatabase):
            raise TypeError(f"example database {spec}: expected a hypothesis ExampleDatabase, got {type(db)}")
        return db
    return DirectoryBasedExampleDatabase(str(pathlib.Path(spec).expanduser()))


def _key(backend: str, target: str) -> bytes:
    return f"sparse-paged-attention-suite/fuzz/{backend}/{target}".encode()


@dataclass(frozen=True)
class Entry:
    """One saved failing case: its plain values, who found it, and the stored values behind it."""

    case: dict
    found_by: dict
    raws: tuple[bytes, ...]

    @property
    def digest(self) -> int:
        return zlib.crc32(json.dumps(self.case, sort_keys=True).encode())

    @property
    def run_id(self):
        return self.found_by.get("run_id")

    @property
    def finder(self) -> str:
        """Who saved it, in words."""
        shard = self.found_by.get("shard")
        return (
            f"shard {shard} of the campaign with seed {self.found_by.get('seed')}"
            if shard
            else "an earlier campaign"
        )

    def owner(self, workers: int) -> int:
        """The worker of a campaign that replays it (each entry once per campaign)."""
        return self.digest % max(1, workers)


def fetch(db: ExampleDatabase | None, backend: str, target: str) -> list[Entry]:
    """The saved failures of `backend` on `target`, one entry per distinct case."""
    if db is None:
        return []
    by_case: dict[str, Entry] = {}
    for raw in sorted(db.fetch(_key(backend, target))):
        try:
            value = json.loads(raw)
            case, found_by = value["case"], value.get("found_by", {})
        except (ValueError, KeyError, TypeError):
            continue  # not ours
        text = json.dumps(case, sort_keys=True)
        seen = by_case.get(text)
        by_case[text] = (
            Entry(case, found_by, (raw,)) if seen is None else Entry(case, seen.found_by, (*seen.raws, raw))
        )
    return list(by_case.values())


def remember(db: ExampleDatabase | None, backend: str, target: str, case: dict, found_by: dict) -> None:
    """Saves one failing case (plain values) with who found it."""
    if db is not None:
        db.save(
            _key(backend, target), json.dumps({"case": case, "found_by": found_by}, sort_keys=True).encode()
        )


def forget(db: ExampleDatabase | None, backend: str, target: str, entry: Entry) -> None:
    """Removes a case that passes now."""
    if db is not None:
        for raw in entry.raws:
            db.delete(_key(backend, target), raw)
