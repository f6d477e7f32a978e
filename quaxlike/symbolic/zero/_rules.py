"""Rules for `Zero`: results that are known to be zero stay symbolic.

Every rule here decides from shapes, dtypes and static parameters alone, so it is
resolved while the program is traced: a `Zero` never adds a `broadcast_in_dim` of
zeros, a multiplication by zero or a matrix product with zero to the jaxpr. Where
the answer depends on data (`0 / 0`, `max(0, x)`, a gather that may fill with NaN)
the rule returns `NotImplemented`, and the Zero is materialised.
"""

import math

import jax
import jax.core
import jax.extend.core.primitives as jex_primitives
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import output_aval

from ._value import Zero


_Any = ArrayLike | quaxlike.ArrayValue


def _zero_like_output(primitive, args, params) -> Zero:
    aval = output_aval(primitive, args, params)
    return Zero(aval.shape, aval.dtype)


def _reduced_size(x: Zero, axes) -> int:
    return math.prod(x.shape[a] for a in axes)


def _is_known_zero(x) -> bool:
    """Whether `x` is zero everywhere, as far as trace time can tell."""
    if isinstance(x, Zero):
        return True
    if isinstance(x, (jax.core.Tracer, quaxlike.Value)):
        return False
    return not bool(np.any(np.asarray(x) != 0))


# --- unary and structural primitives ------------------------------------------

# Primitives that map an all-zero input to an all-zero output, whatever their
# parameters: linear in the Zero argument, structural, or with f(0) == 0.
_ZERO_PRESERVING_UNARY = [
    lax.neg_p,
    lax.convert_element_type_p,
    lax.broadcast_in_dim_p,
    lax.reshape_p,
    lax.squeeze_p,
    lax.transpose_p,
    lax.reduce_sum_p,
    lax.reduce_or_p,
    lax.reduce_xor_p,
    lax.slice_p,
    lax.rev_p,
    lax.copy_p,
    lax.real_p,
    lax.imag_p,
    lax.conj_p,
    lax.sin_p,
    lax.tan_p,
    lax.asin_p,
    lax.atan_p,
    lax.sinh_p,
    lax.tanh_p,
    lax.asinh_p,
    lax.atanh_p,
    lax.expm1_p,
    lax.log1p_p,
    lax.erf_p,
    lax.erf_inv_p,
    lax.sqrt_p,
    lax.cbrt_p,
    lax.square_p,
    lax.abs_p,
    lax.sign_p,
    lax.floor_p,
    lax.ceil_p,
    lax.round_p,
    lax.population_count_p,
    lax.cumsum_p,
    lax.cumprod_p,
    lax.cummax_p,
    lax.cummin_p,
    lax.reduce_precision_p,
]

# Reductions whose result is zero only when something is reduced: over an empty
# axis they give their identity (-inf, +inf, 1, True), not zero.
_ZERO_PRESERVING_NONEMPTY_REDUCTIONS = [
    lax.reduce_max_p,
    lax.reduce_min_p,
    lax.reduce_prod_p,
    lax.reduce_and_p,
    lax.argmax_p,
    lax.argmin_p,
]


def _make_unary_rule(primitive):
    def rule(x: Zero, **params) -> Zero:
        return _zero_like_output(primitive, (x,), params)

    rule.__name__ = rule.__qualname__ = f"{primitive.name}_p_zero"
    return rule


def _make_reduction_rule(primitive):
    def rule(x: Zero, *, axes, **params):
        if _reduced_size(x, axes) == 0:
            return NotImplemented  # the identity of the reduction: materialise
        return _zero_like_output(primitive, (x,), dict(params, axes=axes))

    rule.__name__ = rule.__qualname__ = f"{primitive.name}_p_zero"
    return rule


for _primitive in _ZERO_PRESERVING_UNARY:
    quaxlike.register(_primitive, precedence=1)(_make_unary_rule(_primitive))
