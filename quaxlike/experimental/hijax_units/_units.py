"""Units as a hashable value: a sorted tuple of `(Dimension, exponent)` pairs.

A hijax type must be hashable and compare by value, so the units of a
`UnitfulArray` are a tuple rather than the `Unit` objects of
`quaxlike.units`; the dimensions are that example's (`meters`,
`kilograms`, `seconds`, ...).
"""

from typing import Any, TypeAlias

from ...units import Dimension


Units: TypeAlias = tuple[tuple[Dimension, int], ...]


def to_units(units: Any) -> Units:
    """Canonical `Units` from a `Dimension`, a `{Dimension: exponent}` dict or a
    `Units` tuple: sorted by symbol, zero exponents dropped (`m / m` is `()`).

    **Arguments:**

    - `units`: a `Dimension`, a dict from dimensions to integer exponents, or a
      sequence of `(dimension, exponent)` pairs.

    **Returns:**

    The `Units` tuple.

    !!! example

        ```python
        from quaxlike.units import meters, seconds

        assert to_units({seconds: -1, meters: 1}) == ((meters, 1), (seconds, -1))
        assert to_units({meters: 0}) == ()
        ```
    """
    if isinstance(units, Dimension):
        pairs = [(units, 1)]
    elif isinstance(units, dict):
        pairs = list(units.items())
    else:
        pairs = list(units)
    merged: dict[Dimension, int] = {}
    for dimension, exponent in pairs:
        if not isinstance(dimension, Dimension):
            raise TypeError(
                f"UnitfulArray units are built from Dimensions (meters, kilograms, "
                f"seconds, ...); got {dimension!r} of type {type(dimension).__name__}."
            )
        merged[dimension] = merged.get(dimension, 0) + int(exponent)
    return tuple(sorted(((d, e) for d, e in merged.items() if e), key=lambda p: str(p[0])))


def times(a: Units, b: Units) -> Units:
    """The units of a product: exponents add."""
    return to_units(a + b)


def power(a: Units, n: int) -> Units:
    """The units of an integer power: exponents multiply."""
    return to_units(tuple((d, e * n) for d, e in a))


def text(a: Units) -> str:
    """How units print in a type: `kg m^2 s^-2`; dimensionless is `1`."""
    return " ".join(str(d) if e == 1 else f"{d}^{e}" for d, e in a) or "1"
