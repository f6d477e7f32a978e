"""Float8 casts with dynamic scales, and the scaled float8 matrix product, as
torchao's float8 training computes them (torchao/float8/float8_utils.py,
float8_training_tensor.py, float8_ops.py).

A tensor `x` is cast with a scale `s = fmax / max(amax, 1e-12)` (`fmax` the
largest finite value of the float8 type, `amax` the largest `|x|` over the whole
tensor or along some axes), optionally rounded down to a power of 2:
`x8 = saturate(float32(x) * s)` rounded to nearest even. It stands for `x8 / s`.
A product of two such casts is one `dot_general` on the float8 operands,
accumulating in `float32`, with `1 / (s_a s_b)` applied afterwards: scales along
the contracted axes only, so that they factor out of the sum."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array


E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
# torchao's float8_utils.EPS: the smallest amax a scale is computed from.
EPS = 1e-12


class Recipe(NamedTuple):
    """One of torchao's `Float8LinearConfig.from_recipe_name` recipes: whether
    scales are per row (`AXISWISE`) or per tensor, the float8 type of the
    gradient of the output (input and weight are always e4m3), and whether
    scales are rounded down to a power of 2."""

    rowwise: bool
    grad_dtype: np.dtype
    power_of_2: bool


RECIPES = {
    "tensorwise": Recipe(rowwise=False, grad_dtype=E5M2, power_of_2=False),
    "rowwise": Recipe(rowwise=True, grad_dtype=E4M3, power_of_2=True),
}


def round_down_to_power_of_2(scale: Array) -> Array:
    """`2 ** floor(log2(scale))` for a positive `float32` scale (torchao's
    `_round_scale_down_to_power_of_2`), exactly: the scale with its mantissa bits
    cleared. NaN stays NaN."""
    bits = lax.bitcast_convert_type(scale, jnp.uint32)
    pow2 = lax.bitcast_convert_type(bits & jnp.uint32(0xFF800000), jnp.float32)
    return jnp.where(jnp.isnan(scale), scale, pow2)


def amax_scale(x: Array, dtype: np.dtype, axes: tuple[int, ...] | None, power_of_2: bool) -> Array:
    """The `float32` scale that maps `amax(|x|)` (over `axes`, all axes for
    `None`, kept as axes of size 1) to the largest finite value of `dtype`."""
    axes = tuple(range(x.ndim)) if axes is None else axes
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True).astype(jnp.float32)
    fmax = jnp.float32(jnp.finfo(dtype).max)
    # torchao divides in float64 and rounds to float32; a float32 quotient of two
    # float32 numbers is that same correctly rounded value.
    scale = fmax / jnp.maximum(amax, jnp.float32(EPS))
    return round_down_to_power_of_2(scale) if power_of_2 else scale


def cast(
    x: Array, dtype: np.dtype, axes: tuple[int, ...] | None, power_of_2: bool
) -> tuple[Array, Array]:
    """`x` in float8 `dtype` and its scale (see the module's docstring); the
    scale has `x`'s rank, with size 1 along `axes`."""
    scale = amax_scale(x, dtype, axes, power_of_2)
    fmax = jnp.float32(jnp.finfo(dtype).max)
    scaled = jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax)
    return scaled.astype(dtype), scale


# --- whether the backend compiles a float8 dot_general -----------------------------

_FLOAT8_DOT: dict[str, bool] = {}


def float8_dot_compiles() -> bool:
    """Whether the default backend compiles a `dot_general` of `float8_e4m3fn`
    and `float8_e5m2` operands accumulating in `float32` (probed once per
    backend, by compiling a 16 x 16 product)."""
    backend = jax.default_backend()
    if backend not in _FLOAT8_DOT:
        operand = lambda dtype: jax.ShapeDtypeStruct((16, 16), dtype)  # noqa: E731
        dot = lambda a, b: lax.dot_general(  # noqa: E731
            a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        try:
            jax.jit(dot).lower(operand(E4M3), operand(E5M2)).compile()
            _FLOAT8_DOT[backend] = True
        except Exception:  # any failure to lower or compile: fall back
            _FLOAT8_DOT[backend] = False
    return _FLOAT8_DOT[backend]


# --- the scaled product, by labels ---------------------------------------------------


def _axes(labels: list, reduced: set) -> tuple[int, ...]:
    return tuple(i for i, label in enumerate(labels) if label in reduced)


def _layout(scale: Array, labels: list, reduced: set, target: list) -> Array:
    """A scale of an operand with `labels` (size 1 along `reduced`), laid out
    for a result with labels `target` (size 1 where it has no axis)."""
    kept = [label for label in labels if label not in reduced]
    scale = scale.reshape([scale.shape[labels.index(label)] for label in kept])
    order = sorted(range(len(kept)), key=lambda i: target.index(kept[i]))
    scale = jnp.transpose(scale, order) if order != sorted(order) else scale
    shape = [scale.shape[[kept[i] for i in order].index(t)] if t in kept else 1 for t in target]
    return scale.reshape(shape)


def scaled_product(
    a: Array,
    a_labels: list,
    a_dtype: np.dtype,
    b: Array,
    b_labels: list,
    b_dtype: np.dtype,
    out_labels: list,
    recipe: Recipe,
    out_dtype: np.dtype,
    float8_dot: bool,
) -> Array:
    """The product of `a` and `b` with one label per axis, laid out as
    `out_labels` say: labels shared and in `out_labels` are batch axes, the other
    shared labels are contracted. Each operand is cast to float8 with scales
    along its contracted axes (`recipe.rowwise`) or one scale per tensor (per
    index of the batch axes); one
    `dot_general` on the casts (`float8_dot`; else on them converted to
    `float32`), accumulating in `float32`; then the scales divided out and the
    result converted to `out_dtype`.
    """
    shared = [label for label in a_labels if label in b_labels]
    batch = [label for label in shared if label in out_labels]
    contract = [label for label in shared if label not in out_labels]
    # Row by row: scales along the contracted axes. Per tensor: one scale per
    # index of the batch axes (a stack of weights is a stack of tensors).
    a_reduced = set(contract) if recipe.rowwise else set(a_labels) - set(batch)
    b_reduced = set(contract) if recipe.rowwise else set(b_labels) - set(batch)
    a8, a_scale = cast(a, a_dtype, _axes(a_labels, a_reduced), recipe.power_of_2)
    b8, b_scale = cast(b, b_dtype, _axes(b_labels, b_reduced), recipe.power_of_2)
    if not float8_dot:
        a8, b8 = a8.astype(jnp.float32), b8.astype(jnp.float32)
    dimension_numbers = (
        (tuple(a_labels.index(c) for c in contract), tuple(b_labels.index(c) for c in contract)),
        (tuple(a_labels.index(c) for c in batch), tuple(b_labels.index(c) for c in batch)),
    )
    out = lax.dot_general(
        a8,
        b8,
        dimension_numbers,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    labels = (
        batch
        + [label for label in a_labels if label not in shared]
        + [label for label in b_labels if label not in shared]
    )
    inverse = 1 / _layout(a_scale, a_labels, a_reduced, labels)
    inverse = inverse * (1 / _layout(b_scale, b_labels, b_reduced, labels))
    out = out * inverse
    permutation = tuple(labels.index(label) for label in out_labels)
    if permutation != tuple(range(len(permutation))):
        out = lax.transpose(out, permutation)
    return out.astype(out_dtype)
