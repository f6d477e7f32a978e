"""The quantised array types, their constructors, and `quantize` for whole models."""

import abc
import dataclasses
import functools as ft
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, ArrayLike, Float, Int8, PyTree, UInt8

import quaxlike
from quaxlike.internal import ShapedArray

from ..selection import replace_selected


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
_NO_LINEAR_MSG = (
    "`quantize(model)` found no `eqx.nn.Linear` in the model ({type_name}), so it would "
    "quantise nothing. For another kind of model, say which weights to quantise "
    "with `where=`, a function returning them (as for `eqx.tree_at`), for a Flax "
    'params dict for example `where=lambda p: [p["params"]["Dense_0"]["kernel"]]`.'
)
_BAD_BLOCK_MSG = (
    "`{function}`: `block_bytes` (how many bytes of dequantised weight a matrix product "
    "builds at a time) must be a positive int; got {got!r}."
)

# Symmetric ranges: int8 codes lie in [-127, 127], int4 codes in [-7, 7].
_INT8_MAX = 127
_INT4_MAX = 7
# int4 codes are stored offset by 8, as unsigned nibbles in [1, 15].
_INT4_OFFSET = 8
# How much dequantised weight a matrix product builds at a time, by default: a
# block that stays in a core's L2 cache (benchmarks/README.md, "Block size").
DEFAULT_BLOCK_BYTES = 2**19


def _absmax_scale(w: Array, axis: int, code_max: int) -> Array:
    absmax = jnp.max(jnp.abs(w), axis=axis)
    # An all-zero row or group has any positive scale; 1 avoids dividing by zero.
    return jnp.where(absmax > 0, absmax / code_max, jnp.ones_like(absmax))


def _check_block_bytes(block_bytes: int, function: str) -> None:
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(_BAD_BLOCK_MSG.format(function=function, got=block_bytes))


def _as_float_matrix(w: ArrayLike, function: str) -> Array:
    w = jnp.asarray(w)
    if w.ndim < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        got = f"dtype {w.dtype} and shape {w.shape}"
        raise ValueError(_NOT_A_FLOAT_MATRIX_MSG.format(function=function, got=got))
    return w


def dequantize_rows(ints: Array, groups: Array) -> Array:
    """Dense rows from their integer codes `(..., in)` and the scales of their
    groups `(..., n_groups)` (`n_groups` dividing `in`), with the same leading
    dimensions; the result has the codes' shape and the scales' dtype."""
    *lead, size = ints.shape
    weights = ints.astype(groups.dtype).reshape(*lead, groups.shape[-1], -1)
    return (weights * groups[..., None]).reshape(ints.shape)


