"""`Unit`: exponents of the SI base dimensions and a scale factor, as a hashable
static object that `Unitful` keeps in its PyTree structure."""

import math
from fractions import Fraction
from typing import Any, TypeAlias


# Printing order: `kg*m/s^2` is how a newton is usually written.
BASE_DIMENSIONS = ("kg", "m", "s", "A", "K")

# An exponent as `Unit` accepts it (a float must equal a simple fraction).
_Exponent: TypeAlias = int | Fraction | float

# Exponents must stay exact: `sqrt(m^2)` must be `m`, not `m^1.0000000002`.
_MAX_DENOMINATOR = 1000
# `Unit.__mul__`'s results, by (left, right); cleared when it holds this many.
_MAX_PRODUCTS = 4096
_products: dict = {}


def _as_fraction(exponent: Any, what: str) -> Fraction:
    if isinstance(exponent, bool):
        raise TypeError(f"{what} must be a number, not a bool; got {exponent!r}.")
    if isinstance(exponent, (int, Fraction)):
        return Fraction(exponent)
    if isinstance(exponent, float) and math.isfinite(exponent):
        fraction = Fraction(exponent).limit_denominator(_MAX_DENOMINATOR)
        if math.isclose(float(fraction), exponent, rel_tol=0, abs_tol=1e-9):
            return fraction
    raise TypeError(
        f"{what} must be an int, a `fractions.Fraction` or a float equal to a simple "
        f"fraction (such as 0.5); got {exponent!r}."
    )


def _normalise_scale(scale: Any) -> float:
    # Rounded to 12 significant digits so that `km / m * m` has the same scale as
    # `km` and units compare (and hash) equal after float round-off.
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"A unit's scale must be a positive finite number; got {scale!r}.")
    return float(f"{scale:.12g}")


def as_fraction(exponent: Any) -> Fraction:
    """`exponent` as a `Fraction`, as `Unit`'s powers accept it (a float must equal
    a simple fraction); raises `TypeError` otherwise."""
    return _as_fraction(exponent, "An exponent")


def _power_text(symbol: str, exponent: Fraction) -> str:
    if exponent == 1:
        return symbol
    if exponent.denominator == 1:
        return f"{symbol}^{exponent.numerator}"
    return f"{symbol}^({exponent})"


