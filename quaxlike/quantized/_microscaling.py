"""Microscaling storage types: the OCP MX formats (`MXArray`: mxfp8 and mxfp4,
blocks of 32 inputs sharing one E8M0 power-of-two scale) and NVIDIA's NVFP4
(`NVFP4Array`: blocks of 16 with e4m3 scales and one float32 scale per matrix),
weight-only, with the codes and scales of torchao's `to_mx` / `NVFP4Tensor` and
of compressed-tensors' `mxfp4-pack-quantized` / `nvfp4-pack-quantized`.

Both are `QuantizedArray`s: their matrix products dequantise a block of rows at
a time (`_matmul.py`), and indexing, transposes and the batch axes follow the
rules of every quantised array. Their element codes are small floats, read by a
lookup in a table of their values (which `largest_dequantized` counts), so that
the codes stay integers (`uint8`) that no derivative reaches. The rules where
they differ from the integer types are in `_microscaling_rules.py`."""

import dataclasses
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jaxtyping import Array, Float, UInt8

from quaxlike.internal import follow_axes, logical_entries, ShapedArray, with_leaf_specs

from ._base import (
    DEFAULT_BLOCK_BYTES,
    explicit_sharding,
    nibble_halves,
    QuantizedArray,
    unpack_nibbles,
)


_BAD_FORMAT_MSG = (
    '`{function}`: `format` must be "mxfp8" (float8 e4m3 elements) or "mxfp4" (fp4 '
    "e2m1 elements, two per byte); got {got!r}."
)
_BAD_LEAVES_MSG = (
    "{type_name}: `qdata` must be `uint8` of shape `(*batch, out, {width})` and "
    "`scale` `uint8` of shape `(*batch, out, in // {block})`{extra}; got qdata "
    "{qdata} {qdata_dtype} and scale {scale} {scale_dtype}{got_extra}."
)

# The elements: the value of each code, float32, indexed by the code's bits.
# e4m3 (`float8_e4m3fn`): 1 sign, 4 exponent, 3 mantissa bits, no infinities,
# 0x7F and 0xFF are NaN, largest 448. e2m1: 1 sign, 2 exponent, 1 mantissa bit,
# the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code | 8).
E4M3_LEVELS = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
E2M1_LEVELS = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32
)
_ELEMENTS = {"mxfp8": "e4m3", "mxfp4": "e2m1"}
_LEVELS = {"e4m3": E4M3_LEVELS, "e2m1": E2M1_LEVELS}
MX_BLOCK = 32
NVFP4_BLOCK = 16
_E8M0_NAN = 255


def lookup(table: np.ndarray, codes: Array) -> Array:
    """`table[codes]` (float32), as a gather from a table of levels: the lookup
    `largest_dequantized` counts. Codes sharded along an explicit mesh axis give
    values sharded as they are."""
    levels = jnp.asarray(table)
    sharding = explicit_sharding(codes)
    if sharding is None:
        return levels.at[codes].get(mode="promise_in_bounds")
    return levels.at[codes].get(mode="promise_in_bounds", out_sharding=sharding)


def e8m0_values(exponents: Array) -> Array:
    """The powers of two `2 ** (e - 127)` of E8M0 codes `e` (`uint8`), float32, exact:
    `2**-127` (a float32 subnormal) for 0 and NaN for 255, as torchao's
    `get_fp_scale` gives them."""
    bits = exponents.astype(jnp.uint32) << 23
    values = lax.bitcast_convert_type(bits, jnp.float32)
    values = jnp.where(exponents == 0, jnp.float32(2.0**-127), values)
    return jnp.where(exponents == _E8M0_NAN, jnp.float32(jnp.nan), values)


