"""Rules for `Float8Weight`: its matrix product (three float8 products, forward
and backward, in a `jax.custom_vjp`), transposes and dtype conversion.

The product is written with einsum-style labels (`dot_general_labels`), so one
formulation serves every `dot_general` a model emits (`w @ x`, `x @ w.T`,
batched and vmapped forms): the gradient of the input contracts the cotangent
with the weight over the weight's free labels, the gradient of the weight
contracts it with the input over the input's free labels, as JAX's own
transpose rules of `dot_general` do, and each product scales its operands along
the labels it contracts (torchao's `axiswise_dim` choices for a Linear layer)."""

import functools as ft
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import dot_general_labels

from ._float8 import Float8Weight
from ._float8_scaling import E4M3, float8_dot_compiles, Recipe, RECIPES, scaled_product


_JVP_MSG = (
    "Float8Weight (float8 training, scaling={scaling!r}) cannot be differentiated in "
    "forward mode (`jax.jvp`, `jax.linearize`, `jax.jacfwd`, or a `dot_general` of it "
    "under them): its product is a `jax.custom_vjp` whose backward pass casts the "
    "cotangent to float8 with a dynamic scale, as torchao's Float8Linear does, and that "
    "is not the transpose of a linear map, so no tangent agrees with it. Use reverse "
    "mode (`jax.grad`, `jax.vjp`, `eqx.filter_grad`), or take forward-mode derivatives "
    "of the high-precision model `quaxlike.quantized.unwrap_float8(model)`."
)
_NOT_FLOAT_MSG = (
    "Float8Weight: a `dot_general` with an operand of dtype {dtype} has no float8 "
    "form (float8 training casts floating-point inputs). Multiply it with a "
    "floating-point array, or use the master weight `unwrap_float8(model)` here."
)


class _Product(NamedTuple):
    """The static description of one float8 product: the labels of the input `x`,
    of the stored weight and of the output, whether the weight is the right
    operand, the recipe, the output dtype, and whether the backend compiles
    float8 dots."""

    x_labels: tuple
    w_labels: tuple
    out_labels: tuple
    weight_on_right: bool
    recipe: Recipe
    out_dtype: np.dtype
    float8_dot: bool


def _forward(spec: _Product, x, w):
    # Keep the original operand order, so that the product needs no transpose.
    operands = [(x, spec.x_labels), (w, spec.w_labels)]
    if not spec.weight_on_right:
        operands.reverse()
    (a, a_labels), (b, b_labels) = operands
    return scaled_product(
        a,
        list(a_labels),
        E4M3,
        b,
        list(b_labels),
        E4M3,
        list(spec.out_labels),
        spec.recipe,
        spec.out_dtype,
        spec.float8_dot,
    )


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _float8_product(spec: _Product, x, w):
    return _forward(spec, x, w)


def _float8_product_fwd(spec: _Product, x, w):
    # torchao saves the high-precision input and weight and casts them again.
    return _forward(spec, x, w), (x, w)


def _float8_product_bwd(spec: _Product, residuals, g):
    x, w = residuals
    out_labels, grad_dtype = list(spec.out_labels), spec.recipe.grad_dtype
    # grad_input = g @ W, grad_weight = g @ x (as labelled contractions).
    grad_x = scaled_product(
        g,
        out_labels,
        grad_dtype,
        w,
        list(spec.w_labels),
        E4M3,
        list(spec.x_labels),
        recipe=spec.recipe,
        out_dtype=np.dtype(x.dtype),
        float8_dot=spec.float8_dot,
    )
    grad_w = scaled_product(
        g,
        out_labels,
        grad_dtype,
        x,
        list(spec.x_labels),
        E4M3,
        list(spec.w_labels),
        recipe=spec.recipe,
        out_dtype=np.dtype(w.dtype),
        float8_dot=spec.float8_dot,
    )
    return grad_x, grad_w


_float8_product.defvjp(_float8_product_fwd, _float8_product_bwd)


