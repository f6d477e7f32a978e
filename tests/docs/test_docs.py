"""The code on the documentation pages runs, and its checks pass.

Every `docs/**/*.md` page with Python code blocks, and the README, is one test: its blocks run in
order, in one namespace, in a fresh interpreter (`_run_page.py`), with
warnings as errors and quaxlike's checked mode on (`QUAXLIKE_CHECK=1`), on the
CPU. Pages check themselves with `assert`s against plain JAX on the
materialised arrays. A block is left out with a `<!-- no-run -->` comment on
the line above it (used for code of other libraries, and for fragments); a
page marked `<!-- docs-test: devices=8 -->` runs with eight virtual CPU
devices, and one marked `<!-- docs-test: slow -->` (a page that trains models for
a minute or more) is a `slow` test: CI's shards and `--run-slow` run it. See
`_blocks.py` for the exact rules.
"""

import concurrent.futures
import os
import pathlib
import subprocess
import sys

import pytest
from _blocks import blocks, NO_RUN, options


HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
RUNNABLE = [p for p in PAGES if any(b.run for b in blocks(p.read_text(encoding="utf-8")))]


def _env(page_options: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUAXLIKE_", "XLA_", "JAX_"))}
    env["QUAXLIKE_CHECK"] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    devices = page_options.get("devices")
    if devices is not None:
        # Only effective if set before JAX starts: hence a subprocess per page.
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(devices)}"
    return env


def _run(page: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(HERE / "_run_page.py"), str(page.relative_to(ROOT))],
        cwd=ROOT,
        env=_env(options(page.read_text(encoding="utf-8"))),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _is_slow(page: pathlib.Path) -> bool:
    return "slow" in options(page.read_text(encoding="utf-8"))


class _PageRuns:
    """The pages' runs: every page that is not slow started at once (a few at a
    time, each an independent process), a slow page when its test asks for it (a
    skipped one never runs)."""

    def __init__(self, pool: concurrent.futures.Executor):
        self._pool = pool
        self._runs = {page: pool.submit(_run, page) for page in RUNNABLE if not _is_slow(page)}

    def result(self, page: pathlib.Path) -> subprocess.CompletedProcess:
        if page not in self._runs:
            self._runs[page] = self._pool.submit(_run, page)
        return self._runs[page].result()


@pytest.fixture(scope="module")
def page_runs():
    workers = max(1, min(4, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        yield _PageRuns(pool)


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=[pytest.mark.slow] if _is_slow(p) else []) for p in RUNNABLE],
    ids=[str(p.relative_to(ROOT)) for p in RUNNABLE],
)
def test_page_runs(page_runs, page: pathlib.Path):
    result = page_runs.result(page)
    if result.returncode != 0:
        pytest.fail(
            f"{page.relative_to(ROOT)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}",
            pytrace=False,
        )


def test_every_tutorial_and_guide_has_code():
    # A page that lost its code blocks (a broken fence, say) would pass silently.
    for folder in ("tutorials", "migration"):
        for page in sorted((DOCS / folder).glob("*.md")):
            if page.name == "index.md":
                continue
            assert page in RUNNABLE, f"{page.relative_to(ROOT)} has no code block that runs"


def test_no_run_markers_mark_python_blocks():
    # A `<!-- no-run -->` that does not sit right above a Python block is a typo.
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            if line.strip() != NO_RUN:
                continue
            following = next((s.strip() for s in lines[number:] if s.strip()), "")
            assert following.startswith("```") and "py" in following, (
                f"{page.relative_to(ROOT)}:{number}: `{NO_RUN}` is not followed by a Python block"
            )


def test_block_extraction():
    text = "\n".join(
        [
            "```python",
            "a = 1",
            "```",
            "<!-- no-run -->",
            "```python",
            "import not_installed",
            "```",
            '=== "tab"',
            "",
            "    ```python",
            "    if a:",
            "        b = 2",
            "    ```",
            "```text",
            "not code",
            "```",
        ]
    )
    found = blocks(text)
    assert [(b.line, b.code, b.run) for b in found] == [
        (2, "a = 1", True),
        (6, "import not_installed", False),
        (11, "if a:\n    b = 2", True),
    ]
    assert options("x <!-- docs-test: devices=8 --> y") == {"devices": "8"}


def test_mkdocs_build_strict(tmp_path):
    # The site builds with warnings as errors: every `:::` reference resolves,
    # every link and snippet exists. Needs the `docs` extra.
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**_env({}), "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-8000:]
