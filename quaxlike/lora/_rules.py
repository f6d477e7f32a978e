"""Rules for `LoraArray`.

Matrix products go through `dot_general` with the low-rank factors contracted one at
a time, so `W + A @ B` is never formed. Structural primitives (transposes, slicing,
indexing and reshaping of batch dimensions, scaling, dtype conversion) are applied to
the three arrays and give another `LoraArray`. Every rule redispatches through
`quaxify`, so the arrays may themselves be Values (a LoRA over a quantised weight, or
whose factors are `Zero`).
"""

import math
from typing import cast, TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.core import Tracer
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import (
    bind_dot_general,
    cached_rule,
    contract_labelled,
    dot_general_labels,
)

from ._conv import LoraConvKernel
from ._value import LoraArray


# The rules that act on the three arrays alike serve both LoRA types.
_LowRank = LoraArray | LoraConvKernel
_L = TypeVar("_L", bound=_LowRank)


# --- matrix products ---------------------------------------------------------


def _dot_low_rank(a, b, other, lora_labels, other_labels, out_labels, lora_on_left, params):
    """The product of `A @ B` (with `lora_labels`) and `other`, as `dot_general`
    would lay it out (`out_labels`), contracting one factor with `other` first."""
    *batch, m, n = lora_labels
    rank_label = object()
    a_labels = [*batch, m, rank_label]
    b_labels = [*batch, rank_label, n]
    # Start with the factor that shares the most with `other`: when the product
    # contracts over n, (A (B x)) costs O((m + n) r) per column and never O(m n).
    if n in other_labels or m not in other_labels:
        first, first_labels, second, second_labels = b, b_labels, a, a_labels
    else:
        first, first_labels, second, second_labels = a, a_labels, b, b_labels
    keep = set(out_labels) | set(second_labels)
    if lora_on_left:
        low, labels = contract_labelled(first, first_labels, other, other_labels, keep, params)
    else:
        low, labels = contract_labelled(other, other_labels, first, first_labels, keep, params)
    low, labels = contract_labelled(second, second_labels, low, labels, set(out_labels), params)
    permutation = tuple(labels.index(label) for label in out_labels)
    if permutation != tuple(range(len(permutation))):
        low = lax.transpose(low, permutation)
    return low


def _lora_dot(lhs, rhs, w, a, b, lora_on_left, dimension_numbers, params):
    lhs_labels, rhs_labels, out_labels = dot_general_labels(
        dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs)
    )
    base = bind_dot_general(lhs, rhs, dimension_numbers, params)
    if lora_on_left:
        low = _dot_low_rank(a, b, rhs, lhs_labels, rhs_labels, out_labels, True, params)
    else:
        low = _dot_low_rank(a, b, lhs, rhs_labels, lhs_labels, out_labels, False, params)
    if low.dtype != base.dtype:
        low = low.astype(base.dtype)
    return lax.add(base, low)


@quaxlike.register(lax.dot_general_p)
@cached_rule
def dot_general_p_lora_any(
    x: LoraArray, y: ArrayLike | quaxlike.ArrayValue, *, dimension_numbers, **params
):
    # W y + (A @ B) y, for any dimension numbers: batch dimensions of the LoRA may
    # be contracted, batched or free (as `jax.vmap` leaves them).
    w = x.frozen_weight()

    def product(w, a, b, y):
        return _lora_dot(w, y, w, a, b, True, dimension_numbers, params)

    return quaxlike.quaxify(product)(w, x.a, x.b, y)


@quaxlike.register(lax.dot_general_p)
@cached_rule
def dot_general_p_any_lora(
    x: ArrayLike | quaxlike.ArrayValue, y: LoraArray, *, dimension_numbers, **params
):
    w = y.frozen_weight()

    def product(x, w, a, b):
        return _lora_dot(x, w, w, a, b, False, dimension_numbers, params)

    return quaxlike.quaxify(product)(x, w, y.a, y.b)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_lora_lora(x: LoraArray, y: LoraArray, **params):
    # The left LoRA is expanded; its products with `y` redispatch to the rule above.
    return dot_general_p_lora_any(x, y, **params)


# --- structural primitives ---------------------------------------------------
#
# Each rule transforms the three arrays of a LoraArray: `w` (*batch, m, n), `a`
# (*batch, m, r) and `b` (*batch, r, n). `_per_array` turns the primitive's per-axis
# parameters for `w` into those for `a` and `b`.


def _per_array(x: LoraArray, per_axis, rank_item):
    """Per-axis items for `w` (`per_axis`, length `x.ndim`) as items for `w`, `a`
    and `b`: the rank axis of the factors gets `rank_item`."""
    *batch, m, n = per_axis
    return tuple(per_axis), (*batch, m, rank_item), (*batch, rank_item, n)


