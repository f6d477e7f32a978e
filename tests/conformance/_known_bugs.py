"""Known bugs the conformance suite found, as xfail reasons.

Each "core:" entry has a minimal reproduction in test_conformance.py (the test
named in it) and marks the table rows it breaks; "jax:" entries are JAX's own.
The marks are strict, so a fix makes them fail until the mark is removed.
"""

DCE_SINK_BATCHING = (
    "jax: dce_sink's batching rule returns one output where its abstract evaluation "
    "gives none; plain JAX drops it, quaxlike's checked mode (QUAXLIKE_CHECK=1) rejects it"
)
