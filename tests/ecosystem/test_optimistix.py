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
# holds that zero (`W` = 0, zero factors: `Value.holding_plain`); a quantised or
# tridiagonal one holds it too (zero codes and scales, zero bands:
# `quaxlike.internal.holding_known_zeros`, the zero being known while tracing),
# tried by the loop as a stand-in for the plain carry before the body could
# materialise the matrix.
CASES = [(name, s) for name in MATRICES for s in SOLVERS]


@pytest.mark.parametrize("name, solver", CASES)
def test_solve(name, solver):
    matrix = MATRICES[name](jr.key(0))
    b = jnp.linspace(1.0, 2.0, _cases.N)
    method, make = SOLVERS[solver]
    expected = method(_cases.dense_of(matrix), b, make())
    run = eqx.filter_jit(quaxlike.quaxify(lambda m, v: method(m, v, make())))
    np.testing.assert_allclose(run(matrix, b), expected, rtol=1e-4, atol=1e-5)
    # Nothing materialised: no solver here needs the dense matrix.
    report = quaxlike.explain(lambda m, v: method(m, v, make()))(matrix, b)
    assert not report.materialised, report