for _primitive in _ZERO_PRESERVING_NONEMPTY_REDUCTIONS:
    quaxlike.register(_primitive, precedence=1)(_make_reduction_rule(_primitive))


@quaxlike.register(jex_primitives.stop_gradient_p)
def stop_gradient_p_zero(x: Zero, **params) -> Zero:
    return x


@quaxlike.register(lax.integer_pow_p)
def integer_pow_p_zero(x: Zero, *, y: int, **params):
    if y <= 0:
        return NotImplemented  # 0 ** 0 == 1 and 0 ** -1 == inf: materialise
    return _zero_like_output(lax.integer_pow_p, (x,), dict(params, y=y))


@quaxlike.register(lax.split_p)
def split_p_zero(x: Zero, **params) -> list[Zero]:
    return [Zero(a.shape, a.dtype) for a in output_aval(lax.split_p, (x,), params)]


# --- indexing -------------------------------------------------------------------


@quaxlike.register(lax.dynamic_slice_p)
def dynamic_slice_p_zero(x: Zero, *indices: _Any, **params) -> Zero:
    return _zero_like_output(lax.dynamic_slice_p, (x, *indices), params)


@quaxlike.register(lax.dynamic_update_slice_p)
def dynamic_update_slice_p_zero_zero(x: Zero, update: Zero, *indices: _Any, **params) -> Zero:
    return _zero_like_output(lax.dynamic_update_slice_p, (x, update, *indices), params)


