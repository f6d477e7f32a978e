"""Rules for indexing a `QuantizedArray`: `slice`, `dynamic_slice` and `gather`.

Each takes the codes and the scales alike (see `QuantizedArray.row_leaves`), so
only what is taken is ever dequantised:

- taking whole matrices (indexing the leading batch dimensions, as `w[i]` on a
  stack of layers does) gives another quantised array, stored as the original
  is (a double-quantised `NF4Array` keeps one second-level scale per block of
  rows: see `NF4Array.with_row_leaves`);
- taking whole rows of the stored weight (an embedding lookup: `table[ids]`,
  `jax.vmap(embedding)(ids)`, `lax.dynamic_slice(table, (i, 0), (n, dim))`) gives
  those rows, dequantised: dense, as the dense table's lookup would be.

Anything that cuts into the stored rows (some of the inputs of a row) would cut
an `Int4Array`'s groups and bytes apart: the rules hand over (`NotImplemented`).
"""

import jax.numpy as jnp
from jax import lax
from jaxtyping import ArrayLike

import quaxlike

from ._base import QuantizedArray


def _stored(x: QuantizedArray, per_axis: list) -> list:
    """Per-axis items given in the array's layout, in the stored layout."""
    per_axis = list(per_axis)
    if x.transposed:
        per_axis[-2], per_axis[-1] = per_axis[-1], per_axis[-2]
    return per_axis


def _result(x: QuantizedArray, op, whole_rows: bool):
    """`op(leaf, k)` applied to every row leaf of `x` (`k`: the leaf's last
    extent): a quantised array if whole matrices were taken, else the dense rows
    taken (in the array's layout)."""
    leaves = [op(leaf, leaf.shape[-1]) for leaf in x.row_leaves()]
    if whole_rows:
        return x.with_row_leaves(*leaves)
    dense = x.dequantize_leaves(*leaves)
    return jnp.swapaxes(dense, -1, -2) if x.transposed else dense


@quaxlike.register(lax.slice_p)
def slice_p_quantized(x: QuantizedArray, *, start_indices, limit_indices, strides, **params):
    strides = (1,) * x.ndim if strides is None else strides
    axes = _stored(x, list(zip(start_indices, limit_indices, strides, x.shape)))
    whole = [(start, limit, step) == (0, n, 1) for start, limit, step, n in axes]
    if not whole[-1]:
        return NotImplemented  # part of each stored row

    def op(leaf, k):
        starts, limits, steps, _ = zip(*axes[:-1], (0, k, 1, k))
        return lax.slice(leaf, starts, limits, steps)

    return _result(x, op, whole_rows=whole[-2])


@quaxlike.register(lax.dynamic_slice_p)
def dynamic_slice_p_quantized(x: QuantizedArray, *indices: ArrayLike, slice_sizes, **params):
    if len(indices) != x.ndim:
        return NotImplemented  # dynamic shapes
    axes = _stored(x, list(zip(indices, slice_sizes)))
    stored_shape = x.stored_shape
    if axes[-1][1] != stored_shape[-1]:
        return NotImplemented  # part of each stored row

    def op(leaf, k):
        # The whole last axis: its start index is clamped to 0 for either leaf.
        starts, sizes = zip(*axes[:-1], (axes[-1][0], k))
        return lax.dynamic_slice(leaf, starts, sizes)

    return _result(x, op, whole_rows=axes[-2][1] == stored_shape[-2])


_GATHER_MODES = (lax.GatherScatterMode.CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@quaxlike.register(lax.gather_p)
def gather_p_quantized(
    x: QuantizedArray, indices: ArrayLike, *, dimension_numbers, slice_sizes, **params
):
    # Gathers that take the stored rows whole (`table[ids]`, the batched
    # `dynamic_slice` of `jax.vmap`), in the stored layout only.
    numbers = dimension_numbers
    mode = params.get("mode")
    if mode == lax.GatherScatterMode.FILL_OR_DROP:
        # An out-of-bounds index fills with NaN, as the codes times NaN scales
        # give; any other fill value would need the codes to match it.
        if params.get("fill_value") is not None:
            return NotImplemented
    elif mode not in _GATHER_MODES:
        return NotImplemented
    last, row = x.ndim - 1, x.ndim - 2
    out_ndim = len(numbers.offset_dims) + jnp.ndim(indices) - 1
    batching = getattr(numbers, "operand_batching_dims", ())
    if (
        x.transposed
        or slice_sizes[last] != x.shape[last]
        or last in (*numbers.collapsed_slice_dims, *batching)
        or numbers.offset_dims[-1] != out_ndim - 1
    ):
        return NotImplemented
    whole_rows = (
        slice_sizes[row] == x.shape[row]
        and row not in (*numbers.collapsed_slice_dims, *batching)
        and numbers.offset_dims[-2] == out_ndim - 2
    )

    def op(leaf, k):
        sizes = (*slice_sizes[:-1], k)
        return lax.gather_p.bind(
            leaf, indices, dimension_numbers=numbers, slice_sizes=sizes, **params
        )

    return _result(x, op, whole_rows=whole_rows)
