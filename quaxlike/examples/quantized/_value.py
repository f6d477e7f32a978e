"""The quantised array types, their constructors, and `quantize` for whole models."""

import abc
import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, ArrayLike, Float, Int8, PyTree, UInt8

import quaxlike
from quaxlike.internal import ShapedArray


_REFUSE_MSG = (
    "Refusing to materialise an {type_name} of shape {shape}: that builds the whole "
    "dense weight, which is what quantising it was meant to avoid. Call "
    "`.dequantize()` to get the dense weight on purpose, or create the array with "
    "`allow_materialise=True` to let primitives that have no {type_name} rule fall "
    "back to the dense weight."
)
_NOT_A_FLOAT_MATRIX_MSG = (
    "`{function}` quantises a floating-point array with at least two dimensions "
    "`(*batch, out, in)` (the layout of an `eqx.nn.Linear` weight); got {got}."
)
_BAD_GROUP_MSG = (
    "`quantize_int4`: `group_size={group_size}` must be even (two 4-bit values share "
    "a byte) and divide the input dimension {size} of the weight of shape {shape}. "
    "Pick a group size that divides {size}, or leave this weight out with `where=`."
)
_BAD_BITS_MSG = "`quantize`: `bits` must be 8 or 4; got {bits!r}."

# Symmetric ranges: int8 codes lie in [-127, 127], int4 codes in [-7, 7].
_INT8_MAX = 127
_INT4_MAX = 7
# int4 codes are stored offset by 8, as unsigned nibbles in [1, 15].
_INT4_OFFSET = 8


def _absmax_scale(w: Array, axis: int, code_max: int) -> Array:
    absmax = jnp.max(jnp.abs(w), axis=axis)
    # An all-zero row or group has any positive scale; 1 avoids dividing by zero.
    return jnp.where(absmax > 0, absmax / code_max, jnp.ones_like(absmax))


def _as_float_matrix(w: ArrayLike, function: str) -> Array:
    w = jnp.asarray(w)
    if w.ndim < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        got = f"dtype {w.dtype} and shape {w.shape}"
        raise ValueError(_NOT_A_FLOAT_MATRIX_MSG.format(function=function, got=got))
    return w


