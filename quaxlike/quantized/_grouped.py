"""`GroupedIntArray`: integer codes packed in `int32` words, one scale (and
optionally one integer zero point) per group of inputs, optionally with an
act-order map of inputs to groups: the layout GPTQ, AWQ and compressed-tensors'
`pack-quantized` store, read without building the dense weight."""

import dataclasses
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int, Int32

from quaxlike.internal import follow_axes, logical_entries, ShapedArray, with_leaf_specs

from ._base import DEFAULT_BLOCK_BYTES, QuantizedArray


_BAD_BITS_MSG = (
    "GroupedIntArray: `bits={bits}` must divide 32 (codes do not straddle the "
    "`int32` words): 2, 4 or 8. A checkpoint of 3-bit codes cannot be read here."
)
_BAD_LEAVES_MSG = (
    "GroupedIntArray: `packed` must have shape `(*batch, out, ceil(columns * bits / "
    "32))` in `int32`, `scale` `(*batch, out, groups)` floating point, `zero` (if "
    "any) the scale's shape in an integer dtype and `g_idx` (if any) `(*batch, "
    "columns)` in an integer dtype, with `columns` divisible by the groups when "
    "there is no `g_idx`; got packed {packed} {packed_dtype}, scale {scale}, zero "
    "{zero}, g_idx {g_idx} and columns={columns}, bits={bits}."
)
_G_IDX_BATCH_MSG = (
    "GroupedIntArray: an act-order `g_idx` of shape {g_idx} cannot follow an "
    "operation that gives its codes the shape {packed}: the map of inputs to "
    "groups is stored once per matrix, not per row. Loop over a stack of layers "
    "with `lax.scan` (which slices every leaf alike), or load the layers as "
    "separate weights."
)


def word_shifts(bits: int) -> np.ndarray:
    """The bit offset of each of the `32 // bits` codes in a word, lowest first."""
    return np.arange(0, 32, bits, dtype=np.uint32)


def unpack_words(words: Array, bits: int, columns: int | None = None) -> Array:
    """The codes packed in `int32` words, as GPTQ, AWQ and compressed-tensors store
    them: code `j` of a word in bits `j * bits` to `j * bits + bits - 1`, lowest
    first, the words in order.

    **Arguments:**

    - `words`: `int32` words `(..., k)`.
    - `bits`: bits per code, 2, 4 or 8.
    - `columns`: how many codes to keep (the rest pad the last word); by default
        all `k * 32 // bits`.

    **Returns:**

    The codes as `uint8`, `(..., columns)`.

    !!! example

        ```python
        from quaxlike.quantized import pack_words

        codes = np.arange(16, dtype=np.uint8).reshape(2, 8)
        assert np.array_equal(unpack_words(jnp.asarray(pack_words(codes, 4)), 4), codes)
        ```
    """
    unsigned = lax.bitcast_convert_type(words, jnp.uint32)
    shifts = jnp.asarray(word_shifts(bits)).reshape((1,) * words.ndim + (-1,))
    codes = (unsigned[..., None] >> shifts) & jnp.uint32(2**bits - 1)
    codes = codes.reshape(*words.shape[:-1], -1).astype(jnp.uint8)
    return codes if columns is None else codes[..., :columns]


