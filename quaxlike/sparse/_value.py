import functools as ft
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array, ArrayLike

import quaxlike
from quaxlike.internal import cannot_follow, logical_entries, ShapedArray, with_leaf_specs


_REFUSE_MSG = (
    "Refusing to materialise a BCOO of shape {shape} with {nse} stored entries: a "
    "sparse array only becomes dense when asked to. Call `.todense()` where you want "
    "the dense array, or build the BCOO with `allow_materialise=True` (for example "
    "`BCOO.fromdense(x, allow_materialise=True)`) to let operations without a sparse "
    "rule fall back to it."
)
_BAD_SHAPES_MSG = (
    "BCOO: `data` must have shape (*batch, nse) and `indices` shape (*batch, nse, "
    "n_sparse), where `shape` is (*batch, *sparse) with n_sparse >= 1 sparse "
    "dimensions; got data of shape {data}, indices of shape {indices} for shape "
    "{shape}. Without batch dimensions that is data (nse,) and indices (nse, "
    "len(shape)); with them, the leading dimensions of `shape` must equal those of "
    "`data` and `indices`."
)
_BAD_INDICES_DTYPE_MSG = "BCOO: `indices` must have an integer dtype; got {dtype}."
_SCALAR_MSG = "BCOO needs at least one dimension; got shape (). Keep a scalar as an ordinary array."
_NSE_UNDER_TRACE_MSG = (
    "`BCOO.fromdense` got a traced array (under `jax.jit`, `jax.grad`, `jax.vmap`, ...) "
    "and no `nse`: the number of stored entries must be known when tracing. Pass "
    "`nse=<an upper bound on the number of nonzeros>`, or call `fromdense` outside "
    "the transformation."
)
_NSE_TOO_SMALL_MSG = (
    "`BCOO.fromdense(x, nse={nse})`: x has {count} nonzero entries, so {dropped} "
    "would be dropped. Pass `nse={count}` or more (or leave `nse` out outside "
    "`jax.jit`)."
)


def in_bounds(indices: Array, shape: tuple[int, ...]) -> Array:
    """Which stored entries have every coordinate inside `shape` (the others are
    padding and stand for nothing)."""
    upper = jnp.asarray(shape, dtype=indices.dtype)
    return jnp.all((indices >= 0) & (indices < upper), axis=-1)


# Jitted so that an eager `fromdense` is one compiled program, not a dozen.
@ft.partial(jax.jit, static_argnames=("nse", "index_dtype"))
def _nonzero_entries(x: Array, nse: int, index_dtype: np.dtype) -> tuple[Array, Array]:
    # Padding slots get the out-of-bounds coordinates `x.shape`.
    coordinates = jnp.nonzero(x, size=nse, fill_value=tuple(x.shape))
    data = x.at[coordinates].get(mode="fill", fill_value=0)
    return data, jnp.stack(coordinates, axis=-1).astype(index_dtype)


