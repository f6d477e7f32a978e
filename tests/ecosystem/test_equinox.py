"""Equinox's own machinery on Values: `eqx.error_if`, `eqx.filter_custom_jvp` and
`filter_custom_vjp` (forward), `equinox.internal.while_loop` of every kind, and a
host callback in a `cond` branch. Each against the dense computation, eagerly and
under `eqx.filter_jit`. (Their derivatives are in `test_gradients.py`.)"""

import _ecosystem_values as _cases
import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import quaxlike
from quaxlike.units import m, s, Unitful


VALUES = {
    "lora": _cases.lora_general,
    "diagonal": _cases.diagonal,
    "tridiagonal": _cases.tridiagonal,
    "int8": _cases.int8,
    "sparse": _cases.sparse,
    "unitful": lambda key: Unitful(jr.normal(key, (_cases.N,)), m),
}


def _same(out, value):
    assert type(out) is type(value)
    for a, b in zip(jtu.tree_leaves(out), jtu.tree_leaves(value)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", list(VALUES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
def test_error_if_passes_a_value_through_with_its_type(name, jit):
    value = VALUES[name](jr.key(0))
    check = quaxlike.quaxify(lambda v, p: eqx.error_if(v, p, "bad value"))
    if jit:
        check = eqx.filter_jit(check)
    _same(check(value, jnp.array(False)), value)
    with pytest.raises(Exception, match="bad value"):
        check(value, jnp.array(True))


@pytest.mark.parametrize("name", ["lora", "diagonal", "unitful"])
def test_error_if_under_jax_jit_and_in_a_larger_program(name):
    value = VALUES[name](jr.key(1))

    def f(v, limit):
        v = eqx.error_if(v, limit < 0, "negative limit")
        return v * 2.0

    out = jax.jit(quaxlike.quaxify(f))(value, 1.0)
    expected = quaxlike.quaxify(lambda v: v * 2.0)(value)
    _same(out, expected)
    with pytest.raises(Exception, match="negative limit"):
        jax.jit(quaxlike.quaxify(f))(value, -1.0)


def test_a_callback_that_returns_where_the_other_branch_gives_a_value_raises():
    value = _cases.diagonal(jr.key(0))
    struct = jax.ShapeDtypeStruct(value.shape, value.dtype)

    def f(v, p):
        return jax.lax.cond(
            p, lambda: jax.pure_callback(lambda: np.zeros(v.shape, v.dtype), struct), lambda: v
        )

    run = jax.jit(quaxlike.quaxify(f))
    _same(run(value, False), value)
    with pytest.raises(Exception, match="cannot be turned into a Diagonal"):
        run(value, True)


@pytest.mark.parametrize("name", ["lora", "diagonal", "tridiagonal", "int8", "sparse"])
@pytest.mark.parametrize(
    "fn", [_cases.doubled_tangent_matvec, _cases.clipped_matvec], ids=["custom_jvp", "custom_vjp"]
)
def test_filter_custom_derivative_functions_forward(name, fn):
    w = VALUES[name](jr.key(2))
    x = jnp.linspace(-1.0, 1.0, _cases.N)
    expected = _cases.dense_of(w) @ x
    np.testing.assert_allclose(quaxlike.quaxify(fn)(w, x), expected, rtol=1e-5)
    np.testing.assert_allclose(eqx.filter_jit(quaxlike.quaxify(fn))(w, x), expected, rtol=1e-5)


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
@pytest.mark.parametrize("name", ["lora", "tridiagonal", "int8"])
def test_internal_while_loop_with_a_value_in_the_body(kind, name):
    w = VALUES[name](jr.key(3))
    x0 = jnp.linspace(-1.0, 1.0, _cases.N)

    def power_iteration(w, x0):
        def body(carry):
            i, x = carry
            y = w @ x
            return i + 1, y / jnp.linalg.norm(y)

        return eqxi.while_loop(lambda c: c[0] < 6, body, (0, x0), max_steps=8, kind=kind)[1]

    expected = power_iteration(_cases.dense_of(w), x0)
    np.testing.assert_allclose(quaxlike.quaxify(power_iteration)(w, x0), expected, rtol=1e-5)
    jitted = eqx.filter_jit(quaxlike.quaxify(power_iteration))(w, x0)
    np.testing.assert_allclose(jitted, expected, rtol=1e-5)
    report = quaxlike.explain(power_iteration)(w, x0)
    assert not report.materialised, report


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
def test_internal_while_loop_buffers_keep_units(kind):
    # Writes into a loop's buffers are Equinox's `maybe_set` primitive.
    x, t = Unitful(jnp.arange(3.0), m), Unitful(jnp.array(2.0), s)

    def fill(x, t, buffer):
        def body(carry):
            i, buffer, total = carry
            return i + 1, buffer.at[i].set(x * i), total + t

        init = (0, buffer, t)
        out = eqxi.while_loop(
            lambda c: c[0] < 4, body, init, max_steps=4, kind=kind, buffers=lambda c: c[1]
        )
        return out[1], out[2]

    zeros = jnp.zeros((4, 3))
    buffer, total = quaxlike.quaxify(fill)(x, t, Unitful(zeros, m))
    assert buffer.unit == m and total.unit == s
    expected, expected_total = fill(x.array, t.array, zeros)
    np.testing.assert_allclose(buffer.array, expected)
    np.testing.assert_allclose(total.array, expected_total)
