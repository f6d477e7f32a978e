"""lineax solves with Values as operators, each against the same solve on the dense
matrix: eagerly, under `eqx.filter_jit` and under `jax.grad`.

The iterative solvers only multiply by the operator, so they run on a LoRA,
structured, quantised or sparse matrix as it is: `explain` reports nothing
materialised. LU and QR factorise the dense matrix, so a LoRA operator needs
`allow_materialise=True` there (tridiagonal and diagonal matrices have their own
`lu` rule).
"""

import _ecosystem_values as _cases
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx
import numpy as np
import pytest

import quaxlike
from quaxlike.lora import LoraArray
from quaxlike.structured import TriDiagonal


SOLVERS = {
    "CG": lambda: lx.CG(rtol=1e-7, atol=1e-7, max_steps=200),
    "Normal(CG)": lambda: lx.Normal(lx.CG(rtol=1e-7, atol=1e-7, max_steps=400)),
    "GMRES": lambda: lx.GMRES(rtol=1e-7, atol=1e-7, max_steps=200, restart=_cases.N),
    "BiCGStab": lambda: lx.BiCGStab(rtol=1e-7, atol=1e-7, max_steps=200),
}
# The operator types and which iterative solvers apply (CG needs a positive
# definite operator; a quantised matrix is no longer exactly symmetric).
TYPES = {
    "lora": (_cases.lora_spd, ["CG", "Normal(CG)", "GMRES", "BiCGStab"]),
    "tridiagonal": (_cases.tridiagonal, ["CG", "GMRES", "BiCGStab"]),
    "diagonal": (_cases.diagonal, ["CG", "BiCGStab"]),
    "int8": (_cases.int8, ["Normal(CG)", "GMRES"]),
    "sparse": (_cases.sparse, ["GMRES", "Normal(CG)"]),
}
CASES = [(t, s) for t, (_, solvers) in TYPES.items() for s in solvers]


def _solve(solver_name):
    def solve(matrix, vector):
        tags = lx.positive_semidefinite_tag if solver_name == "CG" else ()
        operator = lx.MatrixLinearOperator(matrix, tags)
        return lx.linear_solve(operator, vector, SOLVERS[solver_name]()).value

    return solve


def _operands(type_name):
    matrix = TYPES[type_name][0](jr.key(3))
    vector = jnp.linspace(1.0, 2.0, _cases.N)
    return matrix, vector, _cases.dense_of(matrix)


@pytest.mark.parametrize("type_name, solver", CASES)
def test_iterative_solve_keeps_the_operator_structured(type_name, solver):
    matrix, vector, dense = _operands(type_name)
    solve = _solve(solver)
    expected = jnp.linalg.solve(dense, vector)
    report = quaxlike.explain(solve)(matrix, vector)
    assert not report.materialised, report
    jitted = eqx.filter_jit(quaxlike.quaxify(solve))(matrix, vector)
    np.testing.assert_allclose(jitted, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(jitted, solve(dense, vector), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("type_name", ["lora", "tridiagonal"])
def test_cg_eagerly_and_its_gradient_wrt_the_right_hand_side(type_name):
    matrix, vector, dense = _operands(type_name)
    solve = _solve("CG")
    out = quaxlike.quaxify(solve)(matrix, vector)
    np.testing.assert_allclose(out, jnp.linalg.solve(dense, vector), rtol=1e-4, atol=1e-5)

    def loss(solve_fn, m, v):
        return jnp.sum(solve_fn(m, v) ** 2)

    grad = jax.grad(ft_partial(loss, quaxlike.quaxify(solve), matrix))(vector)
    expected = jax.grad(ft_partial(loss, solve, dense))(vector)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-5)
    grad_jit = jax.jit(jax.grad(ft_partial(loss, quaxlike.quaxify(solve), matrix)))(vector)
    np.testing.assert_allclose(grad_jit, expected, rtol=1e-4, atol=1e-5)


def test_cg_gradient_wrt_a_tridiagonal_operator():
    vector = jnp.linspace(1.0, 2.0, _cases.N)
    off = jnp.full(_cases.N - 1, 0.5)
    solve = _solve("CG")

    def loss_value(diag):
        return jnp.sum(quaxlike.quaxify(solve)(TriDiagonal(off, diag, off), vector) ** 2)

    def loss_dense(diag):
        return jnp.sum(solve(jnp.diag(diag) + jnp.diag(off, 1) + jnp.diag(off, -1), vector) ** 2)

    diag = jnp.linspace(3.0, 4.0, _cases.N)
    np.testing.assert_allclose(
        jax.grad(loss_value)(diag), jax.grad(loss_dense)(diag), rtol=1e-4, atol=1e-6
    )
    tangent = jnp.ones(_cases.N)
    np.testing.assert_allclose(
        jax.jvp(loss_value, (diag,), (tangent,))[1],
        jax.jvp(loss_dense, (diag,), (tangent,))[1],
        rtol=1e-4,
    )


@pytest.mark.parametrize("solver", ["CG", "GMRES"])
def test_gradient_wrt_the_lora_factors_of_an_operator(solver):
    # The solve's JVP needs the operator's tangent, the dense tangent of W + A B
    # (`dense_for_derivatives`): built inside `jit`, so nothing is materialised.
    lora = _cases.lora_spd(jr.key(3))
    vector = jnp.linspace(1.0, 2.0, _cases.N)
    solve = _solve(solver)
    factors = (lora.a, lora.b)  # W + A B symmetric, as CG needs

    def loss_value(factors):
        matrix = LoraArray.from_factors(lora.w, *factors)
        return jnp.sum(quaxlike.quaxify(solve)(matrix, vector) ** 2)

    def loss_dense(factors):
        a, b = factors
        return jnp.sum(jnp.linalg.solve(jax.lax.stop_gradient(lora.w) + a @ b, vector) ** 2)

    got, expected = jax.grad(loss_value)(factors), jax.grad(loss_dense)(factors)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-6)
    assert not quaxlike.explain(jax.grad(loss_value))(factors).materialised


