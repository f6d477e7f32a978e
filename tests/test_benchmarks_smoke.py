"""Smoke test of `benchmarks/`: every script runs in `--quick` mode and prints its
table. Structural only: nothing here looks at a measured number."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = (
    "### Trace time",
    "### Eager per-op cost",
    "### Compile and run",
    "### Nested quaxify",
    "### Training-step memory",
    "### Quantised model, forward",
    "### QLoRA training step",
    "### Trace time per layer against depth",
)


# Timed scripts; `instructions.py` (run under Valgrind, a minute even when quick)
# has its own test below, among the slow ones.
TIMED = (
    "trace_time",
    "eager_ops",
    "compile_run",
    "nested",
    "memory",
    "quantized",
    "qlora",
    "depth_scaling",
)


def _run_quick(*scripts: str, timeout: int = 600) -> str:
    # The suite's own settings (checked mode, set by conftest.py) are not passed on:
    # the scripts run as a user would run them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUAXLIKE_")}
    # The checkout's own quaxlike, installed or not.
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    result = subprocess.run(
        [
            sys.executable,
            os.path.join("benchmarks", "run_all.py"),
            "--quick",
            "--in-process",
            "--only",
            *scripts,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _assert_tables(out: str, titles) -> None:
    for title in titles:
        assert title in out, f"missing table {title!r}"
        table = out.split(title, 1)[1].lstrip("\n").splitlines()
        assert table[0].startswith("| ") and set(table[1]) <= set("|-"), table[:2]
    assert out.count("- CPU: ") == len(titles)


def test_run_all_quick():
    _assert_tables(_run_quick(*TIMED), TABLES)


@pytest.mark.slow  # seven compilations: over a minute and a half on two cores
def test_scale_quick():
    # `scale.py` compiles its steps for shapes only; quick: a two-layer decoder, still
    # seven compilations (a few minutes on a loaded two-core machine).
    out = _run_quick("scale", timeout=1800)
    assert out.count("- CPU: ") == 1
    title = "### Fine-tuning step at scale, tiny"
    assert title in out, f"missing table {title!r}"
    lines = out.split(title, 1)[1].splitlines()[2:]  # the rest of the title, a blank
    assert lines[0].startswith("| step") and set(lines[1]) <= set("|-"), lines[:2]
    rows = [row for row in lines[2:] if row.startswith("| ")]
    names = [row.split("|")[1].strip() for row in rows]
    assert names == ["LoRA (loraify)", "hand-written LoRA", "QLoRA 4 bits", "QLoRA NF4"]
    for row in rows[:3]:  # a peak in bytes, and trace and compile ratios
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        assert cells[2].endswith("B") and float(cells[7]) > 0 and float(cells[9]) > 0
    # NF4 is measured where `quantize` takes `bits="nf4"`, else reported as such.
    assert "unavailable" in rows[3] or rows[3].split("|")[3].strip().endswith("B")
    # The tiny model's check that LoRA, the hand-written LoRA and chunking agree.
    assert "the chunked model the unchunked one's loss: True" in out


@pytest.mark.slow  # four short training loops in one process: half a minute or more
def test_soak_quick():
    out = _run_quick("soak")
    assert out.count("- CPU: ") == 1
    growth, caches, rss = (
        "### Soak: resident memory growth over the run",
        "### Soak: cache entries over the run (quaxlike loops)",
        "### Soak: resident memory over the run",
    )
    for title in (growth, caches, rss):
        assert title in out, f"missing table {title!r}"
        table = out.split(title, 1)[1].lstrip("\n").splitlines()
        assert table[0].startswith("| ") and set(table[1]) <= set("|-"), table[:2]
    rows = out.split(growth, 1)[1].lstrip("\n").splitlines()[2:6]
    assert [row.split("|")[1].strip() for row in rows] == [
        "quaxlike LoRA",
        "plain JAX LoRA",
        "quaxlike QLoRA int4",
        "plain JAX QLoRA int4",
    ]
    # The same loss as plain JAX at the end of each pair of loops.
    losses = [row.split("|")[7].strip() for row in rows]
    assert losses[0] == losses[1] and losses[2] == losses[3]
    assert "WARNING" not in out  # no cache over its bound


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_instructions_quick():
    out = _run_quick("instructions")
    _assert_tables(out, ("### Instructions per trace",))
    rows = out.split("### Instructions per trace", 1)[1].strip().splitlines()[2:7]
    assert [row.split("|")[1].strip() for row in rows] == [
        "dense",
        "lora",
        "nested, Zero outer",
        "nested, LoRA outer",
        "LoRA step (scale.py)",
    ]
    for row in rows:  # every count is a positive number of millions
        baseline, quaxlike = (
            float(cell.strip().removesuffix(" M")) for cell in row.split("|")[3:5]
        )
        assert baseline > 0 and quaxlike > 0


def test_forwarding_trace_matches_plain():
    """`benchmarks/_eager_impls.forward` (the floor column of `eager_ops.py`) binds
    every primitive unchanged: its results are plain JAX's, bit for bit."""
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from _eager_impls import forward
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))

    x = jnp.arange(16.0, dtype=jnp.float32)
    w = jnp.ones((16, 16), jnp.float32) / 4

    def f(a, b):
        return jnp.sum(jnp.sin(a @ b + a) ** 2)

    np.testing.assert_array_equal(forward(f)(x, w), f(x, w))


