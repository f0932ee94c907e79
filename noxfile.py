"""Entry points of the suite (SPEC section 7). Dependencies come from pyproject.toml's groups.

The project itself is never installed: sessions run from the repository root, where `reference`,
`kernels`, `engine`, `tests`, `fuzz` and `reports` are importable.
"""

import pathlib
import re
import shutil

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "tests"]

PYPROJECT = nox.project.load_toml("pyproject.toml")
TEST_DEPS = nox.project.dependency_groups(PYPROJECT, "test")
LINT_DEPS = nox.project.dependency_groups(PYPROJECT, "lint")
# Triton must know before its first import whether to use the CPU interpreter.
ENV = {"PYTHONPATH": "."} | ({} if shutil.which("nvidia-smi") else {"TRITON_INTERPRET": "1"})
# The oracle imports nothing but torch, math and the standard library.
FORBIDDEN_IN_REFERENCE = r"^\s*(import|from)\s+(triton|kernels|engine|numpy|scipy|fuzz|reports|tests)\b"


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite; on the CPU the kernels run under TRITON_INTERPRET=1."""
    session.install(*TEST_DEPS)
    session.run("pytest", "-n", "auto", *session.posargs, env=ENV)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, plus the reference-purity and banned-API greps."""
    session.install(*LINT_DEPS)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    _forbid(session, "reference", FORBIDDEN_IN_REFERENCE)
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


@nox.session(name="kernel-fuzz")
def kernel_fuzz(session: nox.Session) -> None:
    """Time-boxed fuzz campaign: `nox -s kernel-fuzz -- --minutes 1 --target prefill`."""
    session.install(*TEST_DEPS)
    session.run("python", "-m", "fuzz", *session.posargs, env=ENV)


@nox.session
def report(session: nox.Session) -> None:
    """Numerical accuracy report under reports/<device>/ (markdown, PNG plots, JSON)."""
    session.install(*TEST_DEPS)
    session.run("python", "-m", "reports.accuracy", *session.posargs, env=ENV)


@nox.session
def bench(session: nox.Session) -> None:
    """GPU benchmarks; on a machine without a GPU it says why it does nothing and exits 0."""
    session.install(*TEST_DEPS)
    session.run("python", "-m", "reports.bench", *session.posargs, env=ENV)
