"""reports/host_proxy.py: the CPU proxy of a cached request's host work stops at the first replay."""

import re

import pytest
import torch

from reports import host_proxy


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU tool: on a GPU the graphs are CUDA graphs")
def test_host_proxy_times_the_path_up_to_the_first_replay(capsys):
    host_proxy.main(["--requests", "4", "--length", "96", "--phases"])
    out = capsys.readouterr().out
    until = float(re.search(r"until the first replay\s+([\d.]+)", out).group(1))
    launch = float(re.search(r"PrefillGraph.run\s+([\d.]+)", out).group(1))
    assert 0 < launch < until  # the stand-in stopped inside the step's prefill graph, not after it


def test_host_proxy_refuses_to_run_compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit, match="TRITON_INTERPRET=1"):
        host_proxy.main([])


def test_host_proxy_wants_more_requests_than_its_warm_up():
    with pytest.raises(SystemExit):
        host_proxy.main(["--requests", str(host_proxy.WARMUP)])
