"""Rules for the primitives an `Interval` meets that are not non-decreasing in
every operand (those go through `Interval.default`).

Every rule names `Interval` in at least one position: a signature that plain
arrays alone could satisfy would capture ordinary arithmetic in every quaxified
function. A plain operand is an interval of width zero.
"""

import jax.numpy as jnp
from jax import lax
from jaxtyping import ArrayLike

import quaxlike

from ._value import bounds, Interval


def _hull(*corners) -> Interval:
    """The smallest interval holding every one of `corners`, elementwise."""
    lo = hi = corners[0]
    for corner in corners[1:]:
        lo = jnp.minimum(lo, corner)
        hi = jnp.maximum(hi, corner)
    return Interval(lo, hi)


@quaxlike.register(lax.neg_p)
def neg_interval(x: Interval, **params) -> Interval:
    return Interval(-x.hi, -x.lo)


@quaxlike.register(lax.sub_p)
def sub_interval_any(x: Interval, y: Interval | ArrayLike, **params) -> Interval:
    # The largest difference takes x's upper bound and y's *lower* one.
    y_lo, y_hi = bounds(y)
    return Interval(x.lo - y_hi, x.hi - y_lo)


@quaxlike.register(lax.sub_p)
def sub_array_interval(x: ArrayLike, y: Interval, **params) -> Interval:
    return Interval(x - y.hi, x - y.lo)


def _product(x, y) -> Interval:
    # With mixed signs any of the four endpoint products can be an extreme.
    x_lo, x_hi = bounds(x)
    y_lo, y_hi = bounds(y)
    return _hull(x_lo * y_lo, x_lo * y_hi, x_hi * y_lo, x_hi * y_hi)


@quaxlike.register(lax.mul_p)
def mul_interval_any(x: Interval, y: Interval | ArrayLike, **params) -> Interval:
    return _product(x, y)


@quaxlike.register(lax.mul_p)
def mul_array_interval(x: ArrayLike, y: Interval, **params) -> Interval:
    return _product(x, y)


@quaxlike.register(lax.div_p)
def div_interval_array(x: Interval, y: ArrayLike, **params) -> Interval:
    # Dividing by a fixed number is monotone in x; its sign decides the direction.
    return _hull(x.lo / y, x.hi / y)


@quaxlike.register(lax.div_p)
def div_any_interval(x: Interval | ArrayLike, y: Interval, **params) -> Interval:
    # 1 / y over [y.lo, y.hi] is [1 / y.hi, 1 / y.lo] when the bracket keeps to one
    # side of zero; where it contains zero the quotient is unbounded, which the
    # infinite bracket says (the data decides where, so it cannot be refused here).
    finite = (y.lo > 0) | (y.hi < 0)
    inf = jnp.asarray(jnp.inf, y.lo.dtype)
    recip = Interval(jnp.where(finite, 1 / y.hi, -inf), jnp.where(finite, 1 / y.lo, inf))
    out = _product(x, recip)
    x_lo, x_hi = bounds(x)
    x_zero = (x_lo == 0) & (x_hi == 0)  # 0 * inf is nan; 0 / y is 0 wherever y != 0
    return Interval(
        jnp.where(finite | ~x_zero, out.lo, -inf), jnp.where(finite | ~x_zero, out.hi, inf)
    )


@quaxlike.register(lax.abs_p)
def abs_interval(x: Interval, **params) -> Interval:
    low, high = jnp.abs(x.lo), jnp.abs(x.hi)
    straddles = (x.lo < 0) & (x.hi > 0)
    lo = jnp.where(straddles, jnp.zeros_like(low), jnp.minimum(low, high))
    return Interval(lo, jnp.maximum(low, high))


@quaxlike.register(lax.integer_pow_p)
def integer_pow_interval(x: Interval, *, y: int, **params) -> Interval:
    if y < 0:
        raise NotImplementedError(
            f"Interval ** {y} divides by the interval, which is unbounded wherever "
            "the interval contains zero. Divide explicitly (1 / x**n) to get an "
            "infinite bracket there, or keep the interval away from zero."
        )
    at_lo, at_hi = x.lo**y, x.hi**y
    out = _hull(at_lo, at_hi)
    if y % 2 == 0 and y > 0:
        # An even power reaches its minimum, zero, inside a bracket that straddles
        # zero, which neither endpoint shows. (y == 0 is even but constant.)
        straddles = (x.lo < 0) & (x.hi > 0)
        return Interval(jnp.where(straddles, jnp.zeros_like(out.lo), out.lo), out.hi)
    return out
