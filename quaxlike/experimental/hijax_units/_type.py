"""The hijax type of an array with units: `UnitfulArray` (the value, not a
pytree), `UnitfulArrayTy` (its type, holding the units) and `UnitfulArraySpec`
(how `vmap` maps it). The primitives that act on it are in `_unitful_array.py`."""

import dataclasses
from typing import Any

import jax
import jax.core
import jax.numpy as jnp

from quaxlike.experimental.hijax import HiType, MappingSpec, register_hitype, ShapedArray

from ._units import power, text, Units


class _IsUnitfulArray(type):
    """`isinstance(x, UnitfulArray)` is also true for a tracer of a unitful type,
    which is what a `UnitfulArray` is while a transformation traces it."""

    def __instancecheck__(cls, instance: Any) -> bool:
        if type.__instancecheck__(cls, instance):
            return True
        return isinstance(instance, jax.core.Tracer) and isinstance(
            jax.typeof(instance), UnitfulArrayTy
        )


@dataclasses.dataclass(frozen=True)
class UnitfulArray(metaclass=_IsUnitfulArray):
    """An array and its units, as one hijax value (not a pytree: JAX types it
    with `UnitfulArrayTy`). Build one with `wrap`, which keeps it in a traced
    program; read the array with `unwrap`.

    **Arguments:**

    - `array`: the numbers.
    - `units`: a `Units` tuple.

    !!! example

        ```python
        from quaxlike.units import meters

        q = wrap(jnp.array([1.0, 2.0]), meters)
        assert isinstance(q, UnitfulArray) and q.units == ((meters, 1),)
        ```
    """

    array: Any
    units: Units

    def __repr__(self) -> str:
        return f"UnitfulArray({self.array}, {text(self.units)})"


@dataclasses.dataclass(frozen=True)
class UnitfulArraySpec(MappingSpec):
    """The `vmap` spec of a `UnitfulArray`: mapped over its leading axis.

    That is the only way to map one, so the spec carries no data. `MAPPED` is
    the spec for a `Unitful`.

    **Arguments:**

    None.

    !!! example

        ```python
        from quaxlike.units import meters

        qs = wrap(jnp.ones((3, 2)), meters)
        out = jax.vmap(lambda q: mul(q, q), in_axes=UnitfulArraySpec(),
                       out_axes=UnitfulArraySpec(), axis_size=3)(qs)
        assert jax.typeof(out).shape == (3, 2)
        ```
    """


@dataclasses.dataclass(frozen=True)
class UnitfulArrayTy(HiType):
    """The type of a `UnitfulArray`: shape, dtype and units. Prints as `u[3]{m}`.

    **Arguments:**

    - `shape`, `dtype`: those of the array.
    - `units`: a `Units` tuple.

    !!! example

        ```python
        from quaxlike.units import meters

        ty = jax.typeof(wrap(jnp.ones(3), meters))
        assert isinstance(ty, UnitfulArrayTy) and str(ty) == "u[3]{m}"
        assert ty.to_ct_aval().units == ((meters, -1),)
        ```
    """

    shape: tuple[int, ...]
    dtype: Any
    units: Units

    def lo_ty(self):
        return [ShapedArray(self.shape, self.dtype)]

    def lower_val(self, value):
        return [value.array]

    def raise_val(self, array):
        return UnitfulArray(array, self.units)

    # A change in a length is a length; the derivative of a number by a length is
    # per length: the cotangent type inverts the units.
    def to_tangent_aval(self):
        return self

    def to_ct_aval(self):
        return UnitfulArrayTy(self.shape, self.dtype, power(self.units, -1))

    def vspace_zero(self):
        return UnitfulArray(jnp.zeros(self.shape, self.dtype), self.units)

    # `vspace_add` (adding two tangents) is the `add` primitive, which is built on
    # this type: `_unitful_array` sets it when it defines that primitive.

    # vmap, and scan through it: a batch is one more leading axis, same units.
    def dec_rank(self, size, spec):
        return UnitfulArrayTy(self.shape[1:], self.dtype, self.units)

    def inc_rank(self, size, spec):
        return UnitfulArrayTy((size, *self.shape), self.dtype, self.units)

    def leading_axis_spec(self):
        return UnitfulArraySpec()

    def str_short(self, short_dtypes: bool = False, **_: Any) -> str:
        return f"u[{','.join(map(str, self.shape))}]{{{text(self.units)}}}"

    __repr__ = str_short


register_hitype(UnitfulArray, lambda v: UnitfulArrayTy(jnp.shape(v.array), v.array.dtype, v.units))


def units_of(ty: Any) -> Units:
    """The units of a type; an ordinary array type is dimensionless."""
    return ty.units if isinstance(ty, UnitfulArrayTy) else ()
