"""Hardware gating: `gpu` and `slow` markers get their skips at collection, never in a test body."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_slow = pytest.mark.skip(reason="slow: pass --run-slow")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(no_slow)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the tests run on: the GPU when there is one, else the CPU (Triton interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
