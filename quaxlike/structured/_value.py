"""The structured square matrices and `solve`.

Every type stands for an `n x n` matrix (or a stack of them: leading batch
dimensions on the stored arrays give a batch of matrices). Each one reports its
three bands (`diagonal`, `lower_band`, `upper_band`), so rules can combine two
different structured types by converting both to the richer one; the `_kind`
class attribute orders them: Identity < ScaledIdentity < Diagonal < TriDiagonal.
"""

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec
from jaxtyping import Array, ArrayLike, DTypeLike

import quaxlike
from quaxlike.internal import (
    cannot_follow,
    follow_axes,
    logical_entries,
    ShapedArray,
    with_leaf_specs,
)


_BAD_BAND_MSG = (
    "TriDiagonal: `lower` and `upper` must have shape {expected} (one shorter than "
    "`diag`, with the same batch dimensions); got lower {lower} and upper {upper} "
    "for diag {diag}."
)
_NOT_SQUARE_MSG = (
    "`solve(A, b)`: `b` must have shape ({n},) or ({n}, k) to match the {n} x {n} "
    "{type_name}; got {shape}. For a batch of systems use `jax.vmap(solve)`."
)


class StructuredMatrix(quaxlike.ArrayValue):
    """Base class of the structured square matrices in this module.

    A `StructuredMatrix` stands for an `n x n` array (or a batch of them) that is
    zero outside a few bands. Matrix products with a dense operand cost `O(n)`
    per column, sums and products of structured matrices stay structured, and
    `solve` (or `jnp.linalg.solve` inside `quaxify`) never forms the dense matrix.
    Primitives without a rule materialise the dense array.

    Subclasses: `Identity`, `ScaledIdentity`, `Diagonal`, `TriDiagonal`.

    **Arguments:**

    None of its own: it is abstract. Build one of the subclasses.

    !!! example

        ```python
        d = Diagonal(jnp.array([1.0, 2.0, 3.0]))
        assert isinstance(d, StructuredMatrix)
        v = jnp.ones(3)
        assert jnp.allclose(quaxlike.quaxify(lambda a, v: a @ v)(d, v), jnp.diag(d.diagonal()) @ v)
        ```
    """

    # Orders the types by how much they can represent, for mixed-type rules.
    _kind: ClassVar[int]
    # A loop state that starts as zeros in a matrix's place (optimistix's least
    # squares carries its Jacobian operator) is held with zero bands.
    tracks_known_values: ClassVar[bool] = True

    def holding_plain(self, array: Any) -> "StructuredMatrix | None":
        return quaxlike.internal.holding_known_zeros(self, array)

    def stand_in_for_plain(self, array: Any) -> "StructuredMatrix | None":
        # A loop state of zeros in this matrix's place (a `cond` in the body
        # choosing between them) is tried as the zero matrix first, so that the
        # body keeps the bands rather than materialising them.
        return self.holding_plain(array)

    @property
    @abc.abstractmethod
    def n(self) -> int:
        """The size of the (square) matrix."""

    @property
    @abc.abstractmethod
    def batch_shape(self) -> tuple[int, ...]:
        """The leading batch dimensions (`()` for a single matrix)."""

    @abc.abstractmethod
    def diagonal(self) -> Array:
        """The main diagonal, shape `(*batch, n)`."""

    def lower_band(self) -> Array:
        """The band below the diagonal (`A[i + 1, i]`), shape `(*batch, n - 1)`."""
        return jnp.zeros((*self.batch_shape, self.n - 1), self.dtype)

    def upper_band(self) -> Array:
        """The band above the diagonal (`A[i, i + 1]`), shape `(*batch, n - 1)`."""
        return jnp.zeros((*self.batch_shape, self.n - 1), self.dtype)

    @abc.abstractmethod
    def transpose(self) -> "StructuredMatrix":
        """The transposed matrix (of each matrix in a batch), as a structured matrix."""

    @abc.abstractmethod
    def matvec(self, v: ArrayLike) -> Array:
        """`A @ v` contracting over the first axis of `v`, in `O(n)` per column.

        Only for an unbatched matrix; `v` has shape `(n, *rest)`.
        """

    @abc.abstractmethod
    def astype(self, dtype: DTypeLike) -> "StructuredMatrix":
        """The same structure with its values converted to `dtype`."""

    def map_leaves(self, fn: Callable[[Array], Array]) -> "StructuredMatrix":
        """Apply `fn` to every stored array (for maps with `f(0) == 0`)."""
        return jtu.tree_map(fn, self)

    def logical_leaf_specs(self, spec: Any) -> "StructuredMatrix":
        """How the stored arrays follow a sharding of the matrix (see
        `quaxlike.leaf_specs`): each follows the batch axes; a scale (one per
        matrix) is kept whole on each device; the diagonal splits with the rows or
        with the columns (not with both, split differently); the bands above and
        below it, `n - 1` entries, cannot be split in step with the diagonal, so a
        split matrix axis is an error for a tridiagonal matrix.

        **Arguments:**

        - `spec`: a `PartitionSpec` of `(*batch, n, n)`.

        **Returns:**

        This matrix with a `PartitionSpec` in place of each stored array.
        """
        batch = len(self.batch_shape)
        entries = logical_entries(spec, batch + 2)
        lead = list(range(batch))
        rows, cols = entries[-2], entries[-1]
        names = {field.name for field in dataclasses.fields(self)}
        specs: dict[str, Any] = {}
        if "scale" in names:
            specs["scale"] = follow_axes(entries, lead)
        if "lower" in names and (rows is not None or cols is not None):
            axis = batch if rows is not None else batch + 1
            raise cannot_follow(
                self,
                spec,
                axis,
                "its bands `lower` and `upper` hold n - 1 entries each, which cannot be "
                "split in step with the diagonal.",
            )
        if "diag" in names:
            if rows is not None and cols is not None and rows != cols:
                raise cannot_follow(
                    self,
                    spec,
                    batch + 1,
                    "its one diagonal `diag` cannot be split along rows and columns at once.",
                )
            along = rows if rows is not None else cols
            specs["diag"] = PartitionSpec(*entries[:batch], along)
            for band in ("lower", "upper"):
                if band in names:
                    specs[band] = follow_axes(entries, lead)
        return with_leaf_specs(self, **specs)

    def aval(self) -> ShapedArray:
        return ShapedArray((*self.batch_shape, self.n, self.n), self.dtype)

    def materialise(self) -> Array:
        return _dense_from_bands(
            self.lower_band(), self.diagonal(), self.upper_band(), self.n, self.dtype
        )


