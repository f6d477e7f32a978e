"""Rules for `DoraArray`.

A product with `D = diag(c) (W + A B)`, `c = m / n`, is the LoRA product (the
base's own rule plus the low-rank factors, `LoraArray`'s rule) with `c` applied
to the side where the row axis of `W` goes: to the result when that axis is kept
(`D x`), to the other operand when it is contracted (`x D`, `Dᵀ x`). Structural
primitives act on the batch axes of every array alike (the magnitude `m` and
`‖W‖²` are `(*batch, out)`), or swap the matrix axes (a transpose flips
`transposed`); anything that would cut the rows apart from their norm has no rule.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import bind_dot_general, cached_rule, dot_general_labels

from ._dora import DoraArray, norm_from_cross


# --- matrix products ---------------------------------------------------------


def _placed(c, c_labels: list, labels: list):
    """`c` (with `c_labels`) laid out along `labels`, size 1 where it has none."""
    order = sorted(range(len(c_labels)), key=lambda i: labels.index(c_labels[i]))
    if order != list(range(len(order))):
        c = lax.transpose(c, tuple(order))
    placed = [c_labels[i] for i in order]
    shape = [c.shape[placed.index(label)] if label in placed else 1 for label in labels]
    return c.reshape(shape)


def _labels(dora: DoraArray, other, dora_on_left: bool, dimension_numbers):
    """The labels of the DoRA operand, the other operand and the output, and those
    of the row scale `m / n` (the DoRA's batch axes and `W`'s rows)."""
    ndims = (dora.ndim, jnp.ndim(other)) if dora_on_left else (jnp.ndim(other), dora.ndim)
    lhs_labels, rhs_labels, out_labels = dot_general_labels(dimension_numbers, *ndims)
    dora_labels, other_labels = (
        (lhs_labels, rhs_labels) if dora_on_left else (rhs_labels, lhs_labels)
    )
    row = dora_labels[-1] if dora.transposed else dora_labels[-2]
    return list(other_labels), list(out_labels), [*dora_labels[:-2], row]


def _shared_columns(
    dora: DoraArray, other, dora_on_left: bool, dimension_numbers
) -> tuple[int, bool] | None:
    """For `D x` (or `x Dᵀ`) with an array `x` of the input axis and at most one
    free axis (what a `Linear` binds, over one token or a batch of them): the axis
    of `x` contracted with `W`'s input axis, and whether the result is `(n, out)`
    rather than `(out, n)`; else None."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
    if dora.ndim != 2 or lhs_b or rhs_b:
        return None
    if isinstance(other, quaxlike.Value) or jnp.ndim(other) not in (1, 2):
        return None
    if dora_on_left and not dora.transposed and tuple(lhs_c) == (1,) and len(rhs_c) == 1:
        return int(rhs_c[0]), False
    if not dora_on_left and dora.transposed and tuple(rhs_c) == (0,) and len(lhs_c) == 1:
        return int(lhs_c[0]), True
    return None


def _one_base_product(dora: DoraArray, other, axis: int, flipped: bool, params):
    """`D x` with one product of the base: `W [x | Bᵀ]` gives `W x` and the norm's
    cross term `W Bᵀ` together (a quantised base is dequantised once, not twice)."""
    vector = jnp.ndim(other) == 1
    rows = other[None] if vector else other if axis == 1 else other.T  # (n, in)
    n = rows.shape[0]

    def product(w, a, b, rows, w_norm_sq, m):
        frozen_b = lax.stop_gradient(b).astype(rows.dtype)  # the norm is detached
        columns = jnp.concatenate([rows, frozen_b], axis=0)  # (n + r, in)
        contract = (((1,), (1,)), ((), ()))
        both = bind_dot_general(w, columns, contract, params)  # (out, n + r)
        base, cross = both[:, :n], lax.stop_gradient(both[:, n:])
        low = bind_dot_general(b, rows, contract, params)  # (r, n)
        low = bind_dot_general(a, low, (((1,), (0,)), ((), ())), params)  # (out, n)
        norm = norm_from_cross(cross, a, b, w_norm_sq)
        scale = (m.astype(norm.dtype) / norm).astype(base.dtype)
        out = (base + low.astype(base.dtype)) * scale[:, None]
        return out[:, 0] if vector else out.T if flipped else out  # (out, n) or (n, out)

    fields = (dora.frozen_weight(), dora.a, dora.b, rows, dora.weight_norm_squared(), dora.m)
    return quaxlike.quaxify(product)(*fields)


