"""Families of primitives that Value types tend to treat alike."""

from jax import lax
from jax.extend.core import Primitive


TRANSCENDENTAL_PRIMITIVES: tuple[Primitive, ...] = (
    lax.exp_p,
    lax.exp2_p,
    lax.log_p,
    lax.log1p_p,
    lax.expm1_p,
    lax.sin_p,
    lax.cos_p,
    lax.tan_p,
    lax.asin_p,
    lax.acos_p,
    lax.atan_p,
    lax.sinh_p,
    lax.cosh_p,
    lax.tanh_p,
    lax.asinh_p,
    lax.acosh_p,
    lax.atanh_p,
    lax.logistic_p,
    lax.erf_p,
    lax.erfc_p,
    lax.erf_inv_p,
    lax.lgamma_p,
    lax.digamma_p,
)
"""The elementwise transcendental functions of one operand: exponentials and
logarithms, the trigonometric and hyperbolic functions and their inverses, the
logistic function, and the error and gamma functions.

Each maps an array to an array of the same shape and dtype, and each needs a
pure number (a physical quantity must be made dimensionless before its
logarithm is taken), so a type tends to give them all one rule: `Unitful`
requires a dimensionless argument, `Constant` computes them on its scalar."""