class QuantizedArray(quaxlike.ArrayValue):
    """Base class of the quantised weights `Int8Array` and `Int4Array`.

    A quantised array stores integer codes `q` of shape `(*batch, out, in)` and
    floating-point scales; it stands for `q * scale` (the dequantised weight), with
    one scale per output row (`Int8Array`) or per group of `group_size` consecutive
    inputs of a row (`Int4Array`). Its dtype is the dtype of the scales.

    Matrix products (`weight @ x`, `x @ weight.T`, batched, vmapped and
    transposed forms, any `lax.dot_general`) dequantise the weight a block of
    stored rows at a time, inside a loop, and multiply each block as it comes, so
    the dense weight is never built: at most `block_bytes` of it exist at once.
    Indexing rows (an embedding lookup, `table[ids]`) dequantises only the rows
    taken. Transposing the last two dimensions, converting to another floating
    dtype, negating, multiplying or dividing by a scalar, `lax.stop_gradient`,
    and slicing, indexing or reshaping the leading batch dimensions stay
    quantised. Any other primitive materialises the dense weight, which by
    default raises an error instead (see `allow_materialise`).

    All of `QuantizedArray`'s subclasses share two static fields: `transposed`,
    true when the array stands for the stored weight with its last two
    dimensions swapped (as `weight.T` gives), and `block_bytes`, the most bytes
    of dequantised weight a matrix product builds at a time.

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
    block_bytes: eqx.AbstractVar[int]
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
    def row_leaves(self) -> tuple[Array, Array]:
        """The stored leaves seen row by row: `(data, groups)`, where `data` holds
        the codes as stored, `(*batch, out, in)` or packed `(*batch, out, in // 2)`,
        and `groups` the scales with a last axis of groups, `(*batch, out,
        n_groups)` (one group for `Int8Array`). An operation that keeps the last
        axis whole applies alike to both (see `with_row_leaves`)."""

    @abc.abstractmethod
    def with_row_leaves(self, data: Array, groups: Array) -> "QuantizedArray":
        """A copy with the leaves `row_leaves` describes replaced."""

    @abc.abstractmethod
    def unpack(self, data: Array) -> Int8[Array, "..."]:  # noqa: F722
        """The integer codes `(..., in)` of stored data `(..., k)`, as `row_leaves`
        gives it or after an operation on its leading axes."""

    def codes(self) -> Int8[Array, "*batch out in"]:  # noqa: F722
        """The integer codes as `int8`, in stored layout `(*batch, out, in)`."""
        return self.unpack(self.row_leaves()[0])

    #: Into how many phases `dequantize_phases` cuts the columns.
    phases: ClassVar[int] = 1

    def dequantize_phases(self, data: Array, groups: Array) -> list[Array]:
        """Dense rows from row leaves (as `row_leaves` gives them, or after an
        operation on their leading axes), cut into `phases` arrays by column:
        phase `j` holds columns `j, j + phases, j + 2 * phases, ...`. The cut that
        unpacks fastest: one phase, in order, for `Int8Array`; for `Int4Array`,
        two of whose codes share a byte, the even columns (low nibbles) and the
        odd ones (high nibbles)."""
        return [dequantize_rows(self.unpack(data), groups)]

    def stored_rows(self, start: ArrayLike, size: int) -> "QuantizedArray":
        """Rows `start` to `start + size` of the stored weight (axis `-2` of
        `(*batch, out, in)`), as a quantised array of the same kind in stored
        layout (`transposed=False`). `start` may be traced; as for
        `lax.dynamic_slice`, it is clamped so that the rows lie inside the weight.
        """
        rows = [lax.dynamic_slice_in_dim(x, start, size, axis=-2) for x in self.row_leaves()]
        return dataclasses.replace(self.with_row_leaves(*rows), transposed=False)

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
        dense = dequantize_rows(self.codes(), self.row_leaves()[1])
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
    - `block_bytes`: the most bytes of dequantised weight a matrix product builds
        at a time (see `quantize`).

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

    def with_row_leaves(self, data: Array, groups: Array) -> "Int8Array":
        return dataclasses.replace(self, values=data, scale=groups[..., 0])

    def unpack(self, data: Array) -> Int8[Array, "..."]:  # noqa: F722
        return data


def _pack_nibbles(codes: Array) -> Array:
    # Byte j of a row holds code 2j in its low nibble and code 2j + 1 in its high one.
    nibbles = (codes + _INT4_OFFSET).astype(jnp.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def _nibbles(packed: Array) -> tuple[Array, Array]:
    """The codes in the low and in the high nibbles: columns 2j and 2j + 1."""
    low = (packed & 0xF).astype(jnp.int8) - _INT4_OFFSET
    return low, (packed >> 4).astype(jnp.int8) - _INT4_OFFSET


def _unpack_nibbles(packed: Array) -> Array:
    # Shifts by (0, 4) broadcast along a new last axis give the nibbles of each
    # byte in column order, low first.
    shifts = jnp.array([0, 4], jnp.uint8).reshape((1,) * packed.ndim + (2,))
    nibbles = ((packed[..., None] >> shifts) & 0xF).astype(jnp.int8) - _INT4_OFFSET
    return nibbles.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


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

    def with_row_leaves(self, data: Array, groups: Array) -> "Int4Array":
        return dataclasses.replace(self, packed=data, scale=groups)

    def unpack(self, data: Array) -> Int8[Array, "..."]:  # noqa: F722
        return _unpack_nibbles(data)

    def dequantize_phases(self, data: Array, groups: Array) -> list[Array]:
        # Low nibbles (even columns) and high nibbles (odd columns) apart: no
        # shuffling of nibbles into column order, which XLA's CPU code does
        # slowly. A group of `g` columns holds `g / 2` of each.
        return [dequantize_rows(c, groups) for c in _nibbles(data)]


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


def quantize_int8(
    w: ArrayLike, *, allow_materialise: bool = False, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> Int8Array:
    """Quantise a dense weight to `int8`, one absmax scale per output channel.

    **Arguments:**

    - `w`: a floating-point weight of shape `(*batch, out, in)`, such as the weight
        of an `eqx.nn.Linear`. Each row `w[..., o, :]` gets its own scale.
    - `allow_materialise`, `block_bytes`: as for `Int8Array`.

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
    _check_block_bytes(block_bytes, "quantize_int8")
    values, scale = _quantize_int8_arrays(w)
    # Keywords: pyright orders the fields with the `AbstractVar`s of the base first.
    return Int8Array(
        values=values, scale=scale, allow_materialise=allow_materialise, block_bytes=block_bytes
    )


