"""The accuracy report (reports/accuracy.py) end to end on the tiny profile: the conformance matrix
judges each implementation, a narrow one is unsupported (never FAIL) outside what it declares, and
every file the report names on stdout exists."""

import json
import pathlib

from reports import accuracy
from reports.accuracy_measure import load_implementations

NARROW = '''
"""Dense causal float32 only: the oracle behind a narrow declaration."""
from types import SimpleNamespace

import reference

narrow = SimpleNamespace(
    write_kv=None,
    paged_prefill=reference.paged_prefill,
    paged_decode=reference.paged_decode,
    capabilities={"dtypes": ("float32",), "layouts": ("dense",)},
)
'''


def table_lines(markdown: str, heading: str) -> list[str]:
    """The table lines of one `## heading` section."""
    section = markdown.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|")]


def verdicts(markdown: str) -> dict:
    """{implementation: verdict} from the report's verdict table."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table_lines(markdown, "Verdicts")[2:]]
    return {row[0].strip("`"): row[1] for row in rows}


def conformance_matrix(markdown: str) -> dict:
    """{(operator, layout, dtype): {implementation: cell}} from the report's matrix section."""
    lines = table_lines(markdown, "Conformance matrix")
    names = [c.strip().strip("`") for c in lines[0].strip("|").split("|")][3:]
    matrix = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        matrix[tuple(cells[:3])] = dict(zip(names, cells[3:], strict=True))
    return matrix


def test_accuracy_report(tmp_path, capsys):
    (tmp_path / "narrow.py").write_text(NARROW)
    narrow = f"{tmp_path / 'narrow.py'}:narrow"
    out = tmp_path / "report"
    assert accuracy.main(["--profile", "tiny", "--backend", f"reference,{narrow}", "--out", str(out)]) == 0
    written = [
        pathlib.Path(line.removeprefix("wrote "))
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("wrote ")
    ]
    assert {p.suffix for p in written} == {".md", ".json", ".png"}
    assert all(p.is_file() and p.stat().st_size > 0 for p in written), written
    markdown = next(p for p in written if p.suffix == ".md").read_text()
    matrix = conformance_matrix(markdown)

    assert matrix and all(set(row) == {"reference", narrow} for row in matrix.values())
    assert all(row["reference"] == "pass" for row in matrix.values())
    for (op, layout, dtype), row in matrix.items():
        if op == "write_kv":
            want = "-"  # the narrow implementation provides no write_kv
        elif (layout, dtype) == ("dense", "float32"):
            want = "pass"
        else:
            want = "unsupported"
        assert row[narrow] == want, (op, layout, dtype, row)
    assert verdicts(markdown) == {"reference": "pass", narrow: "pass"}
    data = json.loads(next(p for p in written if p.suffix == ".json").read_text())
    assert [i["name"] for i in data["implementations"]] == ["reference", narrow]
    assert {r["status"] for r in data["rows"] if r["implementation"] == narrow} == {
        "passed",
        "unsupported",
        "not provided",
    }


def test_load_implementations_keeps_the_reason(tmp_path):
    loaded, unavailable = load_implementations(["reference", f"{tmp_path / 'missing.py'}:impl"])
    assert list(loaded) == ["reference"]
    assert "missing.py" in unavailable[f"{tmp_path / 'missing.py'}:impl"]
