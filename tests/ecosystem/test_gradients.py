"""Derivatives through custom-derivative functions and the solvers built on them,
with Values inside: each equals the derivative of the same computation on the
dense arrays.

`jax.custom_jvp`/`custom_vjp` (and Equinox's filter versions) are what diffrax's
adjoints, optimistix's implicit differentiation and Equinox's checkpointed loops
are made of, so these tests need the custom-derivative rules to run whenever JAX
would run them, and a dense cotangent to be pulled back to a Value's leaves.
"""

import _ecosystem_values as _cases
import diffrax
import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optimistix as optx
import pytest

import quaxlike
from quaxlike.lora import LoraArray
from quaxlike.structured import TriDiagonal


def test_custom_jvp_rule_runs_for_a_lora_argument():
    @jax.custom_jvp
    def f(w, x):
        return w @ x

    @f.defjvp
    def f_jvp(primals, tangents):
        (w, x), (_, tx) = primals, tangents
        return f(w, x), 2 * (w @ tx)

    lora = LoraArray(jnp.eye(3), rank=1, key=jr.key(0))
    x = jnp.ones(3)
    got = jax.jvp(lambda x: quaxlike.quaxify(f)(lora, x), (x,), (x,))[1]
    expected = jax.jvp(lambda x: f(lora.dense(), x), (x,), (x,))[1]
    np.testing.assert_allclose(got, expected)
    np.testing.assert_allclose(got, [2.0, 2.0, 2.0])


@pytest.mark.parametrize("name", ["lora", "diagonal", "tridiagonal", "int8"])
@pytest.mark.parametrize(
    "fn",
    [_cases.doubled_tangent_matvec, _cases.clipped_matvec],
    ids=["filter_custom_jvp", "filter_custom_vjp"],
)
def test_filter_custom_derivatives_wrt_a_plain_argument(name, fn):
    make = {
        "lora": _cases.lora_general,
        "diagonal": _cases.diagonal,
        "tridiagonal": _cases.tridiagonal,
        "int8": _cases.int8,
    }[name]
    w = make(jr.key(2))
    x = jnp.linspace(-1.0, 1.0, _cases.N)

    def loss(f, w, x):
        return jnp.sum(jnp.sin(f(w, x)))

    expected = jax.grad(lambda x: loss(fn, _cases.dense_of(w), x))(x)
    got = jax.grad(lambda x: loss(quaxlike.quaxify(fn), w, x))(x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


class _MatVecField(eqx.Module):
    matrix: object

    def __call__(self, t, y, args):
        return -(self.matrix @ y)


def _final_state(field, y0, adjoint):
    return diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        diffrax.Tsit5(),
        t0=0.0,
        t1=1.0,
        dt0=0.25,
        y0=y0,
        adjoint=adjoint,
        max_steps=8,
    ).ys[-1]


ADJOINTS = {
    "RecursiveCheckpointAdjoint": diffrax.RecursiveCheckpointAdjoint,
    "DirectAdjoint": diffrax.DirectAdjoint,
    "BacksolveAdjoint": diffrax.BacksolveAdjoint,
}


@pytest.mark.parametrize("adjoint", list(ADJOINTS))
def test_diffrax_gradient_wrt_the_initial_state(adjoint):
    matrix = _cases.lora_general(jr.key(0))
    y0 = jnp.linspace(-0.5, 0.5, _cases.N)

    def loss(field, y0):
        return jnp.sum(_final_state(field, y0, ADJOINTS[adjoint]()) ** 2)

    expected = jax.grad(loss, argnums=1)(_MatVecField(_cases.dense_of(matrix)), y0)
    got = jax.grad(lambda y: quaxlike.quaxify(loss)(_MatVecField(matrix), y))(y0)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("adjoint", list(ADJOINTS))
def test_diffrax_gradient_wrt_a_tridiagonal_vector_field(adjoint):
    off = jnp.full(_cases.N - 1, 0.3)
    y0 = jnp.linspace(-0.5, 0.5, _cases.N)

    def loss_value(diag):
        field = _MatVecField(TriDiagonal(off, diag, off))
        return jnp.sum(quaxlike.quaxify(_final_state)(field, y0, ADJOINTS[adjoint]()) ** 2)

    def loss_dense(diag):
        dense = jnp.diag(diag) + jnp.diag(off, 1) + jnp.diag(off, -1)
        return jnp.sum(_final_state(_MatVecField(dense), y0, ADJOINTS[adjoint]()) ** 2)

    diag = jnp.linspace(1.0, 2.0, _cases.N)
    np.testing.assert_allclose(
        jax.grad(loss_value)(diag), jax.grad(loss_dense)(diag), rtol=1e-4, atol=1e-6
    )


