"""Root conftest: runs before anything imports triton.

Sets TRITON_INTERPRET=1 when no GPU is present (triton cannot import its CPU interpreter later),
registers the hypothesis profiles `ci`, `dev` and `nightly`, and the suite's command-line options.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # xdist workers are processes: one thread each avoids oversubscribing the cores.
    torch.set_num_threads(1)

from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(
    deadline=None,
    print_blob=True,
    # The session-wide `impl` and the per-test `expect` recorder are shared by a test's examples on
    # purpose; the first call of a kernel compiles, so examples may be slow.
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
settings.register_profile("ci", max_examples=60, derandomize=True, **_COMMON)
settings.register_profile("dev", max_examples=25, **_COMMON)
settings.register_profile("nightly", max_examples=400, **_COMMON)
# A quick pass for the suite's own tests of itself (tests/harness run pytest on sample implementations).
settings.register_profile("smoke", max_examples=3, derandomize=True, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")
    group = parser.getgroup("implementation under test")
    group.addoption(
        "--backend",
        default="triton",
        help="the implementation every operator test runs against: a built-in name (triton, reference, sdpa, "
        "flex), package.module:attribute or path/to/file.py:attribute (default: %(default)s)",
    )
    group.addoption(
        "--layout-family",
        action="append",
        default=None,
        metavar="NAME",
        help="a layout family the family tests sweep, package.module:attribute or path/to/file.py:attribute "
        "(backends/layout_families.py); repeatable (default: examples/sliding_window_sinks.py:family)",
    )
    group.addoption(
        "--xfails-file",
        default=None,
        help="a file of test-id patterns (fnmatch, one per line, # comments) expected to fail; "
        "an expected failure that passes is reported as a failure",
    )
    group.addoption(
        "--skips-file", default=None, help="a file of test-id patterns (same format) not to run at all"
    )
    group.addoption(
        "--failures-dir",
        default=None,
        help="where a test that crashes or hangs saves its case (default: fuzz/failures)",
    )
    group.addoption(
        "--case-timeout",
        type=float,
        default=300.0,
        help="seconds one judged case may run before the worker is stopped and the test reported as "
        "HANG (default: %(default)s; needs -n, xdist, to go on with the other tests)",
    )
