"""Int8 dynamic activations times int8 weights (W8A8), as torchao's
`Int8DynamicActivationInt8WeightConfig` computes it: `W8A8Array`, its
constructor `quantize_w8a8`, and its matrix-product rules.

A `W8A8Array` is an `Int8Array` (codes per output channel) whose matrix
products quantise the other operand too, per token: each vector of the other
operand along the axis it contracts with the weight's input axis gets its own
scale, `absmax / 127.5`, and codes `clamp(round(x * (1 / scale)), -128, 127)`.
The codes meet in one `int8 x int8` `dot_general` accumulating in `int32`,
which is then scaled by both scales. Every other rule of `Int8Array`
(transposes, indexing, scaling, `stop_gradient`, logical sharding) applies
unchanged, so a `W8A8Array` stays one where an `Int8Array` stays quantised.

Derivatives: rounding has no useful derivative, so the activations'
quantisation is differentiated as the identity (the straight-through
estimator): the product's tangent along the other operand is its product with
the dequantised weight, `dx @ W.T`, and along the weight's scales the exact
derivative of the quantised product. This is the derivative of the plain-JAX
computation `(x + stop_gradient(fq(x) - x)) @ W.T`, `fq` the activations'
quantise-dequantise; tests compare with it. A product that does not contract
the weight's input axis (the transposed product `g @ W` a backward pass takes)
has no activation to quantise and is the weight-only product.

Inside `quaxify`, a `jax.jvp` (or `jax.linearize`, `jax.jacfwd`) taken there
meets the weight through JAX's own rule for `dot_general`, which is bilinear:
the tangent is the product of the tangent `dx` with the weight, and that
product is evaluated as every product with a `W8A8Array` is, with `dx`
quantised per token. So the tangent is `fq(dx) @ W.T`: the straight-through
tangent evaluated at int8 precision, as `precision=` lowers the precision of a
`dot_general` and of its tangent product alike (tested: exactly the int8
product of `dx`, and within half a code step per token of `dx @ W.T`, which the
same `jvp` outside `quaxify` gives). Reverse mode inside `quaxify` meets the
weight in the transposed product `g @ W`, weight-only, so `jax.grad` gives the
straight-through gradient wherever it is taken.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike

import quaxlike
from quaxlike.internal import dot_general_labels, output_aval

from ..selection import replace_selected
from ._base import as_float_matrix, check_block_bytes, DEFAULT_BLOCK_BYTES
from ._matmul import _quantized_dot
from ._value import default_where, Int8Array


# torchao's symmetric int8 mapping: the full range [-128, 127], the scale
# absmax / ((127 - (-128)) / 2), never below float32's eps (for every input dtype).
_QMIN, _QMAX = -128, 127
_HALF_RANGE = (_QMAX - _QMIN) / 2
_EPS = float(jnp.finfo(jnp.float32).eps)

_ACTIVATIONS_MSG = (
    "`quantize`: {what}. `activations=8` quantises each matrix product's input to "
    "int8 per token, against `bits=8` weights rounded to nearest (a `W8A8Array`, "
    "as torchao's `Int8DynamicActivationInt8WeightConfig`); no other combination "
    "has a type here. Leave `activations` out to quantise the weights only (any "
    '`bits` or `method`), or give it with `bits=8` and `method="rtn"`.'
)
_NOT_FLOAT_MSG = (
    "W8A8Array: a matrix product quantises the other operand to int8 per token, "
    "which needs a floating-point operand; got {dtype}. Cast it to a float dtype, "
    "or `dequantize` the weight for a product of integers."
)


def quantize_rows_int8(x: ArrayLike, axis: int = -1) -> tuple[Array, Array]:
    """Symmetric int8 codes of `x`, one scale per vector along `axis`, with
    torchao's arithmetic (`choose_qparams_affine` and `quantize_affine` of
    `Int8Tensor.from_hp`, `MappingType.SYMMETRIC`).

    The scale is `max(|v|) / 127.5`, computed in `x`'s dtype, at least float32's
    eps, then converted to `float32`; the codes are
    `clamp(round(v * (1 / scale)), -128, 127)` in `float32`, rounding half to
    even.

    **Arguments:**

    - `x`: a floating-point array.
    - `axis`: the axis each scale covers (the inputs of a row).

    **Returns:**

    `(codes, scale)`: `int8` codes of `x`'s shape, and `float32` scales of its
    shape without `axis`.

    !!! example

        ```python
        codes, scale = quantize_rows_int8(jnp.array([[1.0, -0.5], [0.0, 0.0]]))
        codes  # int8 [[127, -64], [0, 0]]; scale [1 / 127.5, eps]
        ```
    """
    x = jnp.asarray(x)
    absmax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    # A true division, as torch's: XLA turns a division by a constant or by a
    # broadcast (a scalar, or an array that `vmap` leaves unbatched) into a
    # product with its reciprocal, which is off by an ulp for some inputs (and
    # then so are some codes). A divisor computed from `absmax`, behind a
    # barrier, is an array of its shape that XLA cannot see into.
    divisor = lax.optimization_barrier(absmax * 0) + jnp.asarray(_HALF_RANGE, x.dtype)
    scale = jnp.maximum(absmax / divisor, jnp.asarray(_EPS, x.dtype))
    scale = scale.astype(jnp.float32)
    codes = jnp.round(x.astype(jnp.float32) * (1.0 / scale))
    codes = jnp.clip(codes, _QMIN, _QMAX).astype(jnp.int8)
    return codes, jnp.squeeze(scale, axis)


class W8A8Array(Int8Array):
    """An `Int8Array` whose matrix products quantise the other operand to `int8`
    per token and multiply the codes in integers (W8A8, torchao's
    `Int8DynamicActivationInt8WeightConfig`).

    The weight is stored as an `Int8Array` is: codes `(*batch, out, in)` and one
    scale per output channel. In a product `x @ w.T` (any `dot_general` that
    contracts the weight's input axis with a floating-point operand), each
    vector of `x` along that axis is quantised with its own scale
    (`quantize_rows_int8`), the codes are multiplied as `int8 x int8 -> int32`,
    and the result is scaled by the activation scales (then cast to `x`'s
    dtype, as torchao does) and by the weight's scales. No dense weight is built.

    Products that do not contract the weight's input axis (the transposed
    product of a backward pass) are the weight-only products of `Int8Array`.
    Derivatives pass the activations' quantisation straight through (see the
    module docstring); the codes carry none, the scales their exact ones.

    **Arguments:**

    As for `Int8Array`: `values` (`int8`, any codes in `[-128, 127]`), `scale`
    `(*batch, out)`, `transposed`, `allow_materialise`, `block_bytes` and
    `matmul` (these two for the weight-only products). Build one with
    `quantize_w8a8`, or `quantize(model, bits=8, activations=8)`.

    !!! example

        ```python
        w = quantize_w8a8(jr.normal(jr.key(0), (4, 8)))
        x = jr.normal(jr.key(1), (3, 8))
        y = quaxlike.quaxify(lambda w, x: x @ w.T)(w, x)  # int8 x int8 -> int32
        assert jnp.allclose(y, x @ w.dequantize().T, atol=0.05)
        ```
    """

    def __check_init__(self):
        if self.values.dtype != jnp.int8:
            raise ValueError(f"W8A8Array: `values` must be int8; got {self.values.dtype}.")

    def int8_weight(self) -> Int8Array:
        """The same weight as a weight-only `Int8Array` (products in floating point)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Int8Array(**fields)


