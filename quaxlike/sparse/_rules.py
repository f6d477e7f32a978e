"""Rules for `BCOO`. Each works on the stored entries (gathers from the dense
operand, scatter-adds into a dense result, or combines `data`) and never builds
the dense form of the sparse operand.

Entries with an out-of-bounds coordinate are padding: gathers use
`mode="fill"` (they read zero) and scatters use `mode="drop"` (they write
nothing), so padding never needs masking except where coordinates are dropped
(`reduce_sum` over some axes, sparse-sparse matching).

A BCOO with batch dimensions (Quax's layout) keeps it through the rules that only
change `data` (products with dense operands, negation, conversions, elementwise
functions), through sums of two BCOOs with the same batch dimensions, and
through broadcasting and squeezing batch dimensions. The other rules work on
its `unbatched` form, with the batch positions as leading coordinates.
"""

from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike

import quaxlike
from quaxlike.internal import output_aval

from ._value import BCOO, in_bounds, unbatched


def _replace(
    x: BCOO, data, indices=None, shape=None, *, unique_indices=None, allow_materialise=None
) -> BCOO:
    return BCOO(
        data,
        x.indices if indices is None else indices,
        x.shape if shape is None else shape,
        unique_indices=x.unique_indices if unique_indices is None else unique_indices,
        allow_materialise=x.allow_materialise if allow_materialise is None else allow_materialise,
    )


def _coordinates(x: BCOO, dims) -> tuple[Array, ...]:
    return tuple(x.indices[:, d] for d in dims)


def _columns(indices: Array, dims) -> Array:
    """The columns `dims` of `indices`, shape `(nse, len(dims))`."""
    return indices[:, np.asarray(dims, dtype=np.int32)]


def _gather(dense: Array, coordinates: tuple[Array, ...]) -> Array:
    """`dense` at the given coordinates of its leading dimensions; zero where a
    coordinate is out of bounds. Shape `(nse, *dense.shape[len(coordinates):])`."""
    return dense.at[coordinates].get(mode="fill", fill_value=0)


def _same_pattern(x: BCOO, y: BCOO) -> bool:
    """Whether `x` and `y` certainly store their entries at the same coordinates,
    in the same order. Known for the same `indices` object, or by comparing
    concrete indices; traced indices of different objects count as different."""
    if x.indices is y.indices:
        return True
    if x.indices.shape != y.indices.shape:
        return False
    if isinstance(x.indices, jax.core.Tracer) or isinstance(y.indices, jax.core.Tracer):
        return False
    return bool(np.array_equal(np.asarray(x.indices), np.asarray(y.indices)))


def _match(x_indices, x_valid, y_indices, y_valid) -> Array:
    """`match[a, b]`: entry `a` of x and entry `b` of y are in bounds and share
    coordinates. Costs `nse_x * nse_y`."""
    equal = jnp.all(x_indices[:, None, :] == y_indices[None, :, :], axis=-1)
    return equal & x_valid[:, None] & y_valid[None, :]


# --- dot_general ---------------------------------------------------------------


def _sparse_dense_dot(x: BCOO, y: Array, dimension_numbers, out_dtype) -> Array:
    """`dot_general(x, y)` for sparse `x`: each stored entry multiplies the slice of
    `y` at its batch and contracting coordinates, and is scatter-added into the
    result at its batch and free coordinates."""
    (lc, rc), (lb, rb) = dimension_numbers
    lfree = [d for d in range(x.ndim) if d not in lc and d not in lb]
    rfree = [d for d in range(y.ndim) if d not in rc and d not in rb]
    # Bring y's batch and contracting dims to the front, in the order they pair
    # with x's, so one gather reads all of them.
    y = jnp.transpose(y, (*rb, *rc, *rfree))
    gathered_dims = (*lb, *lc)
    if gathered_dims:
        slices = _gather(y, _coordinates(x, gathered_dims))
    else:  # an outer product: every entry meets all of y
        slices = jnp.broadcast_to(y, (x.nse, *y.shape))
    data = x.data.astype(out_dtype)[(slice(None),) + (None,) * len(rfree)]
    contributions = data * slices.astype(out_dtype)
    scattered_dims = (*lb, *lfree)
    if not scattered_dims:  # x has only contracting dims: out-of-bounds gathers read 0
        return jnp.sum(contributions, axis=0)
    out_shape = (*(x.shape[d] for d in scattered_dims), *slices.shape[1:])
    zeros = jnp.zeros(out_shape, out_dtype)
    return zeros.at[_coordinates(x, scattered_dims)].add(contributions, mode="drop")


