"""Implementation names as the campaign records them: the same string from any working directory.

A registry name (backends/registry.py) of the form `path/to/file.py:attr` is relative to the working
directory it was typed in. The campaign records it in a canonical form instead: relative to the
repository root when the file lies inside the repository (so a case file stays valid in another
checkout), absolute otherwise. Built-in names and `package.module:attr` are kept as they are.
"""

import pathlib


def _repo() -> pathlib.Path:
    # Imported late: spawned workers import this module (via fuzz.campaign) before their environment
    # is set, and backends.registry imports torch.
    from backends.registry import REPO

    return REPO


def _file_part(name: str) -> tuple[str, str] | None:
    """(path, attribute) of a `file.py:attr` name, else None (the registry's own test of the form)."""
    where, sep, attr = name.rpartition(":")
    if not sep or not (where.endswith(".py") or "/" in where or "\\" in where):
        return None
    return where, attr


def canonical(name: str, base=None) -> str:
    """The recorded form of `name`; a relative file path is taken relative to `base` (default: the
    working directory), as the ledger does for its own entries."""
    part = _file_part(name)
    if part is None:
        return name
    path = pathlib.Path(part[0]).expanduser()
    if not path.is_absolute():
        path = pathlib.Path(base or pathlib.Path.cwd()) / path
    path = path.resolve()
    try:
        return f"{path.relative_to(_repo()).as_posix()}:{part[1]}"
    except ValueError:
        return f"{path}:{part[1]}"


def loadable(name: str) -> str:
    """A canonical name as `registry.load` takes it from any working directory (repository-relative
    files made absolute)."""
    part = _file_part(name)
    if part is None or pathlib.Path(part[0]).expanduser().is_absolute():
        return name
    return f"{_repo() / part[0]}:{part[1]}"


def slug(name: str) -> str:
    """A short file-name-safe label of a name: `my_kernel-impl` for `/x/my_kernel.py:impl`."""
    part = _file_part(name)
    if part is not None:
        name = f"{pathlib.PurePath(part[0].replace(chr(92), '/')).stem}:{part[1]}"
    return "".join(c if c.isalnum() or c in "._" else "-" for c in name)
