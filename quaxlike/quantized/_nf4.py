"""`NF4Array`: 4-bit NormalFloat codes (the QLoRA paper's data type) with an absmax
per group of inputs, optionally double-quantised (the absmaxes themselves stored
in 8 bits), and `quantize_nf4`."""

import dataclasses
import functools as ft
import statistics
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, Float, UInt8

from ._base import (
    as_float_matrix,
    check_block_bytes,
    check_group_size,
    DEFAULT_BLOCK_BYTES,
    dequantize_rows,
    explicit_sharding,
    nibble_halves,
    pack_nibbles,
    QuantizedArray,
    unpack_nibbles,
)


_BAD_DOUBLE_QUANT_BLOCK_MSG = (
    "`quantize_nf4`: `double_quant_block` (how many group scales share one "
    "second-level scale) must be a positive int; got {got!r}."
)
_BAD_LEAVES_MSG = (
    "NF4Array: `packed` must have shape `(*batch, out, in // 2)`; `scale` (without "
    "double quantisation) `(*batch, out, in // group_size)` with an even group size, "
    "or (with it) `absmax` that shape in `uint8` and `scale` `(*batch, out // r, k)` "
    "for an `r` dividing `out` and a `k` dividing the groups of a row; got packed "
    "{packed}, scale {scale} and absmax {absmax}."
)
# Double quantisation stores each group's absmax as an unsigned 8-bit code.
_ABSMAX_CODE_MAX = 255


def normal_float_levels(bits: int = 4) -> np.ndarray:
    """The `2**bits` levels of the NormalFloat data type (Dettmers et al., "QLoRA",
    2023): quantiles of a standard normal distribution, scaled into `[-1, 1]`, with
    an exact zero.

    An even number of levels cannot be symmetric and hold a zero, so the two
    halves are estimated apart: `2**(bits-1)` positive quantiles, at probabilities
    evenly spaced from `1/2` (left out: it is the zero) to `1 - delta`, and
    `2**(bits-1) - 1` negative ones, evenly spaced from `1/2` to `delta`. The
    outermost probability `delta` stays off 0, whose quantile is infinite: it is
    the mean of `1 / (2 (n - 1))` and `1 / (2 n)` for `n = 2**bits` levels. The
    levels are divided by the largest, so that both ends are exactly `-1` and `1`.

    **Arguments:**

    - `bits`: how many bits a code has (4 for NF4).

    **Returns:**

    The levels as a sorted `float64` NumPy array, computed with the inverse of the
    normal distribution function in Python's `statistics` (no table is copied).

    !!! example

        ```python
        levels = normal_float_levels()
        assert levels.shape == (16,) and levels[0] == -1 and levels[-1] == 1
        assert 0.0 in levels
        ```
    """
    n = 2**bits
    delta = (1 / (2 * (n - 1)) + 1 / (2 * n)) / 2
    quantile = statistics.NormalDist().inv_cdf
    half = n // 2
    positive = [quantile(p) for p in np.linspace(1 - delta, 0.5, half + 1)[:-1]]
    negative = [-quantile(p) for p in np.linspace(1 - delta, 0.5, half)[:-1]]
    levels = np.sort(np.array([*positive, 0.0, *negative]))
    return levels / levels.max()


#: The 16 levels of NF4, and the midpoints between neighbours (where rounding to
#: the nearest level changes from one to the next).
NF4_LEVELS = normal_float_levels(4)
_NF4_MIDPOINTS = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2


def _levels(nibbles: Array, dtype) -> Array:
    """The NF4 levels of the codes `nibbles` (`uint8` in `[0, 15]`): a lookup in a
    table of 16, which `largest_dequantized` counts as a dequantisation. Codes
    sharded along an explicit mesh axis give levels sharded as they are (JAX asks
    for the lookup's `out_sharding` there)."""
    table = jnp.asarray(NF4_LEVELS, dtype)
    sharding = explicit_sharding(nibbles)
    if sharding is None:
        return table.at[nibbles].get(mode="promise_in_bounds")
    return table.at[nibbles].get(mode="promise_in_bounds", out_sharding=sharding)