def _out_dtype(primitive, args, params):
    return output_aval(primitive, args, params).dtype


@quaxlike.register(lax.dot_general_p)
def dot_general_p_bcoo_dense(x: BCOO, y: ArrayLike, *, dimension_numbers, **params) -> Array:
    dtype = _out_dtype(lax.dot_general_p, (x, y), dict(params, dimension_numbers=dimension_numbers))
    return _sparse_dense_dot(unbatched(x), jnp.asarray(y), dimension_numbers, dtype)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_dense_bcoo(x: ArrayLike, y: BCOO, *, dimension_numbers, **params) -> Array:
    # dot_general(x, y) has dims (batch, x free, y free); compute
    # dot_general(y, x), with dims (batch, y free, x free), and swap the free parts.
    dtype = _out_dtype(lax.dot_general_p, (x, y), dict(params, dimension_numbers=dimension_numbers))
    x = jnp.asarray(x)
    (lc, rc), (lb, rb) = dimension_numbers
    swapped = _sparse_dense_dot(unbatched(y), x, ((rc, lc), (rb, lb)), dtype)
    n_batch = len(lb)
    n_y_free = y.ndim - len(rc) - len(rb)
    n_x_free = x.ndim - len(lc) - len(lb)
    y_free = range(n_batch, n_batch + n_y_free)
    x_free = range(n_batch + n_y_free, n_batch + n_y_free + n_x_free)
    return jnp.transpose(swapped, (*range(n_batch), *x_free, *y_free))


@quaxlike.register(lax.dot_general_p)
def dot_general_p_bcoo_bcoo(x: BCOO, y: BCOO, *, dimension_numbers, **params) -> Array | BCOO:
    # Every pair of entries that agree on their batch and contracting coordinates
    # gives one entry of the result: nse_x * nse_y slots, unmatched ones zero.
    dtype = _out_dtype(lax.dot_general_p, (x, y), dict(params, dimension_numbers=dimension_numbers))
    x, y = unbatched(x), unbatched(y)
    (lc, rc), (lb, rb) = dimension_numbers
    lfree = [d for d in range(x.ndim) if d not in lc and d not in lb]
    rfree = [d for d in range(y.ndim) if d not in rc and d not in rb]
    match = _match(
        _columns(x.indices, (*lb, *lc)),
        in_bounds(x.indices, x.shape),
        _columns(y.indices, (*rb, *rc)),
        in_bounds(y.indices, y.shape),
    )
    products = x.data.astype(dtype)[:, None] * y.data.astype(dtype)[None, :]
    data = jnp.where(match, products, jnp.zeros((), dtype)).reshape(-1)
    if not lb and not lfree and not rfree:  # a scalar result
        return jnp.sum(data)
    nx, ny = x.nse, y.nse
    x_part = _columns(x.indices, (*lb, *lfree))[:, None, :]
    y_part = _columns(y.indices, rfree).astype(x.indices.dtype)[None, :, :]
    x_part = jnp.broadcast_to(x_part, (nx, ny, x_part.shape[-1]))
    y_part = jnp.broadcast_to(y_part, (nx, ny, y_part.shape[-1]))
    shape = (*(x.shape[d] for d in (*lb, *lfree)), *(y.shape[d] for d in rfree))
    indices = jnp.concatenate([x_part, y_part], axis=-1).reshape(nx * ny, len(shape))
    return BCOO(
        data,
        indices,
        shape,
        allow_materialise=x.allow_materialise and y.allow_materialise,
    )


# --- add and sub ---------------------------------------------------------------


def _scatter_into(x: BCOO, dense: ArrayLike, out_aval, sign: int) -> Array:
    x = unbatched(x)
    base = jnp.broadcast_to(lax.convert_element_type(dense, out_aval.dtype), out_aval.shape)
    data = x.data.astype(out_aval.dtype)
    data = -data if sign < 0 else data
    return base.at[_coordinates(x, range(x.ndim))].add(data, mode="drop")


