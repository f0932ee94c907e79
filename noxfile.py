"""Entry points of the suite (docs/contract.md §7). Dependencies come from pyproject.toml's groups.

The project itself is never installed: sessions run from the repository root, where `reference`,
`kernels`, `backends`, `engine`, `harness`, `tests`, `fuzz` and `reports` are importable.

All sessions share one virtual environment, `.nox/suite`, made by `suite_python` rather than by nox
(which would build, and refill with torch, one environment per session): it is created on the
first run and reinstalled only when the pins it was built from change, so a second run of any
session starts its work within seconds.
"""

import hashlib
import pathlib
import re
import shutil
import sys

import nox

nox.options.sessions = ["lint", "tests"]

PYPROJECT = nox.project.load_toml("pyproject.toml")
GROUPS = ("test", "lint")
SUITE_ENV = pathlib.Path(".nox") / "suite"
PINS_FILE = SUITE_ENV / "pins.sha256"
# Triton must know before its first import whether to use the CPU interpreter.
ENV = {"PYTHONPATH": "."} | ({} if shutil.which("nvidia-smi") else {"TRITON_INTERPRET": "1"})
# The oracle imports nothing but torch, math and the standard library.
FORBIDDEN_IN_REFERENCE = (
    r"^\s*(import|from)\s+(triton|kernels|backends|engine|harness|numpy|scipy|fuzz|reports|tests)\b"
)
# The engine is a product, not a test: it never imports the test harness, the campaign or the reports.
FORBIDDEN_IN_ENGINE = r"^\s*(import|from)\s+(harness|fuzz|reports|tests)\b"


def suite_python(session: nox.Session) -> str:
    """The shared environment's python, created or updated first when pyproject.toml's pins changed."""
    pins = [dep for group in GROUPS for dep in nox.project.dependency_groups(PYPROJECT, group)]
    digest = hashlib.sha256("\n".join(pins).encode()).hexdigest()
    python = SUITE_ENV / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    if not python.exists():
        session.run(sys.executable, "-m", "venv", str(SUITE_ENV), external=True)
    if not PINS_FILE.exists() or PINS_FILE.read_text() != digest:
        session.log(f"installing the pinned dependencies into {SUITE_ENV}")
        session.run(str(python), "-m", "pip", "install", "--quiet", *pins, external=True)
        PINS_FILE.write_text(digest)
    return str(python)


def run(session: nox.Session, *args: str) -> None:
    session.run(suite_python(session), *args, env=ENV, external=True)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The whole suite; on the CPU the kernels run under TRITON_INTERPRET=1.

    `nox -s tests -- --backend NAME` runs every operator test against another implementation.
    """
    run(session, "-m", "pytest", "-n", "auto", *session.posargs)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff, plus the reference-purity and banned-API greps."""
    run(session, "-m", "ruff", "check", ".")
    run(session, "-m", "ruff", "format", "--check", ".")
    _forbid(session, "reference", FORBIDDEN_IN_REFERENCE)
    _forbid(session, "engine", FORBIDDEN_IN_ENGINE)
    _forbid(session, "kernels", r"make_block_ptr|tl\.advance")  # deprecated block pointers (STYLE 8)


def _forbid(session: nox.Session, folder: str, pattern: str) -> None:
    hits = [
        f"{path}:{i}: {line.strip()}"
        for path in sorted(pathlib.Path(folder).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(pattern, line)
    ]
    if hits:
        session.error(f"{folder}/ matches the banned pattern {pattern!r}:\n" + "\n".join(hits))


@nox.session(name="kernel-fuzz", venv_backend="none")
def kernel_fuzz(session: nox.Session) -> None:
    """Time-boxed fuzz campaign: `nox -s kernel-fuzz -- --minutes 1 --target prefill`."""
    run(session, "-m", "fuzz", *session.posargs)


@nox.session(venv_backend="none")
def report(session: nox.Session) -> None:
    """Numerical accuracy report under reports/<device>/ (markdown, PNG plots, JSON)."""
    run(session, "-m", "reports.accuracy", *session.posargs)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks: the GPU ones (kernels, engine TTFT) where a GPU is, the host-cost one anywhere."""
    run(session, "-m", "reports.bench", *session.posargs)
