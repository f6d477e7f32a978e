"""Gathers from a `LoraArray` that pick rows, columns or elements of its matrices.

`W[ids]` (token ids into a LoRA'd embedding table), `jax.vmap` of `W[i]`,
`jnp.take(W, ids, axis=1)`, `jnp.take_along_axis` and `W[rows, cols]` all become a
`gather` whose windows cut across the matrix axes. The result is dense, and is
computed as `W[ids] + A[ids] @ B` (columns: `W[:, ids] + A @ B[:, ids]`; elements:
both factors gathered): each window of `A @ B` is the product of the matching
window of rows of `A` and of columns of `B`, and `W + A @ B` is never formed.

(`_rules.py` keeps the gathers that take whole matrices along the batch axes, whose
result is another `LoraArray`; the rule here runs for every other gather.)
"""

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import cached_rule, contract_labelled

from ._value import LoraArray


class _Factor(NamedTuple):
    """How to cut the windows of one factor out of the gather's description."""

    rank_axis: int  # the axis of the factor that holds the rank (n for A, m for B)
    components: tuple[int, ...]  # which index components it needs (empty: a static slice)


def _factor(rank_axis, shape, dimension_numbers, slice_sizes, fill) -> _Factor:
    # An index component along an axis the window spans whole only ever starts at
    # 0 once clamped, so a factor needs none of those, except in FILL_OR_DROP mode,
    # where any start but 0 drops the window.
    components = tuple(
        c
        for c, axis in enumerate(dimension_numbers.start_index_map)
        if axis != rank_axis and (fill or slice_sizes[axis] < shape[axis])
    )
    return _Factor(rank_axis, components)


class _Layout(NamedTuple):
    """Labels for the gather's output: one per output dimension (its position), and
    where each index batch dimension and each operand offset axis lands."""

    out_ndim: int
    index_labels: tuple[int, ...]  # for each index batch dimension
    offset_labels: dict[int, int]  # operand axis -> output position
    rank_label: int


def _layout(ndim: int, index_ndim: int, dimension_numbers) -> _Layout:
    numbers = dimension_numbers
    out_ndim = len(numbers.offset_dims) + index_ndim - 1
    index_labels = tuple(p for p in range(out_ndim) if p not in numbers.offset_dims)
    skipped = set(numbers.collapsed_slice_dims) | set(numbers.operand_batching_dims)
    offset_axes = [axis for axis in range(ndim) if axis not in skipped]
    return _Layout(out_ndim, index_labels, dict(zip(offset_axes, numbers.offset_dims)), out_ndim)


def _gathered_factor(
    f, factor: _Factor, indices, dimension_numbers, slice_sizes, mode, fill, layout
):
    """The windows of factor `f` (rank along `factor.rank_axis`) and their labels."""
    numbers = dimension_numbers
    shape = jnp.shape(f)
    rank = shape[factor.rank_axis]
    pairs = [
        (axis, index_dim)
        for axis, index_dim in zip(
            numbers.operand_batching_dims, numbers.start_indices_batching_dims
        )
        if axis != factor.rank_axis
    ]
    collapsed = [axis for axis in numbers.collapsed_slice_dims if axis != factor.rank_axis]
    batching = {axis: index_dim for axis, index_dim in pairs}
    kept_axes = [axis for axis in range(len(shape)) if axis not in collapsed]

    def label(axis):
        if axis == factor.rank_axis:
            return layout.rank_label
        if axis in batching:
            return layout.index_labels[batching[axis]]
        return layout.offset_labels[axis]

    if not factor.components:
        # The factor's windows do not depend on the indices: one static slice (the
        # batching axes kept whole, each labelled as its index dimension).
        limits = [
            rank if axis == factor.rank_axis else shape[axis] if axis in batching else size
            for axis, size in enumerate(slice_sizes)
        ]
        window = f if tuple(limits) == shape else lax.slice(f, (0,) * len(shape), limits)
        if collapsed:
            window = lax.squeeze(window, collapsed)
        return window, [label(axis) for axis in kept_axes]

    index_ndim = jnp.ndim(indices)
    if factor.components != tuple(range(jnp.shape(indices)[-1])):
        indices = lax.concatenate(
            [lax.slice_in_dim(indices, c, c + 1, axis=index_ndim - 1) for c in factor.components],
            index_ndim - 1,
        )
    offset_axes = [axis for axis in kept_axes if axis not in batching]
    n_batch = index_ndim - 1
    sizes = list(slice_sizes)
    sizes[factor.rank_axis] = rank
    windows = lax.gather(
        f,
        indices,
        lax.GatherDimensionNumbers(
            offset_dims=tuple(range(n_batch, n_batch + len(offset_axes))),
            collapsed_slice_dims=tuple(collapsed),
            start_index_map=tuple(numbers.start_index_map[c] for c in factor.components),
            operand_batching_dims=tuple(axis for axis, _ in pairs),
            start_indices_batching_dims=tuple(index_dim for _, index_dim in pairs),
        ),
        tuple(sizes),
        mode=mode,
        # Dropped windows of a factor are zero, so the product adds nothing to
        # the fill value of `W`'s dropped windows.
        fill_value=0 if fill else None,
    )
    return windows, [*layout.index_labels, *map(label, offset_axes)]


@cached_rule
def _gather_through_factors(x: LoraArray, indices, *, dimension_numbers, slice_sizes, **params):
    *_, m, n = range(x.ndim)
    fill = lax.GatherScatterMode.from_any(params["mode"]) == lax.GatherScatterMode.FILL_OR_DROP
    layout = _layout(x.ndim, jnp.ndim(indices), dimension_numbers)
    factors = [_factor(axis, x.shape, dimension_numbers, slice_sizes, fill) for axis in (n, m)]

    def gather(w, a, b, indices):
        base = lax.gather_p.bind(
            w, indices, dimension_numbers=dimension_numbers, slice_sizes=slice_sizes, **params
        )
        (ga, a_labels), (gb, b_labels) = (
            _gathered_factor(
                f, factor, indices, dimension_numbers, slice_sizes, params["mode"], fill, layout
            )
            for f, factor in zip((a, b), factors)
        )
        out_labels = list(range(layout.out_ndim))
        low, labels = contract_labelled(ga, a_labels, gb, b_labels, set(out_labels), {})
        # Labels in output order, then broadcast over any output dimension that
        # neither factor depends on.
        order = sorted(range(len(labels)), key=lambda i: labels[i])
        if order != list(range(len(labels))):
            low = lax.transpose(low, order)
        if len(labels) < layout.out_ndim:
            low = lax.broadcast_in_dim(low, jnp.shape(base), tuple(sorted(labels)))
        return lax.add(base, low.astype(base.dtype))

    return quaxlike.quaxify(gather)(x.frozen_weight(), x.a, x.b, indices)


@quaxlike.register(lax.gather_p, precedence=-1)
def gather_p_lora_any(
    x: LoraArray, indices: ArrayLike, *, dimension_numbers, slice_sizes, **params
):
    # After `gather_p_lora` (precedence 0), which keeps whole-matrix gathers a
    # LoraArray: here the windows cut across the matrix axes.
    try:
        lax.GatherScatterMode.from_any(params.get("mode"))
    except (ValueError, TypeError):
        return NotImplemented  # a mode this rule does not know
    return _gather_through_factors(
        x, indices, dimension_numbers=dimension_numbers, slice_sizes=slice_sizes, **params
    )
