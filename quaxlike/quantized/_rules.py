"""Rules for `QuantizedArray` that give another quantised array: transposes, dtype
conversion, scaling, `stop_gradient`, and reshaping the leading batch dimensions.
Matrix products are in `_matmul.py`, indexing in `_indexing.py`."""

import jax.numpy as jnp
from jax import lax
from jaxtyping import ArrayLike

import quaxlike

from ._base import QuantizedArray


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


@quaxlike.register(lax.copy_p)
def copy_p_quantized(x: QuantizedArray, **params):
    return x


@quaxlike.register("stop_gradient")
def stop_gradient_p_quantized(x: QuantizedArray, **params):
    # The codes are integers, which carry no gradient: only the scales need it.
    return x.with_scale(lax.stop_gradient(x.scale))


# --- the leading batch dimensions --------------------------------------------------
#
# The row leaves (`QuantizedArray.row_leaves`) share the array's batch dimensions and
# end in two axes of their own, which these rules keep as they are.


def _on_batch_axes(x: QuantizedArray, op) -> QuantizedArray:
    """`x` with `op(leaf, trailing_shape)` applied to each of its row leaves."""
    return x.with_row_leaves(*(op(leaf, leaf.shape[-2:]) for leaf in x.row_leaves()))


@quaxlike.register(lax.squeeze_p)
def squeeze_p_quantized(x: QuantizedArray, *, dimensions, **params):
    if any(d >= x.ndim - 2 for d in dimensions):
        return NotImplemented  # a matrix axis of size 1 goes: materialise
    return _on_batch_axes(x, lambda leaf, _: lax.squeeze(leaf, dimensions))


def reshapes_batch_axes_only(shape, new_sizes, dimensions, params) -> bool:
    """Whether a `reshape` of an array of `shape` to `new_sizes` keeps its last two
    (matrix) axes and changes only the batch axes before them, with no
    `dimensions` or `sharding`: the reshapes a stacked weight's rules can do on
    its leaves."""
    new_sizes = tuple(new_sizes)
    return (
        dimensions is None
        and params.get("sharding") is None
        and len(new_sizes) >= 2
        and new_sizes[-2:] == tuple(shape[-2:])
    )


@quaxlike.register(lax.reshape_p)
def reshape_p_quantized(x: QuantizedArray, *, new_sizes, dimensions, **params):
    if not reshapes_batch_axes_only(x.shape, new_sizes, dimensions, params):
        return NotImplemented  # the matrix axes would change
    new_sizes = tuple(new_sizes)
    return _on_batch_axes(x, lambda leaf, trailing: lax.reshape(leaf, (*new_sizes[:-2], *trailing)))


@quaxlike.register(lax.broadcast_in_dim_p)
def broadcast_in_dim_p_quantized(x: QuantizedArray, *, shape, broadcast_dimensions, **params):
    n = len(shape)
    if (
        params.get("sharding") is not None
        or tuple(shape[-2:]) != tuple(x.shape[-2:])
        or tuple(broadcast_dimensions[-2:]) != (n - 2, n - 1)
    ):
        return NotImplemented  # the matrix axes would move or grow
    return _on_batch_axes(
        x,
        lambda leaf, trailing: lax.broadcast_in_dim(
            leaf, (*shape[:-2], *trailing), broadcast_dimensions
        ),
    )
