"""The quantised array types, their constructors, and `quantize` for whole models."""

import dataclasses
import functools as ft
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, ArrayLike, Float, Int8, PyTree, UInt8

from ..selection import replace_selected
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
from ._nf4 import quantize_nf4


_BAD_BITS_MSG = (
    '`quantize`: `bits` must be 8, 4, 3 or 2, or "nf4" for NormalFloat codes; got {bits!r}.'
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


def quantize(
    model: PyTree,
    *,
    bits: int | str = 8,
    group_size: int | None = None,
    double_quant: bool = False,
    where: Any = None,
    allow_materialise: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    matmul: str | None = None,
    method: Any = "rtn",
    calibration: Iterable[Any] | None = None,
    run: Callable[[Any, Any], Any] | None = None,
) -> PyTree:
    """Replace the weight of every `eqx.nn.Linear` in `model` by a quantised one.

    Biases and every other leaf stay as they are. Call the result with
    `quaxlike.quaxify(model)(x)`. The integer codes are not differentiable; the
    scales are floating-point leaves, so `eqx.filter_grad` gives gradients for them
    (and for the biases) and `None` for the codes, while `jax.grad` refuses the
    model because of its integer leaves.

    **Arguments:**

    - `model`: any PyTree holding Equinox layers.
    - `bits`: 8 for `Int8Array` (per output channel), 4 for `Int4Array` (per
        group) or `"nf4"` for `NF4Array` (4-bit NormalFloat codes, per group);
        3 or 2 for codes in `[-3, 3]` or `[-1, 1]` stored in an `Int4Array`
        (the accuracy of 3 or 2 bits, the memory of 4).
    - `group_size`: the group size for `bits=4`, 3 and 2 (default 32) and
        `"nf4"` (default 64); ignored for 8.
    - `double_quant`: for `bits="nf4"` only: quantise the groups' scales to 8 bits
        too (see `quantize_nf4`).
    - `where`: instead of every `Linear` weight, the weights to quantise: any
        selection of `quaxlike.selection`, as `loraify` takes it (check
        one with `select(model, where)`): a path pattern (`"layers.*.weight"`,
        `"**.query_proj"`), a module type or `module(eqx.nn.Linear,
        out_features=10)`, a predicate `(path, leaf) -> bool`, a getter returning
        the arrays (as for `eqx.tree_at`: one array, or a list or tuple of them),
        or a list of these.
    - `allow_materialise`, `matmul`: as for `Int8Array`, `Int4Array` and `NF4Array`.
    - `block_bytes`: the most bytes of dequantised weight a matrix product builds
        at a time (default 512 KiB). A matrix product dequantises its weight in
        blocks of whole rows, one after another inside a loop, and at least two
        blocks, so that no dense copy of a weight is ever alive; a larger block
        means fewer, larger steps (faster, up to the size of the cache) and more
        memory. See benchmarks/README.md for the trade-off measured.
    - `method`: how the codes are chosen. `"rtn"` (the default) rounds each
        weight to the nearest code. `"gptq"` (or `GPTQ(...)` for its options)
        rounds column by column, spreading each column's error over the columns
        not yet rounded so that the layer's output on the calibration data
        changes least (Frantar et al., 2022). `"awq"` (or `AWQ(...)`) scales the
        weight's input channels by the calibration inputs' magnitudes before
        rounding (Lin et al., 2023); the weight becomes an `InputScaled` over the
        quantised array, which divides its inputs by the scales again. Both
        give the codes and scales of the same types as `"rtn"`.
    - `calibration`: for `"gptq"` and `"awq"`, an iterable of batches the model
        is run on to record each selected weight's inputs (see the
        calibration section of `quaxlike.quantized`'s README).
    - `run`: `run(model, batch)` runs the model on one calibration batch;
        by default `jax.vmap(model)(batch)`, Equinox's convention.

    **Returns:**

    The model with quantised weights.

    **Raises:**

    `ValueError` if `where` is not given and the model has no `eqx.nn.Linear`, or
    `where` selects nothing (rather than returning the model unchanged);
    `CalibrationError` (a `ValueError`) if calibration cannot run or a weight
    cannot be calibrated as the model uses it (the message says why).

    !!! example

        ```python
        mlp = eqx.nn.MLP(64, 8, 64, depth=2, key=jax.random.key(0))
        qmlp = quantize(mlp, bits=4, group_size=32)
        y = eqx.filter_jit(quaxlike.quaxify(qmlp))(jnp.ones(64))
        ```
    """
    options = dict(allow_materialise=allow_materialise, block_bytes=block_bytes, matmul=matmul)
    if double_quant and bits != "nf4":
        raise ValueError(_DOUBLE_QUANT_MSG.format(bits=bits))
    if method != "rtn" or calibration is not None or run is not None or bits in (3, 2):
        from ._calibrated import calibrated_quantize

        return calibrated_quantize(
            model, method, calibration, run, bits, group_size, double_quant, where, options
        )
    if bits == 8:
        make = ft.partial(quantize_int8, **options)
    elif bits == 4:
        make = ft.partial(quantize_int4, group_size=group_size or 32, **options)
    elif bits == "nf4":
        make = ft.partial(
            quantize_nf4, group_size=group_size or 64, double_quant=double_quant, **options
        )
    else:
        raise ValueError(_BAD_BITS_MSG.format(bits=bits))
    if where is None:
        where = default_where(model)
    return replace_selected(model, where, make, "quantize")


def dequantize(model: PyTree) -> PyTree:
    """Replace every quantised array in `model` by its dense weight
    (`QuantizedArray.dequantize`): the plain-JAX model the quantised one computes.

    **Arguments:**

    - `model`: any PyTree holding `QuantizedArray`s, such as the output of
        `quantize`.

    **Returns:**

    The same PyTree with every `Int8Array` and `Int4Array` replaced by the dense
    array `codes * scale` it stands for (and every `InputScaled` of `method="awq"`
    by `codes * scale / input_scale`); it runs without `quaxify`.

    !!! example

        ```python
        mlp = eqx.nn.MLP(8, 2, 16, depth=1, key=jr.key(0))
        qmlp = quantize(mlp, bits=8)
        x = jnp.ones(8)
        assert jnp.allclose(quaxlike.quaxify(qmlp)(x), dequantize(qmlp)(x), atol=1e-5)
        ```
    """
    from ._awq import InputScaled  # AWQ's weights (`_awq` builds on this module)

    is_quantized = lambda x: isinstance(x, (QuantizedArray, InputScaled))  # noqa: E731
    return jtu.tree_map(
        lambda x: x.dequantize() if is_quantized(x) else x, model, is_leaf=is_quantized
    )
