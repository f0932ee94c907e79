"""One place decides what runs where: hardware gating, the implementation under test, capabilities.

- Markers `gpu` (real device required) and `slow` (excluded by default) get their skips at collection.
- `--backend NAME` (backends/registry.py) selects the implementation every operator test receives as
  the `impl` fixture. Tests of something it does not declare are skipped at collection, with the
  reason: the marker `operator(name, ...)` names the operators a test calls, `requires(lse=True, ...)`
  the capabilities it needs, and parameters called `dtype`, `layout_kind`, `operator` or `case` are
  checked against what it declares and provides. Tests marked `ours` test this repository's own
  kernels and run only with the default backend `triton`.
- `--layout-family NAME` (backends/layout_families.py, repeatable) selects the families that tests
  taking a `family` parameter sweep; by default the example family of examples/. A family's layouts
  are general block masks: an implementation that does not declare `block_mask` skips them.
- `--xfails-file` / `--skips-file`: the user's own lists of test-id patterns.
- An implementation that refuses a drawn case with NotImplementedError makes it *unsupported*: never
  passed or failed, counted per test and summed at the end. A ValueError or TypeError on a valid
  case is a failure ("rejected a valid input", contract §9).
- Crashes and hangs (harness/isolation.py): every judged case is written to an in-flight file before
  the call, under a hang guard of `--case-timeout` seconds. When an xdist worker dies, the controller
  reports the test that was running by name, with its case, a saved case file and the command that
  replays it in a child process; a worker whose GPU is left unusable exits on purpose, so that the
  tests after it run on a fresh CUDA context.
- The hypothesis example database is kept per implementation, under `.hypothesis/examples/<name>`,
  so one implementation's failures never change another's draws.
"""

import contextlib
import fnmatch
import os
import pathlib
import shutil
import tempfile

import pytest
import torch
from hypothesis import event, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from backends import layout_families, registry
from fuzz import backend_names, case_file, saved_failures
from harness import isolation

IMPLEMENTATION = pytest.StashKey()
FAMILIES = pytest.StashKey()
REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_FAMILIES = (f"{REPO / 'examples' / 'sliding_window_sinks.py'}:family",)
PATTERNS = pytest.StashKey()
INFLIGHT_FOLDER = pytest.StashKey()
UNSUPPORTED_PROPERTY = "unsupported_cases"
# The built-ins of this repository declare everything they support: a refusal of theirs is a bug.
REFUSE_NOTHING = ("triton", "reference")


def _patterns(path) -> list[str]:
    if path is None:
        return []
    lines = pathlib.Path(path).read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


CRASH_FOLDER = pathlib.Path(__file__).resolve().parent.parent / "fuzz" / "failures"  # --failures-dir
MAX_WORKER_RESTARTS = 500


def example_database(impl) -> pathlib.Path:
    """Where hypothesis keeps the failing examples of one implementation (the campaign's too)."""
    return saved_failures.default_location(impl.name)


def pytest_configure(config):
    impl = registry.load(config.getoption("--backend"))
    config.stash[IMPLEMENTATION] = impl
    names = config.getoption("--layout-family") or DEFAULT_FAMILIES
    config.stash[FAMILIES] = [layout_families.load(name) for name in names]
    current = settings.get_current_profile_name()
    settings.register_profile(
        f"{current}-{impl.name}",
        parent=settings.get_profile(current),
        database=DirectoryBasedExampleDatabase(str(example_database(impl))),
    )
    settings.load_profile(f"{current}-{impl.name}")
    if getattr(config.option, "maxworkerrestart", "") is None:
        # Every crash of a kernel under test costs a worker (xdist's default allows 4 per worker).
        config.option.maxworkerrestart = str(MAX_WORKER_RESTARTS)
    if not hasattr(config, "workerinput") and isolation.INFLIGHT_ENV not in os.environ:
        # The controller's folder, inherited by the xdist workers it starts after this.
        os.environ[isolation.INFLIGHT_ENV] = tempfile.mkdtemp(prefix="suite-inflight-")
        config.stash[INFLIGHT_FOLDER] = os.environ[isolation.INFLIGHT_ENV]
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


