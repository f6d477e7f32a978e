"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM
Compression and Acceleration", 2023), onto the grids of the existing quantised
types, and `InputScaled`, the Value that holds its result.

AWQ scales each input channel of a weight by `s = mean|x|^α` before rounding
(`W diag(s)`, so that the channels that carry large activations lose less to
rounding) and divides the input by `s` again: the layer computes
`Q(W diag(s)) (x / s)`. `α` is chosen on a grid of `grid` points in `[0, 1)`
to minimise the layer's output error on the calibration inputs,
`‖(W - Q(W diag(s)) diag(s)⁻¹) X‖²`, computed exactly from their Gram matrix
(`α = 0` is round-to-nearest, so AWQ never does worse than it there).

The paper folds `1/s` into the operation before the layer (a layer norm's
scale, the previous linear layer's rows) where the model has one. A weight
taken alone has none, so `quantize` keeps `s` beside the quantised weight, as
the per-input-channel `scale` of an `InputScaled`, whose matrix products divide
the other operand by it (or the product, where the weight's input axis is not
contracted, as in a backward pass) and multiply with the quantised weight,
which stays an `Int8Array`, `Int4Array` or `NF4Array` of the usual layout.
"""

import dataclasses
import functools as ft
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike

import quaxlike
from quaxlike.internal import (
    bind_dot_general,
    dot_general_labels,
    follow_axes,
    logical_entries,
    materialise_value,
    ShapedArray,
    with_leaf_specs,
)

from ._rounding import fake_quantize, Grid, layer_error


_BAD_GRID_MSG = (
    "`AWQ`: `grid` (how many values of alpha to try) must be a positive int; got {got!r}."
)


@dataclasses.dataclass(frozen=True)
class AWQ:
    """AWQ's options, for `quantize(model, method=AWQ(...), calibration=...)`
    (`method="awq"` takes the defaults).

    **Arguments:**

    - `grid`: how many exponents `α = k / grid`, `k = 0 .. grid - 1`, to try
        (20 in the paper).

    !!! example

        ```python
        linear = eqx.nn.Linear(64, 8, key=jr.key(0))
        x = jr.normal(jr.key(1), (256, 64)) * jnp.linspace(0.1, 3.0, 64)
        q = quantize(linear, bits=4, method=AWQ(grid=10), calibration=[x])
        assert isinstance(q.weight, InputScaled)  # an Int4Array and the input scales
        y = quaxlike.quaxify(q)(x[0])
        ```
    """

    grid: int = 20

    def __post_init__(self):
        if isinstance(self.grid, bool) or not isinstance(self.grid, int) or self.grid < 1:
            raise ValueError(_BAD_GRID_MSG.format(got=self.grid))


class InputScaled(quaxlike.ArrayValue):
    """A weight `base / scale[..., None, :]`: a quantised weight whose input
    channels were multiplied by `scale` before rounding (AWQ), so that dividing
    them by it again gives back the weight.

    Matrix products multiply with `base` as it is (quantised, never dense) and
    divide the other operand by `scale` along the axis it shares with the
    weight's input axis (or, where that axis is not contracted, the product
    along it). Other primitives materialise, which a quantised `base` refuses
    unless it allows it.

    **Arguments:**

    - `base`: the weight with scaled input channels, `(*batch, out, in)`: an
        `Int8Array`, `Int4Array` or `NF4Array` (any array or Value works).
    - `scale`: the per-input-channel scales, `(*batch, in)`, floating point.
    - `transposed`: whether `base` (and so the array) is the weight with its last
        two axes swapped, `(*batch, in, out)`, as `weight.T` gives it.

    !!! example

        ```python
        w = jr.normal(jr.key(0), (4, 64))
        s = jnp.linspace(0.5, 2.0, 64)
        q = InputScaled(quantize_int4(w * s), s)
        y = quaxlike.quaxify(lambda w, x: w @ x)(q, jnp.ones(64))  # ~ w @ ones
        ```
    """

    base: Any
    scale: Array
    transposed: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        shape = tuple(self.base.shape)
        size = shape[-2] if self.transposed else shape[-1]
        if len(shape) < 2 or tuple(self.scale.shape) != (*shape[:-2], size):
            raise ValueError(
                "InputScaled: `scale` must have the shape `(*batch, in)` of a `base` "
                f"`(*batch, out, in)`; got {tuple(self.scale.shape)} for {shape}."
            )

    def aval(self) -> ShapedArray:
        return ShapedArray(tuple(self.base.shape), self.base.dtype)

    def _divided(self, dense: Array) -> Array:
        scale = self.scale[..., :, None] if self.transposed else self.scale[..., None, :]
        return dense / scale.astype(dense.dtype)

    def materialise(self) -> Array:
        base = self.base
        dense = materialise_value(base) if isinstance(base, quaxlike.Value) else base
        return self._divided(dense)

    def logical_leaf_specs(self, spec: Any) -> "InputScaled":
        """How `base` and `scale` follow a sharding of the weight (see
        `quaxlike.leaf_specs`): `base`, which has the weight's shape, as its own
        type declares (a quantised base splits its codes and scales by rows and
        whole groups of columns), and `scale` along the batch axes and the input
        axis (the last, or the second last when `transposed`).

        **Arguments:**

        - `spec`: a `PartitionSpec` of the weight.

        **Returns:**

        This value with the specs of its leaves in place of them.
        """
        ndim = len(self.base.shape)
        entries = logical_entries(spec, ndim)
        inputs = ndim - 2 if self.transposed else ndim - 1
        return with_leaf_specs(
            self,
            base=quaxlike.leaf_specs(self.base, spec),
            scale=follow_axes(entries, [*range(ndim - 2), inputs]),
        )

    def dequantize(self) -> Array:
        """The dense weight `base.dequantize() / scale`, built on purpose."""
        base = self.base
        return self._divided(base.dequantize() if hasattr(base, "dequantize") else base)


def _spread(scale: Array, scale_labels: list, labels: list, shape: tuple) -> Array:
    """`scale` (one label per axis) laid out along the axes of an array with
    `labels` and `shape`, size 1 on the others, for broadcasting."""
    order = sorted(range(len(scale_labels)), key=lambda k: labels.index(scale_labels[k]))
    moved = jnp.transpose(scale, order)
    return moved.reshape([n if label in scale_labels else 1 for label, n in zip(labels, shape)])


def _scaled_product(w: InputScaled, other, w_on_left: bool, dimension_numbers, params):
    ndim_w, ndim_o = w.ndim, jnp.ndim(other)
    if w_on_left:
        w_labels, o_labels, out_labels = dot_general_labels(dimension_numbers, ndim_w, ndim_o)
    else:
        o_labels, w_labels, out_labels = dot_general_labels(dimension_numbers, ndim_o, ndim_w)
    input_label = w_labels[-2] if w.transposed else w_labels[-1]
    scale_labels = [*w_labels[:-2], input_label]
    divide_other = input_label in o_labels  # the input axis is contracted
    where = o_labels if divide_other else out_labels
    if not all(label in where for label in scale_labels):
        return NotImplemented  # a layer axis of the weight is contracted: materialise

    def product(base, scale, other):
        if divide_other:
            spread = _spread(scale, scale_labels, where, jnp.shape(other))
            other = other / spread.astype(other.dtype)
        lhs, rhs = (base, other) if w_on_left else (other, base)
        out = bind_dot_general(lhs, rhs, dimension_numbers, params)
        if divide_other:
            return out
        # Otherwise the product keeps the input axis: divide it there.
        return out / _spread(scale, scale_labels, where, out.shape).astype(out.dtype)

    return quaxlike.quaxify(product)(w.base, w.scale, other)


@quaxlike.register(lax.transpose_p)
def transpose_p_inputscaled(x: InputScaled, *, permutation, **params):
    k = x.ndim - 2
    if tuple(permutation[:k]) != tuple(range(k)):
        return NotImplemented  # moving a layer axis: materialise
    if tuple(permutation[k:]) == (k, k + 1):
        return x
    base = quaxlike.quaxify(lambda b: jnp.swapaxes(b, -1, -2))(x.base)
    return InputScaled(base, x.scale, not x.transposed)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_inputscaled_any(
    lhs: InputScaled, rhs: ArrayLike | quaxlike.ArrayValue, *, dimension_numbers, **params
):
    return _scaled_product(lhs, rhs, True, dimension_numbers, params)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_any_inputscaled(
    lhs: ArrayLike | quaxlike.ArrayValue, rhs: InputScaled, *, dimension_numbers, **params
):
    return _scaled_product(rhs, lhs, False, dimension_numbers, params)


# --- the search for alpha ---------------------------------------------------------


def _scales(mean_abs: Array, alpha: Array) -> Array:
    s = jnp.maximum(mean_abs**alpha, 1e-4)
    # Normalised as in the paper's code: only the ratios between channels matter.
    return s / jnp.sqrt(jnp.max(s) * jnp.min(s))


@ft.partial(jax.jit, static_argnames=("grid", "points"))
def _search(w, gram, mean_abs, *, grid: Grid, points: int):
    """The errors of every `α` on the grid, and the scales of the best."""
    w32 = w.astype(jnp.float32)

    def error(alpha):
        s = _scales(mean_abs, alpha)
        w_hat = fake_quantize(grid, (w32 * s).astype(w.dtype)).astype(jnp.float32) / s
        return layer_error(w32, w_hat, gram)

    alphas = jnp.arange(points, dtype=jnp.float32) / points
    errors = lax.map(error, alphas)
    best = jnp.argmin(errors)
    return errors, _scales(mean_abs, alphas[best])


def awq_scales(
    grid: Grid, w: Array, gram: Array, mean_abs: Array, options: AWQ
) -> tuple[Array, Array]:
    """AWQ's per-input-channel scales `(*batch, in)` for a weight `w` `(*batch,
    out, in)` with calibration statistics `gram` `(*batch, in, in)` and `mean_abs`
    `(*batch, in)`, and the output error of every `α` tried `(*batch, grid)`.

    **Arguments:**

    - `grid`: the grid the weight will be rounded onto.
    - `w`, `gram`, `mean_abs`: the weight and its statistics.
    - `options`: the `AWQ` options.

    **Returns:**

    The scales (`float32`), and the errors.
    """
    *batch, out, size = w.shape
    search = ft.partial(_search, grid=grid, points=options.grid)
    if not batch:
        errors, scales = search(w, gram, mean_abs)
        return scales, errors
    flat = (w.reshape(-1, out, size), gram.reshape(-1, size, size), mean_abs.reshape(-1, size))
    errors, scales = jax.vmap(search)(*flat)
    return scales.reshape(*batch, size), errors.reshape(*batch, -1)
