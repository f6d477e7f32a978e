"""The tested-versions table of README.md and docs/supported-versions.md, from a run.

`.ci/run` records one row per cell in a tab-separated file (step, jax, python,
passed, failed, seconds). This script turns such a file into the markdown table
that README.md and docs/supported-versions.md show between the markers
`<!-- versions-table:start -->` and `<!-- versions-table:end -->`, so that the
figures there come from a run rather than being typed.

    python .ci/versions_table.py RESULTS.tsv            # print the table
    python .ci/versions_table.py RESULTS.tsv --write    # and rewrite both files

A partial run (some cells only) replaces the rows of the cells it ran and keeps
the others, each with the date and commit it was measured on.
"""

import argparse
import datetime
import pathlib
import re
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = (ROOT / "README.md", ROOT / "docs" / "supported-versions.md")
START, END = "<!-- versions-table:start -->", "<!-- versions-table:end -->"
HEADER = (
    "| cell | JAX | Python | passed | failed | measured |",
    "|---|---|---|---|---|---|",
)


def read_results(path: pathlib.Path, measured: str) -> dict[str, list[str]]:
    """`{"cell | python": [cell, jax, python, passed, failed, measured]}` from a results file.

    **Arguments:**

    - `path`: the tab-separated file `.ci/run` writes (a header line, then one
      line per cell: step, jax, python, passed, failed, seconds).
    - `measured`: what the `measured` column says for these rows (a date and a
      commit).

    **Returns:**

    The rows, keyed by cell name and Python version (a cell such as the README's
    first command runs on several), in the file's order.
    """
    rows = {}
    lines = path.read_text().splitlines()
    for line in lines[1:]:
        fields = line.split("\t")
        if len(fields) < 5:
            continue
        step, jax_version, python, passed, failed = fields[:5]
        # The slow shard changes from commit to commit: the cell is the main suite.
        step = re.sub(r", slow \d+/\d+$", "", step)
        rows[f"{step} | {python}"] = [step, jax_version, python, passed, failed, measured]
    return rows


def existing_rows(text: str) -> dict[str, list[str]]:
    """The table's rows already between the markers of `text`, keyed as `read_results`'s."""
    if START not in text or END not in text:
        return {}
    block = text[text.index(START) + len(START) : text.index(END)]
    rows = {}
    for line in block.splitlines():
        if not line.startswith("| ") or line in HEADER:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(HEADER[0].strip("|").split("|")):
            rows[f"{cells[0]} | {cells[2]}"] = cells
    return rows


def render(rows: dict[str, list[str]]) -> str:
    """The markdown table of `rows`."""
    return "\n".join([*HEADER, *("| " + " | ".join(r) + " |" for r in rows.values())])


def rewrite(text: str, table: str) -> str:
    """`text` with the block between the markers replaced by `table`."""
    if START not in text or END not in text:
        raise SystemExit(f"versions_table: no {START} ... {END} block to rewrite")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=pathlib.Path)
    parser.add_argument("--write", action="store_true", help="rewrite README.md and the docs page")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--commit", default=None)
    args = parser.parse_args(argv)
    measured = f"{args.date}, {args.commit or _commit()}"
    new = read_results(args.results, measured)
    for path in FILES:
        text = path.read_text()
        rows = existing_rows(text)
        rows.update(new)
        table = render(rows)
        if args.write:
            path.write_text(rewrite(text, table))
    print(render({**existing_rows(FILES[0].read_text()), **new}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
