"""Smoke test of `benchmarks/`: every script runs in `--quick` mode and prints its
table. Structural only: nothing here looks at a measured number."""

import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = (
    "### Trace time",
    "### Eager per-op cost",
    "### Compile and run",
    "### Nested quaxify",
    "### Training-step memory",
    "### Trace time per layer against depth",
)


def test_run_all_quick():
    # The suite's own settings (checked mode, set by conftest.py) are not passed on:
    # the scripts run as a user would run them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUAXLIKE_")}
    result = subprocess.run(
        [sys.executable, os.path.join("benchmarks", "run_all.py"), "--quick", "--in-process"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for title in TABLES:
        assert title in out, f"missing table {title!r}"
        table = out.split(title, 1)[1].lstrip("\n").splitlines()
        assert table[0].startswith("| ") and set(table[1]) <= set("|-"), table[:2]
    assert out.count("- CPU: ") == len(TABLES)
