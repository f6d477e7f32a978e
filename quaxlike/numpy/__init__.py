"""`jax.numpy` with every function accepting Values: `quaxlike.numpy.sin(value)`.

Each public name of `jax.numpy` is available here. Functions are wrapped with
`quaxlike.quaxify` on first access (and cached), keeping their names, signatures
and docstrings; `jnp.ufunc`s keep their `reduce`/`accumulate`/`outer`/`at`
methods, also quaxified. Everything that is not a function (dtypes such as
`float32`, classes such as `ndarray`, constants such as `pi`) is the very same
object as in `jax.numpy`. The submodules `quaxlike.numpy.linalg` and
`quaxlike.numpy.fft` mirror those of `jax.numpy` in the same way.

Called without Values, a function here is the `jax.numpy` function itself (at
the cost of one PyTree flatten of its arguments).
"""

import sys as _sys
from typing import Any as _Any

import jax.numpy as _jnp

from ._mirror import Mirror as _Mirror


_namespace = _Mirror(_sys.modules[__name__], _jnp)
__all__ = list(_namespace.names)  # pyright: ignore[reportUnsupportedDunderAll]


def __getattr__(name: str) -> _Any:
    return _namespace.getattr(name)


def __dir__() -> list[str]:
    return _namespace.dir()
