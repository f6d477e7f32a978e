"""The `Unitful` type: an array with a physical unit."""

from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import materialise_value, ShapedArray, with_leaf_specs

from ._constants import takes_any_unit
from ._quax_names import as_unit, units_of
from ._unit import dimensionless, Unit, unresolved, UnresolvedUnit


class UnitError(quaxlike.QuaxlikeError, ValueError):
    """The units of a primitive's arguments do not fit it: different dimensions
    where they must agree, or a dimensioned quantity where a pure number is needed.
    A `ValueError`, as Quax's unitful example raises for mismatched units.

    !!! example

        ```python
        length, time = Unitful(jnp.ones(2), m), Unitful(jnp.ones(2), s)
        try:
            quaxlike.quaxify(lambda a, b: a + b)(length, time)
        except UnitError as error:
            print(error)  # `add` needs its arguments in compatible units ...
        ```
    """


_REFUSE_MATERIALISE_MSG = (
    "Refusing to materialise a Unitful quantity in {unit}: a plain array would "
    "silently drop its unit. Take the number explicitly with `.array` (the value in "
    "{unit}) or `.to(other_unit).array`; only dimensionless quantities become plain "
    "arrays on their own."
)
_NO_RULE_MSG = (
    "Primitive `{primitive}` has no unit rule, and its arguments include a quantity "
    "in {unit} (argument {position}); applying it to the bare numbers would give a "
    "result whose unit nobody knows. Primitives without a rule only accept "
    "dimensionless quantities. Ways out: divide by a reference quantity first so the "
    "argument is dimensionless; take the number with `.array` outside `quaxify`; or "
    "register a rule:\n"
    '    @quaxlike.register("{primitive}")\n'
    "    def {rule_name}(x: Unitful, **params): ..."
)
_NOT_FLOAT_MSG = (
    "Cannot convert a quantity of dtype {dtype} from {source} to {target}: the factor "
    "{factor:g} is not a whole number. Convert the array to a floating dtype first."
)


def convert_array(array: Any, source: Unit, target: Unit) -> Any:
    """The numbers of a quantity in `source` expressed in `target` (same dtype).

    The identity when the scales agree; raises `UnitError` if the dimensions differ
    or an integer array would need a fractional factor.
    """
    if not source.same_dimensions(target):
        raise UnitError(
            f"Cannot convert a quantity in {source} to {target}: their dimensions differ."
        )
    factor = source.factor_to(target)
    if factor == 1.0:
        return array
    dtype = jnp.result_type(array)
    if not jnp.issubdtype(dtype, jnp.inexact) and not float(factor).is_integer():
        raise UnitError(
            _NOT_FLOAT_MSG.format(dtype=dtype, source=source, target=target, factor=factor)
        )
    return lax.mul(array, jnp.asarray(factor, dtype=dtype))


