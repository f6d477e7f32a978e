"""`DenseArrayValue`: the simplest Value, one ordinary array standing for itself."""

from typing import ClassVar

import jax
from jaxtyping import ArrayLike

from . import _jax_compat as jc
from ._values import ArrayValue


class DenseArrayValue(ArrayValue):
    """A Value that wraps one ordinary array and materialises to it.

    Every primitive falls back to materialising, so a `DenseArrayValue` computes
    exactly what the wrapped array would (eagerly, functions that need the
    array's value, such as `jnp.unique` or `x.item()`, get it too); it is useful to force arrays through the
    interpreter (benchmarks, tests) and as the simplest possible example type.
    Being dense is its purpose, so `materialise_policy` leaves it alone.

    **Arguments:**

    - `array`: the array it wraps.

    !!! example

        ```python
        x = jnp.arange(4.0)
        out = quaxlike.quaxify(lambda v: jnp.cumsum(v) * 2)(quaxlike.DenseArrayValue(x))
        assert jnp.array_equal(out, jnp.cumsum(x) * 2)
        ```
    """

    warn_on_materialise: ClassVar[bool] = False
    # Materialising is free: eagerly, JAX's concreteness questions (`x.item()`,
    # `jnp.unique`, boolean masks) get the wrapped array, as for a plain array.
    concrete_eagerly: ClassVar[bool] = True

    array: ArrayLike

    def aval(self) -> jc.ShapedArray:
        return jax.typeof(self.array)  # pyright: ignore

    def materialise(self) -> ArrayLike:
        return self.array
