"""Quax's names for units: `Dimension`, `kilograms`, `meters` and `seconds`, and
the conversions between Quax's `{dimension: power}` dicts and `Unit`.

Quax writes the unit of a quantity as a dict from base dimensions to integer
powers, `{meters: 1, seconds: -1}`. Here a `Dimension` is the `Unit` of one SI
base dimension (`meters == m`), so such a dict converts to a `Unit` by
multiplying out (`as_unit`), and a `Unit` back to one (`units_of`).
"""

from collections.abc import Mapping
from fractions import Fraction

from ._unit import BASE_DIMENSIONS, Unit


_UNKNOWN_DIMENSION_MSG = (
    "Dimension({name!r}): quaxlike's units are built from the SI base dimensions "
    "{known}, so a new base dimension cannot be made. Use one of those names (or "
    "the ready units `kg`, `m`, `s`, `A`, `K`); a quantity of another kind (a count, "
    "an angle) is best kept dimensionless."
)
_NOT_UNITS_MSG = (
    "Expected a `Unit` (such as `m / s`) or Quax's form of one, a dict from "
    "dimensions to powers (such as `{{meters: 1, seconds: -1}}`); got {units!r} of "
    "type {type_name}."
)
_NOT_A_DIMENSION_MSG = (
    "Quax-style units map dimensions (or units) to powers; got the key {key!r} of type "
    "{type_name} in {units!r}."
)


class Dimension(Unit):
    """One SI base dimension as a unit, under Quax's name (Quax's
    `unitful.Dimension`): `Dimension("m")` is the metre, equal to `m`.

    Quax lets any name make a new base dimension; here units are built from the
    SI base dimensions kg, m, s, A and K, so only those names are accepted (others
    raise `ValueError`). A `Dimension` is a `Unit`: it multiplies, divides and
    takes powers like one, and can key the dicts Quax uses for units
    (`{meters: 1, seconds: -1}`, see `as_unit`). It prints as its symbol, as in
    Quax.

    **Arguments:**

    - `name`: `"kg"`, `"m"`, `"s"`, `"A"` or `"K"`.

    !!! example

        ```python
        assert Dimension("m") == m and meters == m
        assert as_unit({meters: 1, seconds: -1}) == m / s
        ```
    """

    __slots__ = ("_symbol",)

    def __init__(self, name: str):
        if name not in BASE_DIMENSIONS:
            raise ValueError(
                _UNKNOWN_DIMENSION_MSG.format(name=name, known=", ".join(BASE_DIMENSIONS))
            )
        super().__init__(**{name: 1})
        self._symbol = name

    def __repr__(self) -> str:
        return self._symbol


kilograms = Dimension("kg")
meters = Dimension("m")
seconds = Dimension("s")

_BASES = {"kg": kilograms, "m": meters, "s": seconds, "A": Dimension("A"), "K": Dimension("K")}


# `units` is annotated loosely so that anything else gets the error below, which
# shows both accepted forms, rather than a generic type-check failure.
def as_unit(units: Unit | Mapping | object) -> Unit:
    """The `Unit` that Quax's `{dimension: power}` dict stands for.

    **Arguments:**

    - `units`: a `Unit` (returned as it is), or a dict from units (such as the
        `Dimension`s `meters`, `seconds`, or any `Unit`) to powers.

    **Returns:**

    The product of each unit raised to its power.

    !!! example

        ```python
        assert as_unit({kilograms: 1, meters: 1, seconds: -2}) == N
        assert as_unit(meters) == m
        ```
    """
    if isinstance(units, Unit):
        return units
    if not isinstance(units, Mapping):
        raise TypeError(_NOT_UNITS_MSG.format(units=units, type_name=type(units).__qualname__))
    out = Unit()
    for key, power in units.items():
        if not isinstance(key, Unit):
            raise TypeError(
                _NOT_A_DIMENSION_MSG.format(key=key, type_name=type(key).__qualname__, units=units)
            )
        out = out * key**power
    return out


def units_of(unit: Unit) -> dict[Unit, int | Fraction]:
    """`unit` in Quax's form: a dict from base `Dimension`s to their powers.

    Dimensions with power zero are left out, so a dimensionless unit gives `{}`
    (Quax keeps zero powers that arise from arithmetic: `{meters: 0}`). A scale
    other than 1 (a kilometre) appears as the dimensionless unit of that scale
    with power 1, so that `as_unit(units_of(u)) == u`.

    **Arguments:**

    - `unit`: a `Unit`.

    **Returns:**

    A dict such as `{meters: 1, seconds: -1}`; powers are ints where whole,
    `Fraction`s otherwise.

    !!! example

        ```python
        assert units_of(m / s) == {meters: 1, seconds: -1}
        assert as_unit(units_of(km)) == km
        ```
    """
    out: dict[Unit, int | Fraction] = {}
    if unit.scale != 1.0:
        out[Unit(scale=unit.scale)] = 1
    for name, power in unit.exponents.items():
        if power:
            out[_BASES[name]] = int(power) if power.denominator == 1 else power
    return out
