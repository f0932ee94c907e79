"""Smoke tests of `python -m fuzz` as a user runs it: campaigns bounded by --max-cases (never by
throughput), an implementation in a file outside the repository, replay from the case file alone,
and the user's own ledger outside the repository."""

import json

from fuzz import case_file
from harness.cases import AttentionCase, LayoutSpec
from harness.judge import Verdict

# The oracle with query head 1 zeroed, in a file of its own outside the repository.
OUTSIDE_KERNEL = '''
import reference


def paged_prefill(*args, **kwargs):
    result = reference.paged_prefill(*args, **kwargs)
    out, lse = result if isinstance(result, tuple) else (result, None)
    out = out.clone()
    if out.shape[1] > 1:
        out[:, 1] = 0
    return out if lse is None else (out, lse)


class impl:
    """A kernel that forgets query head 1."""

    write_kv = None
    paged_decode = None
    paged_prefill = staticmethod(paged_prefill)
    capabilities = {"dtypes": ("float32",)}
'''


def summary_of(tmp_path) -> dict:
    return json.loads((tmp_path / "summary.json").read_text())


def test_campaign_on_the_oracle_runs_exactly_max_cases(tmp_path, fuzz_cli):
    proc = fuzz_cli(
        "--backend", "reference", "--workers", "2", "--max-cases", "10",
        "--target", "prefill", "--target", "write_kv",
        "--summary", tmp_path / "summary.json", "--failures-dir", tmp_path / "failures",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = summary_of(tmp_path)
    assert data["exit_code"] == 0 and not data["failures"] and data["minutes"] is None
    for target in ("prefill", "write_kv"):
        counts = data["counts"][target]
        assert counts["passed"] == 10 and counts["failed"] == counts["unsupported"] == 0, counts
        assert sum(by["passed"] for by in counts["by_dtype"].values()) == 10
    assert "passed 10  failed 0  unsupported 0" in proc.stdout


def test_campaign_dtype_flag_draws_only_that_dtype(tmp_path, fuzz_cli):
    proc = fuzz_cli(
        "--backend", "reference", "--workers", "1", "--max-cases", "12", "--dtype", "float16",
        "--target", "prefill", "--target", "decode", "--target", "engine",
        "--summary", tmp_path / "summary.json", "--failures-dir", tmp_path / "failures",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = summary_of(tmp_path)
    for target in ("prefill", "decode"):
        assert set(data["counts"][target]["by_dtype"]) == {"float16"}
        assert data["counts"][target]["passed"] == 12
    assert "engine" not in data["counts"] and "float32" in data["unavailable"]["engine"]


def test_campaign_on_a_file_outside_the_repository_replays_from_the_file(tmp_path, fuzz_cli):
    (tmp_path / "my_kernel.py").write_text(OUTSIDE_KERNEL)
    failures = tmp_path / "failures"
    # A relative file name, typed in the kernel's own folder.
    proc = fuzz_cli(
        "--backend", "my_kernel.py:impl", "--workers", "1", "--max-cases", "40", "--target", "prefill",
        "--max-failures", "1", "--failures-dir", failures, "--summary", tmp_path / "summary.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    [saved] = failures.glob("*.json")
    data = case_file.load(saved)
    assert data["backend"] == f"{(tmp_path / 'my_kernel.py').resolve()}:impl"
    assert "FAILURE prefill" in proc.stdout and data["case_in_words"] in proc.stdout
    # Replay from the repository root with nothing but the file.
    replay = fuzz_cli("--replay", saved)
    assert replay.returncode == 1 and "REPRODUCED" in replay.stdout, replay.stdout + replay.stderr[-2000:]


def _passing_case_file(folder) -> str:
    case = AttentionCase(
        seed=1,
        seq_lens=(5,),
        query_lens=(3,),
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        page_size=2,
        dtype="float32",
        layout=LayoutSpec(),
    )
    path = case_file.save(
        folder,
        target="prefill",
        backend="reference",
        case=case.to_dict(),
        dtype=case.dtype,
        words=case.describe(),
        verdict=Verdict("failed", 2.0),
        device="cpu",
    )
    return path.name


def test_stale_entry_of_a_user_ledger_outside_the_repository_fails_the_run(tmp_path, fuzz_cli):
    ledger_dir = tmp_path / "my-ledger"
    name = _passing_case_file(ledger_dir / "cases")
    stale = dict(
        id="fixed-long-ago",
        reason="was wrong once",
        issue=7,
        kind="wrong-answer",
        target="prefill",
        backend="reference",
        case=f"cases/{name}",
    )
    # Still wrong on the kernel next to the ledger's folder: named relative to the ledger file.
    (tmp_path / "my_kernel.py").write_text(OUTSIDE_KERNEL)
    still = stale | dict(id="head-one", reason="forgets head 1", backend="../my_kernel.py:impl")
    ledger = ledger_dir / "ledger.json"
    ledger.write_text(json.dumps({"entries": [stale, still]}))
    proc = fuzz_cli(
        "--backend", "reference", "--workers", "1", "--max-cases", "1", "--target", "write_kv",
        "--ledger", ledger, "--summary", tmp_path / "summary.json", "--failures-dir", tmp_path / "failures",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "STALE LEDGER ENTRY: fixed-long-ago (issue #7)" in proc.stdout
    data = summary_of(tmp_path)
    assert data["stale_ledger_entries"] == ["fixed-long-ago"]
    assert not [n for n in data["notes"] if "not replayed" in n], data["notes"]


# A layout family in a file of its own outside the repository: one block of window, no sinks.
OUTSIDE_FAMILY = """
import torch
from hypothesis import strategies as st


class Diagonal:
    def __init__(self, block_size):
        self.block_size = block_size

    def block_mask(self, num_heads, num_blocks):
        return torch.eye(num_blocks, dtype=torch.bool).expand(num_heads, -1, -1)


def family(num_heads):
    return st.builds(Diagonal, st.sampled_from((2, 3, 4)))
"""
# The oracle that forgets the layout (dense causal always), declaring general block masks.
IGNORES_LAYOUT = """
import reference


class impl:
    write_kv = None
    paged_decode = None
    capabilities = {"dtypes": ("float32",), "layouts": ("dense", "block_mask")}

    @staticmethod
    def paged_prefill(*args, layout=None, **kwargs):
        return reference.paged_prefill(*args, **kwargs)
"""


def test_campaign_draws_an_outside_family_and_replays_without_it(tmp_path, fuzz_cli):
    (tmp_path / "diagonal.py").write_text(OUTSIDE_FAMILY)
    (tmp_path / "ignores_layout.py").write_text(IGNORES_LAYOUT)
    failures = tmp_path / "failures"
    proc = fuzz_cli(
        "--backend", "ignores_layout.py:impl", "--layout-family", "diagonal.py:family", "--workers", "1",
        "--max-cases", "30", "--target", "prefill", "--max-failures", "1", "--failures-dir", failures,
        "--summary", tmp_path / "summary.json", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert summary_of(tmp_path)["layout_families"] == [f"{(tmp_path / 'diagonal.py').resolve()}:family"]
    [saved] = failures.glob("*.json")
    case = case_file.load(saved)["case"]
    assert case["layout"]["kind"] == "family" and "Diagonal" in case["layout"]["words"]
    (tmp_path / "diagonal.py").unlink()  # the case file alone replays it
    replay = fuzz_cli("--replay", saved)
    assert replay.returncode == 1 and "REPRODUCED" in replay.stdout, replay.stdout + replay.stderr[-2000:]
