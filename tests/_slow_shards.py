"""Shards of the slow tests: `--slow-shard=K/N` (tests/conftest.py) runs the slow
tests whose node id hashes to K, and `.ci/run` picks K from the commit."""

import zlib

import pytest


def slow_shard_of(nodeid: str, n: int) -> int:
    """The shard (1 to n) a slow test belongs to.

    **Arguments:**

    - `nodeid`: the test's pytest node id (`tests/...::test_x[param]`).
    - `n`: the number of shards.

    **Returns:**

    A number from 1 to `n`, the same in every process and on every run (CRC-32 of the
    node id, not Python's salted `hash`), so that shards 1 to `n` partition the slow
    tests.
    """
    return zlib.crc32(nodeid.encode()) % n + 1


def parse_slow_shard(spec: str) -> tuple[int, int]:
    """`--slow-shard`'s value, checked.

    **Arguments:**

    - `spec`: `"K/N"`.

    **Returns:**

    `(K, N)`; a `pytest.UsageError` saying what is expected unless `1 <= K <= N`.
    """
    try:
        k, n = (int(part) for part in spec.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise pytest.UsageError(
            f"--slow-shard={spec!r}: expected K/N with 1 <= K <= N (for example "
            "--slow-shard=3/8); --run-slow runs every shard"
        )
    return k, n
