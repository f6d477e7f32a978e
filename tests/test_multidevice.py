"""Runs the multi-device tests in `tests/multidevice/` in a subprocess with 8
virtual CPU devices: `XLA_FLAGS` only takes effect before JAX starts, and this
process has started it with one device.

A slow test (two to five minutes on two cores, in one worker): `.ci/run` runs
`tests/multidevice` as cells of their own, on the oldest JAX and the newest, so
the README's test command leaves it to `--run-slow`. Run the suite directly with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest -n 0 tests/multidevice`."""

import os
import subprocess
import sys

import pytest


HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_multidevice_suite():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",  # one process: the outer run already uses the cores
            "-p",
            "no:cacheprovider",
            os.path.join(HERE, "multidevice"),
        ],
        cwd=os.path.dirname(HERE),
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if result.returncode != 0:
        pytest.fail(f"multi-device tests failed:\n{result.stdout[-8000:]}\n{result.stderr[-4000:]}")
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