class Unitful(quaxlike.ArrayValue):
    """An array of numbers together with the physical unit they are measured in.

    Inside `quaxlike.quaxify`, ordinary JAX code computes with it as with an
    array, and the unit follows along: products and quotients multiply and divide
    units, `x**2` and `jnp.sqrt` take powers of them, sums, reductions, indexing and
    reshapes keep them. Adding, subtracting, comparing or taking the maximum of
    quantities with different dimensions raises a `UnitError` naming both units and
    the primitive; quantities with the same dimensions but different scales
    (`km` and `m`) are converted to the unit of the first. Plain arrays count as
    dimensionless numbers: they multiply anything, but only add to dimensionless
    quantities. `exp`, `log`, `sin` and the other transcendental functions need a
    dimensionless argument.

    The unit is a static field, so it is part of the PyTree structure: `jax.jit`
    compiles once per unit, and `lax.scan`/`lax.while_loop` carries must keep their
    unit.

    **Arguments:**

    - `array`: the numbers, in `unit`.
    - `unit`: a `Unit`, such as `m / s` (default: dimensionless).

    !!! example

        ```python
        import jax.numpy as jnp
        import quaxlike
        from quaxlike.units import kg, m, s, Unitful

        mass = Unitful(jnp.array(2.0), kg)
        velocity = Unitful(jnp.array([3.0, 4.0]), m / s)
        energy = quaxlike.quaxify(lambda m, v: 0.5 * m * jnp.sum(v**2))(mass, velocity)
        print(energy.array, energy.unit)  # 25.0 kg*m^2/s^2
        ```
    """

    array: ArrayLike
    unit: Unit = eqx.field(static=True)

    # A known 0, inf or NaN fits every unit (`_constants`): ask quaxlike to note
    # which plain arrays are constants in disguise under `jit`.
    tracks_known_values: ClassVar[bool] = True

    def __init__(self, array: ArrayLike, unit: Unit | dict = dimensionless):
        if isinstance(unit, dict):
            unit = as_unit(unit)  # Quax's form, `{meters: 1}`
        if not isinstance(unit, Unit):
            raise TypeError(
                f"Unitful's `unit` must be a `Unit` (such as `m / s`); got {unit!r} of "
                f"type {type(unit).__qualname__}."
            )
        self.array = array if isinstance(array, jax.Array) else jnp.asarray(array)
        self.unit = unit

    @property
    def units(self) -> dict:
        """The unit in Quax's form, `{meters: 1, seconds: -1}`."""
        return units_of(self.unit)

    def logical_leaf_specs(self, spec: Any) -> "Unitful":
        """The magnitudes have the array's shape and follow its sharding; the unit is static (see `quaxlike.leaf_specs`).

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array.

        **Returns:**

        This value with a `PartitionSpec` in place of each leaf.
        """
        return with_leaf_specs(self, array=spec)

    def aval(self) -> ShapedArray:
        aval = jax.typeof(self.array)
        return ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)

    def materialise(self) -> Any:
        if not self.unit.dimensionless:
            raise UnitError(_REFUSE_MATERIALISE_MSG.format(unit=self.unit))
        return convert_array(self.array, self.unit, self.unit.si)

    def dense_for_derivatives(self) -> Any:
        # A derivative given as a plain array speaks of the numbers in this
        # quantity's own unit (its `array` leaf); dimensionless ones, of the
        # plain array they materialise to.
        return self.materialise() if self.unit.dimensionless else self.array

    def as_cotangent(self, leaf_cotangents: Any) -> "Unitful":
        # A loss's cotangent for a quantity in `m` is per metre: `1/m`. (A
        # tangent keeps the unit; a cotangent inverts it, so that a backward
        # pass's `k * ct` for `y = k * x` is in the unit `x`'s cotangent is.)
        # `leaf_cotangents` is a Unitful of this one's structure.
        return Unitful(leaf_cotangents.array, self.unit**-1)

    def cotangent_leaves(self, cotangent: Any) -> "Unitful | None":
        if not isinstance(cotangent, Unitful):
            return None
        per_unit = self.unit**-1
        if not cotangent.unit.same_dimensions(per_unit):
            return None
        return Unitful(convert_array(cotangent.array, cotangent.unit, per_unit), self.unit)

    def holding_plain(self, array: Any) -> "Unitful | None":
        # A plain array is a dimensionless number: it holds a unit only where its
        # value is known to fit every unit (0, +-inf, NaN everywhere), such as a
        # solver's state that starts as `jnp.zeros` and becomes a quantity (or,
        # inside `plain_constants_take_units`, where its value is known).
        if isinstance(array, Unitful):
            # Only one computed from a stand-in (a unit still being worked out, in
            # a loop traced only to find units) is held: it takes this unit.
            if not array.standing_in() or jnp.shape(array.array) != jnp.shape(self.array):
                return None
            return Unitful(array.array, self.unit)
        if jnp.shape(array) != jnp.shape(self.array):
            return None
        if jnp.result_type(array) != jnp.result_type(self.array):
            return None
        plain_number = self.unit.dimensionless and self.unit == self.unit.si
        if not (plain_number or takes_any_unit(array)):
            return None
        return Unitful(array, self.unit)

    def stand_in_for_plain(self, array: Any) -> "Unitful | None":
        # A loop's float carry that starts as 0, +-inf or NaN (a solver's buffer
        # or stage) may be meant to hold quantities in a unit only the loop's
        # body tells; inside the body its value is no longer known, so it would
        # be refused there as a plain number. It enters a trace made to find
        # units in a unit still being worked out, which fits any other, to see
        # the unit the body gives it; the loop is then traced from
        # `holding_plain` in that unit.
        dtype = jnp.result_type(array)
        if not jnp.issubdtype(dtype, jnp.inexact) or not takes_any_unit(array):
            return None
        return Unitful(array, unresolved)

    def standing_in(self) -> bool:
        return isinstance(self.unit, UnresolvedUnit)

    def to(self, unit: Unit) -> "Unitful":
        """The same quantity expressed in `unit`.

        **Arguments:**

        - `unit`: a unit with the same dimensions (`km` for a quantity in `m`).

        **Returns:**

        A `Unitful` in `unit`, its numbers multiplied by the conversion factor.

        **Raises:**

        `UnitError` if the dimensions differ.
        """
        return Unitful(convert_array(self.array, self.unit, unit), unit)

    @staticmethod
    def default(
        primitive: jax.extend.core.Primitive,
        values: Sequence[Any],
        params: dict[str, Any],
    ) -> Any:
        # A primitive with no unit rule: fine for pure numbers, refused otherwise.
        for position, value in enumerate(values):
            if isinstance(value, Unitful) and not value.unit.dimensionless:
                raise UnitError(
                    _NO_RULE_MSG.format(
                        primitive=primitive.name,
                        unit=value.unit,
                        position=position,
                        rule_name=f"{primitive.name.replace('-', '_')}_p_unitful",
                    )
                )
        arrays = [
            materialise_value(v, primitive) if isinstance(v, quaxlike.Value) else v for v in values
        ]
        out = primitive.bind(*arrays, **params)
        if primitive.multiple_results:
            return [_as_dimensionless(o) for o in out]
        return _as_dimensionless(out)


def _as_dimensionless(x: Any) -> Any:
    # Numbers computed from dimensionless quantities stay quantities (so that the
    # results of `quaxify` keep their type); booleans and integers (indices, masks)
    # come back as plain arrays.
    if jnp.issubdtype(np.result_type(x.dtype), jnp.inexact):
        return Unitful(x, dimensionless)
    return x
