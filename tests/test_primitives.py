"""Calls through `quaxlike.quaxify` that the conformance table does not make:
Values inside containers, keyword arguments, Equinox modules and partial
functions, `DenseArrayValue` under nested transforms and `grad`.

The sweep of JAX operations (every primitive, every argument position, under
`jit`, `grad` and `vmap`) lives in tests/conformance/.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import materialise_tree, PassThrough, tree_allclose

import quaxlike


_rng = np.random.default_rng(0)


def f32(*shape, low=-2.0, high=2.0):
    return jnp.asarray(_rng.uniform(low, high, shape).astype(np.float32))


@jax.custom_jvp
def my_custom_sin(x):
    return jnp.sin(x)


@my_custom_sin.defjvp
def _my_custom_sin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.sin(x), jnp.cos(x) * t


# Tolerances for operations whose result may differ in the last bits when the
# same primitives run through a different code path.
_TOLERANCES = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture
def no_leak_check():
    """The tracer-leak checker (on for every test, see conftest.py) turns off JAX's
    compilation caches; tests that compile a lot run without it."""
    with jax.check_tracer_leaks(False):
        yield


def test_jit_of_vmap_of_quaxify_dense(no_leak_check):
    fn = lambda x, w: jax.nn.relu(x @ w).sum()  # noqa: E731
    x, w = f32(5, 3), f32(3, 2)
    expected = jax.vmap(fn, in_axes=(0, None))(x, w)
    out = jax.jit(jax.vmap(quaxlike.quaxify(fn), in_axes=(0, None)))(
        quaxlike.DenseArrayValue(x), quaxlike.DenseArrayValue(w)
    )
    assert isinstance(out, jax.Array)
    assert tree_allclose(out, expected, **_TOLERANCES)


def test_grad_through_custom_jvp_passthrough():
    x = f32(3, 4)

    def loss(x):
        out = quaxlike.quaxify(lambda v: my_custom_sin(v) * 2.0)(PassThrough(x))
        assert isinstance(out, PassThrough)
        return out.array.sum()

    g = jax.grad(loss)(x)
    assert tree_allclose(g, 2.0 * jnp.cos(x), **_TOLERANCES)


def test_grad_through_relu_dense(no_leak_check):
    x = f32(3, 4)

    def loss(x):
        out = quaxlike.quaxify(lambda v: jax.nn.relu(v) ** 2)(quaxlike.DenseArrayValue(x))
        return out.sum()

    g = jax.grad(loss)(x)
    assert tree_allclose(g, jax.grad(lambda x: (jax.nn.relu(x) ** 2).sum())(x), **_TOLERANCES)


# --- misc --------------------------------------------------------------------


def test_values_in_containers_and_kwargs():
    x, y = f32(3, 4), f32(3, 4)

    def fn(pair, *, scale):
        a, b = pair
        return {"s": (a + b) * scale, "d": a - b}

    expected = fn((x, y), scale=jnp.float32(2.0))
    out = quaxlike.quaxify(fn)((PassThrough(x), y), scale=PassThrough(jnp.float32(2.0)))
    assert isinstance(out["s"], PassThrough) and isinstance(out["d"], PassThrough)
    assert tree_allclose(materialise_tree(out), expected)


def test_passthrough_inside_module(no_leak_check):
    class Linear(eqx.Module):
        w: jax.Array
        b: jax.Array

        def __call__(self, x):
            return self.w @ x + self.b

    w, bias, x = f32(3, 4), f32(3), f32(4)
    model = Linear(PassThrough(w), bias)
    out = quaxlike.quaxify(model)(x)
    assert isinstance(out, PassThrough)
    assert tree_allclose(out.array, w @ x + bias)
    # The same through eqx.filter_jit.
    out = eqx.filter_jit(quaxlike.quaxify(model))(x)
    assert isinstance(out, PassThrough)
    assert tree_allclose(out.array, w @ x + bias, **_TOLERANCES)


def test_partial_application_closure():
    x = f32(3, 4)
    wrapped = PassThrough(f32(3, 4))
    out = quaxlike.quaxify(jtu.Partial(jnp.add, wrapped))(x)
    assert isinstance(out, PassThrough)
    assert tree_allclose(out.array, wrapped.array + x)
