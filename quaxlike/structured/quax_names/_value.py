"""`TridiagonalMatrix`: Quax's tridiagonal matrix, as a `TriDiagonal`."""

import equinox as eqx
from jaxtyping import Array, ArrayLike, DTypeLike

from .._value import TriDiagonal


_REFUSE_MSG = (
    "Refusing to materialise a {n} x {n} TridiagonalMatrix{batch} built with "
    "`allow_materialise=False` (the default, as in Quax): an operation with no "
    "tridiagonal rule would make it dense. Build it with "
    "`TridiagonalMatrix(..., allow_materialise=True)` to allow that, or use "
    "`quaxlike.structured.TriDiagonal`, which has rules for more "
    "operations and materialises when it must."
)


class TridiagonalMatrix(TriDiagonal):
    """A tridiagonal matrix stored as its three diagonals, under Quax's name
    and fields (Quax's `structured_matrices.TridiagonalMatrix`).

    It is a `quaxlike.structured.TriDiagonal`, so every rule for that
    type applies: products with dense operands (`A @ x`, `x @ A`, `einsum`, with
    batch dimensions too) in `O(n)` per column, sums, scaling, transposes and
    `jnp.linalg.solve`. As in Quax, it refuses to become a dense array unless
    built with `allow_materialise=True`: an operation with no rule raises
    instead. Scaling, negating, transposing and converting it keep that
    setting; the results of other rules (`A + D`, `A * M` with a matrix `M`)
    are plain `TriDiagonal`s, which materialise when they must.

    `A[i + 1, i] = lower_diag[i]`, `A[i, i] = main_diag[i]`,
    `A[i, i + 1] = upper_diag[i]`.

    **Arguments:**

    - `lower_diag`: the diagonal below the main one, shape `(*batch, n - 1)`.
    - `main_diag`: the main diagonal, shape `(*batch, n)`.
    - `upper_diag`: the diagonal above the main one, shape `(*batch, n - 1)`.
    - `allow_materialise`: whether an operation with no rule may build the dense
        matrix (default `False`).

    The three are converted to a common dtype (Quax requires them to agree).

    !!! example

        ```python
        import jax.numpy as jnp
        import quaxlike
        from quaxlike.structured.quax_names import TridiagonalMatrix

        a = TridiagonalMatrix(jnp.ones(3), 2 * jnp.ones(4), -jnp.ones(3))
        v = jnp.arange(4.0)
        out = quaxlike.quaxify(lambda a, v: a @ v)(a, v)
        dense = a.enable_materialise().materialise()
        assert jnp.allclose(out, dense @ v)
        ```
    """

    allow_materialise: bool = eqx.field(static=True)

    def __init__(
        self,
        lower_diag: ArrayLike,
        main_diag: ArrayLike,
        upper_diag: ArrayLike,
        allow_materialise: bool = False,
    ):
        super().__init__(lower_diag, main_diag, upper_diag)
        self.allow_materialise = bool(allow_materialise)

    @property
    def lower_diag(self) -> Array:
        """The diagonal below the main one (Quax's name for `lower`)."""
        return self.lower

    @property
    def main_diag(self) -> Array:
        """The main diagonal (Quax's name for `diag`)."""
        return self.diag

    @property
    def upper_diag(self) -> Array:
        """The diagonal above the main one (Quax's name for `upper`)."""
        return self.upper

    def materialise(self) -> Array:
        if not self.allow_materialise:
            batch = f" (batch {self.batch_shape})" if self.batch_shape else ""
            raise RuntimeError(_REFUSE_MSG.format(n=self.n, batch=batch))
        return super().materialise()

    def enable_materialise(self, allow_materialise: bool = True) -> "TridiagonalMatrix":
        """The same matrix with `allow_materialise` set.

        **Arguments:**

        - `allow_materialise`: the new setting.

        **Returns:**

        A `TridiagonalMatrix` with the same diagonals.

        !!! example

            ```python
            a = TridiagonalMatrix(jnp.ones(1), jnp.ones(2), jnp.ones(1))
            assert jnp.array_equal(a.enable_materialise().materialise(), jnp.ones((2, 2)))
            ```
        """
        return TridiagonalMatrix(self.lower, self.diag, self.upper, allow_materialise)

    def transpose(self) -> "TridiagonalMatrix":
        return TridiagonalMatrix(self.upper, self.diag, self.lower, self.allow_materialise)

    def astype(self, dtype: DTypeLike) -> "TridiagonalMatrix":
        return TridiagonalMatrix(
            self.lower.astype(dtype),
            self.diag.astype(dtype),
            self.upper.astype(dtype),
            self.allow_materialise,
        )