class BCOO(quaxlike.ArrayValue):
    """A sparse array in coordinate (COO) format: `data[i]` is stored at position
    `indices[i]`, and every other entry is zero.

    Entries with the same coordinates add up; entries with a coordinate outside
    `shape` are padding and are ignored (this is how `fromdense` fills `nse` slots
    when there are fewer nonzeros). Leading batch dimensions are allowed, in the
    layout of Quax's and `jax.experimental.sparse`'s BCOO: with `shape = (*batch,
    *sparse)`, `data` has shape `(*batch, nse)` and `indices` `(*batch, nse,
    len(sparse))`, each batch element storing its own `nse` entries. There are no
    dense dimensions.

    Matrix products with dense arrays, elementwise products, sums, negation,
    transposes, reductions with `sum` and dtype conversions keep to the stored
    entries and never build the dense array (see the README for each rule).
    Anything else needs the dense array: by default that raises an error, naming
    the operation, unless the BCOO was built with `allow_materialise=True`.

    **Arguments:**

    - `data`: the stored values, shape `(nse,)` (or `(*batch, nse)`).
    - `indices`: their coordinates, an integer array of shape `(nse, len(shape))`
        (or `(*batch, nse, n_sparse)`).
    - `shape`: the shape of the array this stands for (at least one sparse
        dimension).
    - `allow_materialise`: whether an operation with no sparse rule may build the
        dense array (otherwise it raises).
    - `unique_indices`: a promise that no two in-bounds entries share coordinates
        (within a batch element); it lets elementwise operations act on `data`
        directly. Leave it `False` unless you know.

    !!! example

        ```python
        import jax.numpy as jnp
        import quaxlike
        from quaxlike.sparse import BCOO

        x = BCOO.fromdense(jnp.array([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]]))
        quaxlike.quaxify(lambda m, v: m @ v)(x, jnp.ones(3))  # Array([3., 3.])
        ```
    """

    data: Array
    indices: Array
    _shape: tuple[int, ...] = eqx.field(static=True)
    unique_indices: bool = eqx.field(static=True)
    allow_materialise: bool = eqx.field(static=True)

    # `allow_materialise` may be given by position, as in Quax's BCOO.
    def __init__(
        self,
        data: ArrayLike,
        indices: ArrayLike,
        shape: Sequence[int],
        allow_materialise: bool = False,
        *,
        unique_indices: bool = False,
    ):
        data = jnp.asarray(data)
        indices = jnp.asarray(indices)
        shape = tuple(int(d) for d in shape)
        if not shape:
            raise ValueError(_SCALAR_MSG)
        if not jnp.issubdtype(indices.dtype, jnp.integer):
            raise ValueError(_BAD_INDICES_DTYPE_MSG.format(dtype=indices.dtype))
        n_batch = data.ndim - 1
        if (
            data.ndim < 1
            or indices.ndim != data.ndim + 1
            or indices.shape[:-1] != data.shape
            or data.shape[:-1] != shape[:n_batch]
            or indices.shape[-1] < 1
            or n_batch + indices.shape[-1] != len(shape)
        ):
            raise ValueError(
                _BAD_SHAPES_MSG.format(data=data.shape, indices=indices.shape, shape=shape)
            )
        self.data = data
        self.indices = indices
        self._shape = shape
        self.unique_indices = unique_indices
        self.allow_materialise = allow_materialise

    @property
    def nse(self) -> int:
        """The number of stored entries (padding included; per batch element)."""
        return self.data.shape[-1]

    @property
    def n_batch(self) -> int:
        """The number of leading batch dimensions (0 unless built with them)."""
        return len(self._shape) - self.indices.shape[-1]

    def enable_materialise(self, allow_materialise: bool = True) -> "BCOO":
        """The same BCOO with `allow_materialise` set (Quax's method).

        **Arguments:**

        - `allow_materialise`: the new setting.

        **Returns:**

        A `BCOO` with the same entries.

        !!! example

            ```python
            x = BCOO.fromdense(jnp.array([0.0, 2.0]))
            assert jnp.array_equal(x.enable_materialise().materialise(), jnp.array([0.0, 2.0]))
            ```
        """
        return BCOO(
            self.data,
            self.indices,
            self._shape,
            allow_materialise,
            unique_indices=self.unique_indices,
        )

    def logical_leaf_specs(self, spec: Any) -> "BCOO":
        """A replicated array keeps its nonzeros whole on every device; any split
        is an error (see `quaxlike.leaf_specs`): the nonzeros of every row and
        column are in one list, `data` and `indices`, so no leaf can be cut
        along a logical axis.

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array.

        **Returns:**

        This value with `PartitionSpec()` for `data` and `indices`.
        """
        for axis, entry in enumerate(logical_entries(spec, len(self._shape))):
            if entry is not None:
                raise cannot_follow(
                    self,
                    spec,
                    axis,
                    f"its nonzeros (`data`, `indices`) are one list in no order of axis "
                    f"{axis}, so no leaf can be split along it.",
                )
        return with_leaf_specs(self, data=PartitionSpec(), indices=PartitionSpec())

    def aval(self) -> ShapedArray:
        return ShapedArray(self._shape, self.data.dtype)

    def materialise(self) -> Array:
        if not self.allow_materialise:
            raise RuntimeError(_REFUSE_MSG.format(shape=self._shape, nse=self.nse))
        return self.todense()

    def dense_for_derivatives(self) -> Array:
        # Derivatives reach the stored entries: quaxlike differentiates this
        # inside `jax.jit`, never keeping the dense array.
        return self.todense()

    def todense(self) -> Array:
        """The dense array this stands for (always allowed: you asked for it)."""
        flat = unbatched(self)
        coordinates = tuple(flat.indices[:, d] for d in range(len(self._shape)))
        zeros = jnp.zeros(self._shape, self.data.dtype)
        return zeros.at[coordinates].add(flat.data, mode="drop")

    @classmethod
    def fromdense(
        cls,
        x: ArrayLike,
        nse: int | None = None,
        *,
        index_dtype=jnp.int32,
        allow_materialise: bool = False,
    ) -> "BCOO":
        """The BCOO holding the nonzero entries of a dense array.

        **Arguments:**

        - `x`: the dense array, with at least one dimension.
        - `nse`: how many entries to store. Needed when `x` is traced (under
            `jax.jit`, `jax.grad`, ...); eagerly it defaults to the number of
            nonzeros. Extra slots are padding (out-of-bounds coordinates, zero
            data). Under a trace, nonzeros beyond the first `nse` in row-major
            order are silently dropped; eagerly that raises.
        - `index_dtype`: the integer dtype of `indices`.
        - `allow_materialise`: as for `BCOO`.

        **Returns:**

        A `BCOO` with `unique_indices=True`.
        """
        if not isinstance(x, (jax.Array, np.ndarray)):
            x = jnp.asarray(x)
        if x.ndim == 0:
            raise ValueError(_SCALAR_MSG)
        concrete = not isinstance(x, jax.core.Tracer)
        if nse is None:
            if not concrete:
                raise ValueError(_NSE_UNDER_TRACE_MSG)
            nse = int(np.count_nonzero(np.asarray(x)))
        elif concrete:
            count = int(np.count_nonzero(np.asarray(x)))
            if count > nse:
                raise ValueError(
                    _NSE_TOO_SMALL_MSG.format(nse=nse, count=count, dropped=count - nse)
                )
        data, indices = _nonzero_entries(x, nse=nse, index_dtype=np.dtype(index_dtype))
        return cls(
            data,
            indices,
            x.shape,
            unique_indices=True,
            allow_materialise=allow_materialise,
        )


def unbatched(x: BCOO) -> BCOO:
    """The same array with no batch dimensions: each batch element's entries
    become entries of the whole array, their batch position prepended to their
    coordinates (`nse` times the batch size of them). Exact: padding stays
    out of bounds, and unique coordinates stay unique."""
    n_batch = x.n_batch
    if n_batch == 0:
        return x
    batch, nse = x.shape[:n_batch], x.nse
    positions = jnp.stack(
        jnp.meshgrid(*(jnp.arange(b, dtype=x.indices.dtype) for b in batch), indexing="ij"),
        axis=-1,
    )
    positions = jnp.broadcast_to(positions[..., None, :], (*batch, nse, n_batch))
    indices = jnp.concatenate([positions, x.indices], axis=-1).reshape(-1, len(x.shape))
    return BCOO(
        x.data.reshape(-1),
        indices,
        x.shape,
        x.allow_materialise,
        unique_indices=x.unique_indices,
    )
