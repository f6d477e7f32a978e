"""Rules for `Unitful`: how each primitive combines, keeps or checks units.

Families, each registered from a table below:

- same-unit primitives (`add`, `max`, comparisons, `select_n`, `concatenate`, ...):
  every quantity operand is converted to one unit, after checking dimensions;
- unit-keeping primitives (`neg`, reductions, reshapes, slicing, ...): the first
  operand carries the unit, the others (indices) are plain;
- unit algebra (`mul`, `div`, `dot_general`, `integer_pow`, `sqrt`, ...);
- dimensionless-only primitives (`exp`, `log`, `sin`, ...).
"""

import math
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import jax
import jax.extend.core
import numpy as np
from jax import lax
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import TRANSCENDENTAL_PRIMITIVES

from ._constants import known_value
from ._operands import (
    _array_of,
    _common_unit,
    _require_dimensionless,
    _rule_name,
    _unit_of,
)
from ._unit import as_fraction, dimensionless, Unit
from ._value import UnitError, Unitful


_POW_MSG = (
    "`pow` with a quantity in {unit} as its base: the unit of the result depends on "
    "the exponent's value, which is not known while tracing (or is not the same "
    "number everywhere, or not a simple fraction). Write the exponent as a number "
    "(`x ** 1.5`, `jnp.power(x, 2.0)`), use `jnp.sqrt` or `jnp.cbrt`, or divide by "
    "a reference quantity first so the base is dimensionless."
)


# --- same-unit primitives --------------------------------------------------------

# primitive -> (positions holding quantities, given the number of operands; whether
# the result is a quantity in the common unit rather than a plain array)
_SAME_UNIT = {
    lax.add_p: (lambda n: range(n), True),
    # `add_any` sums cotangents: `jax.grad` inside `quaxify` emits it.
    jax.extend.core.primitives.add_jaxvals_p: (lambda n: range(n), True),
    lax.sub_p: (lambda n: range(n), True),
    lax.max_p: (lambda n: range(n), True),
    lax.min_p: (lambda n: range(n), True),
    lax.rem_p: (lambda n: range(n), True),
    lax.nextafter_p: (lambda n: range(n), True),
    lax.clamp_p: (lambda n: range(n), True),
    lax.concatenate_p: (lambda n: range(n), True),
    lax.pad_p: (lambda n: range(n), True),
    lax.select_n_p: (lambda n: range(1, n), True),
    lax.dynamic_update_slice_p: (lambda n: (0, 1), True),
    lax.scatter_p: (lambda n: (0, 2), True),
    lax.scatter_add_p: (lambda n: (0, 2), True),
    lax.scatter_sub_p: (lambda n: (0, 2), True),
    # `jnp.stack` (JAX 0.10.1 and later; earlier, `broadcast_in_dim` and
    # `concatenate`).
    **({lax.stack_p: (lambda n: range(n), True)} if hasattr(lax, "stack_p") else {}),
    lax.eq_p: (lambda n: range(n), False),
    lax.ne_p: (lambda n: range(n), False),
    lax.lt_p: (lambda n: range(n), False),
    lax.le_p: (lambda n: range(n), False),
    lax.gt_p: (lambda n: range(n), False),
    lax.ge_p: (lambda n: range(n), False),
    # Comparisons in the total order of floats (`jnp.searchsorted`, `jnp.sort` of
    # NaNs), in recent JAX.
    **{
        getattr(lax, name): (lambda n: range(n), False)
        for name in ("eq_to_p", "le_to_p", "lt_to_p")
        if hasattr(lax, name)
    },
}


def _make_same_unit_rule(primitive, positions_for, keeps_unit: bool):
    def rule(*args: Unitful | ArrayLike, **params):
        arrays, unit = _common_unit(primitive, args, positions_for(len(args)))
        out = primitive.bind(*arrays, **params)
        return Unitful(out, unit) if keeps_unit else out

    rule.__name__ = rule.__qualname__ = _rule_name(primitive, "unitful")
    return rule


for _primitive, (_positions, _keeps) in _SAME_UNIT.items():
    quaxlike.register(_primitive)(_make_same_unit_rule(_primitive, _positions, _keeps))


