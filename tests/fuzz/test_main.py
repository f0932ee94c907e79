"""The command line of `python -m fuzz` (fuzz/__main__.py): every flag explained, any registry name
accepted, and the bounds a user gets by default."""

import pytest

from fuzz import __main__ as cli


def test_every_flag_has_help_text():
    for action in cli.parser()._actions:
        assert action.help and action.help.strip(), action.option_strings


def test_help_explains_the_worst_ratio_and_the_exit_codes():
    text = cli.parser().format_help()
    assert "worst ratio: contract §5's worst gate ratio, error / allowed error" in text
    assert "exit codes:" in text and "--max-cases" in text


@pytest.mark.parametrize("name", ["flex", "pkg.module:impl", "/elsewhere/my_kernel.py:impl", "anything"])
def test_backend_takes_any_name(name):
    # The registry, not argparse, decides what a name means (an unknown one fails when loaded).
    assert cli.parse_args(["--backend", name]).backend == name


def test_time_box_by_default_and_none_with_only_max_cases():
    assert cli.parse_args([]).minutes == cli.DEFAULT_MINUTES
    assert cli.parse_args(["--max-cases", "5"]).minutes is None
    assert cli.parse_args(["--max-cases", "5", "--minutes", "1"]).minutes == 1.0
    assert cli.parse_args([]).target == ["prefill", "decode", "write_kv", "engine"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-cases", "0"],
        ["--dtype", "int8"],
        ["--ledger", "/no/such/ledger.json"],
        ["--replay", "/no/such.json"],
    ],
)
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    assert "error:" in capsys.readouterr().err
