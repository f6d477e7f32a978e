"""The multi-device tables of `scale.py` (`--devices N`): the fine-tuning steps
compiled for shapes over N fake devices (see `_sharded.py` for how the model is
sharded and how collectives are counted), and the quick mode's table run in a
process of its own."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any

import _harness as h
import jax
from _decoder import Shape
from _live_buffers import dump_options, print_live_at_peak
from _sharded import describe, measure_sharded, sharded_loss, weight_shapes


SCALE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scale.py")


def sharded_quick_subprocess() -> None:
    """The quick mode's multi-device table (the tiny model on 2 devices), in a
    process of its own: fake devices only take effect before JAX starts."""
    import subprocess

    command = [sys.executable, SCALE, "--quick", "--devices", "2"]
    result = subprocess.run([*command, "--sharded-only"], capture_output=True, text=True)
    # Its table only: this process has printed the header (machine, versions).
    title = "### Sharded"
    print(title + result.stdout.split(title, 1)[-1] if title in result.stdout else "", end="")
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")


def print_sharded_tables(
    shape: Shape,
    args: Any,
    optimiser: Any,
    rows: list[str],
    state_for: Callable[[str, int, str], Any],
    memory_title: str,
) -> None:
    """The QLoRA steps of `shape` compiled over each `--devices` count (FSDP, every
    Value split by its logical rows, each block gathered in the layer loop as
    stored), for each `--batch`: per-device memory, compile time and the bytes of
    each collective per step.

    **Arguments:**

    - `shape`: the model's shape.
    - `args`: `scale.py`'s options (`devices`, `plans`, `batch`, `dump`).
    - `optimiser`: the optax optimiser of the step.
    - `rows`: the names of the steps to compile (`scale.py`'s variants).
    - `state_for`: `(row, n, plan) -> (trainable, opt_state, frozen)`, the abstract state of a
        row for `n` devices and a plan (`"fsdp"` or `"replicated"`).
    - `memory_title`: the memory options, as the table's title states them.
    """
    table = h.Table(
        f"Sharded fine-tuning step, {shape.name} (d={shape.dim}, {shape.layers} layers, "
        f"seq {shape.seq}; FSDP over N fake CPU devices; "
        f"{memory_title})",
        [
            "step",
            "plan",
            "N",
            "batch",
            "peak / device",
            "arguments",
            "temporaries",
            "compile",
            "collectives per step (per device)",
            "all-gathered, by dtype",
            "dequantised weights gathered",
        ],
    )
    available = jax.device_count()
    weights = weight_shapes(shape)
    dumps = []
    for name in rows:
        for n in args.devices:
            if n > available:
                table.add(name, "-", str(n), "-", f"only {available} devices", *["-"] * 6)
                continue
            for plan, batch in [(p, b) for p in args.plans for b in args.batch]:
                state = state_for(name, n, plan)
                loss = sharded_loss(lambda m, t, y: m.loss(t, y))
                row = f"{name}, {plan}, N = {n}, batch {batch}"
                dump = _row_folder(args.dump, row) if args.dump else None
                r = measure_sharded(
                    shape, state, loss, optimiser, h.training_step, n, batch, weights,
                    compiler_options=dump_options(dump) if dump else None,
                    peak_bytes=h.peak_bytes,
                )  # fmt: skip
                dumps += [(row, dump)] if dump else []
                d = describe(r)
                table.add(
                    name,
                    plan if n > 1 else "-",
                    str(n),
                    f"{batch} x {shape.seq}",
                    h.fmt_bytes(r.peak),
                    h.fmt_bytes(r.arguments),
                    h.fmt_bytes(r.temporaries),
                    h.fmt_time(r.compile_s),
                    d["moved"],
                    d["gathered"],
                    str(r.dequantised),
                )
                sys.stdout.flush()
    table.print(
        [
            "peak = arguments + outputs + temporaries - aliased, per device (memory_analysis() "
            "of the partitioned program); collectives: the bytes of each collective's result "
            "on one device times the trip counts of the loops around it (optimised HLO)",
            "dequantised weights gathered: floating-point all-gathers shaped like a "
            "projection's (out, in), which must be 0 (only packed codes and scales move)",
        ]
    )
    for row, dump in dumps:
        print_live_at_peak(f"{row} ({shape.name})", dump, h.fmt_bytes)


def _row_folder(parent: str, row: str) -> str:
    return os.path.join(parent, re.sub(r"[^A-Za-z0-9]+", "-", row).strip("-"))
