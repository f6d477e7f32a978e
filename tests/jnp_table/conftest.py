import jax
import pytest


# The table runs hundreds of small programs: JAX's tracer-leak checker (on for
# the core's tests, see tests/conftest.py) turns JAX's caches off, so every
# primitive would compile afresh. The table tests rules, not the trace
# machinery, as tests/toolkits does.
@pytest.fixture(autouse=True)
def _no_leak_checks():
    with jax.check_tracer_leaks(False):
        yield
