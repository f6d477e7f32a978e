"""Experimental parts of quaxlike, whose API may change without a deprecation
period: `quaxlike.experimental.hijax` (Values built on JAX's high-level types)."""
