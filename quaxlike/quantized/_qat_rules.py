"""Rules of `FakeQuantized` and `ActivationFakeQuantized` (`_qat.py`).

Matrix products multiply with the rounded weight (`Q(w)` with the
straight-through gradient, or a quantised base by its own rule), after
fake-quantising the other operand per token where the weight has
`activations` and the product contracts the weight's input axis. Transposes
of the last two axes, `stop_gradient`, and slices and reshapes that keep every
stored row whole give another Value of the same kind (rounding is row by row,
so the rows taken round as they did in the whole weight). Anything else
materialises `Q(w)`, with the straight-through gradient.
"""

import jax.numpy as jnp
from jax import lax
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import bind_dot_general, dot_general_labels

from ._qat import ActivationFakeQuantized, fake_quantize_tokens, FakeQuantized
from ._rules import reshapes_batch_axes_only


_Weight = FakeQuantized | ActivationFakeQuantized


def _multiplied(w: _Weight):
    """What the product multiplies: the rounded float weight (straight through)
    or the base."""
    return w.materialise() if isinstance(w, FakeQuantized) else w.base


def _activation_bits(w: _Weight) -> int | None:
    return w.activations if isinstance(w, FakeQuantized) else w.bits


def _product(w: _Weight, other, w_on_left: bool, dimension_numbers, params):
    ndim_w, ndim_o = len(w.shape), len(jnp.shape(other))
    if w_on_left:
        w_labels, o_labels, _ = dot_general_labels(dimension_numbers, ndim_w, ndim_o)
    else:
        o_labels, w_labels, _ = dot_general_labels(dimension_numbers, ndim_o, ndim_w)
    input_label = w_labels[-2] if w.transposed else w_labels[-1]
    bits = _activation_bits(w)

    def product(weight, other):
        if bits is not None and input_label in o_labels:
            # The weight takes its inputs from `other`: round them per token,
            # along the axis they meet the weight's inputs on.
            other = fake_quantize_tokens(other, bits, o_labels.index(input_label))
        lhs, rhs = (weight, other) if w_on_left else (other, weight)
        return bind_dot_general(lhs, rhs, dimension_numbers, params)

    return quaxlike.quaxify(product)(_multiplied(w), other)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_fakequantized_any(
    lhs: FakeQuantized, rhs: ArrayLike | quaxlike.ArrayValue, *, dimension_numbers, **params
):
    return _product(lhs, rhs, True, dimension_numbers, params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_any_fakequantized(
    lhs: ArrayLike | quaxlike.ArrayValue, rhs: FakeQuantized, *, dimension_numbers, **params
):
    return _product(rhs, lhs, False, dimension_numbers, params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_activationfakequantized_any(
    lhs: ActivationFakeQuantized,
    rhs: ArrayLike | quaxlike.ArrayValue,
    *,
    dimension_numbers,
    **params,
):
    return _product(lhs, rhs, True, dimension_numbers, params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_any_activationfakequantized(
    lhs: ArrayLike | quaxlike.ArrayValue,
    rhs: ActivationFakeQuantized,
    *,
    dimension_numbers,
    **params,
):
    return _product(rhs, lhs, False, dimension_numbers, params)


# Precedence: for two fake-quantised weights this rule and the one-sided ones
# above all match, none more specific than the others (`matrix_power` of one).
@quaxlike.register(lax.dot_general_p, precedence=1)
def dot_general_p_fakequantized_fakequantized(
    lhs: _Weight, rhs: _Weight, *, dimension_numbers, **params
):
    # Two weights multiplied (no activations in between): each rounded.
    return bind_dot_general(_multiplied(lhs), _multiplied(rhs), dimension_numbers, params)


# --- operations that keep the type -------------------------------------------------


def _swapped(x: _Weight) -> _Weight:
    if isinstance(x, FakeQuantized):
        return x.with_weight(x.weight, transposed=not x.transposed)
    base = quaxlike.quaxify(lambda b: jnp.swapaxes(b, -1, -2))(x.base)
    return ActivationFakeQuantized(base, bits=x.bits, transposed=not x.transposed)


@quaxlike.register(lax.transpose_p)
def transpose_p_fakequantized(x: _Weight, *, permutation, **params):
    k = len(x.shape) - 2
    if tuple(permutation[:k]) != tuple(range(k)):
        return NotImplemented  # moving a batch axis: materialise
    if tuple(permutation[k:]) == (k, k + 1):
        return x
    return _swapped(x)


@quaxlike.register("stop_gradient")
def stop_gradient_p_fakequantized(x: FakeQuantized, **params):
    # `Q(stop_gradient(w))` is `stop_gradient(Q(w))`: a frozen base (LoRA's)
    # keeps its activations' rounding.
    return x.with_weight(lax.stop_gradient(x.weight))


@quaxlike.register("stop_gradient")
def stop_gradient_p_activationfakequantized(x: ActivationFakeQuantized, **params):
    base = quaxlike.quaxify(lax.stop_gradient)(x.base)
    return ActivationFakeQuantized(base, bits=x.bits, transposed=x.transposed)


@quaxlike.register(lax.copy_p)
def copy_p_fakequantized(x: _Weight, **params):
    return x


def _stored(x: FakeQuantized, per_axis: list) -> list:
    """Per-axis items given in the array's layout, in the stored layout."""
    per_axis = list(per_axis)
    if x.transposed:
        per_axis[-2], per_axis[-1] = per_axis[-1], per_axis[-2]
    return per_axis


@quaxlike.register(lax.slice_p)
def slice_p_fakequantized(x: FakeQuantized, *, start_indices, limit_indices, strides, **params):
    strides = (1,) * len(x.shape) if strides is None else strides
    axes = _stored(x, list(zip(start_indices, limit_indices, strides, x.weight.shape)))
    if axes[-1][:3] != (0, axes[-1][3], 1):
        return NotImplemented  # part of each stored row: its groups would be cut
    starts, limits, steps, _ = zip(*axes)
    return x.with_weight(lax.slice(x.weight, starts, limits, steps))


@quaxlike.register(lax.dynamic_slice_p)
def dynamic_slice_p_fakequantized(x: FakeQuantized, *indices: ArrayLike, slice_sizes, **params):
    sizes = _stored(x, list(slice_sizes))
    if len(indices) != len(x.shape) or sizes[-1] != x.weight.shape[-1]:
        return NotImplemented  # dynamic shapes, or part of each stored row
    return x.with_weight(lax.dynamic_slice(x.weight, _stored(x, list(indices)), sizes))


@quaxlike.register(lax.squeeze_p)
def squeeze_p_fakequantized(x: FakeQuantized, *, dimensions, **params):
    if any(d >= len(x.shape) - 2 for d in dimensions):
        return NotImplemented  # a matrix axis goes: materialise
    return x.with_weight(lax.squeeze(x.weight, dimensions))


@quaxlike.register(lax.reshape_p)
def reshape_p_fakequantized(x: FakeQuantized, *, new_sizes, dimensions, **params):
    if not reshapes_batch_axes_only(x.shape, new_sizes, dimensions, params):
        return NotImplemented  # the matrix axes would change
    new_sizes = tuple(new_sizes)
    trailing = tuple(x.weight.shape[-2:])
    return x.with_weight(lax.reshape(x.weight, (*new_sizes[:-2], *trailing)))
