from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import DTypeLike

import quaxlike
from quaxlike.internal import ShapedArray, with_leaf_specs


class Zero(quaxlike.ArrayValue):
    """An array of zeros of a given shape and dtype, stored as nothing at all.

    A `Zero` has no array leaves: under `jax.jit` it is static, and it costs no
    memory. Operations whose result is known to be zero (`0 * x`, `0 @ x`,
    reshapes, slices and reductions of zero, ...) give another `Zero` at trace
    time, and `0 + x`, `x - 0` give `x` itself, so none of them adds an operation
    to the traced program. Anything else materialises it as
    `jnp.zeros(shape, dtype)`.

    Like JAX's own symbolic zeros, `0 * x` is zero even where `x` is `inf` or
    `nan` (dense arithmetic would give `nan`); the same holds for `0 / x`.

    **Arguments:**

    - `shape`: the shape of the array.
    - `dtype`: its dtype.

    !!! example

        ```python
        z = Zero((3, 4), jnp.float32)
        x = jnp.ones((4, 2))
        out = quaxlike.quaxify(lambda z, x: (z @ x) * 2.0)(z, x)
        assert isinstance(out, Zero) and out.shape == (3, 2)
        ```
    """

    _shape: tuple[int, ...] = eqx.field(static=True)
    _dtype: np.dtype = eqx.field(static=True)

    def __init__(self, shape: Sequence[int], dtype: DTypeLike):
        self._shape = tuple(int(d) for d in shape)
        self._dtype = np.dtype(dtype)

    def logical_leaf_specs(self, spec: Any) -> "Zero":
        """A symbolic zero has no array leaves: any sharding is followed, with nothing to place (see `quaxlike.leaf_specs`).

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array.

        **Returns:**

        This value with a `PartitionSpec` in place of each leaf.
        """
        return with_leaf_specs(
            self,
        )

    def aval(self) -> ShapedArray:
        return ShapedArray(self._shape, self._dtype)

    def materialise(self):
        return jnp.zeros(self._shape, self._dtype)
