"""Rules that keep `jnp.linalg.solve(a, b)` `O(n)` for a structured `a`.

`jnp.linalg.solve` is built from three primitives: `lu` factorises `a`, and
`custom_linear_solve` runs a `solve` function (two `triangular_solve`s with the
factors) while defining its derivatives through `matvec` (`a @ x`). So:

- `lu` of a structured matrix gives structured factors, packed the way LAPACK
  packs them (unit-lower `L` below the diagonal, `U` on and above it). A
  diagonal matrix is its own packed factorisation; a tridiagonal one gives a
  tridiagonal packing (the Thomas algorithm, without pivoting). The pivots are
  the identity permutation.
- `triangular_solve` with a structured matrix reads only its lower or upper
  bidiagonal part: a division, or one `lax.scan` of forward or back substitution.
- `custom_linear_solve` with structured constants is rebuilt with
  `lax.custom_linear_solve` around quaxified `matvec`/`solve` functions, so those
  rules run inside it and its derivative rules still apply. Without this rule the
  constants would be materialised before the solve.

No pivoting means the tridiagonal factorisation needs nonzero pivots (true for
diagonally dominant or symmetric positive definite matrices); `solve` uses
`lax.linalg.tridiagonal_solve`, which pivots.
"""

import jax.extend.core as jex_core
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike

import quaxlike

from ._value import StructuredMatrix, TriDiagonal


def _tridiagonal_lu(a: TriDiagonal) -> TriDiagonal:
    # u[0] = d[0]; l[i] = lower[i] / u[i]; u[i + 1] = d[i + 1] - l[i] * upper[i].
    def step(u_prev, inputs):
        lower, upper, d = inputs
        ell = lower / u_prev
        u = d - ell * upper
        return u, (ell, u)

    _, (ell, u_rest) = lax.scan(step, a.diag[0], (a.lower, a.upper, a.diag[1:]))
    return TriDiagonal(ell, jnp.concatenate([a.diag[:1], u_rest]), a.upper)


@quaxlike.register(lax.linalg.lu_p)
def lu_p_structured(a: StructuredMatrix, **params):
    if a.batch_shape:
        return NotImplemented
    identity = jnp.arange(a.n, dtype=jnp.int32)
    packed = _tridiagonal_lu(a) if isinstance(a, TriDiagonal) else a
    return [packed, identity, identity]


def _bidiagonal_solve(diag: Array, off: Array, rhs: Array, lower: bool) -> Array:
    """Solve `m @ x = rhs` along axis 0 of `rhs`, for the bidiagonal `m` with
    diagonal `diag` and sub- (`lower`) or super-diagonal `off`."""
    zero = jnp.zeros((1,), off.dtype)
    # Pad `off` so that step i reads the entry coupling x[i] to its neighbour.
    off = jnp.concatenate([zero, off]) if lower else jnp.concatenate([off, zero])

    def step(x_neighbour, inputs):
        r, d, o = inputs
        x = (r - o * x_neighbour) / d
        return x, x

    _, x = lax.scan(step, jnp.zeros_like(rhs[0]), (rhs, diag, off), reverse=not lower)
    return x


@quaxlike.register(lax.linalg.triangular_solve_p)
def triangular_solve_p_structured_dense(
    a: StructuredMatrix,
    b: ArrayLike,
    *,
    left_side: bool,
    lower: bool,
    transpose_a: bool,
    conjugate_a: bool,
    unit_diagonal: bool,
    **params,
):
    if a.batch_shape or jnp.ndim(b) != 2:
        return NotImplemented
    b = jnp.asarray(b)
    # Solve along the rows of b (left side: op(a) x = b) or its columns (right
    # side: x op(a) = b, which is op(a).T x.T = b.T).
    rhs = b if left_side else b.T
    # The triangle of `a` that is read; transposing turns lower into upper.
    off = a.lower_band() if lower else a.upper_band()
    diag = jnp.ones((a.n,), b.dtype) if unit_diagonal else a.diagonal()
    if conjugate_a:
        off, diag = jnp.conj(off), jnp.conj(diag)
    off, diag = off.astype(b.dtype), diag.astype(b.dtype)
    effective_lower = bool(lower) ^ bool(transpose_a) ^ (not left_side)
    if isinstance(a, TriDiagonal):
        x = _bidiagonal_solve(diag, off, rhs, effective_lower)
    else:
        x = rhs / diag[:, None]
    return x if left_side else x.T


def _quaxified(jaxpr, consts):
    fn = quaxlike.quaxify(jex_core.jaxpr_as_fun(jaxpr))
    return lambda *xs: list(fn(*consts, *xs))


@quaxlike.register("custom_linear_solve")
def custom_linear_solve_p_structured(
    *args: StructuredMatrix | ArrayLike, const_lengths, jaxprs, **params
):
    if jaxprs.solve is None or len(jaxprs.solve.out_avals) != len(jaxprs.matvec.out_avals):
        return NotImplemented  # has auxiliary outputs
    groups, start = [], 0
    for length in const_lengths:
        groups.append(args[start : start + length])
        start += length
    matvec_consts, _, solve_consts, transpose_consts = groups
    b = list(args[start:])
    if any(isinstance(x, quaxlike.Value) for x in b):
        return NotImplemented
    matvec = _quaxified(jaxprs.matvec, matvec_consts)
    solve = _quaxified(jaxprs.solve, solve_consts)
    transpose_solve = None
    if jaxprs.transpose_solve is not None:
        transpose_solve = _quaxified(jaxprs.transpose_solve, transpose_consts)
    return lax.custom_linear_solve(
        lambda x: matvec(*x),
        b,
        lambda _, rhs: solve(*rhs),
        None if transpose_solve is None else (lambda _, rhs: transpose_solve(*rhs)),
        # JAX gives the matvec jaxpr as the vecmat one exactly when symmetric.
        symmetric=jaxprs.vecmat is jaxprs.matvec,
    )
