"""Quantising dense weights to the microscaling types: `quantize_mx` (torchao's
`to_mx`, in its FLOOR, RCEIL and EVEN scale modes) and `quantize_nvfp4` (torchao's
`NVFP4Tensor.to_nvfp4`), bit for bit, in their order of operations."""

import functools as ft

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike

from ._base import as_float_matrix, check_block_bytes, DEFAULT_BLOCK_BYTES, pack_nibbles
from ._microscaling import (
    _BAD_FORMAT_MSG,
    _E8M0_NAN,
    _ELEMENTS,
    MX_BLOCK,
    MXArray,
    NVFP4_BLOCK,
    NVFP4Array,
)


_BAD_MODE_MSG = (
    '`{function}`: `scale_mode` must be "floor" (the OCP MX spec\'s and torchao '
    "`to_mx`'s default), \"rceil\" (torchao's inference default, NVIDIA's cuBLAS "
    'rule) or "even" (compressed-tensors\' rule); got {got!r}.'
)
_BAD_BLOCKS_MSG = (
    "`{function}`: the input dimension {size} of the weight of shape {shape} must be "
    "a multiple of the block size {block} ({fmt} blocks run along the inputs of a "
    "row). Leave this weight out with `where=`."
)

# The largest element, and the exponent of the largest power of two below it.
_MAX = {"e4m3": 448.0, "e2m1": 6.0}
_MAX_POW2 = {"e4m3": 8, "e2m1": 2}
_MANTISSA_BITS = {"e4m3": 3, "e2m1": 1}
_SCALE_MODES = ("floor", "rceil", "even")
_F32_MIN_NORMAL = 2.0**-126
_E4M3_TINY = 2.0**-6  # the smallest normal e4m3, NVFP4's least block scale


def _round_e2m1(x: Array) -> Array:
    """e2m1 codes (`uint8` in `[0, 15]`) of float32 values already scaled into
    `[-6, 6]`: the nearest value, ties to the even code, saturating, the sign bit
    kept (a negative value that rounds to zero is code 8), as torchao's
    `f32_to_f4_unpacked` and compressed-tensors' `cast_to_fp4` round."""
    a = jnp.abs(x)
    # The midpoints between neighbouring values; at a tie the even code wins:
    # (a >= t) where the code above is even, (a > t) where it is odd.
    # (Each comparison cast on its own: `uint8 + bool` has no promotion under
    # `jax.numpy_dtype_promotion("strict")`.)
    steps = (a > 0.25, a >= 0.75, a > 1.25, a >= 1.75, a > 2.5, a >= 3.5, a > 5.0)
    code = sum((step.astype(jnp.uint8) for step in steps[1:]), steps[0].astype(jnp.uint8))
    return code | (jnp.signbit(x).astype(jnp.uint8) << 3)


def _encode(x: Array, element: str) -> Array:
    """The codes of scaled float32 values `x` (clamped into the element's range)."""
    x = jnp.clip(x, -_MAX[element], _MAX[element])
    if element == "e4m3":
        # XLA's conversion rounds to nearest even, as torch's (tested bit for bit).
        return lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8)
    return pack_nibbles(_round_e2m1(x))


def _exponent_field(x: Array) -> Array:
    """The biased exponent field of float32 values, as int32."""
    return ((lax.bitcast_convert_type(x, jnp.uint32) >> 23) & 0xFF).astype(jnp.int32)