@pytest.mark.skipif(
    importlib.util.find_spec("quax") is None, reason="needs quax (0.4.6) installed beside quaxlike"
)
def test_eager_ops_beside_quax():
    """`eager_ops.py --impl both` runs Quax's column beside quaxlike's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUAXLIKE_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    result = subprocess.run(
        [sys.executable, os.path.join("benchmarks", "eager_ops.py"), "--quick", "--impl", "both"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _assert_tables(result.stdout, ("### Eager per-op cost",))
    header = result.stdout.split("### Eager per-op cost", 1)[1].strip().splitlines()[0]
    assert "| quax " in header and "| quaxlike " in header, header


@pytest.mark.slow  # two compilations on two fake devices: about a minute on two cores
def test_scale_devices_quick():
    """`scale.py --devices 2` compiles the tiny model's QLoRA steps over two fake
    devices (FSDP): its table, and the HLO check that only packed codes (`uint8`)
    and scales are gathered, never a dequantised weight."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUAXLIKE_", "XLA_"))}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, os.path.join("benchmarks", "scale.py"), "--quick"]
    result = subprocess.run(
        [*command, "--devices", "2", "--sharded-only"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    title = "### Sharded fine-tuning step, tiny"
    assert title in result.stdout, result.stdout[-3000:]
    lines = result.stdout.split(title, 1)[1].splitlines()[2:]
    assert lines[0].startswith("| step") and set(lines[1]) <= set("|-"), lines[:2]
    rows = [row for row in lines[2:] if row.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows] == ["QLoRA 4 bits", "QLoRA NF4"]
    for row in rows:
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        assert cells[1:3] == ["fsdp", "2"] and cells[4].endswith("B")  # a peak in bytes
        assert "all-gather" in cells[8] and "u8" in cells[9]  # codes gathered
        assert cells[10] == "0"  # no dequantised weight gathered


@pytest.mark.slow  # three scripts that train or compile small models: minutes on two cores
@pytest.mark.parametrize(
    "script, header",
    [
        ("qat", "| bits |"),
        ("float8_step", "| step | peak GiB |"),
        ("w8a8", "| tokens | float32 (MiB) |"),
    ],
)
def test_low_precision_quick(script, header):
    """The low-precision scripts (issue 43) run in `--quick` mode and print their
    tables."""
    out = _run_quick(script, timeout=900)
    assert header in out, out[-3000:]
    table = out.split(header, 1)[1].splitlines()
    assert set(table[1]) <= set("|- "), table[:2]