def pytest_generate_tests(metafunc):
    if "family" in metafunc.fixturenames:
        families = metafunc.config.stash[FAMILIES]
        metafunc.parametrize("family", families, ids=[pathlib.Path(f.name).name for f in families])


def pytest_unconfigure(config):
    folder = config.stash.get(INFLIGHT_FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(isolation.INFLIGHT_ENV, None)


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
    if "family" in params and "block_mask" not in caps.layouts:
        return f"{impl.name} does not declare layout block_mask (a layout family's layouts are block masks)"
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
    return [
        f"implementation under test: {impl.name} ({impl.description or 'no description'}); {caps}",
        f"hypothesis examples of {impl.name}: {example_database(impl)}",
    ]


def pytest_handlecrashitem(crashitem, report, sched):
    """xdist: a worker died while running `crashitem`; report its case, save it, say how to replay it."""
    worker, config = report.node.gateway.id, report.node.config
    record = isolation.InFlight.read(os.environ[isolation.INFLIGHT_ENV], worker)
    if record is None or record.get("test") != crashitem:
        return
    status = record.get("status") or isolation.crash_status(record)
    what = {
        "hung": f"HANG: no result within the per-case limit of {record['case_timeout']:g} s (--case-timeout)",
        "crashed": record.get("message") or "CRASH: the worker process died while running the case",
    }[status]
    lines = [f"{what}", f"  test:   {crashitem}"]
    if record.get("case") is not None:
        from harness.judge import Verdict

        path = case_file.save(
            config.getoption("--failures-dir") or CRASH_FOLDER,
            target=record["target"],
            backend=record["backend"],
            case=record["case"],
            dtype=record["case"]["dtype"],
            words=record["words"],
            verdict=Verdict(status, float("inf"), what),
            device=record["device"],
        )
        lines += [
            f"  case:   {record['words']}",
            f"  saved:  {case_file.display_path(path)}",
            f"  replay: {case_file.REPLAY_COMMAND.format(path=case_file.display_path(path))}",
        ]
    else:
        lines.append(f"  replay: python -m pytest '{crashitem}' --backend {record['backend']}")
    report.longrepr = "\n".join(lines + [f"  ({report.longrepr})"])


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


@pytest.fixture(scope="session")
def worker_record(pytestconfig) -> isolation.InFlight:
    """This worker's in-flight record (harness/isolation.py): the case it is running, for the controller."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    return isolation.InFlight(
        os.environ[isolation.INFLIGHT_ENV], worker, pytestconfig.getoption("--case-timeout")
    )


@pytest.fixture
def in_flight(worker_record, impl, device, request):
    """`with in_flight(target, case):` around one call of the implementation under test; without a
    case (a table entry), the record names the test alone."""

    @contextlib.contextmanager
    def running(target: str | None = None, case=None):
        record = dict(test=request.node.nodeid, backend=backend_names.canonical(impl.name))
        if case is not None:
            record |= dict(target=target, case=case.to_dict(), words=case.describe(), device=str(device))
        worker_record.begin(record)
        try:
            yield
        finally:
            worker_record.end()

    return running


@pytest.fixture
def expect(impl, record_property, worker_record):
    """`expect(verdict)`: fails on a failed verdict (wrong, crashed, hung), counts an unsupported one.

    Under hypothesis the counter spans all of a test's examples; in a test without `@given`, an
    unsupported verdict skips the test with the implementation's reason. A crash that leaves the GPU
    unusable ends this worker (xdist replaces it and reports the test with its case) or, without
    xdist, the session: no later test could run on that device.
    """
    refused = []

    def check(verdict, *, single: bool = False):
        if verdict.status == "crashed" and torch.cuda.is_available():
            if os.environ.get("PYTEST_XDIST_WORKER"):
                worker_record.device_lost(verdict.message)
            pytest.exit(f"{verdict.message}: no later test can run on this device; run with -n", 1)
        if verdict.failed:
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
