"""Rules for `QuantizedArray`: matrix products that never build the dense weight.

A `dot_general` with a quantised operand is planned with einsum-style labels: every
dimension of the two operands and of the output gets a label, and a contracted or
batch pair of dimensions shares one. The stored weight has labels `(*batch, out, in)`
and its scales vary along `(*batch, out)`, plus the group index `g` for `Int4Array`,
whose `in` dimension is split into `(g, k)`: group, and position within the group.

- If no label of the scales is contracted (`weight @ x`: only `in` is), the integer
  codes are multiplied by `x` and the scales applied to the output. For groups, `g`
  becomes a batch dimension of that product and is summed after scaling.
- If no label of the scales is a free output dimension (`x @ weight`, the transpose
  `jax.grad` needs: `out` is contracted), the scales are applied to `x` first.
- Otherwise the scales cannot be factored out of the product; the rule hands over
  (`NotImplemented`), which materialises the weight if that is allowed.
"""

import itertools as it
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import contract_labelled, dot_general_labels

from ._value import QuantizedArray


class _Plan(NamedTuple):
    """How to compute one product; labels as described in the module docstring."""

    codes: list  # labels of the codes, `in` split into (g, k) when grouped
    scale: list  # labels of the scales
    other: list  # labels of the other operand (split likewise)
    out: list  # labels of the output (split likewise)
    other_split_at: int | None  # where `other` has the weight's `in` dim, if grouped
    groups: tuple | None  # the labels (g, k) when grouped
    scale_output: bool  # apply the scales to the output, else to the other operand


def _plan(
    q: QuantizedArray, other_ndim: int, dimension_numbers, quantized_is_lhs: bool
) -> _Plan | None:
    """Work out from shapes alone how to compute the product; None when the scales
    cannot be factored out of it."""
    if quantized_is_lhs:
        labels, other, out = dot_general_labels(dimension_numbers, q.ndim, other_ndim)
    else:
        other, labels, out = dot_general_labels(dimension_numbers, other_ndim, q.ndim)
    fresh = it.count(q.ndim + other_ndim)  # labels not used by any dimension
    stored = list(labels)
    if q.transposed:
        stored[-2], stored[-1] = stored[-1], stored[-2]
    per_row = stored[:-1]  # the scales vary along (*batch, out) ...
    scale_output = set(per_row) <= set(out)
    if not (scale_output or set(per_row) <= set(other)):
        return None
    if q.group_size is None:
        return _Plan(stored, per_row, other, out, None, None, scale_output)
    # ... and along the group index `g` of the split `in` dimension.
    split, groups = stored[-1], (next(fresh), next(fresh))

    def split_labels(labels):
        return [x for label in labels for x in (groups if label == split else (label,))]

    return _Plan(
        codes=[*per_row, *groups],
        scale=[*per_row, groups[0]],
        other=split_labels(other),
        out=split_labels(out),
        other_split_at=other.index(split) if split in other else None,
        groups=groups,
        scale_output=scale_output,
    )


def _align(x, labels: list, target: list):
    """`x` transposed and reshaped to broadcast against an array labelled `target`."""
    order = sorted(range(len(labels)), key=lambda d: target.index(labels[d]))
    if order != list(range(len(labels))):
        x = jnp.transpose(x, order)
    shape = [1] * len(target)
    for position, d in enumerate(order):
        shape[target.index(labels[d])] = jnp.shape(x)[position]
    return jnp.reshape(x, shape)


