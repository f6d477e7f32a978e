"""Rules for `LoraArray`. Every rule redispatches through `quaxify`, so the
factors may themselves be Values (a LoRA whose `a` and `b` are `Zero`)."""

import jax.numpy as jnp
from jax import lax
from jaxtyping import ArrayLike

import quaxlike

from ._value import LoraArray


def _dot(x, y, contract, batch, params):
    return lax.dot_general(
        x,
        y,
        (contract, batch),
        precision=params.get("precision"),
        preferred_element_type=params.get("preferred_element_type"),
    )


def _lora_on_left(w, a, b, other, dimension_numbers, params):
    (lc, rc), (lb, rb) = dimension_numbers
    k = jnp.ndim(w) - 2
    batch = tuple(range(k))
    base = _dot(w, other, (lc, rc), (lb, rb), params)
    if lc == (k + 1,):  # contract over n: (W + AB) x = W x + A (B x)
        low = _dot(b, other, ((k + 1,), rc), (batch, rb), params)
        low = _dot(a, low, ((k + 1,), (k,)), (batch, batch), params)
    else:  # contract over m: (W + AB)^T x = W^T x + B^T (A^T x)
        low = _dot(a, other, ((k,), rc), (batch, rb), params)
        low = _dot(b, low, ((k,), (k,)), (batch, batch), params)
    return base + low


def _lora_on_right(other, w, a, b, dimension_numbers, params):
    (lc, rc), (lb, rb) = dimension_numbers
    k = jnp.ndim(w) - 2
    batch = tuple(range(k))
    base = _dot(other, w, (lc, rc), (lb, rb), params)
    if rc == (k,):  # contract over m: x (W + AB) = x W + (x A) B
        low = _dot(other, a, (lc, (k,)), (lb, batch), params)
        low = _dot(low, b, ((jnp.ndim(low) - 1,), (k,)), (batch, batch), params)
    else:  # contract over n: x (W + AB)^T = x W^T + (x B^T) A^T
        low = _dot(other, b, (lc, (k + 1,)), (lb, batch), params)
        low = _dot(low, a, ((jnp.ndim(low) - 1,), (k + 1,)), (batch, batch), params)
    return base + low


def _supported(lora: LoraArray, contract, batch) -> bool:
    k = lora.ndim - 2
    return tuple(batch) == tuple(range(k)) and len(contract) == 1 and contract[0] in (k, k + 1)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_lora_any(
    x: LoraArray, y: ArrayLike | quaxlike.ArrayValue, *, dimension_numbers, **params
):
    (lc, _), (lb, _) = dimension_numbers
    if not _supported(x, lc, lb):
        return NotImplemented
    return quaxlike.quaxify(_lora_on_left)(
        x.frozen_weight(), x.a, x.b, y, dimension_numbers, params
    )


@quaxlike.register(lax.dot_general_p)
def dot_general_p_any_lora(
    x: ArrayLike | quaxlike.ArrayValue, y: LoraArray, *, dimension_numbers, **params
):
    (_, rc), (_, rb) = dimension_numbers
    if not _supported(y, rc, rb):
        return NotImplemented
    return quaxlike.quaxify(_lora_on_right)(
        x, y.frozen_weight(), y.a, y.b, dimension_numbers, params
    )


@quaxlike.register(lax.dot_general_p)
def dot_general_p_lora_lora(x: LoraArray, y: LoraArray, **params):
    # The left LoRA is expanded; the products with `y` redispatch to its rule.
    return dot_general_p_lora_any(x, y, **params)


@quaxlike.register(lax.transpose_p)
def transpose_p_lora(x: LoraArray, *, permutation, **params):
    k = x.ndim - 2
    if set(permutation[k:]) != {k, k + 1} or sorted(permutation[:k]) != list(range(k)):
        return NotImplemented
    t = quaxlike.quaxify(lambda v: lax.transpose(v, permutation))
    if tuple(permutation[k:]) == (k, k + 1):
        return x.with_factors(t(x.w), t(x.a), t(x.b))
    # (W + AB)^T = W^T + B^T A^T
    return x.with_factors(t(x.w), t(x.b), t(x.a))


@quaxlike.register(lax.mul_p)
def mul_p_lora_scalar(x: LoraArray, y: ArrayLike, **params):
    if jnp.ndim(y) != 0:
        return NotImplemented
    scale = quaxlike.quaxify(lambda v: v * y)
    return x.with_factors(scale(x.w), scale(x.a), x.b)


@quaxlike.register(lax.neg_p)
def neg_p_lora(x: LoraArray, **params):
    neg = quaxlike.quaxify(lax.neg)
    return x.with_factors(neg(x.w), neg(x.a), x.b)


@quaxlike.register(lax.convert_element_type_p)
def convert_element_type_p_lora(x: LoraArray, *, new_dtype, **params):
    convert = quaxlike.quaxify(lambda v: lax.convert_element_type(v, new_dtype))
    return x.with_factors(convert(x.w), convert(x.a), convert(x.b))