def _broadcast_batch(x: BCOO, shape: tuple[int, ...]) -> BCOO | None:
    """`x` with its batch dimensions broadcast to those of `shape`, or None if
    `shape` differs elsewhere (a sparse dimension would have to grow)."""
    n_batch = x.n_batch
    if x.shape == shape:
        return x
    if len(shape) != x.ndim or shape[n_batch:] != x.shape[n_batch:]:
        return None
    if any(size not in (1, full) for size, full in zip(x.shape[:n_batch], shape)):
        return None
    batch = shape[:n_batch]
    return _replace(
        x,
        jnp.broadcast_to(x.data, (*batch, x.nse)),
        jnp.broadcast_to(x.indices, (*batch, *x.indices.shape[n_batch:])),
        shape,
    )


def _add_sparse(x: BCOO, y: BCOO, y_data, dtype) -> BCOO:
    """x + y, where `y_data` is y's data (negated for a subtraction)."""
    allow = x.allow_materialise and y.allow_materialise
    if _same_pattern(x, y):
        return _replace(x, x.data.astype(dtype) + y_data.astype(dtype), allow_materialise=allow)
    # Different patterns: store both sets of entries (duplicates add up), per
    # batch element when both have the same batch dimensions.
    if x.n_batch != y.n_batch:
        y_data = y_data.reshape(-1)
        x, y = unbatched(x), unbatched(y)
    return BCOO(
        jnp.concatenate([x.data.astype(dtype), y_data.astype(dtype)], axis=-1),
        jnp.concatenate([x.indices, y.indices.astype(x.indices.dtype)], axis=-2),
        x.shape,
        allow,
    )


def _same_shape(primitive, x: BCOO, y: BCOO, params) -> tuple[BCOO, BCOO] | None:
    """Both operands at the result's shape (broadcasting size-1 batch
    dimensions, as `lax.add` does), or None where a sparse dimension differs."""
    shape = tuple(output_aval(primitive, (x, y), params).shape)
    x2, y2 = _broadcast_batch(x, shape), _broadcast_batch(y, shape)
    return None if x2 is None or y2 is None else (x2, y2)


# A dense operand may broadcast along size-1 dimensions (`lax.add` allows it), and
# so may the sparse operand's size-1 batch dimensions; one that would grow a
# sparse dimension is left to the default.


@quaxlike.register([lax.add_p, "add_any"])
def add_p_bcoo_dense(x: BCOO, y: ArrayLike, **params):
    out_aval = output_aval(lax.add_p, (x, y), params)
    sparse = _broadcast_batch(x, tuple(out_aval.shape))
    if sparse is None:
        return NotImplemented
    return _scatter_into(sparse, y, out_aval, sign=1)


@quaxlike.register([lax.add_p, "add_any"])
def add_p_bcoo_bcoo(x: BCOO, y: BCOO, **params):
    both = _same_shape(lax.add_p, x, y, params)
    if both is None:
        return NotImplemented
    return _add_sparse(*both, both[1].data, _out_dtype(lax.add_p, (x, y), params))


@quaxlike.register(lax.sub_p)
def sub_p_bcoo_dense(x: BCOO, y: ArrayLike, **params):
    out_aval = output_aval(lax.sub_p, (x, y), params)
    sparse = _broadcast_batch(x, tuple(out_aval.shape))
    if sparse is None:
        return NotImplemented
    return _scatter_into(sparse, lax.neg(jnp.asarray(y)), out_aval, sign=1)


@quaxlike.register(lax.sub_p)
def sub_p_dense_bcoo(x: ArrayLike, y: BCOO, **params):
    out_aval = output_aval(lax.sub_p, (x, y), params)
    sparse = _broadcast_batch(y, tuple(out_aval.shape))
    if sparse is None:
        return NotImplemented
    return _scatter_into(sparse, x, out_aval, sign=-1)


@quaxlike.register(lax.sub_p)
def sub_p_bcoo_bcoo(x: BCOO, y: BCOO, **params):
    both = _same_shape(lax.sub_p, x, y, params)
    if both is None:
        return NotImplemented
    return _add_sparse(*both, -both[1].data, _out_dtype(lax.sub_p, (x, y), params))