@quaxlike.register(lax.atan2_p)
def atan2_p_unitful(y: Unitful | ArrayLike, x: Unitful | ArrayLike, **params) -> Unitful:
    # The angle between two components of a vector: their units cancel.
    (y, x), _ = _common_unit(lax.atan2_p, (y, x), (0, 1))
    return Unitful(lax.atan2_p.bind(y, x, **params), dimensionless)


# --- unit-keeping primitives -----------------------------------------------------

_KEEPS_UNIT = [
    lax.neg_p,
    lax.abs_p,
    lax.floor_p,
    lax.ceil_p,
    lax.round_p,
    lax.real_p,
    lax.imag_p,
    lax.conj_p,
    lax.copy_p,
    lax.broadcast_in_dim_p,
    lax.reshape_p,
    lax.squeeze_p,
    lax.transpose_p,
    lax.rev_p,
    lax.slice_p,
    lax.dynamic_slice_p,
    lax.gather_p,
    lax.reduce_sum_p,
    lax.reduce_max_p,
    lax.reduce_min_p,
    lax.cumsum_p,
    lax.cummax_p,
    lax.cummin_p,
    lax.reduce_precision_p,
    lax.stop_gradient_p,
    # `jnp.tile` (JAX 0.9 and later; earlier, `broadcast_in_dim` and `reshape`).
    *([lax.tile_p] if hasattr(lax, "tile_p") else []),
]

# The result is a plain array: a sign, a mask, an index.
_PLAIN_RESULT = [lax.sign_p, lax.is_finite_p, lax.argmax_p, lax.argmin_p]


def _make_keeps_unit_rule(primitive, keeps_unit: bool):
    def rule(x: Unitful, *rest: ArrayLike, **params):
        out = primitive.bind(x.array, *rest, **params)
        return Unitful(out, x.unit) if keeps_unit else out

    rule.__name__ = rule.__qualname__ = _rule_name(primitive, "unitful")
    return rule


for _primitive in _KEEPS_UNIT:
    quaxlike.register(_primitive)(_make_keeps_unit_rule(_primitive, True))
for _primitive in _PLAIN_RESULT:
    quaxlike.register(_primitive)(_make_keeps_unit_rule(_primitive, False))


@quaxlike.register(lax.convert_element_type_p)
def convert_element_type_p_unitful(x: Unitful, *, new_dtype, **params) -> Any:
    out = lax.convert_element_type_p.bind(x.array, new_dtype=new_dtype, **params)
    # A quantity as booleans is "nonzero", the same in every unit: a plain mask
    # (`jnp.all(x)`, `jnp.any(x)`, `x.astype(bool)`).
    if np.dtype(new_dtype) == np.dtype(bool):
        return out
    return Unitful(out, x.unit)


@quaxlike.register(lax.top_k_p)
def top_k_p_unitful(x: Unitful, **params) -> list:
    # The k largest values, in the unit, and their indices.
    values, indices = lax.top_k_p.bind(x.array, **params)
    return [Unitful(values, x.unit), indices]


def _make_each_result_rule(primitive):
    # Several results, each a piece of the one operand: `split` and (JAX 0.10.1
    # and later) `unstack`.
    def rule(x: Unitful, **params) -> list:
        return [Unitful(out, x.unit) for out in primitive.bind(x.array, **params)]

    rule.__name__ = rule.__qualname__ = _rule_name(primitive, "unitful")
    return rule


for _primitive in [lax.split_p, *([lax.unstack_p] if hasattr(lax, "unstack_p") else [])]:
    quaxlike.register(_primitive)(_make_each_result_rule(_primitive))


def _make_each_operand_rule(primitive):
    # Output i comes from operand i and keeps its unit: `sort` (which carries
    # payload operands along with the keys, as `argsort` does) and barriers.
    def rule(*args: Unitful | ArrayLike, **params) -> list:
        outs = primitive.bind(*map(_array_of, args), **params)
        return [
            Unitful(out, x.unit) if isinstance(x, Unitful) else out for x, out in zip(args, outs)
        ]

    rule.__name__ = rule.__qualname__ = _rule_name(primitive, "unitful")
    return rule


for _primitive in [lax.sort_p, lax.optimization_barrier_p]:
    quaxlike.register(_primitive)(_make_each_operand_rule(_primitive))


# --- unit algebra ----------------------------------------------------------------


