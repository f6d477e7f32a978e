"""The Equinox ecosystem (diffrax, lineax, optimistix, Equinox's own machinery) on
Values: user-style code, run like the example types' tests (JAX's default
promotion, no tracer-leak checks, which would switch JAX's compilation caches
off and recompile every solver step)."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _without_leak_checks():
    with jax.check_tracer_leaks(False):
        yield


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.loose_promotion)
