"""Root conftest: runs before anything imports triton.

Sets TRITON_INTERPRET=1 when no GPU is present (triton cannot import its CPU interpreter later), and
registers the hypothesis profiles `ci`, `dev` and `nightly`.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # xdist workers are processes: one thread each avoids oversubscribing the cores.
    torch.set_num_threads(1)

from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(
    deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("ci", max_examples=60, derandomize=True, **_COMMON)
settings.register_profile("dev", max_examples=25, **_COMMON)
settings.register_profile("nightly", max_examples=400, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")
