"""XLA's buffer assignment, read back from a dump (`xla_dump_to`): the largest
buffers live at a compiled program's peak, for `scale.py --dump`."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable
from typing import Any


_LIVE = re.compile(r"^\s+(\S+?)\{[\d,]*\}: (\d+) bytes")
_DEFINITION = re.compile(r"^\s+%(\S+) = (\S+\[[\d,]*\])")


def live_at_peak(directory: str, count: int = 24) -> list[tuple[int, str]]:
    """The `count` largest buffers live at the peak of the newest program XLA dumped
    to `directory` (its `*live-range.txt`, `Live ranges at ... (peak)`): `(bytes,
    "name shape")`, arguments included."""
    files = sorted(glob.glob(os.path.join(directory, "*live-range.txt")), key=os.path.getmtime)
    if not files:
        return []
    live: list[tuple[int, str]] = []
    with open(files[-1]) as f:
        at_peak = False
        for line in f:
            if "(peak):" in line:
                at_peak = True
            elif at_peak:
                match = _LIVE.match(line)
                if not match:
                    break
                live.append((int(match.group(2)), match.group(1)))
    shapes = {}
    program = files[-1].replace("-live-range.txt", ".txt")
    if os.path.exists(program):
        with open(program) as f:
            for line in f:
                match = _DEFINITION.match(line)
                if match:
                    shapes.setdefault(match.group(1), match.group(2))
    live.sort(key=lambda x: -x[0])
    return [(size, f"{name} {shapes.get(name, '')}".strip()) for size, name in live[:count]]


def dump_options(directory: str) -> dict[str, Any]:
    """XLA's compiler options that dump a program, as text, to `directory`: its
    HLO and its buffer assignment (`live_at_peak` reads them)."""
    return {"xla_dump_to": directory, "xla_dump_hlo_as_text": True}


def print_live_at_peak(what: str, directory: str, fmt_bytes: Callable[[int], str]) -> None:
    """Prints `live_at_peak(directory)` as a list, under a line naming `what`."""
    print(f"Largest buffers live at the peak of {what}, from {directory}:")
    for size, name in live_at_peak(directory):
        print(f"- {fmt_bytes(size)}: {name}")
    print()
