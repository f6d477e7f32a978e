"""Imported by `scale.py` before JAX: with `--devices N` on the command line, ask
XLA for N fake CPU devices (`--xla_force_host_platform_device_count`), which only
takes effect before JAX starts."""

import os
import sys


def _wanted(argv: list[str]) -> int:
    if "--devices" not in argv:
        return 0
    counts = []
    for word in argv[argv.index("--devices") + 1 :]:
        if not word.isdigit():
            break
        counts.append(int(word))
    return max(counts, default=0)


_count = _wanted(sys.argv)
if _count > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_count}"
    ).strip()
