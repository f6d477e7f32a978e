"""`jax.lax` with every function accepting Values: `quaxlike.lax.dot_general(lora, x, ...)`.

Each public name of `jax.lax` is available here, functions quaxified on first
access (and cached) with their names, signatures and docstrings. Primitives
(`quaxlike.lax.mul_p is jax.lax.mul_p`), classes and other non-functions are the
very same objects as in `jax.lax`, so they can be passed to `quaxlike.register`.
`quaxlike.lax.linalg` mirrors `jax.lax.linalg` in the same way.
"""

import sys as _sys
from typing import Any as _Any

from jax import lax as _lax

from ..numpy._mirror import Mirror as _Mirror


_mirror = _Mirror(_sys.modules[__name__], _lax)
__all__ = list(_mirror.names)  # pyright: ignore[reportUnsupportedDunderAll]


def __getattr__(name: str) -> _Any:
    return _mirror.getattr(name)


def __dir__() -> list[str]:
    return _mirror.dir()
