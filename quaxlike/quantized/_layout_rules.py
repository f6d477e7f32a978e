"""Rules of the checkpoint layouts' types (`GroupedIntArray`, `Bnb4bitArray`) where
they differ from every quantised array's (`_rules.py`): their dequantisation
follows the checkpoint's library in its own dtype and casts to the array's dtype
last, so a dtype conversion changes only that last cast, and a scalar factor
folds into the leaves only where it does not change the library's rounding."""

import dataclasses

import jax.numpy as jnp
from jax import lax
from jaxtyping import ArrayLike

import quaxlike

from ._bnb import Bnb4bitArray
from ._grouped import GroupedIntArray


@quaxlike.register(lax.convert_element_type_p)
def convert_element_type_p_grouped(x: GroupedIntArray, *, new_dtype, **params):
    if params.get("weak_type") or not jnp.issubdtype(new_dtype, jnp.floating):
        return NotImplemented  # integer or weakly typed results: materialise
    return x.with_dtype(new_dtype)


@quaxlike.register(lax.convert_element_type_p)
def convert_element_type_p_bnb(x: Bnb4bitArray, *, new_dtype, **params):
    if params.get("weak_type") or not jnp.issubdtype(new_dtype, jnp.floating):
        return NotImplemented
    return x.with_dtype(new_dtype)


def _scaled(x: GroupedIntArray, y: ArrayLike, op):
    # `(code - zero) * (scale * y)` in the scale's dtype: only where that is the
    # array's dtype too (no later cast for the factor to skip). Otherwise the
    # dense weight (or, by default, the refusal to build it): handing over with
    # `NotImplemented` would reach every quantised array's rule, which folds the
    # factor into the scales.
    if jnp.ndim(y) != 0 or x.dtype != x.scale.dtype:
        return op(x.materialise(), y)
    return x.with_scale(op(x.scale, jnp.asarray(y, x.scale.dtype)))


@quaxlike.register(lax.mul_p)
def mul_p_grouped_scalar(x: GroupedIntArray, y: ArrayLike, **params):
    return _scaled(x, y, lax.mul)


@quaxlike.register(lax.div_p)
def div_p_grouped_scalar(x: GroupedIntArray, y: ArrayLike, **params):
    return _scaled(x, y, lax.div)


@quaxlike.register(lax.mul_p)
def mul_p_bnb_scalar(x: Bnb4bitArray, y: ArrayLike, **params):
    # A factor folded into the levels or the absmaxes would round differently
    # from bitsandbytes' product followed by the factor: materialise (or refuse).
    return lax.mul(x.materialise(), y)


@quaxlike.register(lax.div_p)
def div_p_bnb_scalar(x: Bnb4bitArray, y: ArrayLike, **params):
    return lax.div(x.materialise(), y)


@quaxlike.register(lax.neg_p)
def neg_p_bnb(x: Bnb4bitArray, **params):
    # Negated levels give exactly the negated products.
    return dataclasses.replace(x, code=lax.neg(x.code))


@quaxlike.register("stop_gradient")
def stop_gradient_p_bnb(x: Bnb4bitArray, **params):
    # Every floating-point leaf: the levels, the absmaxes and the nested ones.
    def stop(leaf):
        floating = leaf is not None and jnp.issubdtype(leaf.dtype, jnp.floating)
        return lax.stop_gradient(leaf) if floating else leaf

    return dataclasses.replace(
        x,
        code=stop(x.code),
        absmax=stop(x.absmax),
        nested=stop(x.nested),
        nested_code=stop(x.nested_code),
        offset=stop(x.offset),
    )
