"""`--slow-shard=K/N`: shards 1 to N partition the slow tests, evenly, the same way in
every process (xdist workers collect on their own), and a bad value is refused."""

import pytest
from _slow_shards import parse_slow_shard, slow_shard_of


_IDS = [f"tests/conformance/test_conformance.py::test_jit[row{i}]" for i in range(4000)]


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_shards_partition_the_slow_tests_evenly(n):
    sizes = [0] * n
    for nodeid in _IDS:
        shard = slow_shard_of(nodeid, n)
        assert 1 <= shard <= n
        sizes[shard - 1] += 1
    assert sum(sizes) == len(_IDS)
    assert max(sizes) - min(sizes) < 0.1 * len(_IDS) / n, sizes


def test_shard_is_stable_across_processes():
    # CRC-32, not Python's per-process salted `hash`: a fixed node id has a fixed shard.
    assert slow_shard_of("tests/conformance/test_conformance.py::test_jit[abs]", 1000) == 307


@pytest.mark.parametrize("spec", ["0/2", "3/2", "1", "a/b", "1/2/3", ""])
def test_bad_shard_is_refused_saying_what_is_expected(spec):
    with pytest.raises(pytest.UsageError, match="expected K/N with 1 <= K <= N"):
        parse_slow_shard(spec)


def test_good_shard_parses():
    assert parse_slow_shard("3/8") == (3, 8)