def quantize_int4(
    w: ArrayLike,
    *,
    group_size: int = 32,
    allow_materialise: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> Int4Array:
    """Quantise a dense weight to 4 bits, one absmax scale per group of inputs.

    **Arguments:**

    - `w`: a floating-point weight of shape `(*batch, out, in)`, such as the weight
        of an `eqx.nn.Linear`.
    - `group_size`: how many consecutive inputs of a row share a scale. It must be
        even and divide `in`. Smaller groups are more accurate and store more scales.
    - `allow_materialise`, `block_bytes`: as for `Int4Array`.

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
    _check_block_bytes(block_bytes, "quantize_int4")
    packed, scale = _quantize_int4_arrays(w, group_size)
    return Int4Array(
        packed=packed, scale=scale, allow_materialise=allow_materialise, block_bytes=block_bytes
    )


def _is_linear(x: Any) -> bool:
    return isinstance(x, eqx.nn.Linear)


def _linear_weights(model: PyTree) -> list:
    return [x.weight for x in jtu.tree_leaves(model, is_leaf=_is_linear) if _is_linear(x)]


def quantize(
    model: PyTree,
    *,
    bits: int = 8,
    group_size: int = 32,
    where: Any = None,
    allow_materialise: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
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
    - `where`: instead of every `Linear` weight, the weights to quantise: any
        selection of `quaxlike.examples.selection`, as `loraify` takes it (check
        one with `select(model, where)`): a path pattern (`"layers.*.weight"`,
        `"**.query_proj"`), a module type or `module(eqx.nn.Linear,
        out_features=10)`, a predicate `(path, leaf) -> bool`, a getter returning
        the arrays (as for `eqx.tree_at`: one array, or a list or tuple of them),
        or a list of these.
    - `allow_materialise`: as for `Int8Array` and `Int4Array`.
    - `block_bytes`: the most bytes of dequantised weight a matrix product builds
        at a time (default 512 KiB). A matrix product dequantises its weight in
        blocks of whole rows, one after another inside a loop, and at least two
        blocks, so that no dense copy of a weight is ever alive; a larger block
        means fewer, larger steps (faster, up to the size of the cache) and more
        memory. See benchmarks/README.md for the trade-off measured.

    **Returns:**

    The model with quantised weights.

    **Raises:**

    `ValueError` if `where` is not given and the model has no `eqx.nn.Linear`, or
    `where` selects nothing (rather than returning the model unchanged).

    !!! example

        ```python
        mlp = eqx.nn.MLP(64, 8, 64, depth=2, key=jax.random.key(0))
        qmlp = quantize(mlp, bits=4, group_size=32)
        y = eqx.filter_jit(quaxlike.quaxify(qmlp))(jnp.ones(64))
        ```
    """
    if bits == 8:
        make = lambda w: quantize_int8(  # noqa: E731
            w, allow_materialise=allow_materialise, block_bytes=block_bytes
        )
    elif bits == 4:
        make = lambda w: quantize_int4(  # noqa: E731
            w, group_size=group_size, allow_materialise=allow_materialise, block_bytes=block_bytes
        )
    else:
        raise ValueError(_BAD_BITS_MSG.format(bits=bits))
    if where is None:
        if not _linear_weights(model):
            raise ValueError(_NO_LINEAR_MSG.format(type_name=type(model).__qualname__))
        where = _linear_weights
    return replace_selected(model, where, make, "quantize")


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
