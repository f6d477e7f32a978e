"""The quantised array types, their constructors, and `quantize` for whole models."""

import dataclasses
import functools as ft
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, ArrayLike, Float, Int8, PyTree, UInt8

from ._base import (
    as_float_matrix,
    check_block_bytes,
    check_group_size,
    DEFAULT_BLOCK_BYTES,
    dequantize_rows,
    nibble_halves,
    pack_nibbles,
    QuantizedArray,
    unpack_nibbles,
)


_BAD_BITS_MSG = (
    '`quantize`: `bits` must be 8, 4, 3 or 2, "nf4" for NormalFloat codes, or "mxfp8", '
    '"mxfp4" or "nvfp4" for the microscaling formats (rounded to nearest: GPTQ, AWQ '
    "and quantisation-aware training produce the integer and NF4 types); got {bits!r}."
)
_DOUBLE_QUANT_MSG = (
    '`quantize`: `double_quant=True` quantises the scales of `bits="nf4"` only; '
    'got `bits={bits!r}`. Pass `bits="nf4"`, or leave `double_quant` out.'
)
_NO_LINEAR_MSG = (
    "`quantize(model)` found no `eqx.nn.Linear` in the model ({type_name}), so it would "
    "quantise nothing. For another kind of model, say which weights to quantise "
    "with `where=`, a function returning them (as for `eqx.tree_at`), for a Flax "
    'params dict for example `where=lambda p: [p["params"]["Dense_0"]["kernel"]]`.'
)
# Symmetric ranges: int8 codes lie in [-127, 127], int4 codes in [-7, 7].
_INT8_MAX = 127
_INT4_MAX = 7
# int4 codes are stored offset by 8, as unsigned nibbles in [1, 15].
_INT4_OFFSET = 8


def _absmax_scale(w: Array, axis: int, code_max: int) -> Array:
    absmax = jnp.max(jnp.abs(w), axis=axis)
    # An all-zero row or group has any positive scale; 1 avoids dividing by zero.
    return jnp.where(absmax > 0, absmax / code_max, jnp.ones_like(absmax))


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
    - `block_bytes`: the most bytes of dequantised weight a matrix product builds
        at a time (see `quantize`).
    - `matmul`: how matrix products are computed: `"loop"`, `"fused"` or `None`
        for the backend's default (see `QuantizedArray`).

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
    block_bytes: int = eqx.field(static=True, default=DEFAULT_BLOCK_BYTES)
    matmul: str | None = eqx.field(static=True, default=None)

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

    def row_leaves(self) -> tuple[Array, Array]:
        return self.values, self.scale[..., None]

    def with_row_leaves(self, *leaves: Array) -> "Int8Array":
        data, groups = leaves
        return dataclasses.replace(self, values=data, scale=groups[..., 0])

    def unpack(self, data: Array) -> Int8[Array, "..."]:  # noqa: F722
        return data


def _int4_codes(nibbles: Array) -> Array:
    return nibbles.astype(jnp.int8) - _INT4_OFFSET


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
    - `block_bytes`: the most bytes of dequantised weight a matrix product builds
        at a time (see `quantize`).
    - `matmul`: how matrix products are computed: `"loop"`, `"fused"` or `None`
        for the backend's default (see `QuantizedArray`).

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
    block_bytes: int = eqx.field(static=True, default=DEFAULT_BLOCK_BYTES)
    matmul: str | None = eqx.field(static=True, default=None)

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

    phases: ClassVar[int] = 2

    @property
    def group_size(self) -> int:
        return 2 * self.packed.shape[-1] // self.scale.shape[-1]

    def row_leaves(self) -> tuple[Array, Array]:
        return self.packed, self.scale

    def with_row_leaves(self, *leaves: Array) -> "Int4Array":
        data, groups = leaves
        return dataclasses.replace(self, packed=data, scale=groups)

    def unpack(self, data: Array) -> Int8[Array, "..."]:  # noqa: F722
        return _int4_codes(unpack_nibbles(data))

    def dequantize_phases(self, *leaves: Array) -> list[Array]:
        data, groups = leaves
        # Low nibbles (even columns) and high nibbles (odd columns) apart: no
        # shuffling of nibbles into column order, which XLA's CPU code does
        # slowly. A group of `g` columns holds `g / 2` of each.
        return [dequantize_rows(_int4_codes(c), groups) for c in nibble_halves(data)]


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
    return pack_nibbles(codes.reshape(w.shape) + _INT4_OFFSET), scale