def _dense_from_bands(lower, diag, upper, n: int, dtype) -> Array:
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    zero = jnp.zeros((), dtype)
    pad = jnp.zeros((*jnp.shape(diag)[:-1], 1), dtype)
    # Entry (i, j) takes diag[j] on the diagonal, lower[j] below it, upper[i] above.
    out = jnp.where(rows == cols, diag[..., None, :], zero)
    if n > 1:
        lower_full = jnp.concatenate([lower, pad], axis=-1)
        upper_full = jnp.concatenate([upper, pad], axis=-1)
        out = jnp.where(rows == cols + 1, lower_full[..., None, :], out)
        out = jnp.where(cols == rows + 1, upper_full[..., :, None], out)
    return out.astype(dtype)


def _column_shape(v) -> tuple[int, ...]:
    return (-1,) + (1,) * (jnp.ndim(v) - 1)


class Identity(StructuredMatrix):
    """The `n x n` identity matrix, stored as nothing at all.

    `I @ x` is `x`, `c * I` is a `ScaledIdentity`, `I + D` is a `Diagonal`, and
    solving with it returns the right-hand side.

    **Arguments:**

    - `n`: the size of the matrix.
    - `dtype`: its dtype (default `float32`).

    !!! example

        ```python
        eye = Identity(3)
        quaxlike.quaxify(lambda a, x: a @ x)(eye, jnp.arange(3.0))  # [0., 1., 2.]
        ```
    """

    _kind: ClassVar[int] = 0
    _n: int = eqx.field(static=True)
    _dtype: np.dtype = eqx.field(static=True)

    def __init__(self, n: int, dtype: DTypeLike = jnp.float32):
        if int(n) < 1:
            raise ValueError(f"Identity: the size `n` must be at least 1; got {n}.")
        self._n = int(n)
        self._dtype = np.dtype(dtype)

    @property
    def n(self) -> int:
        return self._n

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return ()

    def aval(self) -> ShapedArray:
        return ShapedArray((self._n, self._n), self._dtype)

    def diagonal(self) -> Array:
        return jnp.ones((self._n,), self._dtype)

    def transpose(self) -> "Identity":
        return self

    def matvec(self, v: ArrayLike) -> Array:
        return jnp.asarray(v)

    def astype(self, dtype: DTypeLike) -> "Identity":
        return Identity(self._n, dtype)

    def holding_plain(self, array: Any) -> None:
        return None  # no leaves to set to zero: it is always the identity

    def materialise(self) -> Array:
        return jnp.eye(self._n, dtype=self._dtype)