def test_cg_under_vmap_over_right_hand_sides():
    matrix, vector, dense = _operands("lora")
    vectors = jnp.stack([vector, 2 * vector, -vector])
    out = jax.vmap(quaxlike.quaxify(_solve("CG")), in_axes=(None, 0))(matrix, vectors)
    expected = jax.vmap(lambda v: jnp.linalg.solve(dense, v))(vectors)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("solver", [lx.LU, lx.QR])
def test_factorisations_need_the_dense_matrix(solver):
    w = _cases.spd(jr.key(3))
    vector = jnp.linspace(1.0, 2.0, _cases.N)

    def solve(matrix, vector):
        return lx.linear_solve(lx.MatrixLinearOperator(matrix), vector, solver()).value

    refusing = LoraArray(w, rank=2, key=jr.key(1))
    with pytest.raises(quaxlike.MaterialisationError):
        quaxlike.quaxify(solve)(refusing, vector)
    allowed = LoraArray(w, rank=2, key=jr.key(1), allow_materialise=True)
    out = eqx.filter_jit(quaxlike.quaxify(solve))(allowed, vector)
    np.testing.assert_allclose(out, jnp.linalg.solve(allowed.dense(), vector), rtol=1e-5)


def test_lu_on_a_tridiagonal_matrix_uses_its_own_rule():
    matrix, vector, dense = _operands("tridiagonal")

    def solve(matrix, vector):
        return lx.linear_solve(lx.MatrixLinearOperator(matrix), vector, lx.LU()).value

    out = eqx.filter_jit(quaxlike.quaxify(solve))(matrix, vector)
    np.testing.assert_allclose(out, jnp.linalg.solve(dense, vector), rtol=1e-5)


def ft_partial(fn, *args):
    return lambda *rest: fn(*args, *rest)


def test_cg_under_vmap_over_tridiagonal_operators_and_its_gradient():
    off = jnp.full(_cases.N - 1, 0.5)
    vector = jnp.linspace(1.0, 2.0, _cases.N)
    diagonals = jnp.stack([jnp.full(_cases.N, 3.0), jnp.linspace(3.0, 4.0, _cases.N)])
    solve = _solve("CG")

    def with_value(diag):
        return quaxlike.quaxify(solve)(TriDiagonal(off, diag, off), vector)

    def dense(diag):
        return solve(jnp.diag(diag) + jnp.diag(off, 1) + jnp.diag(off, -1), vector)

    np.testing.assert_allclose(
        jax.vmap(with_value)(diagonals), jax.vmap(dense)(diagonals), rtol=1e-5, atol=1e-6
    )
    grads = jax.jit(jax.vmap(jax.grad(lambda d: jnp.sum(with_value(d)))))(diagonals)
    expected = jax.vmap(jax.grad(lambda d: jnp.sum(dense(d))))(diagonals)
    np.testing.assert_allclose(grads, expected, rtol=1e-4, atol=1e-6)
