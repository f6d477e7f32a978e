"""How Unitful's rules read their operands: the unit and the numbers of each (a
plain array counts as a dimensionless number), and several operands brought to
one unit after checking that their dimensions agree.

Shared by the primitive rules (`_rules`, `_linalg`) and the rules for whole
`jax.numpy` functions (`_functions`).
"""

from collections.abc import Sequence
from typing import Any

from ._constants import known_value, reading_constants_in_unit, takes_any_unit
from ._unit import dimensionless, Unit, UnresolvedUnit
from ._value import convert_array, UnitError, Unitful


_MISMATCH_MSG = (
    "`{primitive}` needs its arguments in compatible units, but got a quantity in "
    "{first} (argument {first_position}) and one in {second} (argument "
    "{second_position}), whose dimensions differ. Only quantities of the same kind "
    "can be added, subtracted, compared or selected between (units of one kind, "
    "such as km and m, are converted automatically): check the formula."
)
_PLAIN_MSG = (
    "`{primitive}` got a plain array (argument {plain_position}) and a quantity in "
    "{unit} (argument {position}). A plain array counts as a dimensionless number, "
    "so it can only be combined this way with dimensionless quantities, unless it "
    "is 0, +-inf or NaN everywhere (values that fit every unit). Give it a unit, "
    "for example by passing `Unitful(x, {unit_expr})` into the quaxified function "
    "instead of `x`."
)
_KNOWN_PLAIN_MSG = (
    " Its value is known while tracing: if it is a tolerance or a safeguard of a "
    "numerical library meant in the unit of whatever it meets (diffrax's "
    "`PIDController(atol=...)`), call the quaxified function through "
    "`quaxlike.units.plain_constants_take_units`, which reads such "
    "numbers in the unit they meet."
)
_UNKNOWN_PLAIN_MSG = (
    " (Its value is not known while tracing: it depends on a traced input, such as "
    "an argument of `jax.jit`, so it cannot be checked for 0, inf or NaN either.)"
)
_NEEDS_DIMENSIONLESS_MSG = (
    "`{primitive}` needs a dimensionless argument, but argument {position} is a "
    "quantity in {unit}. Divide it by a reference quantity first (for example "
    "`jnp.exp(-energy / kT)` with `kT` in the same unit as `energy`)."
)
_INDEX_MSG = (
    "`{primitive}` got a quantity in {unit} as argument {position}, where it expects "
    "plain numbers (indices, a predicate, a shape); only argument {allowed} may carry "
    "a unit."
)


def _quantities(args: Sequence[Any], positions: Sequence[int]) -> list[int]:
    return [i for i in positions if isinstance(args[i], Unitful)]


def _name(primitive) -> str:
    # Rules for whole `jax.numpy` functions (`_functions`) pass the function's name.
    return primitive if isinstance(primitive, str) else primitive.name


def _check_plain(primitive, args, positions) -> None:
    """Raise if a Unitful sits where the primitive expects plain numbers."""
    allowed = set(positions)
    for i, x in enumerate(args):
        if i not in allowed and isinstance(x, Unitful):
            text = ", ".join(str(p) for p in sorted(allowed))
            raise UnitError(
                _INDEX_MSG.format(primitive=_name(primitive), unit=x.unit, position=i, allowed=text)
            )


def _common_unit(primitive, args: Sequence[Any], positions: Sequence[int]):
    """Express the operands at `positions` in one unit (that of the first quantity
    among them, or dimensionless when a plain array is involved).

    Returns the operands as plain arrays, and that unit.
    """
    _check_plain(primitive, args, positions)
    quantity_positions = _quantities(args, positions)
    # A stand-in's unit, still being worked out (`Unitful.stand_in_for_plain`),
    # takes the unit of the others; with plain numbers only, it stays unresolved.
    resolved = [i for i in quantity_positions if not isinstance(args[i].unit, UnresolvedUnit)]
    first = (resolved or quantity_positions)[0]
    unit = args[first].unit
    # 0, +-inf and NaN fit every unit, and inside `plain_constants_take_units`
    # every known plain number does (see `_constants`); other plain numbers are
    # dimensionless.
    plain_positions = [
        i for i in positions if i not in quantity_positions and not takes_any_unit(args[i])
    ]
    if plain_positions and not isinstance(unit, UnresolvedUnit):
        # Plain numbers are dimensionless with scale 1.
        for i in quantity_positions:
            if not args[i].unit.dimensionless:
                plain = plain_positions[0]
                raise UnitError(
                    _PLAIN_MSG.format(
                        primitive=_name(primitive),
                        plain_position=plain,
                        unit=args[i].unit,
                        position=i,
                        unit_expr=_unit_expression(args[i].unit),
                    )
                    + _plain_value_note(args[plain])
                )
        unit = dimensionless
    arrays = list(args)
    for i in quantity_positions:
        if not args[i].unit.same_dimensions(unit):
            raise UnitError(
                _MISMATCH_MSG.format(
                    primitive=_name(primitive),
                    first=unit,
                    first_position=first,
                    second=args[i].unit,
                    second_position=i,
                )
            )
        arrays[i] = convert_array(args[i].array, args[i].unit, unit)
    return arrays, unit


def _plain_value_note(x: Any) -> str:
    if known_value(x) is None:
        return _UNKNOWN_PLAIN_MSG
    return "" if reading_constants_in_unit() else _KNOWN_PLAIN_MSG


def _unit_expression(unit: Unit) -> str:
    text = str(unit)
    return text.replace("^", "**") if unit.scale == 1.0 else "unit"


def _require_dimensionless(primitive, x: Unitful, position: int = 0):
    """`x`'s numbers as a pure number (scale 1), or a UnitError."""
    if not x.unit.dimensionless:
        raise UnitError(
            _NEEDS_DIMENSIONLESS_MSG.format(
                primitive=primitive.name, position=position, unit=x.unit
            )
        )
    return convert_array(x.array, x.unit, dimensionless)


def _rule_name(primitive, suffix: str) -> str:
    return f"{primitive.name.replace('-', '_')}_p_{suffix}"


def _unit_of(x: Any) -> Unit:
    return x.unit if isinstance(x, Unitful) else dimensionless


def _array_of(x: Any) -> Any:
    return x.array if isinstance(x, Unitful) else x
