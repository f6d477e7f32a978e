"""`Unitful`: a quaxlike Value holding one `UnitfulArray`, and its rules."""

from typing import Any

import jax
from jax import lax

from quaxlike.experimental.hijax import HiValue, register_rules

from . import _unitful_array as hi
from ._unitful_array import UnitfulArray, UnitfulArraySpec


class Unitful(HiValue):
    """An array with units whose units are part of its JAX type.

    Like `quaxlike.units.Unitful`, unchanged `jax.numpy` code runs on
    it inside `quaxlike.quaxify`; unlike it, the units live in the type of its
    leaf (a `UnitfulArray`), so they show in jaxprs, JAX checks them, and
    `jax.grad` with respect to a length returns a cotangent per length. Supported:
    `+` (same units), `*`, `** n`, `sum` and broadcasting; any other primitive
    raises, since `materialise` refuses.

    **Arguments:**

    - `array`: the numbers, or a `UnitfulArray` (taken as it is).
    - `units`: a `Dimension` (`meters`), or a dict from dimensions to exponents
      (`{meters: 1, seconds: -1}`).

    !!! example

        ```python
        from quaxlike.units import meters

        length = Unitful(jnp.array([1.0, 2.0]), meters)
        grad = jax.grad(lambda q: quaxlike.quaxify(lambda a: jnp.sum(a * a))(q).array)(length)
        print(grad.units)  # ((m, -1),): per metre
        ```
    """

    def __init__(self, array: Any, units: Any = (), /):
        # A tracer of a unitful type is a UnitfulArray too (see its metaclass);
        # testing for array-likeness instead would wrap such a tracer twice.
        self.leaf = array if isinstance(array, UnitfulArray) else hi.wrap(array, units)

    @property
    def units(self) -> hi.Units:
        """The units, as `((dimension, exponent), ...)`."""
        return jax.typeof(self.leaf).units

    @property
    def array(self) -> Any:
        """The numbers without the units (the `unwrap` primitive, so it also works
        under a transformation)."""
        return hi.unwrap(self.leaf)


MAPPED = UnitfulArraySpec()
"""The `vmap` `in_axes`/`out_axes` entry for a `Unitful` mapped over its leading
axis. `vmap` needs a spec for a hijax type, and cannot read the axis size from
one, so give `axis_size` too when every mapped argument is a `Unitful`:
`jax.vmap(f, in_axes=MAPPED, out_axes=MAPPED, axis_size=3)`. A `vmap` inside the
`quaxify` (`quaxify(jax.vmap(f))`) needs none of this."""


register_rules(
    Unitful,
    {
        lax.add_p: hi.add,
        lax.mul_p: hi.mul,
        lax.integer_pow_p: lambda q, *, y: hi.int_pow(q, y),
        lax.reduce_sum_p: lambda q, *, axes: hi.sum(q, axes),
        lax.broadcast_in_dim_p: lambda q, *, shape, broadcast_dimensions: hi.broadcast_in_dim(
            q, shape, broadcast_dimensions
        ),
    },
)