_IN_BOUNDS_MODES = (lax.GatherScatterMode.CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@quaxlike.register(lax.gather_p)
def gather_p_zero_any(x: Zero, indices: _Any, *, mode, fill_value, **params):
    # Clamped and promised-in-bounds gathers only read zeros. A filling gather puts
    # `fill_value` (NaN by default for floats) wherever an index is out of bounds,
    # which only the data can tell.
    if mode not in _IN_BOUNDS_MODES and not (
        mode == lax.GatherScatterMode.FILL_OR_DROP and fill_value is not None and fill_value == 0
    ):
        return NotImplemented
    params = dict(params, mode=mode, fill_value=fill_value)
    return _zero_like_output(lax.gather_p, (x, indices), params)


@quaxlike.register(lax.concatenate_p)
def concatenate_p_zeros(*xs: Zero, **params) -> Zero:
    # With dense parts as well there is no rule: the default materialises the Zero
    # parts as `jnp.zeros` and concatenates, which is what a rule would do.
    return _zero_like_output(lax.concatenate_p, xs, params)


@quaxlike.register(lax.pad_p)
def pad_p_zero_any(x: Zero, padding_value: _Any, **params):
    if not _is_known_zero(padding_value):
        return NotImplemented
    return _zero_like_output(lax.pad_p, (x, padding_value), params)


# --- select -------------------------------------------------------------------


@quaxlike.register(lax.select_n_p, precedence=1)
def select_n_p_zero_predicate(predicate: Zero, *cases: _Any, **params):
    # An all-zero (all-False) predicate picks the first case everywhere.
    return cases[0]


@quaxlike.register(lax.select_n_p)
def select_n_p_any_zeros(predicate: _Any, *cases: Zero, **params) -> Zero:
    return _zero_like_output(lax.select_n_p, (predicate, *cases), params)


# --- binary primitives ------------------------------------------------------------
#
# Like JAX's own symbolic zeros, `Zero` treats `0 * x` as zero for every `x`, so
# `0 * inf` and `0 * nan` give 0 here where dense arithmetic gives NaN. The same
# holds for `0 / x` and `0 % x` (see README.md).


# Rules of the form `(Zero, any)` get precedence 1: against another type's
# `(any, TheirType)` rule, which matches `(Zero, TheirType)` equally well, zero's
# answer holds whatever the other operand is.
_OVER_OTHER_TYPES = 1


def _register_each(primitives, make_rule, precedence=0):
    """Register `make_rule(primitive)` for each primitive, named after it, so that
    each rule works out its own primitive's output type."""
    for primitive in primitives:
        rule = make_rule(primitive)
        rule.__name__ = rule.__qualname__ = rule.__name__.replace("PRIM", primitive.name)
        quaxlike.register(primitive, precedence=precedence)(rule)


def _annihilated_by_zero(primitive):
    # 0 * y, 0 & y, 0 << y, 0 >> y: zero whatever `y` is.
    def PRIM_p_zero_any(x: Zero, y: _Any, **params) -> Zero:
        return _zero_like_output(primitive, (x, y), params)

    return PRIM_p_zero_any


_register_each(
    [
        lax.mul_p,
        lax.and_p,
        lax.shift_left_p,
        lax.shift_right_logical_p,
        lax.shift_right_arithmetic_p,
    ],
    _annihilated_by_zero,
    precedence=_OVER_OTHER_TYPES,
)


def _zero_of_zeros(primitive):
    # f(0, 0) == 0.
    def PRIM_p_zero_zero(x: Zero, y: Zero, **params) -> Zero:
        return _zero_like_output(primitive, (x, y), params)

    return PRIM_p_zero_zero


_register_each([lax.max_p, lax.min_p, lax.complex_p, lax.sub_p], _zero_of_zeros)


def _zero_over_nonzero(primitive):
    # 0 / y and rem(0, y); for y == 0 the dense result is NaN (see above), and for
    # a `Zero` y it is NaN everywhere: materialise.
    def PRIM_p_zero_any(x: Zero, y: _Any, **params):
        if isinstance(y, Zero):
            return NotImplemented
        return _zero_like_output(primitive, (x, y), params)

    return PRIM_p_zero_any


_register_each([lax.div_p, lax.rem_p], _zero_over_nonzero, precedence=_OVER_OTHER_TYPES)


def _as_output_of(primitive, zero, other, params):
    """`other` broadcast and converted to the result of `primitive(zero, other)`."""
    aval = output_aval(primitive, (zero, other), params)

    def convert(o):
        return lax.convert_element_type(jnp.broadcast_to(o, aval.shape), aval.dtype)

    return quaxlike.quaxify(convert)(other)


def _identity_is_zero(primitive):
    # 0 + y == y (also for `add_any`, the sum of tangents), 0 | y == y, 0 ^ y == y.
    def PRIM_p_zero_any(x: Zero, y: _Any, **params):
        if isinstance(y, Zero):
            return _zero_like_output(primitive, (x, y), params)
        return _as_output_of(primitive, x, y, params)

    return PRIM_p_zero_any


_register_each(
    [lax.add_p, jex_primitives.add_jaxvals_p, lax.or_p, lax.xor_p],
    _identity_is_zero,
    precedence=_OVER_OTHER_TYPES,
)


@quaxlike.register(lax.dot_general_p, precedence=_OVER_OTHER_TYPES)
def dot_general_p_zero_any(x: Zero, y: _Any, **params) -> Zero:
    return _zero_like_output(lax.dot_general_p, (x, y), params)


@quaxlike.register(lax.dot_general_p, precedence=_OVER_OTHER_TYPES)
def dot_general_p_any_zero(x: _Any, y: Zero, **params) -> Zero:
    return _zero_like_output(lax.dot_general_p, (x, y), params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_zero_zero(x: Zero, y: Zero, **params) -> Zero:
    return _zero_like_output(lax.dot_general_p, (x, y), params)


@quaxlike.register(lax.sub_p, precedence=_OVER_OTHER_TYPES)
def sub_p_zero_any(x: Zero, y: _Any, **params):
    return _as_output_of(lax.sub_p, x, quaxlike.quaxify(lax.neg)(y), params)


@quaxlike.register(lax.sub_p, precedence=_OVER_OTHER_TYPES)
def sub_p_any_zero(x: _Any, y: Zero, **params):
    return _as_output_of(lax.sub_p, y, x, params)