# --- mul and div ---------------------------------------------------------------


def _dense_at_entries(x: BCOO, y: ArrayLike) -> Array | None:
    """`y` read at each stored entry of `x`, for `y` that broadcasts to `x`'s shape
    (a scalar, `x`'s shape, or size-1 dimensions); None for a `y` that would
    broadcast `x` (left to the default). Shaped like `x.data`, or a scalar."""
    y = jnp.asarray(y)
    data_shape = x.data.shape
    x = unbatched(x)
    if y.ndim > x.ndim:
        return None
    y_shape = (1,) * (x.ndim - y.ndim) + y.shape
    if any(size not in (1, full) for size, full in zip(y_shape, x.shape)):
        return None
    # Read y along its non-broadcast dimensions only.
    kept = [d for d, size in enumerate(y_shape) if size != 1]
    y = y.reshape([y_shape[d] for d in kept])
    if not kept:
        return y
    return _gather(y, _coordinates(x, kept)).reshape(data_shape)


@quaxlike.register(lax.mul_p)
def mul_p_bcoo_dense(x: BCOO, y: ArrayLike, **params):
    # Zero times anything is taken to be zero (also for inf and nan in `y`), as in
    # `jax.experimental.sparse`.
    values = _dense_at_entries(x, y)
    if values is None:
        return NotImplemented
    dtype = _out_dtype(lax.mul_p, (x, y), params)
    return _replace(x, x.data.astype(dtype) * values.astype(dtype))


@quaxlike.register(lax.mul_p)
def mul_p_bcoo_bcoo(x: BCOO, y: BCOO, **params):
    both = _same_shape(lax.mul_p, x, y, params)
    if both is None:
        return NotImplemented
    dtype = _out_dtype(lax.mul_p, (x, y), params)
    x, y = both
    allow = x.allow_materialise and y.allow_materialise
    if x.unique_indices and y.unique_indices and _same_pattern(x, y):
        return _replace(x, x.data.astype(dtype) * y.data.astype(dtype), allow_materialise=allow)
    # Different (or possibly repeated) coordinates: read y's value at each entry of
    # x by matching coordinates, at a cost of nse_x * nse_y; the result keeps x's
    # pattern. Repeated coordinates in y add up, those in x distribute.
    fx, fy = unbatched(x), unbatched(y)
    match = _match(
        fx.indices, in_bounds(fx.indices, x.shape), fy.indices, in_bounds(fy.indices, y.shape)
    )
    y_at_x = jnp.sum(jnp.where(match, fy.data.astype(dtype)[None, :], jnp.zeros((), dtype)), 1)
    y_at_x = y_at_x.reshape(x.data.shape)
    return _replace(x, x.data.astype(dtype) * y_at_x, allow_materialise=allow)


@quaxlike.register(lax.div_p)
def div_p_bcoo_dense(x: BCOO, y: ArrayLike, **params):
    # Like `mul`: an entry not stored stays zero, even where `y` is zero.
    values = _dense_at_entries(x, y)
    if values is None:
        return NotImplemented
    dtype = _out_dtype(lax.div_p, (x, y), params)
    return _replace(x, lax.div(x.data.astype(dtype), values.astype(dtype)))


# --- one-operand rules ------------------------------------------------------------


@quaxlike.register(lax.neg_p)
def neg_p_bcoo(x: BCOO, **params) -> BCOO:
    return _replace(x, lax.neg(x.data))


@quaxlike.register("stop_gradient")
def stop_gradient_p_bcoo(x: BCOO, **params) -> BCOO:
    return _replace(x, lax.stop_gradient(x.data))


@quaxlike.register(lax.transpose_p)
def transpose_p_bcoo(x: BCOO, *, permutation, **params) -> BCOO:
    x = unbatched(x)
    permutation = tuple(permutation)
    shape = tuple(x.shape[d] for d in permutation)
    return _replace(x, x.data, _columns(x.indices, permutation), shape)


@quaxlike.register(lax.reduce_sum_p)
def reduce_sum_p_bcoo(x: BCOO, *, axes, **params) -> Array | BCOO:
    x = unbatched(x)
    kept = [d for d in range(x.ndim) if d not in axes]
    # Dropping coordinates could bring a padding entry in bounds: zero it first.
    data = jnp.where(in_bounds(x.indices, x.shape), x.data, jnp.zeros((), x.dtype))
    if not kept:
        return jnp.sum(data)
    shape = tuple(x.shape[d] for d in kept)
    return _replace(x, data, _columns(x.indices, kept), shape, unique_indices=False)