class ScaledIdentity(StructuredMatrix):
    """A multiple of the identity, `scale * I`, stored as the one number `scale`.

    **Arguments:**

    - `scale`: the scalar (a batch of scalars, shape `(*batch,)`, gives a batch of
        matrices). Its dtype is the matrix's dtype.
    - `n`: the size of the matrix.

    !!! example

        ```python
        a = ScaledIdentity(2.0, 3)
        quaxlike.quaxify(lambda a, x: a @ x)(a, jnp.ones(3))  # [2., 2., 2.]
        ```
    """

    _kind: ClassVar[int] = 1
    scale: Array
    _n: int = eqx.field(static=True)

    def __init__(self, scale: ArrayLike, n: int):
        if int(n) < 1:
            raise ValueError(f"ScaledIdentity: the size `n` must be at least 1; got {n}.")
        self.scale = jnp.asarray(scale)
        self._n = int(n)

    @property
    def n(self) -> int:
        return self._n

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(jnp.shape(self.scale))

    @property
    def dtype(self) -> np.dtype:
        return self.scale.dtype

    def diagonal(self) -> Array:
        return jnp.broadcast_to(self.scale[..., None], (*self.batch_shape, self._n))

    def transpose(self) -> "ScaledIdentity":
        return self

    def matvec(self, v: ArrayLike) -> Array:
        return self.scale * jnp.asarray(v)

    def astype(self, dtype: DTypeLike) -> "ScaledIdentity":
        return ScaledIdentity(self.scale.astype(dtype), self._n)


class _StoresDiagonal(StructuredMatrix):
    """A structured matrix holding its main diagonal as the field `diag`, shape
    `(*batch, n)`, from which its size, batch shape and dtype follow."""

    diag: eqx.AbstractVar[Array]

    @property
    def n(self) -> int:
        return self.diag.shape[-1]

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.diag.shape[:-1])

    @property
    def dtype(self) -> np.dtype:
        return self.diag.dtype

    def diagonal(self) -> Array:
        return self.diag


