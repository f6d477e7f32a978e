"""Recompute the type x jax.numpy table and write `table.json` and the docs page.

    python tests/jnp_table/generate.py            # every column, one process
    python tests/jnp_table/generate.py --jobs 2   # columns spread over processes
    python tests/jnp_table/generate.py --columns mxfp4 nvfp4   # only these columns

Run it after changing a rule of an example type (the test suite then fails until
the committed table matches), and commit both files. With `--columns`, the other
columns are kept as committed (the committed table must be from the same JAX).
"""

import argparse
import concurrent.futures
import json
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
# As in the test suite: every rule's outputs checked against the primitive.
os.environ.setdefault("QUAXLIKE_CHECK", "1")


def _column(name: str) -> tuple[str, dict]:
    from _columns import COLUMNS_BY_NAME
    from _data import compute_column

    return name, compute_column(COLUMNS_BY_NAME[name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--columns", nargs="+", help="recompute only these columns")
    options = parser.parse_args()

    import jax
    from _data import as_data, columns_in_order, DATA, load, PAGE, render_page

    names = columns_in_order()
    kept = {}
    if options.columns:
        unknown = sorted(set(options.columns) - set(names))
        if unknown:
            parser.error(f"no column {unknown}; the columns are {names}")
        committed = load()
        if committed["jax"] != jax.__version__:
            parser.error(
                f"table.json is from JAX {committed['jax']}, this is {jax.__version__}: "
                "recompute every column"
            )
        kept = {n: c for n, c in committed["columns"].items() if n not in options.columns}
        names = [n for n in names if n in options.columns]
    if options.jobs > 1:
        with concurrent.futures.ProcessPoolExecutor(options.jobs) as pool:
            results = dict(pool.map(_column, names))
    else:
        results = dict(map(_column, names))
    data = as_data({name: results[name] for name in names})
    if kept:
        # `as_data` gives each computed column's cells as JSON; the kept ones are
        # JSON already. Keep the table's column order.
        computed = data["columns"]
        data["columns"] = {
            n: computed[n] if n in computed else kept[n]
            for n in columns_in_order()
            if n in computed or n in kept
        }
    DATA.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    PAGE.write_text(render_page(data), encoding="utf-8")
    print(f"wrote {DATA} and {PAGE}")


if __name__ == "__main__":
    main()
