"""The campaign's speed as a table: cases per minute per target, where the time went, time to first
failure, from the JSON summaries of `python -m fuzz --summary` (reports/gpu_check.sh campaign).

    python -m reports.campaign_speed --out reports/gpu RUN=SUMMARY.json ...

RUN names a row (`cold`, `warm`, `first-failure-cold`, ...). Writes campaign-speed.md beside the
summaries' numbers in campaign-speed.json.
"""

import argparse
import json
import pathlib

from fuzz.summary import TIME_PHASES


def row(name: str, data: dict) -> dict:
    """One run's figures."""
    rates = data.get("cases_per_minute", {})
    counts = data.get("counts", {})
    failed = sum(counts[t].get(s, 0) for t in counts for s in ("failed", "crashed", "hung"))
    return {
        "run": name,
        "backend": data["backend"],
        "workers": data["workers"],
        "elapsed_s": data["elapsed_s"],
        "cases": sum(sum(v for k, v in c.items() if k != "by_dtype") for c in counts.values()),
        "cases_per_minute": rates,
        "failing_cases": failed,
        "crashed_or_hung": sum(counts[t].get(s, 0) for t in counts for s in ("crashed", "hung")),
        "first_failure_s": data.get("first_failure_s"),
        "first_saved_failure_s": data.get("first_saved_failure_s"),
        "time_split": data.get("time_split", {}),
        "notes": data.get("notes", []),
        "exit_code": data.get("exit_code"),
    }


def markdown(rows: list[dict]) -> str:
    targets = sorted({t for r in rows for t in r["cases_per_minute"] if t != "total"})
    lines = [
        "# Campaign speed",
        "",
        "`python -m fuzz` as a user runs it (default workers; `reports/gpu_check.sh OUT campaign`).",
        "Cases per minute are judged cases over the campaign's wall time, start-up included.",
        "",
        "| run | backend | workers | wall s | cases | cases/min | "
        + " | ".join(targets)
        + " | failing | crashed/hung | first failure s | first saved s |",
        "| --- | --- | --- | --- | --- | --- | "
        + " | ".join("---" for _ in targets)
        + " | --- | --- | --- | --- |",
    ]
    for r in rows:
        rates = r["cases_per_minute"]
        lines.append(
            f"| {r['run']} | `{r['backend']}` | {r['workers']} | {r['elapsed_s']} | {r['cases']} | "
            f"{rates.get('total', 0)} | "
            + " | ".join(str(rates.get(t, "-")) for t in targets)
            + f" | {r['failing_cases']} | {r['crashed_or_hung']} | {r['first_failure_s'] or '-'} | "
            f"{r['first_saved_failure_s'] or '-'} |"
        )
    lines += ["", "## Where the workers' time went", ""]
    lines += ["Share of worker-seconds per target (ms per judged case in parentheses).", ""]
    lines += ["| run | target | worker-s | " + " | ".join(TIME_PHASES) + " |"]
    lines += ["| --- | --- | --- | " + " | ".join("---" for _ in TIME_PHASES) + " |"]
    for r in rows:
        for target, split in r["time_split"].items():
            cells = [
                f"{100 * split['share'].get(p, 0):.0f}% ({split['ms_per_case'].get(p) or 0:.0f})"
                for p in TIME_PHASES
            ]
            total = sum(split["seconds"].values())
            lines.append(f"| {r['run']} | {target} | {total:.0f} | " + " | ".join(cells) + " |")
    notes = [f"- {r['run']}: {n}" for r in rows for n in r["notes"]]
    if notes:
        lines += ["", "## Notes", "", *notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("runs", nargs="+", metavar="RUN=SUMMARY")
    args = p.parse_args(argv)
    rows = []
    for spec in args.runs:
        name, _, path = spec.partition("=")
        if pathlib.Path(path).is_file():
            rows.append(row(name, json.loads(pathlib.Path(path).read_text())))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "campaign-speed.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "campaign-speed.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