@cached_rule
def _dora_product(dora: DoraArray, other, *, dimension_numbers, dora_on_left, **params):
    shared = _shared_columns(dora, other, dora_on_left, dimension_numbers)
    if shared is not None:
        return _one_base_product(dora, other, *shared, params)
    other_labels, out_labels, c_labels = _labels(dora, other, dora_on_left, dimension_numbers)
    lora = dora.as_lora()
    if dora.transposed:
        perm = (*range(dora.ndim - 2), dora.ndim - 1, dora.ndim - 2)
        lora = quaxlike.quaxify(lambda v: lax.transpose(v, perm))(lora)
    scale = dora.row_scale()

    def product(lora, other, scale):
        if all(label in out_labels for label in c_labels):
            # The rows survive: scale the product's rows.
            args = (lora, other) if dora_on_left else (other, lora)
            out = bind_dot_general(*args, dimension_numbers, params)
            return out * _placed(scale.astype(out.dtype), c_labels, out_labels)
        # The rows are contracted (every batch axis shared with `other`): scale
        # `other` along them before the product.
        other = other * _placed(scale.astype(other.dtype), c_labels, other_labels)
        args = (lora, other) if dora_on_left else (other, lora)
        return bind_dot_general(*args, dimension_numbers, params)

    return quaxlike.quaxify(product)(lora, other, scale)


def _dora_dot(dora: DoraArray, other, dora_on_left: bool, dimension_numbers, params):
    other_labels, out_labels, c_labels = _labels(dora, other, dora_on_left, dimension_numbers)
    kept = all(label in out_labels for label in c_labels)
    if not kept and not all(label in other_labels for label in c_labels):
        return NotImplemented  # rows contracted while a batch axis stays free
    return _dora_product(
        dora, other, dimension_numbers=dimension_numbers, dora_on_left=dora_on_left, **params
    )