def _product(weight: Float8Weight, x, weight_on_right: bool, dimension_numbers, params):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(_NOT_FLOAT_MSG.format(dtype=jnp.result_type(x)))
    w = weight.weight
    if weight_on_right:
        x_labels, w_labels, out_labels = dot_general_labels(dimension_numbers, x.ndim, w.ndim)
    else:
        w_labels, x_labels, out_labels = dot_general_labels(dimension_numbers, w.ndim, x.ndim)
    if weight.transposed:  # the labels of the stored weight
        w_labels[-1], w_labels[-2] = w_labels[-2], w_labels[-1]
    out_dtype = params.get("preferred_element_type") or jnp.result_type(x, w)
    spec = _Product(
        tuple(x_labels),
        tuple(w_labels),
        tuple(out_labels),
        weight_on_right,
        RECIPES[weight.scaling],
        np.dtype(out_dtype),
        float8_dot_compiles(),
    )
    try:
        return _float8_product(spec, x, w)
    except TypeError as error:
        if "forward-mode" in str(error):
            raise TypeError(_JVP_MSG.format(scaling=weight.scaling)) from error
        raise


@quaxlike.register(lax.dot_general_p)
def dot_general_p_float8_any(lhs: Float8Weight, rhs: ArrayLike, *, dimension_numbers, **params):
    return _product(lhs, rhs, False, dimension_numbers, params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_any_float8(lhs: ArrayLike, rhs: Float8Weight, *, dimension_numbers, **params):
    return _product(rhs, lhs, True, dimension_numbers, params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_float8_float8(
    lhs: Float8Weight, rhs: Float8Weight, *, dimension_numbers, **params
):
    # Two float8-trained weights: the right one takes the input's role.
    return _product(lhs, rhs.logical(), False, dimension_numbers, params)


@quaxlike.register(lax.transpose_p)
def transpose_p_float8(x: Float8Weight, *, permutation, **params):
    k = x.ndim - 2
    if tuple(permutation[:k]) != tuple(range(k)):
        return NotImplemented  # moving a stacking axis: the master weight
    if tuple(permutation[k:]) == (k, k + 1):
        return x
    return x.swapped()


@quaxlike.register(lax.convert_element_type_p)
def convert_element_type_p_float8(x: Float8Weight, *, new_dtype, **params):
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return NotImplemented
    weight = lax.convert_element_type(x.weight, new_dtype)
    return Float8Weight(weight, scaling=x.scaling, transposed=x.transposed)


# --- indexing the stacking axes: a stack of layers stays float8 ------------------------
#
# `w[i]` on a stack `(layers, out, in)` (a Python loop over layers, `lax.fori_loop`,
# `lax.dynamic_index_in_dim`) slices the leading axes only; the result is the layer's
# own `Float8Weight`. A slice into the last two axes takes the master weight (it
# materialises) and multiplies in high precision.


def _whole_matrix(x: Float8Weight, sizes) -> bool:
    return tuple(sizes[-2:]) == tuple(x.shape[-2:])


def _stored_order(x: Float8Weight, per_axis) -> list:
    per_axis = list(per_axis)
    if x.transposed:
        per_axis[-2], per_axis[-1] = per_axis[-1], per_axis[-2]
    return per_axis


@quaxlike.register(lax.slice_p)
def slice_p_float8(x: Float8Weight, *, start_indices, limit_indices, strides, **params):
    strides = (1,) * x.ndim if strides is None else strides
    sizes = [limit - start for start, limit in zip(start_indices, limit_indices)]
    if not _whole_matrix(x, sizes) or any(s != 1 for s in strides[-2:]):
        return NotImplemented
    starts, limits, steps = (_stored_order(x, v) for v in (start_indices, limit_indices, strides))
    weight = lax.slice(x.weight, tuple(starts), tuple(limits), tuple(steps))
    return Float8Weight(weight, scaling=x.scaling, transposed=x.transposed)


@quaxlike.register(lax.dynamic_slice_p)
def dynamic_slice_p_float8(x: Float8Weight, *indices: ArrayLike, slice_sizes, **params):
    if not _whole_matrix(x, slice_sizes):
        return NotImplemented
    starts = _stored_order(x, indices)
    weight = lax.dynamic_slice(x.weight, starts, _stored_order(x, slice_sizes))
    return Float8Weight(weight, scaling=x.scaling, transposed=x.transposed)


@quaxlike.register(lax.squeeze_p)
def squeeze_p_float8(x: Float8Weight, *, dimensions, **params):
    if any(d % x.ndim >= x.ndim - 2 for d in dimensions):
        return NotImplemented
    weight = lax.squeeze(x.weight, dimensions)
    return Float8Weight(weight, scaling=x.scaling, transposed=x.transposed)
