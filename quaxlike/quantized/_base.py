"""What every quantised array shares: the base class `QuantizedArray`, the checks
of the constructors' arguments, dequantising rows, and packing 4-bit codes two to
a byte."""

import abc
import dataclasses
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Int8

import quaxlike
from quaxlike.internal import (
    follow_axes,
    has_explicit_axes,
    logical_entries,
    ShapedArray,
    with_leaf_specs,
)


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
    "`{function}`: `group_size={group_size}` must be even (two 4-bit values share "
    "a byte) and divide the input dimension {size} of the weight of shape {shape}. "
    "Pick a group size that divides {size}, or leave this weight out with `where=`."
)

_BAD_MATMUL_MSG = (
    '`{type_name}`: `matmul` must be None (the backend\'s default), "loop" or "fused"; got {got!r}.'
)

_BAD_BLOCK_MSG = (
    "`{function}`: `block_bytes` (how many bytes of dequantised weight a matrix product "
    "builds at a time) must be a positive int; got {got!r}."
)


# How much dequantised weight a matrix product builds at a time, by default: a
# block that stays in a core's L2 cache (benchmarks/README.md, "Block size").
DEFAULT_BLOCK_BYTES = 2**19
# How a matrix product with a quantised array is computed (see `_matmul.py`): None
# for the backend's default, a loop over blocks of rows, or the whole weight
# dequantised into the product (which XLA fuses on GPU).
MATMUL_STRATEGIES = (None, "loop", "fused")


def check_matmul(matmul: Any, type_name: str) -> None:
    """Refuse a `matmul` strategy other than None, "loop" and "fused"."""
    if matmul not in MATMUL_STRATEGIES:
        raise ValueError(_BAD_MATMUL_MSG.format(type_name=type_name, got=matmul))


def check_group_size(shape: tuple[int, ...], group_size: Any, function: str) -> None:
    """Refuse a group size that is not even or does not divide the rows of `shape`."""
    size = shape[-1]
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size <= 0
        or group_size % 2
        or size % group_size
    ):
        raise ValueError(
            _BAD_GROUP_MSG.format(function=function, group_size=group_size, size=size, shape=shape)
        )


def check_block_bytes(block_bytes: int, function: str) -> None:
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(_BAD_BLOCK_MSG.format(function=function, got=block_bytes))


def as_float_matrix(w: ArrayLike, function: str) -> Array:
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