@jax.jit
def _quantize_w8a8_arrays(w: Array) -> tuple[Array, Array]:
    codes, scale = quantize_rows_int8(w, axis=-1)
    # torchao computes the scale in the weight's dtype: kept there, it is exact.
    return codes, scale.astype(w.dtype)


def quantize_w8a8(
    w: ArrayLike,
    *,
    allow_materialise: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    matmul: str | None = None,
) -> W8A8Array:
    """Quantise a dense weight for int8 dynamic activations: `int8` codes per
    output channel, as torchao's `Int8DynamicActivationInt8WeightConfig` makes
    them (`quantize_rows_int8` over each row).

    **Arguments:**

    - `w`: a floating-point weight `(*batch, out, in)`, as an `eqx.nn.Linear`'s.
    - `allow_materialise`, `block_bytes`, `matmul`: as for `Int8Array`.

    **Returns:**

    A `W8A8Array` whose scales have `w`'s dtype.

    !!! example

        ```python
        w = quantize_w8a8(jnp.array([[1.0, -0.5], [0.25, 2.0]]))
        w.values  # int8 [[127, -64], [16, 127]]: absmax / 127.5, halves to even
        ```
    """
    w = as_float_matrix(w, "quantize_w8a8")
    check_block_bytes(block_bytes, "quantize_w8a8")
    values, scale = _quantize_w8a8_arrays(w)
    return W8A8Array(
        values=values,
        scale=scale,
        allow_materialise=allow_materialise,
        block_bytes=block_bytes,
        matmul=matmul,
    )


def quantize_activations_model(
    model: Any,
    bits: Any,
    activations: Any,
    method: Any,
    calibration: Any,
    run: Any,
    where: Any,
    options: dict,
) -> Any:
    """`quantize(model, bits=8, activations=8, ...)`: each selected weight a
    `W8A8Array`, or an error that says which combination is refused."""
    if activations != 8 or isinstance(activations, bool):
        what = f"`activations={activations!r}` is not a width quaxlike has (only 8)"
        raise ValueError(_ACTIVATIONS_MSG.format(what=what))
    if bits != 8:
        what = f"`activations=8` takes `bits=8` weights; got `bits={bits!r}`"
        raise ValueError(_ACTIVATIONS_MSG.format(what=what))
    if method != "rtn" or calibration is not None or run is not None:
        what = "`activations=8` takes weights rounded to nearest; got " + (
            f"`method={method!r}`" if method != "rtn" else "calibration (`calibration`, `run`)"
        )
        raise ValueError(_ACTIVATIONS_MSG.format(what=what))
    if where is None:
        where = default_where(model)
    return replace_selected(model, where, lambda w: quantize_w8a8(w, **options), "quantize")