def _dequantize_stored(ints: Array, scale: Array, group_size: int | None) -> Array:
    """The dense weight in stored layout `(*batch, out, in)`."""
    weights = ints.astype(scale.dtype)
    if group_size is None:
        return weights * scale[..., None]
    *batch, out, size = ints.shape
    grouped = weights.reshape(*batch, out, size // group_size, group_size)
    return (grouped * scale[..., None]).reshape(ints.shape)


class QuantizedArray(quaxlike.ArrayValue):
    """Base class of the quantised weights `Int8Array` and `Int4Array`.

    A quantised array stores integer codes `q` of shape `(*batch, out, in)` and
    floating-point scales; it stands for `q * scale` (the dequantised weight), with
    one scale per output row (`Int8Array`) or per group of `group_size` consecutive
    inputs of a row (`Int4Array`). Its dtype is the dtype of the scales.

    Matrix products with a dense array (`weight @ x`, `x @ weight.T`, batched and
    vmapped forms) multiply by the integer codes and apply the scales to the
    output, or to the other operand, so the dense weight is never built. Transposing
    the last two dimensions, converting to another floating dtype, negating, and
    multiplying or dividing by a scalar stay quantised too. Any other primitive materialises the
    dense weight, which by default raises an error instead (see
    `allow_materialise`).

    All of `QuantizedArray`'s subclasses share the field `transposed` (static):
    when true, the array stands for the stored weight with its last two dimensions
    swapped, as `weight.T` gives.

    **Arguments:**

    None of its own: it is abstract. Build an `Int8Array` or `Int4Array`, usually
    with `quantize_int8`, `quantize_int4` or `quantize`.

    !!! example

        ```python
        w = jr.normal(jr.key(0), (4, 8))
        for q in (quantize_int8(w), quantize_int4(w, group_size=4)):
            assert isinstance(q, QuantizedArray)
            y = quaxlike.quaxify(lambda m, x: m @ x)(q, jnp.ones(8))  # on the codes
            assert jnp.allclose(y, q.dequantize() @ jnp.ones(8), atol=1e-5)
        ```
    """

    transposed: eqx.AbstractVar[bool]
    allow_materialise: eqx.AbstractVar[bool]
    scale: eqx.AbstractVar[Array]

    @property
    @abc.abstractmethod
    def stored_shape(self) -> tuple[int, ...]:
        """The shape `(*batch, out, in)` of the weight as stored (before any
        transpose)."""

    @property
    @abc.abstractmethod
    def group_size(self) -> int | None:
        """How many consecutive inputs of a row share one scale; `None` when the whole
        row does (per-channel quantisation)."""

    @abc.abstractmethod
    def codes(self) -> Int8[Array, "*batch out in"]:  # noqa: F722
        """The integer codes as `int8`, in stored layout `(*batch, out, in)`."""

    def aval(self) -> ShapedArray:
        shape = self.stored_shape
        if self.transposed:
            shape = (*shape[:-2], shape[-1], shape[-2])
        return ShapedArray(shape, self.scale.dtype)

    def dequantize(self) -> Array:
        """The dense weight `codes * scale` this array stands for, built on purpose
        (whatever `allow_materialise` says).

        **Returns:**

        An array of this array's shape and dtype.
        """
        dense = _dequantize_stored(self.codes(), self.scale, self.group_size)
        return jnp.swapaxes(dense, -1, -2) if self.transposed else dense

    def materialise(self) -> Array:
        if not self.allow_materialise:
            raise RuntimeError(
                _REFUSE_MSG.format(type_name=type(self).__qualname__, shape=self.shape)
            )
        return self.dequantize()

    def with_scale(self, scale: Array) -> "QuantizedArray":
        """A copy with the scales replaced (same shape; the dtype may change)."""
        return eqx.tree_at(lambda a: a.scale, self, scale)

    def swapped(self) -> "QuantizedArray":
        """A copy standing for the transpose of the last two dimensions."""
        return dataclasses.replace(self, transposed=not self.transposed)


class Int8Array(QuantizedArray):
    """A weight quantised to `int8` with one absmax scale per output channel.

    Stands for `values * scale[..., None]`: row `o` of the weight is stored as
    integers in `[-127, 127]` and the scale `max(abs(row)) / 127`. Build one from a
    dense weight with `quantize_int8`.

    **Arguments:**

    - `values`: the `int8` codes, shape `(*batch, out, in)`.
    - `scale`: the scales, floating point, shape `(*batch, out)`; their dtype is the
        array's dtype.
    - `transposed`: whether the array stands for the stored weight with its last two
        dimensions swapped.
    - `allow_materialise`: whether a primitive with no `Int8Array` rule may build
        the dense weight (by default that raises an error instead).

    !!! example

        ```python
        w = quantize_int8(jnp.arange(6.0).reshape(2, 3))
        quaxlike.quaxify(lambda w, x: w @ x)(w, jnp.ones(3))  # ~ [3., 12.]
        ```
    """

    values: Int8[Array, "*batch out in"]  # noqa: F722
    scale: Float[Array, "*batch out"]  # noqa: F722
    transposed: bool = eqx.field(static=True, default=False)
    allow_materialise: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        if self.values.ndim < 2 or self.scale.shape != self.values.shape[:-1]:
            raise ValueError(
                "Int8Array: `values` must have shape `(*batch, out, in)` and `scale` "
                f"shape `(*batch, out)`; got {self.values.shape} and {self.scale.shape}."
            )

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def group_size(self) -> None:
        return None

    def codes(self) -> Int8[Array, "*batch out in"]:  # noqa: F722
        return self.values


def _pack_nibbles(codes: Array) -> Array:
    # Byte j of a row holds code 2j in its low nibble and code 2j + 1 in its high one.
    nibbles = (codes + _INT4_OFFSET).astype(jnp.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def _unpack_nibbles(packed: Array) -> Array:
    low = (packed & 0xF).astype(jnp.int8) - _INT4_OFFSET
    high = (packed >> 4).astype(jnp.int8) - _INT4_OFFSET
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


class Int4Array(QuantizedArray):
    """A weight quantised to 4 bits with one absmax scale per group of inputs.

    Each row of the weight is cut into groups of `group_size` consecutive inputs;
    a group is stored as integers in `[-7, 7]` and the scale `max(abs(group)) / 7`.
    Two codes share one byte of `packed` (each plus 8, low nibble first), so the
    codes take half the memory of an `int8` copy and an eighth of `float32`.
    The group size is implied by the shapes: `in / scale.shape[-1]`. Build one
    from a dense weight with `quantize_int4`.

    **Arguments:**

    - `packed`: the codes, two per `uint8`, shape `(*batch, out, in // 2)`.
    - `scale`: the scales, floating point, shape `(*batch, out, in // group_size)`;
        their dtype is the array's dtype.
    - `transposed`: whether the array stands for the stored weight with its last two
        dimensions swapped.
    - `allow_materialise`: whether a primitive with no `Int4Array` rule may build
        the dense weight (by default that raises an error instead).

    !!! example

        ```python
        w = quantize_int4(jnp.ones((2, 64)), group_size=32)
        quaxlike.quaxify(lambda w, x: w @ x)(w, jnp.ones(64))  # [64., 64.]
        ```
    """

    packed: UInt8[Array, "*batch out half_in"]  # noqa: F722
    scale: Float[Array, "*batch out groups"]  # noqa: F722
    transposed: bool = eqx.field(static=True, default=False)
    allow_materialise: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        *batch, out, half = self.packed.shape
        ok = (
            self.packed.ndim >= 2
            and self.scale.shape[:-1] == (*batch, out)
            and self.scale.shape[-1] > 0
            and (2 * half) % self.scale.shape[-1] == 0
            and (2 * half // self.scale.shape[-1]) % 2 == 0
        )
        if not ok:
            raise ValueError(
                "Int4Array: `packed` must have shape `(*batch, out, in // 2)` and "
                "`scale` shape `(*batch, out, in // group_size)` with an even group "
                f"size; got {self.packed.shape} and {self.scale.shape}."
            )

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    @property
    def group_size(self) -> int:
        return 2 * self.packed.shape[-1] // self.scale.shape[-1]

    def codes(self) -> Int8[Array, "*batch out in"]:  # noqa: F722
        return _unpack_nibbles(self.packed)


# The arithmetic of `quantize_int8` and `quantize_int4`, jitted: called eagerly on a
# model's weights, they compile once per weight shape rather than once per operation.
@jax.jit
def _quantize_int8_arrays(w: Array) -> tuple[Array, Array]:
    scale = _absmax_scale(w, -1, _INT8_MAX)
    codes = jnp.clip(jnp.round(w / scale[..., None]), -_INT8_MAX, _INT8_MAX)
    return codes.astype(jnp.int8), scale


@ft.partial(jax.jit, static_argnums=1)
def _quantize_int4_arrays(w: Array, group_size: int) -> tuple[Array, Array]:
    *batch, out, size = w.shape
    groups = w.reshape(*batch, out, size // group_size, group_size)
    scale = _absmax_scale(groups, -1, _INT4_MAX)
    codes = jnp.clip(jnp.round(groups / scale[..., None]), -_INT4_MAX, _INT4_MAX)
    return _pack_nibbles(codes.astype(jnp.int8).reshape(w.shape)), scale


def quantize_int8(w: ArrayLike, *, allow_materialise: bool = False) -> Int8Array:
    """Quantise a dense weight to `int8`, one absmax scale per output channel.

    **Arguments:**

    - `w`: a floating-point weight of shape `(*batch, out, in)`, such as the weight
        of an `eqx.nn.Linear`. Each row `w[..., o, :]` gets its own scale.
    - `allow_materialise`: as for `Int8Array`.

    **Returns:**

    An `Int8Array` whose dequantised weight differs from `w` by at most half a
    step, `max(abs(row)) / 254`, in each element.

    !!! example

        ```python
        w = quantize_int8(jnp.array([[1.0, -0.5], [0.25, 2.0]]))
        w.values  # int8 [[127, -64], [16, 127]]
        ```
    """
    w = _as_float_matrix(w, "quantize_int8")
    values, scale = _quantize_int8_arrays(w)
    # Keywords: pyright orders the fields with the `AbstractVar`s of the base first.
    return Int8Array(values=values, scale=scale, allow_materialise=allow_materialise)


def quantize_int4(
    w: ArrayLike, *, group_size: int = 32, allow_materialise: bool = False
) -> Int4Array:
    """Quantise a dense weight to 4 bits, one absmax scale per group of inputs.

    **Arguments:**

    - `w`: a floating-point weight of shape `(*batch, out, in)`, such as the weight
        of an `eqx.nn.Linear`.
    - `group_size`: how many consecutive inputs of a row share a scale. It must be
        even and divide `in`. Smaller groups are more accurate and store more scales.
    - `allow_materialise`: as for `Int4Array`.

    **Returns:**

    An `Int4Array` whose dequantised weight differs from `w` by at most half a
    step, `max(abs(group)) / 14`, in each element.

    !!! example

        ```python
        w = quantize_int4(jnp.linspace(-1.0, 1.0, 64).reshape(1, 64), group_size=16)
        w.packed.shape, w.scale.shape  # (1, 32), (1, 4)
        ```
    """
    w = _as_float_matrix(w, "quantize_int4")
    *batch, out, size = w.shape
    if group_size <= 0 or group_size % 2 or size % group_size:
        raise ValueError(_BAD_GROUP_MSG.format(group_size=group_size, size=size, shape=w.shape))
    packed, scale = _quantize_int4_arrays(w, group_size)
    return Int4Array(packed=packed, scale=scale, allow_materialise=allow_materialise)


def _is_linear(x: Any) -> bool:
    return isinstance(x, eqx.nn.Linear)


def _linear_weights(model: PyTree) -> list:
    return [x.weight for x in jtu.tree_leaves(model, is_leaf=_is_linear) if _is_linear(x)]


def quantize(
    model: PyTree,
    *,
    bits: int = 8,
    group_size: int = 32,
    where: Callable[[PyTree], Any] | None = None,
    allow_materialise: bool = False,
) -> PyTree:
    """Replace the weight of every `eqx.nn.Linear` in `model` by a quantised one.

    Biases and every other leaf stay as they are. Call the result with
    `quaxlike.quaxify(model)(x)`. The integer codes are not differentiable; the
    scales are floating-point leaves, so `eqx.filter_grad` gives gradients for them
    (and for the biases) and `None` for the codes, while `jax.grad` refuses the
    model because of its integer leaves.

    **Arguments:**

    - `model`: any PyTree holding Equinox layers.
    - `bits`: 8 for `Int8Array` (per output channel) or 4 for `Int4Array` (per
        group).
    - `group_size`: the group size for `bits=4` (ignored for 8).
    - `where`: instead of every `Linear` weight, the arrays this function selects
        (as for `eqx.tree_at`: one array, or a list or tuple of them).
    - `allow_materialise`: as for `Int8Array` and `Int4Array`.

    **Returns:**

    The model with quantised weights.

    !!! example

        ```python
        mlp = eqx.nn.MLP(64, 8, 64, depth=2, key=jax.random.key(0))
        qmlp = quantize(mlp, bits=4, group_size=32)
        y = eqx.filter_jit(quaxlike.quaxify(qmlp))(jnp.ones(64))
        ```
    """
    if bits == 8:
        make = lambda w: quantize_int8(w, allow_materialise=allow_materialise)  # noqa: E731
    elif bits == 4:
        make = lambda w: quantize_int4(  # noqa: E731
            w, group_size=group_size, allow_materialise=allow_materialise
        )
    else:
        raise ValueError(_BAD_BITS_MSG.format(bits=bits))
    if where is None:
        where = _linear_weights
    selected = where(model)
    if isinstance(selected, (list, tuple)):
        replacement = type(selected)(make(w) for w in selected)
    else:
        replacement = make(selected)
    return eqx.tree_at(where, model, replacement)


def dequantize(model: PyTree) -> PyTree:
    """Replace every quantised array in `model` by its dense weight
    (`QuantizedArray.dequantize`): the plain-JAX model the quantised one computes.

    **Arguments:**

    - `model`: any PyTree holding `QuantizedArray`s, such as the output of
        `quantize`.

    **Returns:**

    The same PyTree with every `Int8Array` and `Int4Array` replaced by the dense
    array `codes * scale` it stands for; it runs without `quaxify`.

    !!! example

        ```python
        mlp = eqx.nn.MLP(8, 2, 16, depth=1, key=jr.key(0))
        qmlp = quantize(mlp, bits=8)
        x = jnp.ones(8)
        assert jnp.allclose(quaxlike.quaxify(qmlp)(x), dequantize(qmlp)(x), atol=1e-5)
        ```
    """
    is_quantized = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    return jtu.tree_map(
        lambda x: x.dequantize() if is_quantized(x) else x, model, is_leaf=is_quantized
    )
