"""One place decides what runs where: hardware gating, the implementation under test, capabilities.

- Markers `gpu` (real device required) and `slow` (excluded by default) get their skips at collection.
- `--backend NAME` (harness/registry.py) selects the implementation every operator test receives as
  the `impl` fixture. Tests of something it does not declare are skipped at collection, with the
  reason: the marker `operator(name, ...)` names the operators a test calls, `requires(lse=True, ...)`
  the capabilities it needs, and parameters called `dtype`, `layout_kind`, `operator` or `case` are
  checked against what it declares and provides. Tests marked `ours` test this repository's own
  kernels and run only with the default backend `triton`.
- `--xfails-file` / `--skips-file`: the user's own lists of test-id patterns.
- An implementation that refuses a drawn case (NotImplementedError, or ValueError on valid input)
  makes it *unsupported*: never passed or failed, counted per test and summed at the end.
"""

import fnmatch
import pathlib

import pytest
import torch
from hypothesis import event

from harness import registry

IMPLEMENTATION = pytest.StashKey()
PATTERNS = pytest.StashKey()
UNSUPPORTED_PROPERTY = "unsupported_cases"
# The built-ins of this repository declare everything they support: a refusal of theirs is a bug.
REFUSE_NOTHING = ("triton", "reference")


def _patterns(path) -> list[str]:
    if path is None:
        return []
    lines = pathlib.Path(path).read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def pytest_configure(config):
    config.stash[IMPLEMENTATION] = registry.load(config.getoption("--backend"))
    config.stash[PATTERNS] = {
        "xfail": (config.getoption("--xfails-file"), _patterns(config.getoption("--xfails-file"))),
        "skip": (config.getoption("--skips-file"), _patterns(config.getoption("--skips-file"))),
    }
    for line in (
        "operator(*names): the operators of the implementation under test that the test calls",
        "requires(**capabilities): capabilities (lse, context, validates) the test needs",
        "ours: a test of this repository's own kernels (runs only with --backend triton)",
        "planned: a test of the planned path (plan_prefill / plan_decode), where the implementation has one",
    ):
        config.addinivalue_line("markers", line)


def _refusal(item, impl) -> str | None:
    """Why `item` cannot run against `impl`, or None."""
    caps = impl.capabilities
    if item.get_closest_marker("ours") and impl.name != registry.DEFAULT_BACKEND:
        return f"tests this repository's kernels; --backend is {impl.name}"
    if item.get_closest_marker("planned") and not impl.planners:
        return f"{impl.name} has no planned path (plan_prefill / plan_decode)"
    for marker in item.iter_markers("operator"):
        missing = [op for op in marker.args if not impl.provides(op)]
        if missing:
            return f"{impl.name} provides no {', '.join(missing)}"
    for marker in item.iter_markers("requires"):
        for key, wanted in marker.kwargs.items():
            if getattr(caps, key) != wanted:
                return f"needs capability {key}={wanted}; {impl.name} declares {getattr(caps, key)}"
    params = getattr(item, "callspec", None)
    params = params.params if params else {}
    if "dtype" in params and params["dtype"] not in caps.dtypes:
        return f"{impl.name} does not declare dtype {params['dtype']} (declares {', '.join(caps.dtypes)})"
    if "operator" in params and not impl.provides(params["operator"]):
        return f"{impl.name} provides no {params['operator']}"
    if "layout_kind" in params and params["layout_kind"] not in caps.layouts:
        return f"{impl.name} does not declare layout {params['layout_kind']}"
    case = params.get("case")
    marker = item.get_closest_marker("operator")
    if case is not None and marker is not None:
        return next((r for r in (impl.capabilities.refuses(case, op) for op in marker.args) if r), None)
    return None


def pytest_collection_modifyitems(config, items):
    impl = config.stash[IMPLEMENTATION]
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_slow = pytest.mark.skip(reason="slow: pass --run-slow")
    used = {kind: set() for kind in config.stash[PATTERNS]}
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(no_slow)
        if "impl" in item.fixturenames:
            reason = _refusal(item, impl)
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"not declared: {reason}"))
        for kind, (path, patterns) in config.stash[PATTERNS].items():
            hits = [p for p in patterns if fnmatch.fnmatchcase(item.nodeid, p)]
            used[kind].update(hits)
            if hits and kind == "xfail":
                item.add_marker(pytest.mark.xfail(strict=True, reason=f"listed in {path} ({hits[0]})"))
            elif hits:
                item.add_marker(pytest.mark.skip(reason=f"listed in {path} ({hits[0]})"))
    config.stash[PATTERNS] = {
        kind: (path, [p for p in patterns if p not in used[kind]])
        for kind, (path, patterns) in config.stash[PATTERNS].items()
    }


def pytest_report_header(config):
    impl = config.stash[IMPLEMENTATION]
    caps = ", ".join(f"{k}={v}" for k, v in impl.capabilities.as_dict().items() if v is not None)
    return f"implementation under test: {impl.name} ({impl.description or 'no description'}); {caps}"


def pytest_terminal_summary(terminalreporter, config):
    unsupported = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == UNSUPPORTED_PROPERTY:
                    unsupported[report.nodeid] = value
    impl = config.stash[IMPLEMENTATION]
    if unsupported:
        total = sum(n for n, _ in unsupported.values())
        terminalreporter.write_sep(
            "-", f"unsupported cases of {impl.name}: {total} in {len(unsupported)} test(s)"
        )
        for nodeid, (n, reason) in sorted(unsupported.items()):
            terminalreporter.write_line(f"{n:5d}  {nodeid}  (e.g. {reason})")
    for kind, (path, stale) in config.stash[PATTERNS].items():
        if stale:
            terminalreporter.write_line(f"patterns of {path} ({kind}) that match no test: {', '.join(stale)}")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the tests run on: the GPU when there is one, else the CPU (Triton interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def impl(pytestconfig) -> registry.Implementation:
    """The implementation under test (`--backend`, default triton)."""
    return pytestconfig.stash[IMPLEMENTATION]


@pytest.fixture
def expect(impl, record_property):
    """`expect(verdict)`: fails on a failed verdict, counts an unsupported one.

    Under hypothesis the counter spans all of a test's examples; in a test without `@given`, an
    unsupported verdict skips the test with the implementation's reason.
    """
    refused = []

    def check(verdict, *, single: bool = False):
        if verdict.status == "failed":
            raise AssertionError(verdict.message)
        if verdict.status != "unsupported":
            return
        if impl.name in REFUSE_NOTHING:
            raise AssertionError(f"{impl.name} refused a case it supports: {verdict.message}")
        refused.append(verdict.message)
        if single:
            pytest.skip(f"unsupported by {impl.name}: {verdict.message}")
        event("unsupported case")

    yield check
    if refused:
        record_property(UNSUPPORTED_PROPERTY, (len(refused), refused[0][:120]))
