"""Rules for the structured matrices: products, sums, scaling, transposes.

Rules handle single (unbatched) matrices; a batch of structured matrices reaches
them one matrix at a time under `jax.vmap`, and otherwise falls back to the
dense array. Products with a dense operand are the exception: they map over the
batch dimensions themselves (as Quax's `TridiagonalMatrix` does). Every rule ends by converting to the dtype the primitive would
give (worked out with `output_aval`), so mixed dtypes behave as in plain JAX.
"""

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, ArrayLike

import quaxlike
from quaxlike.internal import output_aval

from ._value import as_kind, Diagonal, Identity, ScaledIdentity, StructuredMatrix, TriDiagonal


def _dtype_of(primitive, args, params):
    return output_aval(primitive, args, params).dtype


def _astype(x: StructuredMatrix | Array, dtype) -> StructuredMatrix | Array:
    return x if x.dtype == dtype else x.astype(dtype)


def _scale(a: StructuredMatrix, s) -> StructuredMatrix:
    """`s * a` for a scalar `s`."""
    if isinstance(a, Identity):
        return ScaledIdentity(jnp.asarray(s), a.n)
    return a.map_leaves(lambda leaf: leaf * s)


def _matmul(a: StructuredMatrix, b: StructuredMatrix) -> StructuredMatrix | Array:
    """`a @ b` for two unbatched structured matrices."""
    if a._kind <= ScaledIdentity._kind:
        return b if isinstance(a, Identity) else _scale(b, a.scale)
    if b._kind <= ScaledIdentity._kind:
        return a if isinstance(b, Identity) else _scale(a, b.scale)
    if isinstance(a, Diagonal) and isinstance(b, Diagonal):
        return Diagonal(a.diag * b.diag)
    if isinstance(a, Diagonal):  # scales the rows of b
        assert isinstance(b, TriDiagonal)
        d = a.diag
        return TriDiagonal(b.lower * d[1:], b.diag * d, b.upper * d[:-1])
    if isinstance(b, Diagonal):  # scales the columns of a
        assert isinstance(a, TriDiagonal)
        d = b.diag
        return TriDiagonal(a.lower * d[:-1], a.diag * d, a.upper * d[1:])
    # TriDiagonal @ TriDiagonal is pentadiagonal: give the dense product, O(n^2).
    return a.matvec(b.materialise())


# --- matrix products ---------------------------------------------------------


def _single_contraction(dimension_numbers) -> bool:
    (lc, _), (lb, _) = dimension_numbers
    return len(lc) == 1 and not lb