def explicit_sharding(x: Array):
    """`x`'s sharding where its type names one along an `Explicit` mesh axis
    (`has_explicit_axes`), else `None`."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not has_explicit_axes(getattr(sharding, "mesh", None)):
        return None
    spec = getattr(sharding, "spec", ())
    return sharding if any(entry is not None for entry in spec) else None


class QuantizedArray(quaxlike.ArrayValue):
    """Base class of the quantised weights `Int8Array`, `Int4Array` and `NF4Array`.

    A quantised array stores integer codes `q` of shape `(*batch, out, in)` and
    floating-point scales; it stands for `q * scale` (the dequantised weight), with
    one scale per output row (`Int8Array`) or per group of `group_size` consecutive
    inputs of a row (`Int4Array`); an `NF4Array` stands for `levels[q] * absmax`
    instead. Its dtype is the dtype of the scales.

    Matrix products (`weight @ x`, `x @ weight.T`, batched, vmapped and
    transposed forms, any `lax.dot_general`) dequantise the weight a block of
    stored rows at a time, inside a loop, and multiply each block as it comes, so
    the dense weight is never built: at most `block_bytes` of it exist at once
    (the CPU default; see `matmul` below).
    Indexing rows (an embedding lookup, `table[ids]`) dequantises only the rows
    taken. Transposing the last two dimensions, converting to another floating
    dtype, negating, multiplying or dividing by a scalar, `lax.stop_gradient`,
    and slicing, indexing or reshaping the leading batch dimensions stay
    quantised. Any other primitive materialises the dense weight, which by
    default raises an error instead (see `allow_materialise`).

    All of `QuantizedArray`'s subclasses share three static fields: `transposed`,
    true when the array stands for the stored weight with its last two
    dimensions swapped (as `weight.T` gives), `block_bytes`, the most bytes
    of dequantised weight a matrix product builds at a time, and `matmul`, how
    matrix products are computed: `"loop"` (the blocks above), `"fused"` (the
    weight dequantised whole into the product, for backends whose compiler fuses
    the two, as XLA does on GPU) or `None`, the default of the backend at trace
    time (see `default_matmul`).

    **Arguments:**

    None of its own: it is abstract. Build an `Int8Array`, `Int4Array` or
    `NF4Array`, usually with `quantize_int8`, `quantize_int4`, `quantize_nf4` or
    `quantize`.

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
    matmul: eqx.AbstractVar[str | None]
    scale: eqx.AbstractVar[Array]

    # A loop state that starts as zeros in a weight's place (optimistix's least
    # squares carries its Jacobian operator) is held with zero codes and scales.
    tracks_known_values: ClassVar[bool] = True

    def __check_init__(self):
        check_matmul(self.matmul, type(self).__qualname__)

    def holding_plain(self, array: Any) -> "QuantizedArray | None":
        # Every subclass stands for codes times scales: zero scales are 0.
        return quaxlike.internal.holding_known_zeros(self, array)

    def stand_in_for_plain(self, array: Any) -> "QuantizedArray | None":
        # A loop state of zeros that the body would refuse beside this weight
        # (a `cond` choosing between it and the weight) stands in as the zero
        # weight, to see whether the body gives it this type.
        return self.holding_plain(array)

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
    def row_leaves(self) -> tuple[Array, ...]:
        """The stored leaves seen row by row: `(data, *scales)`, each of shape
        `(*batch, out, k)` for some `k` of its own. `data` holds the codes as
        stored, `(*batch, out, in)` or packed `(*batch, out, in // 2)`; the scales
        have a last axis of groups: for `Int8Array` and `Int4Array` one leaf,
        `(*batch, out, n_groups)` (one group for `Int8Array`). An operation that
        keeps the last axis whole applies alike to all of them (see
        `with_row_leaves`), and `dequantize_leaves` turns them into dense rows."""

    @abc.abstractmethod
    def with_row_leaves(self, *leaves: Array) -> "QuantizedArray":
        """A copy with the leaves `row_leaves` describes replaced."""

    @abc.abstractmethod
    def unpack(self, data: Array) -> Int8[Array, "..."]:  # noqa: F722
        """The integer codes `(..., in)` of stored data `(..., k)`, as `row_leaves`
        gives it or after an operation on its leading axes (`int8`; an `NF4Array`'s
        are `uint8` level indices)."""

    def codes(self) -> Int8[Array, "*batch out in"]:  # noqa: F722
        """The integer codes as `int8`, in stored layout `(*batch, out, in)`."""
        return self.unpack(self.row_leaves()[0])

    def dequantize_leaves(self, *leaves: Array) -> Array:
        """Dense rows `(..., in)`, in stored layout, from row leaves (as `row_leaves`
        gives them, or after an operation on their leading axes)."""
        data, groups = leaves
        return dequantize_rows(self.unpack(data), groups)

    #: Into how many phases `dequantize_phases` cuts the columns.
    phases: ClassVar[int] = 1

    def dequantize_phases(self, *leaves: Array) -> list[Array]:
        """`dequantize_leaves`, cut into `phases` arrays by column: phase `j` holds
        columns `j, j + phases, j + 2 * phases, ...`. The cut that unpacks
        fastest: one phase, in order, for `Int8Array`; for `Int4Array`, two of
        whose codes share a byte, the even columns (low nibbles) and the odd ones
        (high nibbles)."""
        return [self.dequantize_leaves(*leaves)]

    def stored_rows(self, start: ArrayLike, size: int) -> "QuantizedArray":
        """Rows `start` to `start + size` of the stored weight (axis `-2` of
        `(*batch, out, in)`), as a quantised array of the same kind in stored
        layout (`transposed=False`). `start` may be traced; as for
        `lax.dynamic_slice`, it is clamped so that the rows lie inside the weight.
        """
        rows = [lax.dynamic_slice_in_dim(x, start, size, axis=-2) for x in self.row_leaves()]
        return dataclasses.replace(self.with_row_leaves(*rows), transposed=False)

    def logical_leaf_specs(self, spec: Any) -> "QuantizedArray":
        """How the codes and scales follow a sharding of the array (see
        `quaxlike.leaf_specs`). Every leaf is stored row by row, `(*batch, out,
        k)` (`Int8Array`'s scales `(*batch, out)`), so each follows the batch
        axes and the stored rows of the spec, and its last axis (codes, packed
        codes, groups of inputs, blocks of groups) the stored columns: an
        `NF4Array`'s codes, absmaxes and second-level scales split along the same
        rows. A transposed array's spec is read in stored order. Splitting
        columns needs whole groups on each device (the mesh must divide the
        number of groups), and double quantisation's second-level scales split
        with their blocks of rows and groups, or, one block along an axis, are
        kept whole on each device.

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array (its `aval()`'s shape).

        **Returns:**

        This array with a `PartitionSpec` in place of each leaf.
        """
        ndim = len(self.stored_shape)
        entries = list(logical_entries(spec, ndim))
        if self.transposed:
            entries[-2], entries[-1] = entries[-1], entries[-2]
        lead = list(range(ndim - 2))
        specs = {}
        for field in dataclasses.fields(self):
            leaf = getattr(self, field.name)
            if field.metadata.get("static", False) or not hasattr(leaf, "shape"):
                continue
            along_inputs = [ndim - 1] if len(leaf.shape) == ndim else []
            specs[field.name] = follow_axes(entries, [*lead, ndim - 2, *along_inputs])
        return with_leaf_specs(self, **specs)

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
        dense = self.dequantize_leaves(*self.row_leaves())
        return jnp.swapaxes(dense, -1, -2) if self.transposed else dense

    def materialise(self) -> Array:
        if not self.allow_materialise:
            raise RuntimeError(
                _REFUSE_MSG.format(type_name=type(self).__qualname__, shape=self.shape)
            )
        return self.dequantize()

    def dense_for_derivatives(self) -> Array:
        # Derivatives reach the scales (the codes are integers): quaxlike
        # differentiates this inside `jax.jit`, never keeping the dense weight.
        return self.dequantize()

    def with_scale(self, scale: Array) -> "QuantizedArray":
        """A copy with the scales replaced (same shape; the dtype may change)."""
        return eqx.tree_at(lambda a: a.scale, self, scale)

    def swapped(self) -> "QuantizedArray":
        """A copy standing for the transpose of the last two dimensions."""
        return dataclasses.replace(self, transposed=not self.transposed)


def pack_nibbles(nibbles: Array) -> Array:
    """Two 4-bit values `(..., 2k)` in `[0, 15]` per byte `(..., k)`: byte `j` of a
    row holds value `2j` in its low nibble and value `2j + 1` in its high one."""
    nibbles = nibbles.astype(jnp.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def nibble_halves(packed: Array) -> tuple[Array, Array]:
    """The `uint8` values in the low and in the high nibbles of `packed`: columns
    `2j` and `2j + 1`."""
    return packed & 0xF, packed >> 4


def unpack_nibbles(packed: Array) -> Array:
    """The `uint8` values `(..., 2k)` of bytes `(..., k)`, in column order."""
    # Shifts by (0, 4) broadcast along a new last axis give the nibbles of each
    # byte in column order, low first.
    shifts = jnp.array([0, 4], jnp.uint8).reshape((1,) * packed.ndim + (2,))
    nibbles = (packed[..., None] >> shifts) & 0xF
    return nibbles.reshape(*packed.shape[:-1], 2 * packed.shape[-1])