def _blockwise(values: Array, scales: Array) -> Array:
    """Elements `(..., n)` times the scale of their block `(..., n_blocks)`."""
    *lead, n = values.shape
    blocks = values.reshape(*lead, scales.shape[-1], n // scales.shape[-1])
    return (blocks * scales[..., None]).reshape(values.shape)


class MicroscaledArray(QuantizedArray):
    """What `MXArray` and `NVFP4Array` share: element codes in `qdata` (one `uint8`
    per element for e4m3, two per byte for e2m1, low nibble first), one `uint8`
    block scale per `block` consecutive inputs of a row in `scale`, and the
    array's dtype as a static field (the scales are not floats of that dtype).

    **Arguments:**

    None of its own: build an `MXArray` or an `NVFP4Array`.

    !!! example

        ```python
        from quaxlike.quantized import MicroscaledArray, quantize_mx, quantize_nvfp4

        w = jr.normal(jr.key(0), (4, 64))
        for q in (quantize_mx(w, format="mxfp4"), quantize_nvfp4(w)):
            assert isinstance(q, MicroscaledArray) and q.group_size == q.block
            y = quaxlike.quaxify(lambda w, x: w @ x)(q, jnp.ones(64))
            assert jnp.allclose(y, q.dequantize() @ jnp.ones(64), atol=1e-4)
        ```
    """

    qdata: eqx.AbstractVar[Array]
    dtype_name: eqx.AbstractVar[str]
    block: ClassVar[int]

    @property
    def element(self) -> str:
        """The element format: `"e4m3"` or `"e2m1"`."""
        raise NotImplementedError

    @property
    def stored_shape(self) -> tuple[int, ...]:
        *lead, width = self.qdata.shape
        return (*lead, width * (2 if self.element == "e2m1" else 1))

    @property
    def group_size(self) -> int:
        return self.block

    @property
    def phases(self) -> int:  # pyright: ignore[reportIncompatibleVariableOverride]
        # Two codes share a byte for e2m1: the low and high nibbles apart.
        return 2 if self.element == "e2m1" else 1

    def aval(self) -> ShapedArray:
        shape = self.stored_shape
        if self.transposed:
            shape = (*shape[:-2], shape[-1], shape[-2])
        return ShapedArray(shape, jnp.dtype(self.dtype_name))

    def unpack(self, data: Array) -> UInt8[Array, "..."]:  # noqa: F722
        return unpack_nibbles(data) if self.element == "e2m1" else data

    def codes(self) -> UInt8[Array, "*batch out in"]:  # noqa: F722
        """The element codes (their bits: e4m3 bytes, or e2m1 nibbles in
        `[0, 15]`) as `uint8`, in stored layout `(*batch, out, in)`."""
        return self.unpack(self.qdata)

    def block_scales(self, *scales: Array) -> Array:
        """The float32 scale of each block `(..., n_blocks)` from the scale leaves
        of `row_leaves` (after `data`)."""
        raise NotImplementedError

    def dequantize_leaves(self, *leaves: Array) -> Array:
        data, *scales = leaves
        values = lookup(_LEVELS[self.element], self.unpack(data))
        return _blockwise(values, self.block_scales(*scales)).astype(self.dtype_name)

    def dequantize_phases(self, *leaves: Array) -> list[Array]:
        if self.element != "e2m1":
            return [self.dequantize_leaves(*leaves)]
        # Even and odd columns (low and high nibbles) apart: a block of `b`
        # columns holds `b / 2` of each.
        data, *scales = leaves
        block = self.block_scales(*scales)
        return [
            _blockwise(lookup(E2M1_LEVELS, h), block).astype(self.dtype_name)
            for h in nibble_halves(data)
        ]

    def with_dtype(self, dtype: Any) -> "MicroscaledArray":
        """A copy whose dequantised values are cast to `dtype` (the arithmetic
        stays in float32, as torchao's and compressed-tensors' do)."""
        return dataclasses.replace(self, dtype_name=jnp.dtype(dtype).name)

    def negated(self) -> "MicroscaledArray":
        """A copy standing for `-self`: every code's sign bit flipped (exact; a
        NaN code stays NaN)."""
        flip = 0x88 if self.element == "e2m1" else 0x80
        return dataclasses.replace(self, qdata=self.qdata ^ jnp.uint8(flip))

    def _check_leaves(self, extra: str = "", got_extra: str = "", ok: bool = True) -> None:
        *batch, out, width = self.qdata.shape
        columns = width * (2 if self.element == "e2m1" else 1)
        ok = (
            ok
            and self.qdata.ndim >= 2
            and self.qdata.dtype == jnp.uint8
            and self.scale.dtype == jnp.uint8
            and columns % self.block == 0
            and tuple(self.scale.shape) == (*batch, out, columns // self.block)
        )
        if not ok:
            raise ValueError(
                _BAD_LEAVES_MSG.format(
                    type_name=type(self).__qualname__,
                    width="in // 2" if self.element == "e2m1" else "in",
                    block=self.block,
                    extra=extra,
                    qdata=self.qdata.shape,
                    qdata_dtype=self.qdata.dtype,
                    scale=self.scale.shape,
                    scale_dtype=self.scale.dtype,
                    got_extra=got_extra,
                )
            )


class MXArray(MicroscaledArray):
    """A weight in an OCP Microscaling format: mxfp8 or mxfp4.

    Each row is cut into blocks of 32 consecutive inputs; a block is stored as
    one E8M0 scale (an 8-bit power-of-two exponent, `2 ** (e - 127)`) and 32
    elements, float8 e4m3 (mxfp8, one byte each) or fp4 e2m1 (mxfp4, two per
    byte, low nibble first). Element `(o, i)` is `value(qdata[o, i]) * 2 **
    (scale[o, i // 32] - 127)`, computed in float32 and cast to the array's dtype,
    as torchao's `MXTensor.dequantize` and compressed-tensors' `mxfp4`
    decompressor give it. Build one with `quantize_mx`.

    The scales are exponents and the elements codes: no leaf is a float, so no
    derivative reaches the array's leaves (the inputs of its products still get
    theirs). Negating flips the codes' sign bits; a product with a scalar would
    need scales that are not powers of two, and is refused (see
    `_microscaling_rules.py`).

    **Arguments:**

    - `qdata`: the element codes, `uint8`: `(*batch, out, in)` e4m3 bytes for
        mxfp8, `(*batch, out, in // 2)` e2m1 pairs for mxfp4.
    - `scale`: the E8M0 block exponents, `uint8`, `(*batch, out, in // 32)`.
    - `format`: `"mxfp8"` or `"mxfp4"`.
    - `dtype_name`: the array's dtype (`"float32"`, `"bfloat16"`, ...).
    - `transposed`, `allow_materialise`, `block_bytes`, `matmul`: as for
        `Int4Array`.

    !!! example

        ```python
        w = quantize_mx(jr.normal(jr.key(0), (4, 64)), format="mxfp4")
        w.qdata.shape, w.scale.shape  # (4, 32), (4, 2)
        y = quaxlike.quaxify(lambda w, x: w @ x)(w, jnp.ones(64))
        assert jnp.allclose(y, w.dequantize() @ jnp.ones(64), atol=1e-4)
        ```
    """

    qdata: UInt8[Array, "*batch out width"]  # noqa: F722
    scale: UInt8[Array, "*batch out blocks"]  # noqa: F722
    format: str = eqx.field(static=True, default="mxfp8")
    dtype_name: str = eqx.field(static=True, default="float32")
    transposed: bool = eqx.field(static=True, default=False)
    allow_materialise: bool = eqx.field(static=True, default=False)
    block_bytes: int = eqx.field(static=True, default=DEFAULT_BLOCK_BYTES)
    matmul: str | None = eqx.field(static=True, default=None)

    block: ClassVar[int] = MX_BLOCK

    def __check_init__(self):
        if self.format not in _ELEMENTS:
            raise ValueError(_BAD_FORMAT_MSG.format(function="MXArray", got=self.format))
        self._check_leaves()

    @property
    def element(self) -> str:
        return _ELEMENTS[self.format]

    def row_leaves(self) -> tuple[Array, Array]:
        return self.qdata, self.scale

    def with_row_leaves(self, *leaves: Array) -> "MXArray":
        qdata, scale = leaves
        return dataclasses.replace(self, qdata=qdata, scale=scale)

    def block_scales(self, *scales: Array) -> Array:
        (exponents,) = scales
        return e8m0_values(exponents)


class NVFP4Array(MicroscaledArray):
    """A weight in NVIDIA's NVFP4 format: fp4 e2m1 elements in blocks of 16, each
    block with a float8 e4m3 scale, and one float32 scale per matrix.

    Element `(o, i)` is `value(qdata[o, i]) * (per_tensor_scale *
    e4m3(scale[o, i // 16]))` in float32, cast to the array's dtype, as torchao's
    `NVFP4Tensor.dequantize` gives it; with `divide=True`, `value * (e4m3(scale)
    / per_tensor_scale)`, as compressed-tensors' `nvfp4-pack-quantized`
    decompressor gives it from its `weight_global_scale` (the reciprocal
    convention: `448 * 6 / amax` where torchao stores `amax / (448 * 6)`). The
    two conventions round differently by an ulp, so a checkpoint keeps its own.
    Build one with `quantize_nvfp4`.

    The per-tensor scale is the one floating-point leaf: derivatives reach it
    (`eqx.filter_grad`), not the codes or the e4m3 block scales (stored as their
    bits, `uint8`).

    **Arguments:**

    - `qdata`: the e2m1 codes, two per `uint8` (low nibble first), `(*batch, out,
        in // 2)`.
    - `scale`: the e4m3 block scales as their bits, `uint8`, `(*batch, out, in //
        16)`.
    - `per_tensor_scale`: float32, `(*batch, 1, 1)`: one per matrix of a stack.
    - `divide`: whether the block scales are divided by `per_tensor_scale`
        (compressed-tensors) rather than multiplied (torchao).
    - `dtype_name`: the array's dtype.
    - `transposed`, `allow_materialise`, `block_bytes`, `matmul`: as for
        `Int4Array`.

    !!! example

        ```python
        w = quantize_nvfp4(jr.normal(jr.key(0), (4, 64)))
        w.qdata.shape, w.scale.shape, w.per_tensor_scale.shape  # (4, 32), (4, 4), (1, 1)
        ```
    """

    qdata: UInt8[Array, "*batch out half_in"]  # noqa: F722
    scale: UInt8[Array, "*batch out blocks"]  # noqa: F722
    per_tensor_scale: Float[Array, "*batch 1 1"]  # noqa: F722
    divide: bool = eqx.field(static=True, default=False)
    dtype_name: str = eqx.field(static=True, default="float32")
    transposed: bool = eqx.field(static=True, default=False)
    allow_materialise: bool = eqx.field(static=True, default=False)
    block_bytes: int = eqx.field(static=True, default=DEFAULT_BLOCK_BYTES)
    matmul: str | None = eqx.field(static=True, default=None)

    block: ClassVar[int] = NVFP4_BLOCK

    def __check_init__(self):
        batch = tuple(self.qdata.shape[:-2])
        ok = tuple(self.per_tensor_scale.shape) == (*batch, 1, 1) and jnp.issubdtype(
            self.per_tensor_scale.dtype, jnp.floating
        )
        self._check_leaves(
            extra=", `per_tensor_scale` floating point `(*batch, 1, 1)`",
            got_extra=f", per_tensor_scale {self.per_tensor_scale.shape}",
            ok=ok,
        )

    @property
    def element(self) -> str:
        return "e2m1"

    def row_leaves(self) -> tuple[Array, Array, Array]:
        # The per-tensor scale once per row, so that every row operation takes it
        # with the rows (`with_row_leaves` keeps one again).
        rows = (*self.per_tensor_scale.shape[:-2], self.qdata.shape[-2], 1)
        return self.qdata, self.scale, jnp.broadcast_to(self.per_tensor_scale, rows)

    def with_row_leaves(self, *leaves: Array) -> "NVFP4Array":
        qdata, scale, per_row = leaves
        return dataclasses.replace(
            self, qdata=qdata, scale=scale, per_tensor_scale=per_row[..., :1, :]
        )

    def block_scales(self, *scales: Array) -> Array:
        codes, per_row = scales
        # The e4m3 bits as float8, converted: exact, and faster on CPU than a
        # lookup (the scales are not the elements, which a lookup decodes).
        block = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
        tensor = per_row.astype(jnp.float32)
        return block / tensor if self.divide else tensor * block

    def logical_leaf_specs(self, spec: Any) -> "NVFP4Array":
        # The codes and block scales as every quantised array's; the per-tensor
        # scale follows the batch axes only (its two axes of size 1 are whole).
        specs = super().logical_leaf_specs(spec)
        ndim = len(self.stored_shape)
        entries = list(logical_entries(spec, ndim))
        tensor = follow_axes(entries, [*range(ndim - 2), None, None])
        return with_leaf_specs(self, qdata=specs.qdata, scale=specs.scale, per_tensor_scale=tensor)