class NF4Array(QuantizedArray):
    """A weight quantised to 4-bit NormalFloat codes, one absmax per group of inputs,
    optionally double-quantised.

    Each row of the weight is cut into groups of `group_size` consecutive inputs;
    a group is stored as its absmax `max(abs(group))` and, for each input, the
    index of the NF4 level (`NF4_LEVELS`, the 16 quantiles of a standard normal
    scaled into `[-1, 1]`) nearest to `input / absmax`. Normally distributed
    weights fill the levels about evenly, which is why NF4 loses less than
    evenly spaced 4-bit codes. Two codes share one byte of `packed` (low nibble
    first). Build one with `quantize_nf4`.

    With double quantisation the absmaxes are stored as `uint8` codes (`absmax`)
    times a second-level scale, one per block of about 256 absmaxes (`scale`):
    the scales then cost 8.1 bits per group instead of 32, about 0.127 bits per
    parameter for groups of 64 instead of 0.5.

    **Arguments:**

    - `packed`: the level indices, two per `uint8`, shape `(*batch, out, in // 2)`.
    - `scale`: without double quantisation, the absmaxes, floating point, shape
        `(*batch, out, in // group_size)`. With it, the second-level scales, shape
        `(*batch, out // r, k)`: entry `[..., i, j]` scales the absmaxes of rows
        `r i` to `r i + r - 1` and of the `j`-th of `k` equal slices of their
        groups. Their dtype is the array's dtype.
    - `absmax`: `None` without double quantisation; with it, the absmaxes' codes,
        `uint8`, shape `(*batch, out, in // group_size)`: a group's absmax is
        `absmax * scale` (of its block).
    - `transposed`, `allow_materialise`, `block_bytes`, `matmul`: as for
        `Int4Array`.

    !!! example

        ```python
        w = quantize_nf4(jr.normal(jr.key(0), (8, 128)), group_size=64)
        w.packed.shape, w.scale.shape  # (8, 64), (8, 2)
        d = quantize_nf4(jr.normal(jr.key(0), (8, 128)), double_quant=True)
        d.absmax.shape, d.scale.shape  # (8, 2), (1, 1): one block of 16 absmaxes
        ```
    """

    packed: UInt8[Array, "*batch out half_in"]  # noqa: F722
    scale: Float[Array, "..."]
    absmax: UInt8[Array, "*batch out groups"] | None = None  # noqa: F722
    transposed: bool = eqx.field(static=True, default=False)
    allow_materialise: bool = eqx.field(static=True, default=False)
    block_bytes: int = eqx.field(static=True, default=DEFAULT_BLOCK_BYTES)
    matmul: str | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        *batch, out, half = self.packed.shape
        groups = self.scale if self.absmax is None else self.absmax
        ok = (
            self.packed.ndim >= 2
            and groups.shape[:-1] == (*batch, out)
            and groups.shape[-1] > 0
            and (2 * half) % groups.shape[-1] == 0
            and (2 * half // groups.shape[-1]) % 2 == 0
        )
        if ok and self.absmax is not None:
            *scale_batch, scale_rows, k = self.scale.shape
            ok = (
                tuple(scale_batch) == tuple(batch)
                and scale_rows > 0
                and out % scale_rows == 0
                and k > 0
                and groups.shape[-1] % k == 0
            )
        if not ok:
            absmax = None if self.absmax is None else self.absmax.shape
            raise ValueError(
                _BAD_LEAVES_MSG.format(
                    packed=self.packed.shape, scale=self.scale.shape, absmax=absmax
                )
            )

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    phases: ClassVar[int] = 2

    @property
    def double_quantized(self) -> bool:
        """Whether the absmaxes are stored in 8 bits (`absmax`) with second-level
        scales (`scale`)."""
        return self.absmax is not None

    @property
    def group_size(self) -> int:
        groups = self.scale if self.absmax is None else self.absmax
        return 2 * self.packed.shape[-1] // groups.shape[-1]

    @property
    def double_quant_rows(self) -> int:
        """`r`: how many consecutive rows share one second-level scale (1 without
        double quantisation, where every row has scales of its own)."""
        if self.absmax is None:
            return 1
        return self.packed.shape[-2] // self.scale.shape[-2]

    def row_leaves(self) -> tuple[Array, ...]:
        if self.absmax is None:
            return self.packed, self.scale
        # The second-level scales, one per row: a block's rows share theirs.
        return self.packed, self.absmax, repeat_rows(self.scale, self.double_quant_rows)

    def with_row_leaves(self, *leaves: Array) -> "NF4Array":
        """A copy with the leaves `row_leaves` describes replaced. With double
        quantisation, leaves with as many rows as this array's are these rows in
        their order (what every rule that keeps the rows whole passes): their
        second-level scales, one per row in `row_leaves`, are stored one per
        block again, as `quantize_nf4` stores them. Fewer rows (cut out at an
        index that may be traced, so not on a block's edge) keep one per row."""
        if len(leaves) == 2:
            packed, scale = leaves
            return dataclasses.replace(self, packed=packed, scale=scale)
        packed, absmax, scale = leaves
        r = self.double_quant_rows
        rows = packed.shape[-2]
        if r > 1 and rows == self.packed.shape[-2] and scale.shape[-2] == rows:
            # This array's own rows, whole (an operation on the batch axes, as
            # indexing a stack of layers is): one scale per block, not per row
            # (`r` times the bytes). XLA folds the repeat and this back into a
            # slice of the stored scales.
            scale = per_block(scale, r)
        return dataclasses.replace(self, packed=packed, absmax=absmax, scale=scale)

    def unpack(self, data: Array) -> UInt8[Array, "..."]:  # noqa: F722
        return unpack_nibbles(data)

    def codes(self) -> UInt8[Array, "*batch out in"]:  # noqa: F722
        """The level indices in `[0, 15]` (`NF4_LEVELS[codes]` times the group's
        absmax is the weight), as `uint8`, in stored layout `(*batch, out, in)`."""
        return self.unpack(self.packed)

    def group_absmax(self, *scales: Array) -> Array:
        """The groups' absmaxes `(..., n_groups)` from the scale leaves of
        `row_leaves` (after `data`): the absmaxes themselves, or their codes and the
        second-level scales of their rows."""
        if len(scales) == 1:
            return scales[0]
        codes, second = scales
        return dequantize_rows(codes, second)

    def dequantize_leaves(self, *leaves: Array) -> Array:
        data, *scales = leaves
        absmax = self.group_absmax(*scales)
        return dequantize_rows(_levels(self.unpack(data), absmax.dtype), absmax)

    def dequantize_phases(self, *leaves: Array) -> list[Array]:
        # Even and odd columns (low and high nibbles) apart, as for `Int4Array`.
        data, *scales = leaves
        absmax = self.group_absmax(*scales)
        return [dequantize_rows(_levels(h, absmax.dtype), absmax) for h in nibble_halves(data)]


def repeat_rows(x: Array, times: int) -> Array:
    """`x` with each row (axis -2) repeated `times` times in place, as
    `jnp.repeat(x, times, axis=-2)`, written as a broadcast and a reshape that
    merges the rows with their copies: the rows keep their sharding, also along
    an explicitly sharded mesh axis, where `jnp.repeat` asks for an
    `out_sharding`."""
    *batch, rows, k = x.shape
    kept = (*range(len(batch) + 1), len(batch) + 2)  # every axis but the copies'
    copies = lax.broadcast_in_dim(x, (*batch, rows, times, k), kept)
    return copies.reshape(*batch, rows * times, k)


def per_block(x: Array, times: int) -> Array:
    """The inverse of `repeat_rows`: the first row of each run of `times` rows of
    `x` (axis -2), whose rows are equal in runs of `times`. Written as a reshape
    that splits the rows from their copies and an index into the copies, so the
    rows keep their sharding, as `repeat_rows`'s do."""
    *batch, rows, k = x.shape
    runs = x.reshape(*batch, rows // times, times, k)
    return lax.index_in_dim(runs, 0, axis=len(batch) + 1, keepdims=False)


def double_quant_layout(out: int, n_groups: int, block: int) -> tuple[int, int]:
    """`(r, k)`: second-level blocks of `r` whole rows times `n_groups / k` groups
    each, as close to `block` absmaxes as `out` and `n_groups` allow without
    exceeding it (a block that does not cut rows unevenly can be sliced with them).
    """
    k = next(k for k in range(1, n_groups + 1) if n_groups % k == 0 and n_groups // k <= block)
    per_row = n_groups // k
    r = max(r for r in range(1, out + 1) if out % r == 0 and r * per_row <= block)
    return r, k


@ft.partial(jax.jit, static_argnums=(1, 2))
def _quantize_nf4_arrays(
    w: Array, group_size: int, double_quant_block: int | None
) -> tuple[Array, Array, Array | None]:
    *batch, out, size = w.shape
    n_groups = size // group_size
    groups = w.reshape(*batch, out, n_groups, group_size)
    absmax = jnp.max(jnp.abs(groups), axis=-1)
    codes = None
    scale = absmax
    if double_quant_block is not None:
        r, k = double_quant_layout(out, n_groups, double_quant_block)
        blocks = absmax.reshape(*batch, out // r, r, k, n_groups // k)
        scale = jnp.max(blocks, axis=(-3, -1)) / _ABSMAX_CODE_MAX
        scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
        ratio = blocks / scale[..., None, :, None]
        codes = jnp.clip(jnp.round(ratio), 0, _ABSMAX_CODE_MAX).astype(jnp.uint8)
        codes = codes.reshape(*batch, out, n_groups)
        # The codes are rounded against the absmaxes as stored, so that a group
        # whose absmax was rounded down still reaches its extremes (at level +-1).
        absmax = dequantize_rows(codes, repeat_rows(scale, r))
    divisor = jnp.where(absmax > 0, absmax, jnp.ones_like(absmax))
    normalised = groups / divisor[..., None]
    levels = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS, w.dtype), normalised)
    return pack_nibbles(levels.reshape(w.shape)), scale, codes


def quantize_nf4(
    w: ArrayLike,
    *,
    group_size: int = 64,
    double_quant: bool = False,
    double_quant_block: int = 256,
    allow_materialise: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    matmul: str | None = None,
) -> NF4Array:
    """Quantise a dense weight to 4-bit NormalFloat (NF4), one absmax per group of
    inputs, as QLoRA does.

    **Arguments:**

    - `w`: a floating-point weight of shape `(*batch, out, in)`, such as the weight
        of an `eqx.nn.Linear`.
    - `group_size`: how many consecutive inputs of a row share an absmax (64 in
        the QLoRA paper). It must be even and divide `in`.
    - `double_quant`: also quantise the absmaxes, to unsigned 8-bit codes with one
        float scale (the block's largest absmax / 255) per block of about
        `double_quant_block` absmaxes: 4.127 bits per parameter for groups of 64,
        rather than 4.5.
    - `double_quant_block`: how many absmaxes share a second-level scale, at
        most; a block takes whole rows (several when a row has fewer groups) or
        equal slices of a row's groups.
    - `allow_materialise`, `block_bytes`, `matmul`: as for `NF4Array`.

    **Returns:**

    An `NF4Array` in which each element is the NF4 level nearest to `element /
    absmax`, times `absmax` (the group's absmax, as stored).

    !!! example

        ```python
        w = jr.normal(jr.key(0), (64, 256))
        q = quantize_nf4(w, double_quant=True)
        bits = 8 * sum(x.nbytes for x in jax.tree.leaves(q)) / w.size  # 4.127
        ```
    """
    w = as_float_matrix(w, "quantize_nf4")
    check_group_size(w.shape, group_size, "quantize_nf4")
    check_block_bytes(block_bytes, "quantize_nf4")
    block = double_quant_block
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(_BAD_DOUBLE_QUANT_BLOCK_MSG.format(got=block))
    packed, scale, absmax = _quantize_nf4_arrays(w, group_size, block if double_quant else None)
    return NF4Array(
        packed=packed,
        scale=scale,
        absmax=absmax,
        allow_materialise=allow_materialise,
        block_bytes=block_bytes,
        matmul=matmul,
    )