def quantize_int8(
    w: ArrayLike,
    *,
    allow_materialise: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    matmul: str | None = None,
) -> Int8Array:
    """Quantise a dense weight to `int8`, one absmax scale per output channel.

    **Arguments:**

    - `w`: a floating-point weight of shape `(*batch, out, in)`, such as the weight
        of an `eqx.nn.Linear`. Each row `w[..., o, :]` gets its own scale.
    - `allow_materialise`, `block_bytes`, `matmul`: as for `Int8Array`.

    **Returns:**

    An `Int8Array` whose dequantised weight differs from `w` by at most half a
    step, `max(abs(row)) / 254`, in each element.

    !!! example

        ```python
        w = quantize_int8(jnp.array([[1.0, -0.5], [0.25, 2.0]]))
        w.values  # int8 [[127, -64], [16, 127]]
        ```
    """
    w = as_float_matrix(w, "quantize_int8")
    check_block_bytes(block_bytes, "quantize_int8")
    values, scale = _quantize_int8_arrays(w)
    # Keywords: pyright orders the fields with the `AbstractVar`s of the base first.
    return Int8Array(
        values=values,
        scale=scale,
        allow_materialise=allow_materialise,
        block_bytes=block_bytes,
        matmul=matmul,
    )


def quantize_int4(
    w: ArrayLike,
    *,
    group_size: int = 32,
    allow_materialise: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    matmul: str | None = None,
) -> Int4Array:
    """Quantise a dense weight to 4 bits, one absmax scale per group of inputs.

    **Arguments:**

    - `w`: a floating-point weight of shape `(*batch, out, in)`, such as the weight
        of an `eqx.nn.Linear`.
    - `group_size`: how many consecutive inputs of a row share a scale. It must be
        even and divide `in`. Smaller groups are more accurate and store more scales.
    - `allow_materialise`, `block_bytes`, `matmul`: as for `Int4Array`.

    **Returns:**

    An `Int4Array` whose dequantised weight differs from `w` by at most half a
    step, `max(abs(group)) / 14`, in each element.

    !!! example

        ```python
        w = quantize_int4(jnp.linspace(-1.0, 1.0, 64).reshape(1, 64), group_size=16)
        w.packed.shape, w.scale.shape  # (1, 32), (1, 4)
        ```
    """
    w = as_float_matrix(w, "quantize_int4")
    *batch, out, size = w.shape
    check_group_size(w.shape, group_size, "quantize_int4")
    check_block_bytes(block_bytes, "quantize_int4")
    packed, scale = _quantize_int4_arrays(w, group_size)
    return Int4Array(
        packed=packed,
        scale=scale,
        allow_materialise=allow_materialise,
        block_bytes=block_bytes,
        matmul=matmul,
    )


def _is_linear(x: Any) -> bool:
    return isinstance(x, eqx.nn.Linear)


def _linear_weights(model: PyTree) -> list:
    return [x.weight for x in jtu.tree_leaves(model, is_leaf=_is_linear) if _is_linear(x)]


def default_where(model: PyTree) -> Any:
    """`quantize`'s selection when `where` is not given: every `eqx.nn.Linear`
    weight, or an error if there is none."""
    if not _linear_weights(model):
        raise ValueError(_NO_LINEAR_MSG.format(type_name=type(model).__qualname__))
    return _linear_weights