def _quantized_dot(codes, scale, other, plan: _Plan, quantized_is_lhs: bool, params: dict):
    weights = codes.astype(scale.dtype)
    if plan.groups is not None:
        n_groups = jnp.shape(scale)[-1]
        weights = jnp.reshape(weights, (*jnp.shape(weights)[:-1], n_groups, -1))
        if plan.other_split_at is not None:
            r, shape = plan.other_split_at, jnp.shape(other)
            other = jnp.reshape(other, (*shape[:r], n_groups, -1, *shape[r + 1 :]))

    def contract(x, x_labels, y, y_labels, keep):
        # Keep the operands in the order of the original product.
        if quantized_is_lhs:
            return contract_labelled(x, x_labels, y, y_labels, keep, params)
        return contract_labelled(y, y_labels, x, x_labels, keep, params)

    if plan.scale_output:
        # The group index stays a batch dimension until the scales are applied.
        keep = set(plan.out) | ({plan.groups[0]} if plan.groups else set())
        out, labels = contract(weights, plan.codes, other, plan.other, keep)
        out = (out * _align(scale, plan.scale, labels)).astype(out.dtype)
        if plan.groups and plan.groups[0] not in plan.out:
            out = jnp.sum(out, axis=labels.index(plan.groups[0]))
            labels = [label for label in labels if label != plan.groups[0]]
    else:
        labels = list(plan.other)
        if plan.groups and plan.groups[0] not in labels:
            # `in` is a free dimension of the weight: give `other` a group axis to
            # carry the scales, shared (batch) with the codes.
            labels.append(plan.groups[0])
            other = jnp.expand_dims(other, -1)
        scaled = (other * _align(scale, plan.scale, labels)).astype(jnp.result_type(other))
        out, labels = contract(weights, plan.codes, scaled, labels, set(plan.out))
    order = [labels.index(label) for label in plan.out]
    if order != list(range(len(order))):
        out = jnp.transpose(out, order)
    if plan.groups is not None and plan.groups[0] in plan.out:
        g, shape = plan.out.index(plan.groups[0]), jnp.shape(out)
        out = jnp.reshape(out, (*shape[:g], shape[g] * shape[g + 1], *shape[g + 2 :]))
    return out


def _dot(q: QuantizedArray, other, plan: _Plan, params, *, quantized_is_lhs: bool):
    # Under `quaxify`, so that `other` may itself be a Value (another quantised array).
    return quaxlike.quaxify(_quantized_dot)(
        q.codes(), q.scale, other, plan, quantized_is_lhs, params
    )


@quaxlike.register(lax.dot_general_p)
def dot_general_p_quantized_dense(x: QuantizedArray, y: ArrayLike, *, dimension_numbers, **params):
    plan = _plan(x, np.ndim(y), dimension_numbers, quantized_is_lhs=True)
    if plan is None:
        return NotImplemented
    return _dot(x, y, plan, params, quantized_is_lhs=True)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_dense_quantized(x: ArrayLike, y: QuantizedArray, *, dimension_numbers, **params):
    plan = _plan(y, np.ndim(x), dimension_numbers, quantized_is_lhs=False)
    if plan is None:
        return NotImplemented
    return _dot(y, x, plan, params, quantized_is_lhs=False)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_quantized_quantized(
    x: QuantizedArray, y: QuantizedArray, *, dimension_numbers, **params
):
    # The codes of one operand meet the other operand, still quantised, in a product
    # that the other's own rule handles. That needs a plan that passes the other
    # operand straight to `dot_general`: scales applied to the output, and no cutting
    # of the other operand into groups (either would materialise it).
    for q, other, is_lhs in ((x, y, True), (y, x, False)):
        plan = _plan(q, other.ndim, dimension_numbers, quantized_is_lhs=is_lhs)
        if plan is not None and plan.scale_output and plan.other_split_at is None:
            return _dot(q, other, plan, params, quantized_is_lhs=is_lhs)
    return NotImplemented


# --- operations that stay quantised ------------------------------------------------


@quaxlike.register(lax.transpose_p)
def transpose_p_quantized(x: QuantizedArray, *, permutation, **params):
    k = x.ndim - 2
    if tuple(permutation[:k]) != tuple(range(k)):
        return NotImplemented  # moving a batch dimension: materialise
    if tuple(permutation[k:]) == (k, k + 1):
        return x
    return x.swapped()


@quaxlike.register(lax.convert_element_type_p)
def convert_element_type_p_quantized(x: QuantizedArray, *, new_dtype, **params):
    if params.get("weak_type") or not jnp.issubdtype(new_dtype, jnp.floating):
        return NotImplemented  # integer or weakly typed results: materialise
    return x.with_scale(lax.convert_element_type(x.scale, new_dtype))


@quaxlike.register(lax.mul_p)
def mul_p_quantized_scalar(x: QuantizedArray, y: ArrayLike, **params):
    if jnp.ndim(y) != 0:
        return NotImplemented
    return x.with_scale(lax.mul(x.scale, y))


@quaxlike.register(lax.div_p)
def div_p_quantized_scalar(x: QuantizedArray, y: ArrayLike, **params):
    if jnp.ndim(y) != 0:
        return NotImplemented
    return x.with_scale(lax.div(x.scale, y))


@quaxlike.register(lax.neg_p)
def neg_p_quantized(x: QuantizedArray, **params):
    return x.with_scale(lax.neg(x.scale))