class Diagonal(_StoresDiagonal):
    """A diagonal matrix, stored as its diagonal.

    `D @ x` costs `O(n)` per column, `D1 @ D2`, `D1 + D2` and `c * D` are
    `Diagonal`, and `solve(D, b)` is `b / diag`.

    **Arguments:**

    - `diag`: the diagonal, shape `(n,)`; shape `(*batch, n)` gives a batch of
        diagonal matrices.

    !!! example

        ```python
        d = Diagonal(jnp.array([1.0, 2.0, 3.0]))
        quaxlike.quaxify(lambda a, x: a @ x)(d, jnp.ones(3))  # [1., 2., 3.]
        ```
    """

    _kind: ClassVar[int] = 2
    diag: Array

    def __init__(self, diag: ArrayLike):
        diag = jnp.asarray(diag)
        if diag.ndim < 1 or diag.shape[-1] < 1:
            raise ValueError(
                f"Diagonal: `diag` must have shape (n,) or (*batch, n) with n >= 1; "
                f"got {diag.shape}."
            )
        self.diag = diag

    def transpose(self) -> "Diagonal":
        return self

    def matvec(self, v: ArrayLike) -> Array:
        return self.diag.reshape(_column_shape(v)) * v

    def astype(self, dtype: DTypeLike) -> "Diagonal":
        return Diagonal(self.diag.astype(dtype))


class TriDiagonal(_StoresDiagonal):
    """A tridiagonal matrix, stored as its three bands.

    `A[i + 1, i] = lower[i]`, `A[i, i] = diag[i]`, `A[i, i + 1] = upper[i]`.
    `A @ x` costs `O(n)` per column, the transpose swaps the bands, sums with
    other structured matrices and scalar multiples stay `TriDiagonal`, and
    `solve(A, b)` uses `jax.lax.linalg.tridiagonal_solve` (`O(n)`, with pivoting).

    **Arguments:**

    - `lower`: the band below the diagonal, shape `(n - 1,)`.
    - `diag`: the diagonal, shape `(n,)`.
    - `upper`: the band above the diagonal, shape `(n - 1,)`.

    Leading batch dimensions (the same on all three) give a batch of matrices.
    The three are converted to a common dtype.

    !!! example

        ```python
        a = TriDiagonal(-jnp.ones(3), 2 * jnp.ones(4), -jnp.ones(3))
        quaxlike.quaxify(lambda a, x: a @ x)(a, jnp.ones(4))  # [1., 0., 0., 1.]
        ```
    """

    _kind: ClassVar[int] = 3
    lower: Array
    diag: Array
    upper: Array

    def __init__(self, lower: ArrayLike, diag: ArrayLike, upper: ArrayLike):
        dtype = jnp.result_type(lower, diag, upper)
        lower, diag, upper = (jnp.asarray(x, dtype) for x in (lower, diag, upper))
        if diag.ndim < 1 or diag.shape[-1] < 1:
            raise ValueError(
                f"TriDiagonal: `diag` must have shape (n,) or (*batch, n) with n >= 1; "
                f"got {diag.shape}."
            )
        expected = (*diag.shape[:-1], diag.shape[-1] - 1)
        if lower.shape != expected or upper.shape != expected:
            raise ValueError(
                _BAD_BAND_MSG.format(
                    expected=expected, lower=lower.shape, upper=upper.shape, diag=diag.shape
                )
            )
        self.lower = lower
        self.diag = diag
        self.upper = upper

    def lower_band(self) -> Array:
        return self.lower

    def upper_band(self) -> Array:
        return self.upper

    def transpose(self) -> "TriDiagonal":
        return TriDiagonal(self.upper, self.diag, self.lower)

    def matvec(self, v: ArrayLike) -> Array:
        v = jnp.asarray(v)
        shape = _column_shape(v)
        out = self.diag.reshape(shape) * v
        if self.n == 1:
            return out
        no_pad = [(0, 0)] * (v.ndim - 1)
        # Row i gets lower[i - 1] * v[i - 1] and upper[i] * v[i + 1].
        below = jnp.pad(self.lower.reshape(shape) * v[:-1], [(1, 0), *no_pad])
        above = jnp.pad(self.upper.reshape(shape) * v[1:], [(0, 1), *no_pad])
        return out + below + above

    def astype(self, dtype: DTypeLike) -> "TriDiagonal":
        return TriDiagonal(*(x.astype(dtype) for x in (self.lower, self.diag, self.upper)))