def _ceil_log2(x: Array) -> Array:
    """`ceil(log2(x))` of non-negative float32 values, exactly, from their bits."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    exponent = _exponent_field(x) - 127
    inexact = (bits & 0x7FFFFF) != 0
    normal = exponent + inexact.astype(jnp.int32)
    # Subnormals (and 0) lie below 2**-126: -126 above 2**-127, else -127.
    return jnp.where(exponent == -127, jnp.where(x > 2.0**-127, -126, -127), normal)


@ft.partial(jax.jit, static_argnums=(1, 2))
def _mx_arrays(w: Array, element: str, scale_mode: str) -> tuple[Array, Array]:
    *lead, size = w.shape
    x = w.astype(jnp.float32).reshape(*lead, size // MX_BLOCK, MX_BLOCK)
    amax = jnp.max(jnp.abs(x), axis=-1)
    if scale_mode == "rceil":
        # torchao's `_to_mx_rceil`: the exponent of `amax / max` rounded up; the
        # elements times the reciprocal power of two.
        descale = amax / _MAX[element]
        finite = jnp.clip(_ceil_log2(descale), -127, 127) + 127
        exponent = jnp.where(jnp.isinf(descale), 254, finite)
        exponent = jnp.where(jnp.isnan(descale), _E8M0_NAN, exponent).astype(jnp.uint8)
        e = exponent.astype(jnp.int32)
        reciprocal = lax.bitcast_convert_type(((254 - e) << 23).astype(jnp.uint32), jnp.float32)
        reciprocal = jnp.where(e == 0, 1.0, reciprocal)
        reciprocal = jnp.where(e == 254, jnp.float32(2.0**-127), reciprocal)
        reciprocal = jnp.where(e == _E8M0_NAN, descale, reciprocal)
        return _encode(x * reciprocal[..., None], element).reshape(*lead, -1), exponent
    # torchao's FLOOR and EVEN (OCP's rule, and compressed-tensors' rounding of the
    # maximum to a power of two): the exponent of the block maximum, less the
    # exponent of the element's largest power of two.
    if scale_mode == "even":
        bump = 1 << (23 - _MANTISSA_BITS[element] - 1)
        bits = (lax.bitcast_convert_type(amax, jnp.uint32) + bump) & jnp.uint32(0xFF800000)
        amax = jnp.where(jnp.isnan(amax), amax, lax.bitcast_convert_type(bits, jnp.float32))
    unbiased = jnp.clip(_exponent_field(amax) - 127 - _MAX_POW2[element], -127, 128)
    exponent = jnp.where(jnp.isnan(amax), _E8M0_NAN, unbiased + 127).astype(jnp.uint8)
    scale = lax.bitcast_convert_type(exponent.astype(jnp.uint32) << 23, jnp.float32)
    # torchao divides by at least the smallest normal float32 (2**-126 for the
    # exponent 0, whose value is 2**-127).
    scale = jnp.maximum(scale, _F32_MIN_NORMAL)
    return _encode(x / scale[..., None], element).reshape(*lead, -1), exponent


def _check_blocks(w: Array, block: int, fmt: str, function: str) -> None:
    if w.shape[-1] % block:
        raise ValueError(
            _BAD_BLOCKS_MSG.format(
                function=function, size=w.shape[-1], shape=w.shape, block=block, fmt=fmt
            )
        )


def quantize_mx(
    w: ArrayLike,
    *,
    format: str = "mxfp8",
    scale_mode: str = "floor",
    allow_materialise: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    matmul: str | None = None,
) -> MXArray:
    """Quantise a dense weight to an OCP Microscaling format, blocks of 32 inputs.

    The codes and scales are torchao's `to_mx(w, elem_dtype, 32, scaling_mode)`,
    bit for bit (tested against torchao 0.18's output): each block's E8M0 scale
    from its largest magnitude, the elements divided by it (or, for `"rceil"`,
    multiplied by its reciprocal), clamped to the element's range and rounded to
    the nearest element, ties to even.

    **Arguments:**

    - `w`: a floating-point weight `(*batch, out, in)`, `in` a multiple of 32.
    - `format`: `"mxfp8"` (float8 e4m3 elements, largest 448) or `"mxfp4"` (fp4
        e2m1 elements, largest 6, two per byte).
    - `scale_mode`: how a block's exponent is chosen from its maximum `m`:
        `"floor"`, `floor(log2 m) - emax` (the OCP spec's, torchao `to_mx`'s
        default; the largest elements may saturate); `"even"`, the same after
        rounding `m`'s mantissa to the element's precision (compressed-tensors'
        `generate_mx_scales`, torchao's EVEN); `"rceil"`, `ceil(log2(m / max))`
        (torchao's inference default, NVIDIA's cuBLAS rule; nothing saturates).
    - `allow_materialise`, `block_bytes`, `matmul`: as for `Int4Array`.

    **Returns:**

    An `MXArray` of `w`'s shape and dtype.

    !!! example

        ```python
        w = quantize_mx(jnp.array([[0.5, -3.0] * 16]), format="mxfp4")
        assert jnp.array_equal(w.dequantize(), jnp.array([[0.5, -3.0] * 16]))
        ```
    """
    w = as_float_matrix(w, "quantize_mx")
    if format not in _ELEMENTS:
        raise ValueError(_BAD_FORMAT_MSG.format(function="quantize_mx", got=format))
    if scale_mode not in _SCALE_MODES:
        raise ValueError(_BAD_MODE_MSG.format(function="quantize_mx", got=scale_mode))
    _check_blocks(w, MX_BLOCK, format, "quantize_mx")
    check_block_bytes(block_bytes, "quantize_mx")
    qdata, scale = _mx_arrays(w, _ELEMENTS[format], scale_mode)
    return MXArray(
        qdata=qdata,
        scale=scale,
        format=format,
        dtype_name=w.dtype.name,
        allow_materialise=allow_materialise,
        block_bytes=block_bytes,
        matmul=matmul,
    )


@ft.partial(jax.jit, static_argnums=1)
def _nvfp4_arrays(w: Array, tensor_scale: bool) -> tuple[Array, Array, Array]:
    *lead, out, size = w.shape
    x = w.astype(jnp.float32).reshape(*lead, out, size // NVFP4_BLOCK, NVFP4_BLOCK)
    if tensor_scale:
        # torchao's `per_tensor_amax_to_scale`: one per matrix of a stack.
        amax = jnp.max(jnp.abs(x), axis=(-3, -2, -1), keepdims=True)[..., 0]
        per_tensor = amax / (_MAX["e4m3"] * _MAX["e2m1"])
    else:
        per_tensor = jnp.ones((*lead, 1, 1), jnp.float32)
    # torchao's `nvfp4_quantize`, in its order of operations: the block scales
    # over the per-tensor scale in e4m3 (at least its smallest normal), the
    # elements times the reciprocal of both.
    block = jnp.max(jnp.abs(x), axis=-1) / _MAX["e2m1"]
    block_e4m3 = jnp.clip(block / per_tensor, _E4M3_TINY, _MAX["e4m3"]).astype(jnp.float8_e4m3fn)
    reciprocal = (1.0 / per_tensor) / block_e4m3.astype(jnp.float32)
    qdata = _encode(x * reciprocal[..., None], "e2m1").reshape(*lead, out, -1)
    return qdata, lax.bitcast_convert_type(block_e4m3, jnp.uint8), per_tensor


def quantize_nvfp4(
    w: ArrayLike,
    *,
    tensor_scale: bool = True,
    allow_materialise: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    matmul: str | None = None,
) -> NVFP4Array:
    """Quantise a dense weight to NVFP4: fp4 e2m1 elements in blocks of 16 inputs,
    e4m3 block scales, one float32 scale per matrix.

    The codes and scales are torchao's `NVFP4Tensor.to_nvfp4(w, per_tensor_scale=
    per_tensor_amax_to_scale(amax(w)))`, as its `NVFP4WeightOnlyConfig` calls it,
    bit for bit (tested against torchao 0.18): the per-tensor scale `amax / (448
    * 6)`, each block's scale `(block amax / 6) / per_tensor_scale` rounded to
    e4m3 (at least 2**-6), the elements times `(1 / per_tensor_scale) / scale`
    rounded to e2m1, ties to even.

    **Arguments:**

    - `w`: a floating-point weight `(*batch, out, in)`, `in` a multiple of 16.
        A stack `(*batch, out, in)` gets one per-tensor scale per matrix (torchao's
        per-expert scales).
    - `tensor_scale`: `False` for torchao's single-level scaling (block scales
        `block amax / 6` in e4m3 alone; the per-tensor scale is then 1).
    - `allow_materialise`, `block_bytes`, `matmul`: as for `Int4Array`.

    **Returns:**

    An `NVFP4Array` of `w`'s shape and dtype.

    !!! example

        ```python
        w = quantize_nvfp4(jr.normal(jr.key(0), (8, 32)))
        err = jnp.abs(w.dequantize() - jr.normal(jr.key(0), (8, 32))).max()
        ```
    """
    w = as_float_matrix(w, "quantize_nvfp4")
    _check_blocks(w, NVFP4_BLOCK, "nvfp4", "quantize_nvfp4")
    check_block_bytes(block_bytes, "quantize_nvfp4")
    qdata, scale, per_tensor = _nvfp4_arrays(w, bool(tensor_scale))
    return NVFP4Array(
        qdata=qdata,
        scale=scale,
        per_tensor_scale=per_tensor,
        dtype_name=w.dtype.name,
        allow_materialise=allow_materialise,
        block_bytes=block_bytes,
        matmul=matmul,
    )
