"""Rules for `Unitful` matrices in the linear-algebra primitives of `jax.lax.linalg`.

A matrix in a unit `u` has eigenvalues and singular values in `u`, eigenvectors
and singular vectors that are pure numbers, a Cholesky factor in `u^(1/2)` and a
QR factorisation whose `Q` is a pure number and whose `R` is in `u`. A triangular
solve `a x = b` gives `x` in the unit of `b` over that of `a`.

`lu` has no rule: it packs `L` (pure numbers) and `U` (in `u`) into one array,
which one unit cannot describe, so `jnp.linalg.solve`, `inv` and `det` on
quantities have rules of their own (see `_functions`).
"""

from fractions import Fraction

from jax import lax
from jaxtyping import ArrayLike

import quaxlike

from ._operands import _array_of, _unit_of
from ._value import UnitError, Unitful


_UNIT_DIAGONAL_MSG = (
    "`triangular_solve` with `unit_diagonal=True` and a matrix in {unit}: the "
    "diagonal it assumes is the pure number 1, which a matrix in {unit} cannot "
    "have. Divide the matrix by a reference quantity first."
)


def _values_and_vectors(primitive):
    # `eigh`, `eig`, `svd`: outputs with one dimension fewer than the matrix are
    # its (eigen or singular) values, in its unit; the others are vectors, pure
    # numbers. (Their order differs between the primitives.)
    def rule(x: Unitful, **params) -> list:
        outs = primitive.bind(x.array, **params)
        return [Unitful(o, x.unit) if o.ndim == x.ndim - 1 else o for o in outs]

    rule.__name__ = rule.__qualname__ = f"{primitive.name}_p_unitful"
    return rule


for _primitive in [lax.linalg.eigh_p, lax.linalg.eig_p, lax.linalg.svd_p]:
    quaxlike.register(_primitive)(_values_and_vectors(_primitive))


@quaxlike.register(lax.linalg.cholesky_p)
def cholesky_p_unitful(x: Unitful, **params) -> Unitful:
    # `x = L L^H`: `L` in the square root of the unit.
    return Unitful(lax.linalg.cholesky_p.bind(x.array, **params), x.unit ** Fraction(1, 2))


@quaxlike.register(lax.linalg.qr_p)
def qr_p_unitful(x: Unitful, **params) -> list:
    # `x = Q R` (`x P = Q R` with pivoting): `Q` orthogonal, `R` in the unit.
    q, r, *pivots = lax.linalg.qr_p.bind(x.array, **params)
    return [q, Unitful(r, x.unit), *pivots]


@quaxlike.register(lax.linalg.triangular_solve_p)
def triangular_solve_p_unitful(
    a: Unitful | ArrayLike, b: Unitful | ArrayLike, *, unit_diagonal: bool, **params
) -> Unitful:
    # `a x = b` (or `x a = b`): `x` in the unit of `b` over that of `a`.
    a_unit, b_unit = _unit_of(a), _unit_of(b)
    if unit_diagonal and not a_unit.dimensionless:
        raise UnitError(_UNIT_DIAGONAL_MSG.format(unit=a_unit))
    out = lax.linalg.triangular_solve_p.bind(
        _array_of(a), _array_of(b), unit_diagonal=unit_diagonal, **params
    )
    return Unitful(out, b_unit / a_unit)
