"""`.ci/versions_table.py`: the README's tested-versions table comes from a run."""

import importlib.util
import pathlib


_ROOT = pathlib.Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location(
    "versions_table", _ROOT / ".ci" / "versions_table.py"
)
assert _SPEC is not None and _SPEC.loader is not None
versions_table = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(versions_table)


def test_a_partial_run_replaces_its_rows_and_keeps_the_others(tmp_path):
    results = tmp_path / "results.tsv"
    results.write_text(
        "step\tjax\tpython\tpassed\tfailed\tseconds\n"
        "main suite, slow 3/6\t0.10.2\t3.11.7\t2600\t0\t900\n"
        "demo (README)\t0.12.0.1\t3.12.1\t1\t0\t-\n"
    )
    page = (
        "before\n"
        f"{versions_table.START}\n"
        "| cell | JAX | Python | passed | failed | measured |\n"
        "|---|---|---|---|---|---|\n"
        "| main suite | 0.10.2 | 3.11.7 | 2477 | 0 | 2026-11-24, 37bb9e0 |\n"
        "| demo (README) | 0.10.2 | 3.11.7 | 1 | 0 | 2026-11-24, 37bb9e0 |\n"
        "| demo (README) | 0.12.0.1 | 3.12.1 | 0 | 1 | 2026-11-24, 37bb9e0 |\n"
        f"{versions_table.END}\n"
        "after\n"
    )
    rows = versions_table.existing_rows(page)
    rows.update(versions_table.read_results(results, "2026-11-29, abc1234"))
    written = versions_table.rewrite(page, versions_table.render(rows))
    assert written.startswith("before\n") and written.endswith("after\n")
    again = versions_table.existing_rows(written)
    assert list(again.values()) == [
        ["main suite", "0.10.2", "3.11.7", "2600", "0", "2026-11-29, abc1234"],
        ["demo (README)", "0.10.2", "3.11.7", "1", "0", "2026-11-24, 37bb9e0"],
        ["demo (README)", "0.12.0.1", "3.12.1", "1", "0", "2026-11-29, abc1234"],
    ]


def test_the_readme_and_the_docs_page_carry_the_same_table():
    tables = [versions_table.existing_rows(path.read_text()) for path in versions_table.FILES]
    assert tables[0] and tables[0] == tables[1]