def pack_words(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes into `int32` words, as GPTQ, AWQ and compressed-tensors
    store them (the inverse of `unpack_words`), in NumPy, on the host.

    **Arguments:**

    - `codes`: unsigned integers `(..., n)`, each below `2**bits`.
    - `bits`: bits per code, 2, 4 or 8.

    **Returns:**

    `int32` words `(..., ceil(n * bits / 32))`, code `j` of a word in bits `j *
    bits` upwards, the last word padded with zero codes.

    !!! example

        ```python
        words = pack_words(np.array([[1, 2, 3, 4, 5, 6, 7, 8]]), 4)
        assert words.dtype == np.int32 and words.view(np.uint32)[0, 0] == 0x87654321
        ```
    """
    per_word = 32 // bits
    codes = np.asarray(codes).astype(np.uint32)
    pad = -codes.shape[-1] % per_word
    if pad:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], pad), np.uint32)], -1)
    codes = codes.reshape(*codes.shape[:-1], -1, per_word)
    words = np.bitwise_or.reduce(codes << word_shifts(bits), axis=-1)
    return np.ascontiguousarray(words.astype(np.uint32).view(np.int32))


def _gathered(x: Array, g_idx: Array) -> Array:
    """Per-group values `x` `(..., groups)` at the groups `g_idx` `(k,)` (one map
    for every row) or `(*batch, k)` (one per matrix of a stack)."""
    if g_idx.ndim == 1:
        return jnp.take(x, g_idx, axis=-1)
    g_idx = jnp.broadcast_to(g_idx[..., None, :], (*x.shape[:-1], g_idx.shape[-1]))
    return jnp.take_along_axis(x, g_idx, axis=-1)


class GroupedIntArray(QuantizedArray):
    """A weight of unsigned integer codes with a scale and a zero point per group
    of inputs: `(code - zero) * scale`, the layout of GPTQ, AWQ and
    compressed-tensors' `pack-quantized` checkpoints.

    Row `o` of the weight `(*batch, out, columns)` is stored as `columns` codes of
    `bits` bits, packed `32 // bits` to an `int32` word, lowest bits first (the
    order of compressed-tensors' `weight_packed`, and of GPTQ's `qweight` once
    transposed; AWQ's is repacked into it once, at load). Input `i` belongs to
    group `i // group_size`, or, with an act-order map (GPTQ's `desc_act`),
    to group `g_idx[i]`. Element `(o, i)` is `(code - zero[o, g]) * scale[o, g]`,
    computed as the libraries do: the difference exactly, as an integer, then
    times the scale in the scale's dtype; the result is then cast to the
    array's dtype (`dtype`, by default the scale's).

    Without `zero` the zero point is `2**(bits - 1)`: codes are stored offset by
    it, as symmetric schemes do (compressed-tensors' signed codes, GPTQ's
    `sym=True`).

    Matrix products, row indexing, transposes and the other rules of
    `QuantizedArray` apply: a product dequantises a block of rows at a time.

    **Arguments:**

    - `packed`: `int32` words, shape `(*batch, out, ceil(columns * bits / 32))`.
    - `scale`: floating point, shape `(*batch, out, groups)`.
    - `zero`: `None` (symmetric), or the zero points, an integer array of the
        scale's shape.
    - `g_idx`: `None` (input `i` in group `i // group_size`), or the group of
        each input, integers of shape `(*batch, columns)`.
    - `bits`: bits per code: 2, 4 or 8.
    - `columns`: the number of inputs (by default every code the words hold).
    - `dtype`: the array's dtype (by default the scale's).
    - `transposed`, `allow_materialise`, `block_bytes`, `matmul`: as for
        `Int4Array`.

    !!! example

        ```python
        from quaxlike.quantized import pack_words

        codes = np.array([[0, 15, 8, 7, 1, 2, 3, 4]], np.uint8)  # one row, 8 inputs
        q = GroupedIntArray(
            packed=jnp.asarray(pack_words(codes, 4)),
            scale=jnp.array([[0.5, 2.0]]),
            bits=4,
        )
        expected = (codes.astype(np.float32) - 8) * np.repeat([[0.5, 2.0]], 4, axis=1)
        assert np.array_equal(q.dequantize(), expected)
        ```
    """

    packed: Int32[Array, "*batch out words"]  # noqa: F722
    scale: Float[Array, "*batch out groups"]  # noqa: F722
    zero: Int[Array, "*batch out groups"] | None = None  # noqa: F722
    g_idx: Int[Array, "..."] | None = None
    bits: int = eqx.field(static=True, default=4)
    columns: int | None = eqx.field(static=True, default=None)
    dtype_name: str | None = eqx.field(static=True, default=None)
    transposed: bool = eqx.field(static=True, default=False)
    allow_materialise: bool = eqx.field(static=True, default=False)
    block_bytes: int = eqx.field(static=True, default=DEFAULT_BLOCK_BYTES)
    matmul: str | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if self.bits not in (2, 4, 8):
            raise ValueError(_BAD_BITS_MSG.format(bits=self.bits))
        *batch, out, words = self.packed.shape
        columns = self.n_columns
        groups = self.scale.shape[-1] if self.scale.ndim else 0
        ok = (
            self.packed.ndim >= 2
            and self.packed.dtype == jnp.int32
            and jnp.issubdtype(self.scale.dtype, jnp.floating)
            and self.scale.shape[:-1] == (*batch, out)
            and groups > 0
            and -(-columns * self.bits // 32) == words
            and (self.zero is None or self.zero.shape == self.scale.shape)
            and (self.zero is None or jnp.issubdtype(self.zero.dtype, jnp.integer))
        )
        if ok and self.g_idx is None:
            ok = columns % groups == 0
        if ok and self.g_idx is not None:
            if self.g_idx.shape[:-1] != tuple(batch) and self.g_idx.ndim > 1:
                raise ValueError(
                    _G_IDX_BATCH_MSG.format(g_idx=self.g_idx.shape, packed=self.packed.shape)
                )
            ok = self.g_idx.shape[-1] == columns and jnp.issubdtype(self.g_idx.dtype, jnp.integer)
        if not ok:
            raise ValueError(
                _BAD_LEAVES_MSG.format(
                    packed=self.packed.shape,
                    packed_dtype=self.packed.dtype,
                    scale=self.scale.shape,
                    zero=None if self.zero is None else self.zero.shape,
                    g_idx=None if self.g_idx is None else self.g_idx.shape,
                    columns=self.columns,
                    bits=self.bits,
                )
            )

    @property
    def n_columns(self) -> int:
        """The number of inputs (columns of the stored weight)."""
        if self.columns is not None:
            return self.columns
        return self.packed.shape[-1] * 32 // self.bits

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.n_columns)

    @property
    def group_size(self) -> int | None:
        """Inputs per group; `None` where an act-order `g_idx` assigns them."""
        if self.g_idx is not None:
            return None
        return self.n_columns // self.scale.shape[-1]

    def aval(self) -> ShapedArray:
        shape = self.stored_shape
        if self.transposed:
            shape = (*shape[:-2], shape[-1], shape[-2])
        dtype = self.scale.dtype if self.dtype_name is None else jnp.dtype(self.dtype_name)
        return ShapedArray(shape, dtype)

    def row_leaves(self) -> tuple[Array, ...]:
        if self.zero is None:
            return self.packed, self.scale
        return self.packed, self.scale, self.zero

    def with_row_leaves(self, *leaves: Array) -> "GroupedIntArray":
        if len(leaves) == 2:
            packed, scale = leaves
            return dataclasses.replace(self, packed=packed, scale=scale)
        packed, scale, zero = leaves
        return dataclasses.replace(self, packed=packed, scale=scale, zero=zero)

    def unpack(self, data: Array) -> Array:
        return unpack_words(data, self.bits, self.n_columns)

    def codes(self) -> Array:
        """The unsigned codes `(*batch, out, columns)` as `uint8`, stored layout."""
        return self.unpack(self.packed)

    def _per_input(self, x: Array) -> Array:
        """Per-group values `(..., groups)` spread to the inputs `(..., columns)`."""
        if self.g_idx is None:
            return jnp.repeat(x, self.n_columns // x.shape[-1], axis=-1)
        return _gathered(x, self.g_idx)

    def dequantize_leaves(self, *leaves: Array) -> Array:
        data, scale, *zero = leaves
        codes = self.unpack(data).astype(jnp.int32)
        offset = 2 ** (self.bits - 1)
        if self.g_idx is None:
            # Contiguous groups: a reshape, no gather.
            *lead, columns = codes.shape
            groups = scale.shape[-1]
            codes = codes.reshape(*lead, groups, columns // groups)
            zeros = zero[0][..., None].astype(jnp.int32) if zero else offset
            dense = (codes - zeros).astype(scale.dtype) * scale[..., None]
            dense = dense.reshape(*lead, columns)
        else:
            zeros = self._per_input(zero[0]).astype(jnp.int32) if zero else offset
            dense = (codes - zeros).astype(scale.dtype) * self._per_input(scale)
        return dense.astype(self.dtype)

    @property
    def phases(self) -> int:  # pyright: ignore[reportIncompatibleVariableOverride]
        """Into how many phases a product cuts the columns: one per code of a word
        (phase `j` is field `j` of every word: no shuffling of codes into column
        order), where the words hold the columns exactly and a group holds whole
        words (or an act-order map says the groups); else 1."""
        per_word = 32 // self.bits
        columns = self.n_columns
        if columns != self.packed.shape[-1] * per_word:
            return 1
        if self.g_idx is None and (columns // self.scale.shape[-1]) % per_word:
            return 1
        return per_word

    def dequantize_phases(self, *leaves: Array) -> list[Array]:
        phases = self.phases
        if phases == 1:
            return [self.dequantize_leaves(*leaves)]
        data, scale, *zero = leaves
        words = lax.bitcast_convert_type(data, jnp.uint32)
        mask = jnp.uint32(2**self.bits - 1)
        offset = 2 ** (self.bits - 1)
        out = []
        for j in range(phases):
            codes = ((words >> jnp.uint32(self.bits * j)) & mask).astype(jnp.int32)
            if self.g_idx is None:
                # Group `g` holds words `g * w` to `g * w + w - 1` of a row.
                *lead, n_words = codes.shape
                groups = scale.shape[-1]
                codes = codes.reshape(*lead, groups, n_words // groups)
                zeros = zero[0][..., None].astype(jnp.int32) if zero else offset
                dense = (codes - zeros).astype(scale.dtype) * scale[..., None]
                dense = dense.reshape(*lead, n_words)
            else:
                g_idx = self.g_idx[..., j::phases]
                zeros = _gathered(zero[0], g_idx).astype(jnp.int32) if zero else offset
                dense = (codes - zeros).astype(scale.dtype) * _gathered(scale, g_idx)
            out.append(dense.astype(self.dtype))
        return out

    def with_dtype(self, dtype: Any) -> "GroupedIntArray":
        """A copy whose dequantised values are cast to `dtype` (the arithmetic
        stays in the scale's dtype, as the checkpoint's library computes it)."""
        return dataclasses.replace(self, dtype_name=jnp.dtype(dtype).name)

    def logical_leaf_specs(self, spec: Any) -> "GroupedIntArray":
        # The row leaves as every quantised array's; `g_idx` runs along the
        # stored columns.
        ndim = len(self.stored_shape)
        entries = list(logical_entries(spec, ndim))
        if self.transposed:
            entries[-2], entries[-1] = entries[-1], entries[-2]
        lead = list(range(ndim - 2))
        # Whole groups split with the columns, unless act-order scatters them.
        along = ndim - 1 if self.g_idx is None else None
        rows = follow_axes(entries, [*lead, ndim - 2, along])
        specs: dict[str, Any] = {"packed": rows, "scale": rows}
        if self.zero is not None:
            specs["zero"] = rows
        if self.g_idx is not None:
            specs["g_idx"] = (
                follow_axes(entries, [*lead, ndim - 1])
                if self.g_idx.ndim == ndim - 1
                else PartitionSpec()
            )
        return with_leaf_specs(self, **specs)