def as_kind(a: StructuredMatrix, kind: int) -> StructuredMatrix:
    """`a` as the structured type of the given `_kind` (at least its own).

    The result is always one of the four types here, never a subclass (such as
    `structured_matrices.TridiagonalMatrix`), so that two operands converted to
    the same kind have the same PyTree structure."""
    kind = max(kind, a._kind)
    if type(a) in (Identity, ScaledIdentity, Diagonal, TriDiagonal) and kind == a._kind:
        return a
    if kind == Identity._kind:
        return Identity(a.n, a.dtype)
    if kind == ScaledIdentity._kind:
        scale = a.scale if isinstance(a, ScaledIdentity) else jnp.ones(a.batch_shape, a.dtype)
        return ScaledIdentity(scale, a.n)
    if kind == Diagonal._kind:
        return Diagonal(a.diagonal())
    return TriDiagonal(a.lower_band(), a.diagonal(), a.upper_band())


# --- solve -------------------------------------------------------------------


def _solve_structured(a: StructuredMatrix, b: Array) -> Array:
    vector = b.ndim == 1
    if b.ndim not in (1, 2) or b.shape[0] != a.n:
        raise ValueError(_NOT_SQUARE_MSG.format(n=a.n, type_name=type(a).__name__, shape=b.shape))
    dtype = jnp.result_type(a.dtype, b.dtype)
    if not jnp.issubdtype(dtype, jnp.inexact):  # as jnp.linalg.solve: a floating result
        dtype = jnp.result_type(dtype, float)
    b = b.astype(dtype)
    if isinstance(a, Identity):
        return b
    if isinstance(a, ScaledIdentity):
        return b / a.scale.astype(dtype)
    if isinstance(a, Diagonal):
        return b / a.diag.astype(dtype).reshape(_column_shape(b))
    assert isinstance(a, TriDiagonal)
    zero = jnp.zeros((1,), dtype)
    # tridiagonal_solve wants full-length bands: dl[0] and du[n - 1] are ignored.
    dl = jnp.concatenate([zero, a.lower.astype(dtype)])
    du = jnp.concatenate([a.upper.astype(dtype), zero])
    rhs = b[:, None] if vector else b
    out = lax.linalg.tridiagonal_solve(dl, a.diag.astype(dtype), du, rhs)
    return out[:, 0] if vector else out


def solve(
    a: ArrayLike | quaxlike.Value, b: ArrayLike | quaxlike.Value
) -> ArrayLike | quaxlike.Value:
    """Solve `a @ x = b` for `x`, in `O(n)` when `a` is a structured matrix.

    `Identity`: `b`. `ScaledIdentity`: `b / scale`. `Diagonal`: `b / diag`.
    `TriDiagonal`: `jax.lax.linalg.tridiagonal_solve` (`O(n)`, with partial
    pivoting). All are differentiable and work under `jax.jit` and `jax.vmap`.
    Anything else goes to `jnp.linalg.solve` (through `quaxify`, so other Value
    types use their own rules).

    Inside a quaxified function a structured matrix is seen as an array, so this
    function cannot tell it apart from a dense one; there, call
    `jnp.linalg.solve(a, b)` directly: this module registers rules for the
    primitives it is built from (`lu`, `triangular_solve`, `custom_linear_solve`)
    that keep it `O(n)`.

    **Arguments:**

    - `a`: an `n x n` matrix: a single (unbatched) structured matrix, or anything
        `jnp.linalg.solve` accepts.
    - `b`: the right-hand side, shape `(n,)` or `(n, k)`.

    **Returns:**

    `x`, with the shape of `b` and a floating dtype.

    !!! example

        ```python
        a = TriDiagonal(-jnp.ones(3), 4 * jnp.ones(4), -jnp.ones(3))
        x = solve(a, jnp.ones(4))
        ```
    """
    if (
        isinstance(a, StructuredMatrix)
        and a.batch_shape == ()
        and not isinstance(b, quaxlike.Value)
    ):
        return _solve_structured(a, jnp.asarray(b))
    return quaxlike.quaxify(jnp.linalg.solve)(a, b)
