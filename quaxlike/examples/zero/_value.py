import equinox as eqx
import jax.numpy as jnp
import numpy as np

import quaxlike
from quaxlike.internal import ShapedArray


class Zero(quaxlike.ArrayValue):
    """An array of zeros of a given shape and dtype, stored as nothing at all.

    Operations whose result is known to be zero (`0 * x`, `0 @ x`, reshapes and
    reductions of zero, ...) give another `Zero` at trace time; `0 + x` gives `x`.
    Anything else materialises it as `jnp.zeros(shape, dtype)`.

    **Arguments:**

    - `shape`: the shape of the array.
    - `dtype`: its dtype.
    """

    _shape: tuple[int, ...] = eqx.field(static=True)
    _dtype: np.dtype = eqx.field(static=True)

    def __init__(self, shape: tuple[int, ...], dtype):
        self._shape = tuple(int(d) for d in shape)
        self._dtype = np.dtype(dtype)

    def aval(self) -> ShapedArray:
        return ShapedArray(self._shape, self._dtype)

    def materialise(self):
        return jnp.zeros(self._shape, self._dtype)
