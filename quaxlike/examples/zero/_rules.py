"""Rules for `Zero`: results that are known to be zero stay symbolic."""

import jax.numpy as jnp
from jax import lax
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import output_aval

from ._value import Zero


def _zero_like_output(primitive, args, params) -> Zero:
    aval = output_aval(primitive, args, params)
    return Zero(aval.shape, aval.dtype)


# Primitives that map an all-zero input to an all-zero output, whatever the other
# operands are: linear in the Zero argument, or structural.
_ZERO_PRESERVING_UNARY = [
    lax.neg_p,
    lax.convert_element_type_p,
    lax.broadcast_in_dim_p,
    lax.reshape_p,
    lax.squeeze_p,
    lax.transpose_p,
    lax.reduce_sum_p,
    lax.slice_p,
    lax.rev_p,
    lax.copy_p,
    lax.real_p,
    lax.imag_p,
    lax.sin_p,
    lax.tan_p,
    lax.sinh_p,
    lax.tanh_p,
    lax.sqrt_p,
    lax.abs_p,
    lax.sign_p,
    lax.floor_p,
    lax.ceil_p,
    lax.round_p,
    lax.cumsum_p,
    lax.reduce_precision_p,
]


def _make_unary_rule(primitive):
    def rule(x: Zero, **params) -> Zero:
        return _zero_like_output(primitive, (x,), params)

    rule.__name__ = rule.__qualname__ = f"{primitive.name}_p_zero"
    return rule


for _primitive in _ZERO_PRESERVING_UNARY:
    quaxlike.register(_primitive, precedence=1)(_make_unary_rule(_primitive))


@quaxlike.register("stop_gradient")
def stop_gradient_p_zero(x: Zero, **params) -> Zero:
    return x


@quaxlike.register([lax.mul_p, lax.and_p])
def mul_p_zero_any(x: Zero, y: ArrayLike | quaxlike.ArrayValue, **params) -> Zero:
    return _zero_like_output(lax.mul_p, (x, y), params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_zero_any(x: Zero, y: ArrayLike | quaxlike.ArrayValue, **params) -> Zero:
    return _zero_like_output(lax.dot_general_p, (x, y), params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_any_zero(x: ArrayLike | quaxlike.ArrayValue, y: Zero, **params) -> Zero:
    return _zero_like_output(lax.dot_general_p, (x, y), params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_zero_zero(x: Zero, y: Zero, **params) -> Zero:
    return _zero_like_output(lax.dot_general_p, (x, y), params)


@quaxlike.register(lax.div_p)
def div_p_zero_any(x: Zero, y: ArrayLike, **params) -> Zero:
    return _zero_like_output(lax.div_p, (x, y), params)


@quaxlike.register(lax.integer_pow_p)
def integer_pow_p_zero(x: Zero, *, y: int, **params):
    if y <= 0:
        return NotImplemented  # 0 ** 0 == 1 and 0 ** -1 == inf: materialise
    return _zero_like_output(lax.integer_pow_p, (x,), dict(params, y=y))


def _as_output_of(primitive, zero, other, params):
    """`other` broadcast and converted to the result of `primitive(zero, other)`."""
    aval = output_aval(primitive, (zero, other), params)

    def convert(o):
        return lax.convert_element_type(jnp.broadcast_to(o, aval.shape), aval.dtype)

    return quaxlike.quaxify(convert)(other)


@quaxlike.register([lax.add_p, "add_any"])
def add_p_zero_any(x: Zero, y: ArrayLike | quaxlike.ArrayValue, **params):
    if isinstance(y, Zero):
        return _zero_like_output(lax.add_p, (x, y), params)
    return _as_output_of(lax.add_p, x, y, params)


@quaxlike.register(lax.sub_p)
def sub_p_zero_any(x: Zero, y: ArrayLike | quaxlike.ArrayValue, **params):
    if isinstance(y, Zero):
        return _zero_like_output(lax.sub_p, (x, y), params)
    return _as_output_of(lax.sub_p, x, quaxlike.quaxify(lax.neg)(y), params)


@quaxlike.register(lax.sub_p)
def sub_p_any_zero(x: ArrayLike | quaxlike.ArrayValue, y: Zero, **params):
    return _as_output_of(lax.sub_p, y, x, params)