class Unit:
    """A physical unit: integer or rational powers of the base dimensions metre,
    second, kilogram, ampere and kelvin, times a scale factor.

    Units multiply, divide and take powers (`kg*m/s**2`, `m**Fraction(1, 2)`), and
    print as `kg*m/s^2`. The scale factor says how many SI units one of this unit
    is (`1000.0` for a kilometre); units with a scale other than 1 print it first,
    as in `1000 m`. Units are immutable and hashable, so they can be static fields
    of a PyTree: two quantities with different units have different PyTree
    structures, which `jax.jit` and `lax.scan` carries rely on.

    **Arguments:**

    - `m`, `s`, `kg`, `A`, `K`: the exponents of metre, second, kilogram, ampere and
        kelvin (ints, `Fraction`s, or floats equal to simple fractions).
    - `scale`: how many SI units one of this unit is (default 1).

    !!! example

        ```python
        from quaxlike.units import kg, m, s, Unit

        newton = kg * m / s**2
        print(newton)                    # kg*m/s^2
        km = Unit(m=1, scale=1000.0)
        print(km / m)                    # 1000
        ```
    """

    __slots__ = ("_exponents", "_scale", "_hash")

    def __init__(
        self,
        *,
        m: _Exponent = 0,
        s: _Exponent = 0,
        kg: _Exponent = 0,
        A: _Exponent = 0,
        K: _Exponent = 0,
        scale: float = 1.0,
    ):
        given = {"m": m, "s": s, "kg": kg, "A": A, "K": K}
        self._exponents = tuple(
            _as_fraction(given[name], f"The exponent of {name}") for name in BASE_DIMENSIONS
        )
        self._scale = _normalise_scale(scale)
        self._hash = hash((self._exponents, self._scale))

    @classmethod
    def _make(cls, exponents: tuple[Fraction, ...], scale: float) -> "Unit":
        return cls(**dict(zip(BASE_DIMENSIONS, exponents)), scale=scale)

    # --- properties -------------------------------------------------------------

    @property
    def exponents(self) -> dict[str, Fraction]:
        """The exponent of each base dimension, as a dict `{"kg": ..., "m": ...}`."""
        return dict(zip(BASE_DIMENSIONS, self._exponents))

    @property
    def scale(self) -> float:
        """How many SI units one of this unit is."""
        return self._scale

    @property
    def dimensionless(self) -> bool:
        """Whether every exponent is zero (the scale may still differ from 1)."""
        return not any(self._exponents)

    @property
    def si(self) -> "Unit":
        """The unit with the same dimensions and scale 1 (`m` for a kilometre)."""
        return Unit._make(self._exponents, 1.0)

    def same_dimensions(self, other: "Unit") -> bool:
        """Whether `self` and `other` measure the same kind of quantity, so that
        one converts into the other by a constant factor."""
        if isinstance(self, UnresolvedUnit) or isinstance(other, UnresolvedUnit):
            return True
        return self._exponents == other._exponents

    def factor_to(self, other: "Unit") -> float:
        """The number to multiply a value in `self` by to express it in `other`.

        **Arguments:**

        - `other`: a unit with the same dimensions.

        **Returns:**

        `self.scale / other.scale`, a Python float.

        **Raises:**

        `ValueError` if the dimensions differ.
        """
        if not self.same_dimensions(other):
            raise ValueError(f"Cannot convert {self} to {other}: their dimensions differ.")
        return self._scale / other._scale

    # --- algebra ----------------------------------------------------------------

    def __mul__(self, other: "Unit") -> "Unit":
        if not isinstance(other, Unit):
            return NotImplemented
        # Every product on a quantity computes one (eagerly, once per
        # operation): units are immutable, so each product is worked out once.
        key = (self, other)
        product = _products.get(key)
        if product is None:
            exponents = tuple(a + b for a, b in zip(self._exponents, other._exponents))
            product = Unit._make(exponents, self._scale * other._scale)
            if len(_products) >= _MAX_PRODUCTS:
                _products.clear()
            _products[key] = product
        return product

    def __truediv__(self, other: "Unit") -> "Unit":
        if not isinstance(other, Unit):
            return NotImplemented
        return self * other**-1

    def __rtruediv__(self, other: Any) -> "Unit":
        # Only `1 / s`: any other number would be a quantity, not a unit.
        if isinstance(other, int) and not isinstance(other, bool) and other == 1:
            return self**-1
        return NotImplemented

    def __pow__(self, exponent: Any) -> "Unit":
        power = _as_fraction(exponent, "A unit's power")
        exponents = tuple(e * power for e in self._exponents)
        return Unit._make(exponents, self._scale ** float(power))

    # --- comparison and printing ------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Unit):
            return NotImplemented
        return self._exponents == other._exponents and self._scale == other._scale

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        numerator = [
            _power_text(name, e) for name, e in zip(BASE_DIMENSIONS, self._exponents) if e > 0
        ]
        denominator = [
            _power_text(name, -e) for name, e in zip(BASE_DIMENSIONS, self._exponents) if e < 0
        ]
        text = "*".join(numerator) or ("1" if denominator else "")
        if len(denominator) == 1:
            text += "/" + denominator[0]
        elif denominator:
            text += "/(" + "*".join(denominator) + ")"
        if self._scale != 1.0:
            text = f"{self._scale:g} {text}".rstrip()
        return text or "dimensionless"

    def __repr__(self) -> str:
        return f"Unit({self})"

    # Units are immutable; `copy.copy` and `copy.deepcopy` may share them.
    def __copy__(self) -> "Unit":
        return self

    def __deepcopy__(self, memo) -> "Unit":
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuild, (self._exponents, self._scale))


def _rebuild(exponents, scale) -> Unit:
    return Unit._make(exponents, scale)


class UnresolvedUnit(Unit):
    """The unit of a stand-in (`Unitful.stand_in_for_plain`): a loop carry that
    enters as a plain 0, inf or NaN array, in a trace made only to see which unit
    the loop's body gives it. It fits every unit, with factor 1, and every
    product, quotient or power with it is unresolved too. Only such traces see
    it: the loop is then traced again with the units found, and every check in
    force.
    """

    __slots__ = ()

    def __init__(self):
        self._exponents = tuple(Fraction(0) for _ in BASE_DIMENSIONS)
        self._scale = 1.0
        self._hash = hash(UnresolvedUnit)

    @property
    def si(self) -> "Unit":
        return self

    def __mul__(self, other: "Unit") -> "Unit":
        return self if isinstance(other, Unit) else NotImplemented

    __rmul__ = __truediv__ = __mul__

    def __rtruediv__(self, other: Any) -> "Unit":
        return self

    def __pow__(self, exponent: Any) -> "Unit":
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnresolvedUnit)

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return "(a unit being worked out)"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (UnresolvedUnit, ())


unresolved = UnresolvedUnit()


# --- predefined units -----------------------------------------------------------

dimensionless = Unit()
m = Unit(m=1)
s = Unit(s=1)
kg = Unit(kg=1)
A = Unit(A=1)
K = Unit(K=1)

N = kg * m / s**2
J = N * m
W = J / s
Hz = 1 / s

km = Unit(m=1, scale=1000.0)
cm = Unit(m=1, scale=0.01)
gram = Unit(kg=1, scale=0.001)
minute = Unit(s=1, scale=60.0)
hour = Unit(s=1, scale=3600.0)