def _structured_dot_dense(x: StructuredMatrix, y: Array, dimension_numbers) -> Array | None:
    """`dot_general(x, y)` for a structured `x`, with any batch dimensions, in
    `O(n)` per column; None when it contracts other than one matrix axis of `x`,
    or pairs a matrix axis as a batch axis.

    dot_general's result has the paired batch axes, then `x`'s free axes (its
    unpaired batch axes, then its other matrix axis), then `y`'s free axes. So:
    order `x`'s batch axes as (paired, unpaired), move `y`'s paired and
    contracted axes to the front, and map `matvec` over the batch axes."""
    (lc, rc), (lb, rb) = dimension_numbers
    k = len(x.batch_shape)
    if len(lc) != 1 or lc[0] not in (k, k + 1) or any(d >= k for d in lb):
        return None
    unpaired = [d for d in range(k) if d not in lb]
    order = (*lb, *unpaired)
    if order != tuple(range(k)):
        x = jtu.tree_map(lambda leaf: jnp.transpose(leaf, (*order, *range(k, leaf.ndim))), x)
    # Contracting the columns of x is x @ y; contracting its rows is x.T @ y.
    a = x if lc[0] == k + 1 else x.transpose()
    rest = [d for d in range(y.ndim) if d not in rb and d != rc[0]]
    y = jnp.transpose(y, (*rb, rc[0], *rest))
    matvec = lambda a, v: a.matvec(v)  # noqa: E731
    for _ in unpaired:
        matvec = jax.vmap(matvec, in_axes=(0, None))
    for _ in lb:
        matvec = jax.vmap(matvec, in_axes=(0, 0))
    return matvec(a, y)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_structured_dense(
    x: StructuredMatrix, y: ArrayLike, *, dimension_numbers, **params
):
    out = _structured_dot_dense(x, jnp.asarray(y), dimension_numbers)
    if out is None:
        return NotImplemented
    dtype = _dtype_of(lax.dot_general_p, (x, y), dict(params, dimension_numbers=dimension_numbers))
    return out.astype(dtype)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_dense_structured(
    x: ArrayLike, y: StructuredMatrix, *, dimension_numbers, **params
):
    # dot_general(x, y) has axes (batch, x free, y free); compute dot_general(y,
    # x), with axes (batch, y free, x free), and swap the free parts.
    x = jnp.asarray(x)
    (lc, rc), (lb, rb) = dimension_numbers
    swapped = _structured_dot_dense(y, x, ((rc, lc), (rb, lb)))
    if swapped is None:
        return NotImplemented
    dtype = _dtype_of(lax.dot_general_p, (x, y), dict(params, dimension_numbers=dimension_numbers))
    n_batch = len(lb)
    n_y_free = y.ndim - len(rc) - len(rb)
    n_x_free = x.ndim - len(lc) - len(lb)
    y_free = range(n_batch, n_batch + n_y_free)
    x_free = range(n_batch + n_y_free, n_batch + n_y_free + n_x_free)
    return jnp.transpose(swapped, (*range(n_batch), *x_free, *y_free)).astype(dtype)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_structured_structured(
    x: StructuredMatrix, y: StructuredMatrix, *, dimension_numbers, **params
):
    if x.batch_shape or y.batch_shape or not _single_contraction(dimension_numbers):
        return NotImplemented
    (lc, rc), _ = dimension_numbers
    dtype = _dtype_of(lax.dot_general_p, (x, y), dict(params, dimension_numbers=dimension_numbers))
    a = x if tuple(lc) == (1,) else x.transpose()
    b = y if tuple(rc) == (0,) else y.transpose()
    return _astype(_matmul(a, b), dtype)


# --- elementwise -------------------------------------------------------------


def _combine(x: StructuredMatrix, y: StructuredMatrix, op) -> StructuredMatrix:
    """`op` applied band by band, after converting both to the richer type."""
    kind = max(x._kind, y._kind, ScaledIdentity._kind)
    return jtu.tree_map(op, as_kind(x, kind), as_kind(y, kind))


@quaxlike.register([lax.add_p, "add_any"])
def add_p_structured_structured(x: StructuredMatrix, y: StructuredMatrix, **params):
    if x.shape != y.shape:
        return NotImplemented
    dtype = _dtype_of(lax.add_p, (x, y), params)
    return _astype(_combine(x, y, jnp.add), dtype)


@quaxlike.register(lax.sub_p)
def sub_p_structured_structured(x: StructuredMatrix, y: StructuredMatrix, **params):
    if x.shape != y.shape:
        return NotImplemented
    dtype = _dtype_of(lax.sub_p, (x, y), params)
    return _astype(_combine(x, y, jnp.subtract), dtype)


@quaxlike.register(lax.mul_p)
def mul_p_structured_structured(x: StructuredMatrix, y: StructuredMatrix, **params):
    if x.shape != y.shape or x.batch_shape:
        return NotImplemented
    dtype = _dtype_of(lax.mul_p, (x, y), params)
    # The product is zero wherever either factor is: the sparser structure wins.
    if isinstance(x, Identity) and isinstance(y, Identity):
        out = x
    elif max(x._kind, y._kind) <= ScaledIdentity._kind:
        out = ScaledIdentity(as_kind(x, 1).scale * as_kind(y, 1).scale, x.n)
    elif min(x._kind, y._kind) <= Diagonal._kind:
        out = Diagonal(x.diagonal() * y.diagonal())
    else:
        out = _combine(x, y, jnp.multiply)
    return _astype(out, dtype)


