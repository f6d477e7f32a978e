"""The grids that weights are rounded onto, shared by round-to-nearest, GPTQ and
AWQ: symmetric integers with an absmax scale per group (`Int8Array`,
`Int4Array`, and 3 or 2 bits stored in an `Int4Array`'s nibbles) and NF4 levels
times a group's absmax (`NF4Array`); and building the quantised arrays from
codes and scales. Rounding here gives bit for bit the codes of
`quantize_int8`, `quantize_int4` and `quantize_nf4`."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._base import pack_nibbles
from ._nf4 import _NF4_MIDPOINTS, NF4_LEVELS, NF4Array
from ._value import _absmax_scale, _INT4_OFFSET, Int4Array, Int8Array


class Grid(NamedTuple):
    """How a weight is rounded: `kind` `"int"` (codes in `[-code_max, code_max]`
    times a scale `absmax / code_max`) or `"nf4"` (an NF4 level times the
    absmax); `group_size` consecutive inputs share a scale (`None`: a whole row).
    """

    kind: str
    code_max: int
    group_size: int | None

    def groups(self, size: int) -> int:
        """How many inputs share a scale, for rows of `size` inputs."""
        return size if self.group_size is None else self.group_size


#: The symmetric integer range of each integer width: 3 and 2 bits are stored in
#: an `Int4Array`, whose nibbles hold any code in `[-7, 7]`.
CODE_MAX = {8: 127, 4: 7, 3: 3, 2: 1}


def grid_for(bits: int | str, group_size: int | None) -> Grid:
    """The `Grid` of `quantize(bits=...)`, with its default group size."""
    if bits == "nf4":
        return Grid("nf4", 0, group_size or 64)
    if bits == 8:
        return Grid("int", CODE_MAX[8], None)
    assert isinstance(bits, int)  # `quantize` checked it
    return Grid("int", CODE_MAX[bits], group_size or 32)


def group_scale(grid: Grid, w: Array) -> Array:
    """The scale of each group `w[..., :]` (the last axis is the group): the
    absmax over `code_max` for integers, the absmax itself for NF4."""
    if grid.kind == "nf4":
        return jnp.max(jnp.abs(w), axis=-1)
    return _absmax_scale(w, -1, grid.code_max)


def round_to_grid(grid: Grid, w: Array, scale: Array) -> tuple[Array, Array]:
    """The codes (`int32`) of `w` with `scale` (broadcast against it) and the
    values they stand for, as `quantize_int4`/`quantize_nf4` round."""
    if grid.kind == "nf4":
        divisor = jnp.where(scale > 0, scale, jnp.ones_like(scale))
        codes = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS, w.dtype), w / divisor)
        return codes.astype(jnp.int32), jnp.asarray(NF4_LEVELS, w.dtype)[codes] * scale
    codes = jnp.clip(jnp.round(w / scale), -grid.code_max, grid.code_max)
    return codes.astype(jnp.int32), codes * scale


def fake_quantize(grid: Grid, w: Array) -> Array:
    """The dense weight that round-to-nearest on `grid` stands for (`w` is
    `(..., out, in)`)."""
    *lead, size = w.shape
    g = grid.groups(size)
    groups = w.reshape(*lead, size // g, g)
    _, values = round_to_grid(grid, groups, group_scale(grid, groups)[..., None])
    return values.reshape(w.shape)


def rtn_codes(grid: Grid, w: Array) -> tuple[Array, Array]:
    """Round-to-nearest codes `(..., out, in)` and scales `(..., out, groups)`."""
    *lead, size = w.shape
    g = grid.groups(size)
    groups = w.reshape(*lead, size // g, g)
    scale = group_scale(grid, groups).astype(w.dtype)
    codes, _ = round_to_grid(grid, groups, scale[..., None])
    return codes.reshape(w.shape), scale


def build(
    grid: Grid, codes: Array, scale: Array, dtype, **options
) -> Int8Array | Int4Array | NF4Array:
    """The quantised array of `codes` `(*batch, out, in)` and `scale` `(*batch,
    out, groups)` on `grid`, its scales in `dtype`; `options` as for
    `Int4Array`."""
    scale = jnp.asarray(scale, dtype)
    if grid.kind == "nf4":
        return NF4Array(packed=pack_nibbles(codes), scale=scale, **options)
    if grid.group_size is None:
        return Int8Array(values=codes.astype(jnp.int8), scale=scale[..., 0], **options)
    return Int4Array(packed=pack_nibbles(codes + _INT4_OFFSET), scale=scale, **options)


@jax.jit
def layer_error(w: Array, w_hat: Array, gram: Array) -> Array:
    """`sum ‖(w - w_hat) x‖²` over the calibration rows `x`, from their `gram`
    `sum x xᵀ`: the squared output error of the layer on the calibration data."""
    delta = (w - w_hat).astype(jnp.float32)
    return jnp.sum(jnp.einsum("...oi,...ij->...oj", delta, gram) * delta)