def _make_product_rule(primitive, combine: Callable[[Unit, Unit], Unit]):
    # The numbers combine as the primitive says, the units by `combine`: `mul`
    # and the sums of products of an element of each (`dot_general`, `conv`)
    # multiply them, `div` divides them.
    def rule(x: Unitful | ArrayLike, y: Unitful | ArrayLike, **params) -> Unitful:
        out = primitive.bind(_array_of(x), _array_of(y), **params)
        return Unitful(out, combine(_unit_of(x), _unit_of(y)))

    rule.__name__ = rule.__qualname__ = _rule_name(primitive, "unitful")
    return rule


# `mul`, `div`, `dot_general` (`@`, `einsum`) and `conv_general_dilated`
# (`jnp.convolve`).
_PRODUCTS = {
    lax.mul_p: operator.mul,
    lax.div_p: operator.truediv,
    lax.dot_general_p: operator.mul,
    lax.conv_general_dilated_p: operator.mul,
}

for _primitive, _combine in _PRODUCTS.items():
    quaxlike.register(_primitive)(_make_product_rule(_primitive, _combine))


@quaxlike.register(lax.integer_pow_p)
def integer_pow_p_unitful(x: Unitful, *, y: int, **params) -> Unitful:
    return Unitful(lax.integer_pow_p.bind(x.array, y=y, **params), x.unit**y)


_POWERS = {
    lax.square_p: Fraction(2),
    lax.sqrt_p: Fraction(1, 2),
    lax.rsqrt_p: Fraction(-1, 2),
    lax.cbrt_p: Fraction(1, 3),
}


def _make_power_rule(primitive, power: Fraction):
    def rule(x: Unitful, **params) -> Unitful:
        return Unitful(primitive.bind(x.array, **params), x.unit**power)

    rule.__name__ = rule.__qualname__ = _rule_name(primitive, "unitful")
    return rule


for _primitive, _power in _POWERS.items():
    quaxlike.register(_primitive)(_make_power_rule(_primitive, _power))


@quaxlike.register(lax.reduce_prod_p)
def reduce_prod_p_unitful(x: Unitful, *, axes, **params) -> Unitful:
    count = math.prod(x.shape[a] for a in axes)
    return Unitful(lax.reduce_prod_p.bind(x.array, axes=axes, **params), x.unit**count)


@quaxlike.register(lax.pow_p)
def pow_p_unitful(x: Unitful | ArrayLike, y: Unitful | ArrayLike, **params) -> Unitful:
    exponent = _require_dimensionless(lax.pow_p, y, 1) if isinstance(y, Unitful) else y
    if isinstance(x, Unitful) and not x.unit.dimensionless:
        # A dimensioned base needs an exponent whose value is known while
        # tracing (`jnp.power(x, 2.0)`, `x ** 1.5`): the unit is the base's to
        # that power, as in astropy.
        power = _known_power(y)
        if power is None:
            raise UnitError(_POW_MSG.format(unit=x.unit))
        return Unitful(lax.pow_p.bind(x.array, exponent, **params), x.unit**power)
    base = _require_dimensionless(lax.pow_p, x, 0) if isinstance(x, Unitful) else x
    return Unitful(lax.pow_p.bind(base, exponent, **params), dimensionless)


def _known_power(y: Any) -> Fraction | None:
    """The exponent as a fraction, if `y` is plain, known while tracing, the same
    everywhere and a simple fraction; else None."""
    if isinstance(y, Unitful):
        return None
    value = known_value(y)
    if value is None or value.size == 0 or np.iscomplexobj(value):
        return None
    first = value.reshape(-1)[0]
    if not np.all(value == first) or not np.isfinite(first):
        return None
    try:
        return as_fraction(float(first))
    except TypeError:
        return None


# --- dimensionless-only primitives -----------------------------------------------

_NEEDS_DIMENSIONLESS = [
    *TRANSCENDENTAL_PRIMITIVES,
    lax.cumlogsumexp_p,
    lax.cumprod_p,
]


def _make_dimensionless_rule(primitive):
    def rule(x: Unitful, **params) -> Unitful:
        number = _require_dimensionless(primitive, x)
        return Unitful(primitive.bind(number, **params), dimensionless)

    rule.__name__ = rule.__qualname__ = _rule_name(primitive, "unitful")
    return rule


for _primitive in _NEEDS_DIMENSIONLESS:
    quaxlike.register(_primitive)(_make_dimensionless_rule(_primitive))