def _band(y: ArrayLike, k: int, n: int) -> Array:
    """The k-th diagonal of `y` broadcast to `(n, n)`, read without broadcasting."""
    y = jnp.reshape(y, (1,) * (2 - jnp.ndim(y)) + jnp.shape(y))
    length = n - abs(k)
    rows = jnp.arange(length) + max(-k, 0)
    cols = jnp.arange(length) + max(k, 0)
    if y.shape[0] == 1:
        rows = jnp.zeros_like(rows)
    if y.shape[1] == 1:
        cols = jnp.zeros_like(cols)
    return y[rows, cols]


@quaxlike.register(lax.mul_p)
def mul_p_structured_dense(x: StructuredMatrix, y: ArrayLike, **params):
    dtype = _dtype_of(lax.mul_p, (x, y), params)
    if jnp.ndim(y) == 0:
        return _astype(_scale(x, y), dtype)
    n = x.n
    if x.batch_shape or jnp.ndim(y) > 2 or jnp.broadcast_shapes(jnp.shape(y), x.shape) != x.shape:
        return NotImplemented
    # x * y is zero off x's bands, so only those bands of y are read.
    if x._kind <= Diagonal._kind:
        out = Diagonal(x.diagonal() * _band(y, 0, n))
    else:
        assert isinstance(x, TriDiagonal)
        out = TriDiagonal(
            x.lower * _band(y, -1, n), x.diag * _band(y, 0, n), x.upper * _band(y, 1, n)
        )
    return _astype(out, dtype)


@quaxlike.register(lax.div_p)
def div_p_structured_scalar(x: StructuredMatrix, y: ArrayLike, **params):
    if jnp.ndim(y) != 0:
        return NotImplemented  # dividing by a matrix: off-band entries are 0 / y
    dtype = _dtype_of(lax.div_p, (x, y), params)
    if isinstance(x, Identity):
        return _astype(ScaledIdentity(jnp.ones((), x.dtype) / y, x.n), dtype)
    return _astype(x.map_leaves(lambda leaf: leaf / y), dtype)


@quaxlike.register(lax.neg_p)
def neg_p_structured(x: StructuredMatrix, **params):
    if isinstance(x, Identity):
        return ScaledIdentity(-jnp.ones((), x.dtype), x.n)
    return x.map_leaves(jnp.negative)


def _make_leafwise_rule(primitive):
    # For primitives that act on each entry and map 0 to 0.
    def rule(x: StructuredMatrix, **params):
        return x.map_leaves(lambda leaf: primitive.bind(leaf, **params))

    rule.__name__ = rule.__qualname__ = f"{primitive.name}_p_structured"
    return rule


for _primitive in [lax.copy_p, lax.reduce_precision_p]:
    quaxlike.register(_primitive)(_make_leafwise_rule(_primitive))


@quaxlike.register("stop_gradient")
def stop_gradient_p_structured(x: StructuredMatrix, **params):
    return x.map_leaves(lax.stop_gradient)


@quaxlike.register(lax.convert_element_type_p)
def convert_element_type_p_structured(x: StructuredMatrix, *, new_dtype, **params):
    return x.astype(new_dtype)


# --- structure ---------------------------------------------------------------


@quaxlike.register(lax.transpose_p)
def transpose_p_structured(x: StructuredMatrix, *, permutation, **params):
    k = len(x.batch_shape)
    permutation = tuple(permutation)
    if permutation[:k] != tuple(range(k)):
        return NotImplemented  # moves batch dimensions around
    if permutation[k:] == (k, k + 1):
        return x
    return x.transpose()


@quaxlike.register(lax.reduce_sum_p)
def reduce_sum_p_structured(x: StructuredMatrix, *, axes, **params):
    if x.batch_shape:
        return NotImplemented
    axes = tuple(sorted(axes))
    ones = jnp.ones((x.n,), x.dtype)
    if axes == (1,):  # row sums
        return x.matvec(ones).astype(x.dtype)
    if axes == (0,):  # column sums
        return x.transpose().matvec(ones).astype(x.dtype)
    if axes == (0, 1):
        total = jnp.sum(x.diagonal()) + jnp.sum(x.lower_band()) + jnp.sum(x.upper_band())
        return total.astype(x.dtype)
    return x  # axes == (): nothing to reduce