def test_diffrax_implicit_adjoint_of_a_steady_state():
    matrix = _cases.tridiagonal(jr.key(0))
    b = jnp.linspace(1.0, 2.0, _cases.N)

    class Field(eqx.Module):
        matrix: object

        def __call__(self, t, y, b):
            return b - self.matrix @ y

    def steady_state(matrix, b):
        return diffrax.diffeqsolve(
            diffrax.ODETerm(Field(matrix)),
            diffrax.Tsit5(),
            t0=0.0,
            t1=jnp.inf,
            dt0=0.1,
            y0=jnp.zeros(_cases.N),
            args=b,
            stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6),
            event=diffrax.Event(diffrax.steady_state_event(rtol=1e-4, atol=1e-4)),
            adjoint=diffrax.ImplicitAdjoint(),
            max_steps=256,
        ).ys[-1]

    def loss(solve, m, b):
        return jnp.sum(solve(m, b) ** 2)

    expected = jax.grad(lambda b: loss(steady_state, _cases.dense_of(matrix), b))(b)
    got = jax.grad(lambda b: loss(quaxlike.quaxify(steady_state), matrix, b))(b)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-5)


def _solve_by(kind: str):
    def residual(y, args):
        m, b = args
        return m @ y + 0.1 * jnp.tanh(y) - b

    def root(m, b):
        solver = optx.Newton(rtol=1e-6, atol=1e-6)
        return optx.root_find(residual, solver, jnp.zeros_like(b), args=(m, b)).value

    def least_squares(m, b):
        # The loop state starts with a plain zero where the Jacobian operator
        # closes over `m`: a LoRA holds it (`Value.holding_plain`), thawed.
        solver = optx.GaussNewton(rtol=1e-6, atol=1e-6)
        return optx.least_squares(residual, solver, jnp.zeros_like(b), args=(m, b)).value

    return {"root": root, "least_squares": least_squares}[kind]


@pytest.mark.parametrize(
    "name, kind", [("lora", "root"), ("tridiagonal", "root"), ("lora", "least_squares")]
)
def test_optimistix_gradient_by_implicit_differentiation(name, kind):
    matrix = {"lora": _cases.lora_general, "tridiagonal": _cases.tridiagonal}[name](jr.key(0))
    root = _solve_by(kind)

    def loss(solve, m, b):
        return jnp.sum(solve(m, b) ** 2)

    b = jnp.linspace(1.0, 2.0, _cases.N)
    expected = jax.grad(lambda b: loss(root, _cases.dense_of(matrix), b))(b)
    got = jax.grad(lambda b: loss(quaxlike.quaxify(root), matrix, b))(b)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["lora", "tridiagonal", "int8"])
def test_checkpointed_while_loop_gradient(name):
    make = {"lora": _cases.lora_general, "tridiagonal": _cases.tridiagonal, "int8": _cases.int8}
    w = make[name](jr.key(3))
    x0 = jnp.linspace(-1.0, 1.0, _cases.N)

    def iterate(w, x0):
        def body(carry):
            i, x = carry
            return i + 1, jnp.tanh(w @ x)

        out = eqxi.while_loop(lambda c: c[0] < 4, body, (0, x0), max_steps=8, kind="checkpointed")
        return jnp.sum(out[1] ** 2)

    expected = jax.grad(iterate, argnums=1)(_cases.dense_of(w), x0)
    got = jax.grad(lambda x: quaxlike.quaxify(iterate)(w, x))(x0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["root", "least_squares"])
def test_optimistix_gradient_wrt_a_lora_matrix_s_factors(kind):
    # Through the solve's implicit derivative and, in least squares, through the
    # joined loop state (the frozen `W` thawed behind `stop_gradient`).
    lora = _cases.lora_general(jr.key(0))
    w, a, b_factor = lora.w, lora.a, 0.1 * jr.normal(jr.key(5), lora.b.shape)
    solve = _solve_by(kind)
    vector = jnp.linspace(1.0, 2.0, _cases.N)

    def dense_loss(a, b_factor):
        return jnp.sum(solve(jax.lax.stop_gradient(w) + a @ b_factor, vector) ** 2)

    def loss(a, b_factor):
        matrix = LoraArray.from_factors(w, a, b_factor)
        return jnp.sum(quaxlike.quaxify(solve)(matrix, vector) ** 2)

    expected = jax.grad(dense_loss, argnums=(0, 1))(a, b_factor)
    got = jax.grad(loss, argnums=(0, 1))(a, b_factor)
    for g, e in zip(got, expected):
        assert float(jnp.max(jnp.abs(e))) > 0
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6)