@quaxlike.register(lax.dot_general_p)
def dot_general_p_dora_any(
    x: DoraArray, y: ArrayLike | quaxlike.ArrayValue, *, dimension_numbers, **params
):
    # (m / n) ⊙ (W y + A (B y)): never W + A B.
    return _dora_dot(x, y, True, dimension_numbers, params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_any_dora(
    x: ArrayLike | quaxlike.ArrayValue, y: DoraArray, *, dimension_numbers, **params
):
    return _dora_dot(y, x, False, dimension_numbers, params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_dora_dora(x: DoraArray, y: DoraArray, **params):
    # The left DoRA is expanded; its products with `y` redispatch to the rule above.
    return dot_general_p_dora_any(x, y, **params)


# --- structural primitives: batch axes, and transposes -------------------------


def _fields(x: DoraArray, fw, fa, fb, fr) -> DoraArray:
    """`x` with `w`, `a`, `b` replaced by `fw(w)`, `fa(a)`, `fb(b)` and the two row
    vectors `m` and `‖W‖²` by `fr(·)`, each under `quaxify` (`w` may be a Value)."""
    w, a, b = (quaxlike.quaxify(f)(v) for f, v in ((fw, x.w), (fa, x.a), (fb, x.b)))
    return x._replaced(w=w, a=a, b=b, m=fr(x.m), w_norm_sq=fr(x.w_norm_sq))


def _per_field(x: DoraArray, batch_items: list, m_item, n_item, rank_item):
    """Per-axis items for `w`, `a`, `b` and the row vectors, from the items of the
    batch axes and of `W`'s two axes (in `W`'s orientation)."""
    return (
        (*batch_items, m_item, n_item),
        (*batch_items, m_item, rank_item),
        (*batch_items, rank_item, n_item),
        (*batch_items, m_item),
    )


def _matrix_items(x: DoraArray, per_axis: list) -> tuple[list, Any, Any]:
    """The items of the batch axes, and of `W`'s rows and columns."""
    *batch, first, second = per_axis
    return (batch, second, first) if x.transposed else (batch, first, second)


def _whole(x: DoraArray, per_axis_sizes: list) -> bool:
    return tuple(per_axis_sizes[-2:]) == tuple(x.shape[-2:])


@quaxlike.register(lax.transpose_p)
def transpose_p_dora(x: DoraArray, *, permutation, **params):
    k = x.ndim - 2
    if sorted(permutation[:k]) != list(range(k)):
        return NotImplemented  # a matrix axis would move into the batch axes
    batch = list(permutation[:k])
    move = lambda rest: lambda v: lax.transpose(v, (*batch, *rest))  # noqa: E731
    out = _fields(x, move((k, k + 1)), move((k, k + 1)), move((k, k + 1)), move((k,)))
    if tuple(permutation[k:]) == (k, k + 1):
        return out
    return out._replaced(transposed=not x.transposed)


def _apply_items(x: DoraArray, make, items) -> DoraArray:
    return _fields(x, *(make(item) for item in items))


@quaxlike.register(lax.slice_p)
def slice_p_dora(x: DoraArray, *, start_indices, limit_indices, strides, **params):
    strides = (1,) * x.ndim if strides is None else strides
    per_axis = list(zip(start_indices, limit_indices, strides))
    if any(item != (0, n, 1) for item, n in zip(per_axis[-2:], x.shape[-2:])):
        return NotImplemented  # part of the rows or columns: cut apart from their norm
    batch, rows, columns = _matrix_items(x, per_axis)

    def slicer(item):
        starts, limits, steps = zip(*item)
        return lambda v: lax.slice(v, starts, limits, steps)

    return _apply_items(x, slicer, _per_field(x, batch, rows, columns, (0, x.rank, 1)))


@quaxlike.register(lax.dynamic_slice_p)
def dynamic_slice_p_dora(x: DoraArray, *indices: ArrayLike, slice_sizes, **params):
    if len(indices) != x.ndim or not _whole(x, list(slice_sizes)):
        return NotImplemented
    zero = jnp.zeros((), jnp.result_type(indices[0]))
    batch, rows, columns = _matrix_items(x, list(zip(indices, slice_sizes)))
    rows, columns = (zero, rows[1]), (zero, columns[1])

    def slicer(item):
        starts, sizes = zip(*item)
        return lambda v: lax.dynamic_slice(v, starts, sizes)

    return _apply_items(x, slicer, _per_field(x, batch, rows, columns, (zero, x.rank)))


@quaxlike.register(lax.squeeze_p)
def squeeze_p_dora(x: DoraArray, *, dimensions, **params):
    if any(d >= x.ndim - 2 for d in dimensions):
        return NotImplemented
    squeeze = lambda v: lax.squeeze(v, dimensions)  # noqa: E731
    return _fields(x, squeeze, squeeze, squeeze, squeeze)


@quaxlike.register(lax.reshape_p)
def reshape_p_dora(x: DoraArray, *, new_sizes, dimensions, **params):
    new_sizes = tuple(new_sizes)
    if dimensions is not None or len(new_sizes) < 2 or new_sizes[-2:] != tuple(x.shape[-2:]):
        return NotImplemented  # the matrix axes would change
    batch, rows, columns = _matrix_items(x, list(new_sizes))
    items = _per_field(x, batch, rows, columns, x.rank)
    return _apply_items(x, lambda s: lambda v: lax.reshape(v, s), items)


@quaxlike.register(lax.broadcast_in_dim_p)
def broadcast_in_dim_p_dora(x: DoraArray, *, shape, broadcast_dimensions, **params):
    out_ndim = len(shape)
    matrix_axes = (out_ndim - 2, out_ndim - 1)
    if tuple(shape[-2:]) != tuple(x.shape[-2:]) or tuple(broadcast_dimensions[-2:]) != matrix_axes:
        return NotImplemented
    batch, rows, columns = _matrix_items(x, list(shape))
    lead = tuple(broadcast_dimensions[:-2])

    def broadcaster(sizes):
        dims = (*lead, *range(out_ndim - 2, out_ndim - 2 + len(sizes) - len(batch)))
        return lambda v: lax.broadcast_in_dim(v, sizes, dims)

    return _apply_items(x, broadcaster, _per_field(x, batch, rows, columns, x.rank))


_GATHER_MODES = (lax.GatherScatterMode.CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@quaxlike.register(lax.gather_p)
def gather_p_dora(x: DoraArray, indices: ArrayLike, *, dimension_numbers, slice_sizes, **params):
    # Whole matrices picked along the batch axes (`x[i]`, `x[ids]`, `jax.vmap`
    # of `x[i]`): the same gather applies to every array, the row vectors
    # included (their window is the rows').
    k = x.ndim - 2
    numbers = dimension_numbers
    mode = params.get("mode")
    if mode not in _GATHER_MODES:
        return NotImplemented
    out_ndim = len(numbers.offset_dims) + jnp.ndim(indices) - 1
    if (
        not _whole(x, list(slice_sizes))
        or any(d >= k for d in (*numbers.collapsed_slice_dims, *numbers.operand_batching_dims))
        or tuple(numbers.offset_dims[-2:]) != (out_ndim - 2, out_ndim - 1)
    ):
        return NotImplemented
    batch, rows, columns = _matrix_items(x, list(slice_sizes))
    w_sizes, a_sizes, b_sizes, r_sizes = _per_field(x, batch, rows, columns, x.rank)

    def gatherer(sizes, drop_last: bool):
        dims = numbers
        if drop_last:  # the row vectors have one offset axis fewer
            dims = dims._replace(offset_dims=tuple(numbers.offset_dims[:-1]))
        return lambda v: lax.gather_p.bind(
            v, indices, dimension_numbers=dims, slice_sizes=sizes, **params
        )

    return _fields(
        x,
        gatherer(w_sizes, False),
        gatherer(a_sizes, False),
        gatherer(b_sizes, False),
        gatherer(r_sizes, True),
    )


# --- elementwise: scaling, negation, dtype -----------------------------------


def _scale_magnitude(x: DoraArray, scale, op) -> DoraArray:
    # s ⊙ (m / n) (W + A B) = ((s m) / n) (W + A B): only the magnitude changes.
    return x._replaced(m=op(x.m, jnp.asarray(scale, x.m.dtype)))


@quaxlike.register(lax.mul_p)
def mul_p_dora_scalar(x: DoraArray, y: ArrayLike, **params):
    if jnp.ndim(y) != 0:
        return NotImplemented
    return _scale_magnitude(x, y, lax.mul)


@quaxlike.register(lax.div_p)
def div_p_dora_scalar(x: DoraArray, y: ArrayLike, **params):
    if jnp.ndim(y) != 0:
        return NotImplemented
    return _scale_magnitude(x, y, lax.div)


@quaxlike.register(lax.neg_p)
def neg_p_dora(x: DoraArray, **params):
    return x._replaced(m=lax.neg(x.m))


@quaxlike.register(lax.convert_element_type_p)
def convert_element_type_p_dora(x: DoraArray, *, new_dtype, **params):
    if not jnp.issubdtype(new_dtype, jnp.inexact):
        return NotImplemented  # rounding D is not rounding its parts
    convert = lambda v: lax.convert_element_type(v, new_dtype)  # noqa: E731
    out = _fields(x, convert, convert, convert, lambda v: v)
    return out._replaced(m=convert(x.m))  # ‖W‖² stays wide


@quaxlike.register(lax.copy_p)
def copy_p_dora(x: DoraArray, **params):
    return x


@quaxlike.register("stop_gradient")
def stop_gradient_p_dora(x: DoraArray, **params):
    stop = lax.stop_gradient
    return _fields(x, stop, stop, stop, stop)


@quaxlike.register(lax.select_n_p)
def select_n_p_dora(predicate: ArrayLike, *cases: ArrayLike | DoraArray):
    # A scalar predicate picks one case whole: pick each leaf of cases of one
    # structure. Plain cases cannot be held by a DoraArray (see `holding_plain`).
    if jnp.ndim(predicate) != 0 or not all(isinstance(c, DoraArray) for c in cases):
        return NotImplemented
    flat = [jax.tree_util.tree_flatten(c) for c in cases]
    treedef = flat[0][1]
    if any(t != treedef for _, t in flat):
        return NotImplemented
    picked = [lax.select_n(predicate, *parts) for parts in zip(*(ls for ls, _ in flat))]
    return jax.tree_util.tree_unflatten(treedef, picked)