# --- batch dimensions ------------------------------------------------------------


@quaxlike.register(lax.broadcast_in_dim_p)
def broadcast_in_dim_p_bcoo(
    x: BCOO, *dynamic_shape: ArrayLike, shape, broadcast_dimensions, **params
) -> Any:  # a BCOO, or NotImplemented
    # New leading dimensions, and size-1 batch dimensions grown, become batch
    # dimensions: `data` and `indices` are broadcast, the sparse part is kept.
    # (This is how NumPy broadcasting meets a BCOO: `x + y` with `y` of higher
    # rank.) Growing a sparse dimension has no rule.
    shape = tuple(shape)
    n_new = len(shape) - x.ndim
    if dynamic_shape or tuple(broadcast_dimensions) != tuple(range(n_new, len(shape))):
        return NotImplemented
    n_batch = x.n_batch
    if shape[n_new + n_batch :] != x.shape[n_batch:]:
        return NotImplemented
    batch = shape[: n_new + n_batch]
    if any(size not in (1, full) for size, full in zip(x.shape[:n_batch], batch[n_new:])):
        return NotImplemented
    return _replace(
        x,
        jnp.broadcast_to(x.data, (*batch, x.nse)),
        jnp.broadcast_to(x.indices, (*batch, *x.indices.shape[n_batch:])),
        shape,
    )


@quaxlike.register(lax.squeeze_p)
def squeeze_p_bcoo(x: BCOO, *, dimensions, **params) -> Any:  # a BCOO, or NotImplemented
    dimensions = tuple(dimensions)
    shape = tuple(size for d, size in enumerate(x.shape) if d not in dimensions)
    if not shape:
        return NotImplemented  # a scalar is not a BCOO
    if all(d < x.n_batch for d in dimensions):
        return _replace(
            x, jnp.squeeze(x.data, dimensions), jnp.squeeze(x.indices, dimensions), shape
        )
    # A sparse dimension of length 1 goes: its column of `indices` is dropped,
    # after zeroing the padding entries it alone kept out of bounds.
    x = unbatched(x)
    data = jnp.where(in_bounds(x.indices, x.shape), x.data, jnp.zeros((), x.dtype))
    kept = [d for d in range(x.ndim) if d not in dimensions]
    return _replace(x, data, _columns(x.indices, kept), shape)


@quaxlike.register(lax.convert_element_type_p)
def convert_element_type_p_bcoo(x: BCOO, *, new_dtype, **params):
    # Converting each entry equals converting their sum only for unique
    # coordinates, or (up to rounding) for a floating result.
    if not (x.unique_indices or jnp.issubdtype(new_dtype, jnp.inexact)):
        return NotImplemented
    return _replace(x, lax.convert_element_type_p.bind(x.data, new_dtype=new_dtype, **params))


# Elementwise functions with f(0) == 0 act on the stored entries alone, provided
# no two entries share coordinates (f(a + b) != f(a) + f(b) in general).
_ZERO_PRESERVING = [
    lax.abs_p,
    lax.sign_p,
    lax.sin_p,
    lax.tanh_p,
    lax.sqrt_p,
    lax.expm1_p,
    lax.log1p_p,
    lax.square_p,
]


def _make_elementwise_rule(primitive):
    def rule(x: BCOO, **params):
        if not x.unique_indices:
            return NotImplemented
        return _replace(x, primitive.bind(x.data, **params))

    rule.__name__ = rule.__qualname__ = f"{primitive.name}_p_bcoo"
    return rule


for _primitive in _ZERO_PRESERVING:
    quaxlike.register(_primitive)(_make_elementwise_rule(_primitive))


@quaxlike.register(lax.integer_pow_p)
def integer_pow_p_bcoo(x: BCOO, *, y: int, **params):
    if y <= 0 or not x.unique_indices:
        return NotImplemented  # 0 ** 0 == 1, 0 ** -1 == inf: not sparse
    return _replace(x, lax.integer_pow(x.data, y))
