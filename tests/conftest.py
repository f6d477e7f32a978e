import gc
import os
import sys

# The suite runs as users run quaxlike: checked mode off, unless the environment
# turns it on (`.ci/run` runs the core and conformance tests a second time with
# QUAXLIKE_CHECK=1, comparing every rule's outputs with the primitive's abstract
# evaluation). Read once, when quaxlike is first imported.
import jax  # noqa: E402
import pytest  # noqa: E402


# Test files in subfolders (tests/toolkits, tests/conformance) import `helpers`.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _slow_shards import parse_slow_shard, slow_shard_of  # noqa: E402


# JAX's tracer-leak checker (JAX_CHECK_TRACER_LEAKS=1) is on for every test of the
# framework itself. It also switches JAX's compilation caches off, so every eager
# operation compiles afresh: the toolkits. tests (tests/toolkits), which
# exercise rules rather than the trace machinery, run without it. Leaks come from
# the core, and the core's tests, the conformance subset and the multi-device
# tests keep it on.
jax.config.update("jax_check_tracer_leaks", True)
_WITHOUT_LEAK_CHECKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toolkits")


# Strict dtype and rank promotion (no implicit int -> float or float32 -> float64
# mixing, no implicit rank broadcasting) for the tests of the framework itself
# and the conformance table, where the tests allow it: a test that checks
# promotion itself, or runs user code that relies on it, opts out with
# `@pytest.mark.loose_promotion` (or a module's `pytestmark`). The example
# types' tests, the integration and multi-process tests, the jax.numpy table and
# the documentation pages run user-style code, with JAX's default promotion.
_STRICT_PROMOTION = os.environ.get("QUAXLIKE_TEST_STRICT_PROMOTION", "1") == "1"
_TESTS = os.path.dirname(os.path.abspath(__file__))
_USER_STYLE = tuple(
    os.path.join(_TESTS, d) + os.sep
    for d in ("toolkits", "integration", "multiprocess", "jnp_table", "docs", "multidevice")
)


@pytest.fixture(autouse=True)
def _strict_promotion(request):
    if (
        not _STRICT_PROMOTION
        or request.node.get_closest_marker("loose_promotion")
        or str(request.node.path).startswith(_USER_STYLE)
    ):
        yield
        return
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield


@pytest.fixture(autouse=True)
def _collect_only_this_tests_objects():
    # The leak checker collects garbage and searches every object the collector
    # tracks, once per trace: in a worker that has run hundreds of tests (its
    # heap several GiB of caches), that search came to seconds per test, and the
    # last tenth of a run took half of its time. Objects that existed before the
    # test are frozen out of the collector for the test's duration; a tracer the
    # test leaks is created by the test, so it is still found.
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture(autouse=True)
def _leak_checks_for_the_core(request):
    if str(request.node.path).startswith(_WITHOUT_LEAK_CHECKS + os.sep):
        with jax.check_tracer_leaks(False):
            yield
    else:
        yield


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        help="run the slow tests (the exhaustive sweeps, and single tests of a minute or more)",
    )
    parser.addoption(
        "--slow-shard",
        metavar="K/N",
        help="besides the default tests, run shard K of N (1 <= K <= N) of the slow "
        "tests: those whose node id hashes to it (CI runs one shard per commit)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    spec = config.getoption("--slow-shard")
    if spec is None:
        skip = pytest.mark.skip(reason="slow test: pass --run-slow")
        shard = None
    else:
        shard = parse_slow_shard(spec)
        skip = pytest.mark.skip(
            reason=f"slow test outside shard {spec}: pass --run-slow for every shard"
        )
    for item in items:
        if "slow" in item.keywords:
            if shard is not None and slow_shard_of(item.nodeid, shard[1]) == shard[0]:
                continue
            item.add_marker(skip)


@pytest.fixture
def getkey():
    keys = iter(jax.random.split(jax.random.key(0), 1000))
    return lambda: next(keys)


@pytest.fixture
def getseed():
    # NumPy seeds rather than JAX keys: splitting and unstacking keys compiles a
    # program per shape, which would dominate the run time of small tests.
    seeds = iter(range(1000))
    return lambda: next(seeds)