# --- the product -------------------------------------------------------------------


def _spread(x: Array, x_labels: list, labels: list) -> Array:
    """`x` (one label per axis, each in `labels`) laid out along the axes of an
    array with `labels`, size 1 on the others, for broadcasting."""
    order = sorted(range(len(x_labels)), key=lambda k: labels.index(x_labels[k]))
    moved = jnp.transpose(x, order)
    shape = dict(zip(x_labels, x.shape))
    return moved.reshape([shape.get(label, 1) for label in labels])


def _w8a8_dot(w: W8A8Array, other, dimension_numbers, params: dict, w_is_lhs: bool):
    ndim_o = jnp.ndim(other)
    if w_is_lhs:
        w_labels, o_labels, out_labels = dot_general_labels(dimension_numbers, w.ndim, ndim_o)
    else:
        o_labels, w_labels, out_labels = dot_general_labels(dimension_numbers, ndim_o, w.ndim)
    input_label = w_labels[-2] if w.transposed else w_labels[-1]
    contracted = [label for label in w_labels if label not in out_labels]
    if input_label not in contracted:
        # No activation meets the weight's inputs (a backward pass's `g @ W`):
        # the weight-only product.
        return _quantized_dot(w, other, dimension_numbers, params, q_is_lhs=w_is_lhs)
    if contracted != [input_label]:
        return NotImplemented  # a layer axis contracted too: no per-token meaning
    if not jnp.issubdtype(jnp.result_type(other), jnp.floating):
        raise TypeError(_NOT_FLOAT_MSG.format(dtype=jnp.result_type(other)))
    out_dtype = output_aval(
        lax.dot_general_p,
        (w, other) if w_is_lhs else (other, w),
        {"dimension_numbers": dimension_numbers, **params},
    ).dtype
    token_axis = o_labels.index(input_label)
    token_labels = [label for label in o_labels if label != input_label]
    scale_labels = [label for label in w_labels if label != input_label]
    # The functions below are kept in the program (as the custom derivative's),
    # so they close over static fields only, never over `w`'s arrays.
    transposed = w.transposed
    statics = {
        f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.metadata.get("static")
    }

    def accumulate(other, values):
        codes, x_scale = quantize_rows_int8(other, axis=token_axis)
        stored = jnp.swapaxes(values, -1, -2) if transposed else values
        lhs, rhs = (stored, codes) if w_is_lhs else (codes, stored)
        acc = lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.int32)
        # torchao: the int32 sums times the activation scales (float32), cast to
        # the activations' dtype.
        partial = acc.astype(jnp.float32) * _spread(x_scale, token_labels, out_labels)
        return partial.astype(jnp.result_type(other)).astype(jnp.float32)

    def scaled(partial, w_scale):
        w_scale = _spread(w_scale.astype(jnp.float32), scale_labels, out_labels)
        return (partial * w_scale).astype(out_dtype)

    @jax.custom_jvp
    def product(other, w_scale, values):
        return scaled(accumulate(other, values), w_scale)

    def product_jvp(primals, tangents):
        other, w_scale, values = primals
        d_other, d_scale, _ = tangents
        partial = accumulate(other, values)
        out = scaled(partial, w_scale)
        tangent = jnp.zeros(out.shape, out.dtype)
        if not _symbolic_zero(d_other):
            # Straight through the activations' quantisation: `dx` times the
            # dequantised weight, block by block as a weight-only product.
            held = Int8Array(values=values, scale=w_scale, **statics)
            dense = _quantized_dot(held, d_other, dimension_numbers, params, q_is_lhs=w_is_lhs)
            tangent = tangent + dense.astype(out.dtype)
        if not _symbolic_zero(d_scale):
            tangent = tangent + scaled(partial, d_scale)
        return out, tangent

    product.defjvp(product_jvp, symbolic_zeros=True)
    return product(other, w.scale, w.values)


def _symbolic_zero(t: Any) -> bool:
    return isinstance(t, jax.custom_derivatives.SymbolicZero)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_w8a8_dense(x: W8A8Array, y: ArrayLike, *, dimension_numbers, **params):
    return _w8a8_dot(x, y, dimension_numbers, params, w_is_lhs=True)


@quaxlike.register(lax.dot_general_p)
def dot_general_p_dense_w8a8(x: ArrayLike, y: W8A8Array, *, dimension_numbers, **params):
    return _w8a8_dot(y, x, dimension_numbers, params, w_is_lhs=False)