def _apply(x: _L, fw, fa, fb) -> _L:
    """A LoraArray (or LoraConvKernel) whose arrays are `fw(w)`, `fa(a)` and `fb(b)`, each run under
    `quaxify` in case the array is itself a Value."""
    w, a, b = (quaxlike.quaxify(f)(v) for f, v in ((fw, x.w), (fa, x.a), (fb, x.b)))
    return cast(_L, x.with_factors(w, a, b))  # `with_factors` keeps the type


def _apply_each(x: LoraArray, make, items) -> LoraArray:
    return _apply(x, *(make(item) for item in items))


def _batch_axes(x: LoraArray) -> int:
    return x.ndim - 2


@quaxlike.register(lax.transpose_p)
def transpose_p_lora(x: LoraArray, *, permutation, **params):
    k = _batch_axes(x)
    if sorted(permutation[:k]) != list(range(k)):
        return NotImplemented  # a matrix axis would move into the batch axes
    t = lambda v: lax.transpose(v, permutation)  # noqa: E731
    out = _apply(x, t, t, t)
    if tuple(permutation[k:]) == (k, k + 1):
        return out
    # (W + A B)^T = W^T + B^T A^T
    return out.with_factors(out.w, out.b, out.a)


@quaxlike.register(lax.slice_p)
def slice_p_lora(x: LoraArray, *, start_indices, limit_indices, strides, **params):
    # Rows of W + A B are rows of W and A; columns are columns of W and B.
    strides = (1,) * x.ndim if strides is None else strides
    per_axis = list(zip(start_indices, limit_indices, strides))

    def slicer(item):
        starts, limits, steps = zip(*item)
        return lambda v: lax.slice(v, starts, limits, steps)

    return _apply_each(x, slicer, _per_array(x, per_axis, (0, x.rank, 1)))


@quaxlike.register(lax.dynamic_slice_p)
def dynamic_slice_p_lora(x: LoraArray, *indices: ArrayLike, slice_sizes, **params):
    if len(indices) != x.ndim:
        return NotImplemented  # dynamic shapes
    zero = jnp.zeros((), jnp.result_type(indices[0]))
    per_axis = list(zip(indices, slice_sizes))

    def slicer(item):
        starts, sizes = zip(*item)
        return lambda v: lax.dynamic_slice(v, starts, sizes)

    return _apply_each(x, slicer, _per_array(x, per_axis, (zero, x.rank)))


@quaxlike.register(lax.squeeze_p)
def squeeze_p_lora(x: LoraArray, *, dimensions, **params):
    k = _batch_axes(x)
    squeeze = lambda v: lax.squeeze(v, dimensions)  # noqa: E731
    if all(d < k for d in dimensions):
        return _apply(x, squeeze, squeeze, squeeze)
    # A matrix axis of size 1 goes: what is left is a row or column of W + A B,
    # which costs O((m + n) r) to build.
    row = quaxlike.quaxify(lambda w, a, b: squeeze(w + jnp.matmul(a, b)))
    return row(x.frozen_weight(), x.a, x.b)


@quaxlike.register(lax.reshape_p)
def reshape_p_lora(x: LoraArray, *, new_sizes, dimensions, **params):
    *batch, m, n = x.shape
    new_sizes = tuple(new_sizes)
    if dimensions is not None or len(new_sizes) < 2 or new_sizes[-2:] != (m, n):
        return NotImplemented  # the matrix axes would change
    if math.prod(new_sizes[:-2]) != math.prod(batch):
        return NotImplemented
    sizes = _per_array(x, list(new_sizes), x.rank)
    return _apply_each(x, lambda s: lambda v: lax.reshape(v, s), sizes)


@quaxlike.register(lax.broadcast_in_dim_p)
def broadcast_in_dim_p_lora(x: LoraArray, *, shape, broadcast_dimensions, **params):
    # Adding or broadcasting batch dimensions; the matrix axes must stay last.
    *_, m, n = x.shape
    out_ndim = len(shape)
    matrix_axes = (out_ndim - 2, out_ndim - 1)
    if tuple(shape[-2:]) != (m, n) or tuple(broadcast_dimensions[-2:]) != matrix_axes:
        return NotImplemented
    shapes = _per_array(x, list(shape), x.rank)
    return _apply_each(
        x, lambda s: lambda v: lax.broadcast_in_dim(v, s, broadcast_dimensions), shapes
    )


