"""optimistix root finding and least squares on functions holding Values, forward,
each against the same solve on the dense arrays. (Gradients through the solves,
by implicit differentiation, are in `test_gradients.py`.)"""

import _ecosystem_values as _cases
import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optimistix as optx
import pytest

import quaxlike


MATRICES = {
    "lora": _cases.lora_general,
    "tridiagonal": _cases.tridiagonal,
    "int8": _cases.int8,
}


def residual(y, args):
    matrix, b = args
    return matrix @ y + 0.1 * jnp.tanh(y) - b


def root(matrix, b, solver):
    return optx.root_find(residual, solver, jnp.zeros_like(b), args=(matrix, b), max_steps=64).value


def least_squares(matrix, b, solver):
    return optx.least_squares(
        residual, solver, jnp.zeros_like(b), args=(matrix, b), max_steps=64
    ).value


SOLVERS = {
    "root:Newton": (root, lambda: optx.Newton(rtol=1e-6, atol=1e-6)),
    "root:Chord": (root, lambda: optx.Chord(rtol=1e-6, atol=1e-6)),
    "lstsq:GaussNewton": (least_squares, lambda: optx.GaussNewton(rtol=1e-6, atol=1e-6)),
    "lstsq:LevenbergMarquardt": (
        least_squares,
        lambda: optx.LevenbergMarquardt(rtol=1e-6, atol=1e-6),
    ),
}


# Least squares carries the Jacobian operator (closing over the matrix) in its loop
# state, whose initial value holds a dense zero in the matrix's place, and a
# `cond` in the loop's body chooses between it and the matrix. A LoRA matrix
# holds that zero (`W` = 0, zero factors: `Value.holding_plain`), and so does a
# quantised one (zero codes and scales, `quaxlike.internal.holding_known_zeros`:
# the zero is known while tracing), found by the loop's stand-in for the plain
# carry, since the body refuses to materialise it. A tridiagonal matrix may be
# materialised, which its body does silently (it is cheap) before the loop can
# try a stand-in: it is the one case still made dense.
CASES = [(name, s) for name in MATRICES for s in SOLVERS]


@pytest.mark.parametrize("name, solver", CASES)
def test_solve(name, solver):
    matrix = MATRICES[name](jr.key(0))
    b = jnp.linspace(1.0, 2.0, _cases.N)
    method, make = SOLVERS[solver]
    expected = method(_cases.dense_of(matrix), b, make())
    run = eqx.filter_jit(quaxlike.quaxify(lambda m, v: method(m, v, make())))
    np.testing.assert_allclose(run(matrix, b), expected, rtol=1e-4, atol=1e-5)
    # Materialised only where the body materialises before the loop can try a
    # stand-in: a tridiagonal matrix (cheap, so silently), in least squares.
    report = quaxlike.explain(lambda m, v: method(m, v, make()))(matrix, b)
    expect_dense = solver.startswith("lstsq") and name == "tridiagonal"
    assert bool(report.materialised) == expect_dense, report
