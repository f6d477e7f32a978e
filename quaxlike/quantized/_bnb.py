"""`Bnb4bitArray`: bitsandbytes' 4-bit weights (NF4 or FP4) as transformers saves
them, with bitsandbytes' nested quantisation of the absmaxes (an 8-bit dynamic
code over `absmax - offset`, in blocks of 256), read without building the dense
weight."""

import dataclasses
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int32, UInt8

from quaxlike.internal import follow_axes, logical_entries, ShapedArray, with_leaf_specs

from ._base import DEFAULT_BLOCK_BYTES, QuantizedArray


_BAD_LEAVES_MSG = (
    "Bnb4bitArray: `packed` must have shape `(*batch, out, in // 2)` in `uint8`, "
    "`absmax` `(*batch, out, in // blocksize)` (`float32`, or `uint8` codes with "
    "nested quantisation), `code` 16 levels; with nested quantisation also "
    "`nested` `(*batch, out, m)`, `nested_start` `(*batch, out, 1)`, `nested_code` "
    "256 levels and a scalar `offset`; got packed {packed}, absmax {absmax} "
    "{absmax_dtype}, code {code}, nested {nested}."
)


def unpack_high_first(packed: Array) -> Array:
    """The `uint8` values `(..., 2k)` of bytes `(..., k)`, bitsandbytes' order: the
    first value of a pair in the high nibble."""
    pairs = jnp.stack([packed >> 4, packed & 0xF], axis=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _rounded(product: Array) -> Array:
    """`product`, rounded to its dtype before whatever adds to it: XLA:CPU would
    otherwise contract `a * b + c` into one fused multiply-add, rounding once
    where bitsandbytes (in PyTorch) rounds twice. A select that LLVM cannot see
    through keeps the two apart, and keeps NaN as NaN."""
    return jnp.where(jnp.isnan(product), jnp.asarray(jnp.nan, product.dtype), product)


# The leaves stored row by row, in `row_leaves`' order (those that are not None).
_ROW_FIELDS = ("packed", "absmax", "nested", "nested_start", "block_start")


class Bnb4bitArray(QuantizedArray):
    """A weight in bitsandbytes' 4-bit layout: NF4 or FP4 codes, one absmax per block
    of `blocksize` consecutive inputs, optionally with the absmaxes themselves
    quantised (bitsandbytes' `compress_statistics`, "nested").

    bitsandbytes flattens the weight `(out, in)` row by row and cuts it into
    blocks of `blocksize` values; this type keeps the same bytes seen row by row
    (`in` must be even). Where `blocksize` divides `in` (every transformer's
    linear layers), row `o` holds its own `in / blocksize` absmaxes; where it
    does not, blocks straddle rows, and each row holds the absmaxes of the
    blocks it meets (`absmax` `(*batch, out, m)`) and the position of its first
    input in the first of them (`block_start`). Element `(o, i)` is `code[q] * absmax` in
    `float32`, cast to bitsandbytes' dtype (the `dtype` of its quant state) and
    then to this array's dtype: bitsandbytes' `dequantize_4bit`, operation for
    operation.

    With nested quantisation, the absmaxes are `uint8` indices into bitsandbytes'
    256-level dynamic code (`nested_code`), scaled per block of `nested_blocksize`
    absmaxes (counted over the whole flattened weight) and shifted by `offset`:
    `nested_code[a] * nested_absmax[block] + offset`, in `float32`. A row meets
    at most a few of those blocks; `nested` holds them (`m` per row) and
    `nested_start` the position of the row's first absmax in its first block.

    **Arguments:**

    - `packed`: `uint8`, two codes a byte (first in the high nibble), shape
        `(*batch, out, in // 2)`.
    - `absmax`: `float32` absmaxes, or with nested quantisation their `uint8`
        codes, shape `(*batch, out, in // blocksize)` (with `block_start`, `(*batch,
        out, m)`: the blocks each row meets).
    - `code`: the 16 levels (bitsandbytes' `quant_map`), `float32`.
    - `nested`, `nested_start`, `nested_code`, `offset`: `None`, or the nested
        quantisation's second-level absmaxes seen per row `(*batch, out, m)`,
        each row's first position `(*batch, out, 1)` (`int32`), the 256 levels
        (`nested_quant_map`) and the offset (a `float32` scalar).
    - `block_start`, `blocksize`: `None`, or where blocks straddle rows the
        position of each row's first input in its first block, `(*batch, out,
        1)` (`int32`), and bitsandbytes' `blocksize`.
    - `quant_type`: `"nf4"` or `"fp4"` (for the writers and `explain`).
    - `nested_blocksize`: absmaxes per second-level block (bitsandbytes: 256).
    - `library_dtype`: the dtype bitsandbytes dequantises to.
    - `dtype_name`: this array's dtype (by default `library_dtype`).
    - `transposed`, `allow_materialise`, `block_bytes`, `matmul`: as for
        `NF4Array`.

    !!! example

        ```python
        from quaxlike.quantized import NF4_LEVELS

        packed = jnp.array([[0x0F, 0x70]], jnp.uint8)  # codes 0, 15, 7, 0
        q = Bnb4bitArray(
            packed=packed,
            absmax=jnp.array([[2.0]]),
            code=jnp.asarray(NF4_LEVELS, jnp.float32),
        )
        assert np.array_equal(q.dequantize(), [[-2.0, 2.0, 0.0, -2.0]])
        ```
    """

    packed: UInt8[Array, "*batch out half_in"]  # noqa: F722
    absmax: Array
    code: Float[Array, "16"]
    nested: Float[Array, "*batch out m"] | None = None  # noqa: F722
    nested_start: Int32[Array, "*batch out 1"] | None = None  # noqa: F722
    nested_code: Float[Array, "256"] | None = None
    offset: Float[Array, ""] | None = None  # noqa: F722
    block_start: Int32[Array, "*batch out 1"] | None = None  # noqa: F722
    blocksize: int | None = eqx.field(static=True, default=None)
    quant_type: str = eqx.field(static=True, default="nf4")
    nested_blocksize: int = eqx.field(static=True, default=256)
    library_dtype: str = eqx.field(static=True, default="float32")
    dtype_name: str | None = eqx.field(static=True, default=None)
    transposed: bool = eqx.field(static=True, default=False)
    allow_materialise: bool = eqx.field(static=True, default=False)
    block_bytes: int = eqx.field(static=True, default=DEFAULT_BLOCK_BYTES)
    matmul: str | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        *batch, out, half = self.packed.shape
        nested = self.nested is not None
        ok = (
            self.packed.ndim >= 2
            and self.packed.dtype == jnp.uint8
            and self.absmax.shape[:-1] == (*batch, out)
            and self.absmax.shape[-1] > 0
            and (self.block_start is not None or (2 * half) % self.absmax.shape[-1] == 0)
            and (self.block_start is None) == (self.blocksize is None)
            and self.code.shape == (16,)
            and self.absmax.dtype == (jnp.uint8 if nested else jnp.float32)
        )
        if ok and nested:
            ok = (
                self.nested is not None
                and self.nested_start is not None
                and self.nested_code is not None
                and self.offset is not None
                and self.nested.shape[:-1] == (*batch, out)
                and self.nested_start.shape == (*batch, out, 1)
                and self.nested_code.shape == (256,)
                and self.offset.shape == ()
            )
        if not ok:
            raise ValueError(
                _BAD_LEAVES_MSG.format(
                    packed=self.packed.shape,
                    absmax=self.absmax.shape,
                    absmax_dtype=self.absmax.dtype,
                    code=self.code.shape,
                    nested=None if self.nested is None else self.nested.shape,
                )
            )

    @property
    def scale(self) -> Array:  # pyright: ignore[reportIncompatibleVariableOverride]
        """The first-level absmaxes (`float32`, or their codes when nested)."""
        return self.absmax

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    @property
    def group_size(self) -> int:
        """bitsandbytes' `blocksize`: inputs per absmax."""
        if self.blocksize is not None:
            return self.blocksize
        return 2 * self.packed.shape[-1] // self.absmax.shape[-1]

    @property
    def double_quantized(self) -> bool:
        """Whether the absmaxes are nested-quantised."""
        return self.nested is not None

    def aval(self) -> ShapedArray:
        shape = self.stored_shape
        if self.transposed:
            shape = (*shape[:-2], shape[-1], shape[-2])
        return ShapedArray(shape, jnp.dtype(self.dtype_name or self.library_dtype))

    def _row_fields(self) -> tuple[str, ...]:
        return tuple(f for f in _ROW_FIELDS if getattr(self, f) is not None)

    def row_leaves(self) -> tuple[Array, ...]:
        return tuple(getattr(self, f) for f in self._row_fields())

    def with_row_leaves(self, *leaves: Array) -> "Bnb4bitArray":
        return dataclasses.replace(self, **dict(zip(self._row_fields(), leaves)))

    def unpack(self, data: Array) -> UInt8[Array, "..."]:  # noqa: F722
        return unpack_high_first(data)

    def codes(self) -> UInt8[Array, "*batch out in"]:  # noqa: F722
        """The level indices in `[0, 15]` (into `code`), stored layout."""
        return self.unpack(self.packed)

    def block_absmax(self, absmax: Array, nested: Array | None, start: Array | None) -> Array:
        """The absmaxes `(..., blocks)` in `float32`, from the row leaves: as stored,
        or bitsandbytes' nested dequantisation `nested_code[a] * nested_absmax +
        offset` (`nested`, `start`: the row's second-level absmaxes and its first
        position in them)."""
        if nested is None or start is None:
            return absmax
        assert self.nested_code is not None and self.offset is not None
        blocks = absmax.shape[-1]
        which = (start + jnp.arange(blocks, dtype=start.dtype)) // self.nested_blocksize
        second = jnp.take_along_axis(nested, which, axis=-1, mode="clip")
        return _rounded(self.nested_code[absmax] * second) + self.offset

    def dequantize_leaves(self, *leaves: Array) -> Array:
        named = dict(zip(self._row_fields(), leaves))
        absmax = self.block_absmax(named["absmax"], named.get("nested"), named.get("nested_start"))
        values = self.code[self.unpack(named["packed"])]
        *lead, columns = values.shape
        start = named.get("block_start")
        if start is None:
            blocks = absmax.shape[-1]
            dense = values.reshape(*lead, blocks, columns // blocks) * absmax[..., None]
            dense = dense.reshape(*lead, columns)
        else:
            # Blocks that straddle rows: each row holds the absmaxes of the blocks
            # it meets, and its first input's position in the first of them.
            which = (start + jnp.arange(columns, dtype=start.dtype)) // self.group_size
            dense = values * jnp.take_along_axis(absmax, which, axis=-1, mode="clip")
        return dense.astype(self.library_dtype).astype(self.dtype)

    @property
    def phases(self) -> int:  # pyright: ignore[reportIncompatibleVariableOverride]
        """2 (even columns in the high nibbles, odd ones in the low: no shuffling of
        nibbles into column order) where blocks keep to rows, else 1."""
        return 1 if self.block_start is not None else 2

    def dequantize_phases(self, *leaves: Array) -> list[Array]:
        if self.phases == 1:
            return [self.dequantize_leaves(*leaves)]
        named = dict(zip(self._row_fields(), leaves))
        absmax = self.block_absmax(named["absmax"], named.get("nested"), named.get("nested_start"))
        packed = named["packed"]
        out = []
        for nibbles in (packed >> 4, packed & 0xF):  # columns 2k, then 2k + 1
            values = self.code[nibbles]
            *lead, half = values.shape
            blocks = absmax.shape[-1]
            dense = values.reshape(*lead, blocks, half // blocks) * absmax[..., None]
            out.append(dense.reshape(*lead, half).astype(self.library_dtype).astype(self.dtype))
        return out

    def with_dtype(self, dtype: Any) -> "Bnb4bitArray":
        """A copy whose dequantised values are cast to `dtype` after bitsandbytes'
        own cast to its dtype."""
        return dataclasses.replace(self, dtype_name=jnp.dtype(dtype).name)

    def with_scale(self, scale: Array) -> "Bnb4bitArray":
        return dataclasses.replace(self, absmax=scale)

    def logical_leaf_specs(self, spec: Any) -> "Bnb4bitArray":
        # Row leaves follow the rows (and whole blocks the columns); the code
        # tables and the offset are replicated.
        ndim = len(self.stored_shape)
        entries = list(logical_entries(spec, ndim))
        if self.transposed:
            entries[-2], entries[-1] = entries[-1], entries[-2]
        lead = list(range(ndim - 2))
        specs: dict[str, Any] = {
            "packed": follow_axes(entries, [*lead, ndim - 2, ndim - 1]),
            "code": PartitionSpec(),
        }
        if self.nested is None:
            specs["absmax"] = specs["packed"]
        else:
            rows = follow_axes(entries, [*lead, ndim - 2, None])
            specs.update(
                absmax=rows,
                nested=rows,
                nested_start=rows,
                nested_code=PartitionSpec(),
                offset=PartitionSpec(),
            )
        return with_leaf_specs(self, **specs)