_GATHER_MODES = (lax.GatherScatterMode.CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@quaxlike.register(lax.gather_p)
def gather_p_lora(x: LoraArray, indices: ArrayLike, *, dimension_numbers, slice_sizes, **params):
    # Gathers that pick along the batch axes and take whole matrices, as `x[idx]`
    # and `jax.vmap` of `x[i]` do. Indices along the matrix axes (always 0 for a
    # whole-matrix slice, after clipping) apply equally to the factors' axes.
    k = _batch_axes(x)
    *_, m, n = x.shape
    numbers = dimension_numbers
    mode = params.get("mode")
    fill_value = params.get("fill_value")
    if mode == lax.GatherScatterMode.FILL_OR_DROP:
        # An out-of-bounds window is filled: W + A B stays `fill` only for 0 or NaN.
        if not (fill_value is None or fill_value == 0):
            return NotImplemented
    elif mode not in _GATHER_MODES:
        return NotImplemented
    out_ndim = len(numbers.offset_dims) + jnp.ndim(indices) - 1
    if (
        tuple(slice_sizes[k:]) != (m, n)
        or any(d >= k for d in (*numbers.collapsed_slice_dims, *numbers.operand_batching_dims))
        or tuple(numbers.offset_dims[-2:]) != (out_ndim - 2, out_ndim - 1)
    ):
        return NotImplemented

    def gatherer(sizes):
        return lambda v: lax.gather_p.bind(
            v, indices, dimension_numbers=numbers, slice_sizes=sizes, **params
        )

    return _apply_each(x, gatherer, _per_array(x, list(slice_sizes), x.rank))


# --- elementwise: scaling, negation, dtype -----------------------------------


def _scale_by(x: _LowRank, scale, op) -> _LowRank:
    # (W + A B) s = (W s) + (A s) B. A traced `s` may carry a derivative, so a
    # frozen W is frozen before it is scaled: the result holds
    # `stop_gradient(W) s` and is not frozen again (`stop_gradient` is off), so
    # the gradient reaches `s` through `W`, as on the dense array, and never `W`
    # itself. A constant `s` carries none, and is folded into the frozen W: the
    # result keeps the input's form (a loop carry `m * 0.5` keeps its type).
    scaled = lambda v: op(v, scale)  # noqa: E731
    thawed = x.thawed() if isinstance(scale, Tracer) else x
    return _apply(thawed, scaled, scaled, lambda v: v)


@quaxlike.register(lax.select_n_p)
def select_n_p_lora(predicate: ArrayLike, *cases: ArrayLike | _LowRank):
    # A scalar predicate picks one case whole, so picking each of the arrays of
    # cases laid out alike picks that case exactly: the LoRA cases in their
    # joinable form, a plain case held in `W` with zero factors (what a solver's
    # `where(accepted, new_state, old_state)` meets, its first state plain zeros).
    # An elementwise predicate mixes the cases: no rule (materialise).
    if jnp.ndim(predicate) != 0:
        return NotImplemented
    joined = quaxlike.internal.joined(list(cases))
    if joined is None:
        return NotImplemented
    leaves = [jax.tree_util.tree_flatten(j) for j in joined]
    treedef = leaves[0][1]
    picked = [lax.select_n(predicate, *parts) for parts in zip(*(ls for ls, _ in leaves))]
    return jax.tree_util.tree_unflatten(treedef, picked)


@quaxlike.register(lax.mul_p)
def mul_p_lora_scalar(x: _LowRank, y: ArrayLike, **params):
    if jnp.ndim(y) != 0:
        return NotImplemented
    return _scale_by(x, y, lax.mul)


@quaxlike.register(lax.div_p)
def div_p_lora_scalar(x: _LowRank, y: ArrayLike, **params):
    if jnp.ndim(y) != 0:
        return NotImplemented
    return _scale_by(x, y, lax.div)


@quaxlike.register(lax.neg_p)
def neg_p_lora(x: _LowRank, **params):
    return _apply(x, lax.neg, lax.neg, lambda v: v)


@quaxlike.register(lax.convert_element_type_p)
def convert_element_type_p_lora(x: _LowRank, *, new_dtype, **params):
    if not jnp.issubdtype(new_dtype, jnp.inexact):
        return NotImplemented  # rounding W + A B is not rounding W, A and B
    convert = lambda v: lax.convert_element_type(v, new_dtype)  # noqa: E731
    return _apply(x, convert, convert, convert)


@quaxlike.register(lax.copy_p)
def copy_p_lora(x: _LowRank, **params):
    return x


@quaxlike.register("stop_gradient")
def stop_gradient_p_lora(x: _LowRank, **params):
    stop = lax.stop_gradient
    return _apply(x, stop, stop, stop)
