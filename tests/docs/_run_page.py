"""Run the Python blocks of one Markdown page, in order, in one namespace.

    python tests/docs/_run_page.py docs/tutorials/first-type.md

`tests/docs/test_docs.py` runs this in a fresh interpreter per page. Warnings
are errors (as in the test suite), and each block is compiled with the page's
own file name and line numbers, so a traceback points at the line of the page
that failed.
"""

import os
import sys
import warnings


def main(path: str) -> None:
    warnings.simplefilter("error")
    # As in pyproject.toml: import-time deprecations from optax we cannot control.
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"optax(\..*)?")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _blocks import blocks

    with open(path, encoding="utf-8") as file:
        text = file.read()
    namespace: dict = {"__name__": "__main__"}
    for block in blocks(text):
        if not block.run:
            continue
        # Pad with newlines so that line numbers in tracebacks are the page's.
        source = "\n" * (block.line - 1) + block.code
        exec(compile(source, path, "exec"), namespace)


if __name__ == "__main__":
    main(sys.argv[1])
