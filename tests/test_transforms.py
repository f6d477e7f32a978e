"""JAX and Equinox transformations around `quaxify` (transform(quaxify(f))) and
inside it (quaxify(lambda ...: transform(g)(...))). Gradients with respect to the
fields of a LoraArray are compared with the plain function of (w, a, b)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import randn, tree_allclose

import quaxlike
from quaxlike.lora import LoraArray
from quaxlike.symbolic.zero import Zero


RTOL, ATOL = 1e-4, 1e-5


_KEY = jr.key(0)


def make_lora(seed, shape=(4, 3), rank=2, *, allow_materialise=False, stop_gradient=True):
    *batch, m, n = shape
    lora = LoraArray(
        randn(seed, shape),
        rank=rank,
        allow_materialise=allow_materialise,
        stop_gradient=stop_gradient,
        key=_KEY,
    )
    a = randn(seed + 1000, (*batch, m, rank), 0.5)
    b = randn(seed + 2000, (*batch, rank, n))
    return lora.with_factors(lora.w, a, b)


def dense(lora):
    return lora.w + jnp.einsum("...mr,...rn->...mn", lora.a, lora.b)


def g(m, x):
    """The function under test: a matrix product and a non-linearity."""
    return jnp.tanh(m @ x) * 2.0


def loss(m, x):
    return jnp.sum(g(m, x) ** 2)


def loss_factors(w, a, b, x):
    """The same loss as a plain function of (w, a, b): (w + a @ b) x by hand."""
    return jnp.sum((jnp.tanh(w @ x + a @ (b @ x)) * 2.0) ** 2)


@pytest.fixture
def setup(getseed):
    return make_lora(getseed()), randn(getseed(), (3,))


# --- outside: transform(quaxify(f)) ----------------------------------------------


def test_jit_outside(setup):
    lora, x = setup
    out = jax.jit(quaxlike.quaxify(g))(lora, x)
    assert tree_allclose(out, g(dense(lora), x), rtol=RTOL)


def test_jit_outside_returns_value(setup):
    lora, x = setup
    out = jax.jit(quaxlike.quaxify(lambda m: -(m * 2.0)))(lora)
    assert isinstance(out, LoraArray)
    assert tree_allclose(dense(out), -2.0 * dense(lora), rtol=RTOL)
    z = jax.jit(quaxlike.quaxify(lambda z, x: z @ x))(Zero((5, 4), jnp.float32), g(dense(lora), x))
    assert isinstance(z, Zero) and z.shape == (5,)


def test_grad_outside_wrt_factors(setup):
    lora, x = setup

    def f(a, b):
        return quaxlike.quaxify(loss)(lora.with_factors(lora.w, a, b), x)

    got = jax.grad(f, (0, 1))(lora.a, lora.b)
    expected = jax.grad(loss_factors, (1, 2))(lora.w, lora.a, lora.b, x)
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_grad_outside_wrt_value(setup):
    lora, x = setup
    grads = jax.grad(quaxlike.quaxify(loss))(lora, x)
    assert isinstance(grads, LoraArray)
    _, ga, gb = jax.grad(loss_factors, (0, 1, 2))(lora.w, lora.a, lora.b, x)
    assert tree_allclose((grads.a, grads.b), (ga, gb), rtol=RTOL, atol=ATOL)
    # `w` is frozen (stop_gradient).
    assert tree_allclose(grads.w, jnp.zeros_like(lora.w))


def test_grad_outside_wrt_w_when_not_frozen(getseed):
    lora = make_lora(getseed(), stop_gradient=False)
    x = randn(getseed(), (3,))
    grads = jax.grad(quaxlike.quaxify(loss))(lora, x)
    expected = jax.grad(loss_factors, (0, 1, 2))(lora.w, lora.a, lora.b, x)
    assert tree_allclose((grads.w, grads.a, grads.b), expected, rtol=RTOL, atol=ATOL)


def test_grad_outside_wrt_dense_input(setup):
    lora, x = setup
    got = jax.grad(quaxlike.quaxify(loss), argnums=1)(lora, x)
    expected = jax.grad(loss_factors, argnums=3)(lora.w, lora.a, lora.b, x)
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_value_and_grad_outside(setup):
    lora, x = setup

    def f(a, b, x):
        return quaxlike.quaxify(loss)(lora.with_factors(lora.w, a, b), x)

    got = jax.jit(jax.value_and_grad(f, (0, 1, 2)))(lora.a, lora.b, x)
    expected = jax.value_and_grad(loss_factors, (1, 2, 3))(lora.w, lora.a, lora.b, x)
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_jvp_outside(setup, getseed):
    lora, x = setup
    ta, tb, tx = (randn(getseed(), y.shape) for y in (lora.a, lora.b, x))

    def f(a, b, x):
        return quaxlike.quaxify(g)(lora.with_factors(lora.w, a, b), x)

    def ref(a, b, x):
        return jnp.tanh(lora.w @ x + a @ (b @ x)) * 2.0

    got = jax.jvp(f, (lora.a, lora.b, x), (ta, tb, tx))
    expected = jax.jvp(ref, (lora.a, lora.b, x), (ta, tb, tx))
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_vjp_outside(setup, getseed):
    lora, x = setup
    ct = randn(getseed(), (4,))

    def f(a, b, x):
        return quaxlike.quaxify(g)(lora.with_factors(lora.w, a, b), x)

    def ref(a, b, x):
        return jnp.tanh(lora.w @ x + a @ (b @ x)) * 2.0

    out, pullback = jax.vjp(f, lora.a, lora.b, x)
    out_ref, pullback_ref = jax.vjp(ref, lora.a, lora.b, x)
    assert tree_allclose(out, out_ref, rtol=RTOL)
    assert tree_allclose(pullback(ct), pullback_ref(ct), rtol=RTOL, atol=ATOL)


def test_vmap_outside_over_plain_input(setup, getseed):
    lora, _ = setup
    xs = randn(getseed(), (6, 3))
    out = jax.vmap(quaxlike.quaxify(g), in_axes=(None, 0))(lora, xs)
    assert tree_allclose(out, jax.vmap(g, in_axes=(None, 0))(dense(lora), xs), rtol=RTOL)


def test_vmap_outside_over_value(getseed):
    stacked = make_lora(getseed(), (5, 4, 3))
    x = randn(getseed(), (3,))
    out = jax.vmap(quaxlike.quaxify(g), in_axes=(0, None))(stacked, x)
    assert tree_allclose(out, jax.vmap(g, in_axes=(0, None))(dense(stacked), x), rtol=RTOL)
    xs = randn(getseed(), (5, 3))
    out = jax.vmap(quaxlike.quaxify(g))(stacked, xs)
    assert tree_allclose(out, jax.vmap(g)(dense(stacked), xs), rtol=RTOL)


def test_vmap_outside_over_value_grads(getseed):
    stacked = make_lora(getseed(), (5, 4, 3))
    xs = randn(getseed(), (5, 3))

    def f(a, b):
        s = stacked.with_factors(stacked.w, a, b)
        return jnp.sum(jax.vmap(quaxlike.quaxify(loss))(s, xs))

    def ref(a, b):
        return jnp.sum(jax.vmap(loss_factors)(stacked.w, a, b, xs))

    got = jax.grad(f, (0, 1))(stacked.a, stacked.b)
    expected = jax.grad(ref, (0, 1))(stacked.a, stacked.b)
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_vmap_outside_returns_value(getseed):
    stacked = make_lora(getseed(), (5, 4, 3))
    out = jax.vmap(quaxlike.quaxify(lambda m: m * 3.0))(stacked)
    assert isinstance(out, LoraArray) and out.shape == (5, 4, 3)
    assert tree_allclose(dense(out), 3.0 * dense(stacked), rtol=RTOL)


def test_vmap_outside_zero(getseed):
    xs = randn(getseed(), (6, 3))
    out = jax.vmap(quaxlike.quaxify(lambda z, x: z * x + x), in_axes=(None, 0))(
        Zero((3,), jnp.float32), xs
    )
    assert tree_allclose(out, xs)


def test_filter_jit_outside(setup):
    lora, x = setup
    out = eqx.filter_jit(quaxlike.quaxify(g))(lora, x)
    assert tree_allclose(out, g(dense(lora), x), rtol=RTOL)
    z = eqx.filter_jit(quaxlike.quaxify(lambda z: z * 2.0))(Zero((3,), jnp.float32))
    assert isinstance(z, Zero)


def test_filter_grad_outside(setup):
    lora, x = setup
    grads = eqx.filter_grad(quaxlike.quaxify(loss))(lora, x)
    assert isinstance(grads, LoraArray)
    _, ga, gb = jax.grad(loss_factors, (0, 1, 2))(lora.w, lora.a, lora.b, x)
    assert tree_allclose((grads.a, grads.b), (ga, gb), rtol=RTOL, atol=ATOL)


def test_filter_value_and_grad_outside(setup):
    lora, x = setup
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(quaxlike.quaxify(loss)))(lora, x)
    expected_value, (_, ga, gb) = jax.value_and_grad(loss_factors, (0, 1, 2))(
        lora.w, lora.a, lora.b, x
    )
    assert tree_allclose((value, grads.a, grads.b), (expected_value, ga, gb), rtol=RTOL, atol=ATOL)


def test_filter_vmap_outside(getseed):
    stacked = make_lora(getseed(), (5, 4, 3))
    xs = randn(getseed(), (5, 3))
    out = eqx.filter_vmap(quaxlike.quaxify(g))(stacked, xs)
    assert tree_allclose(out, jax.vmap(g)(dense(stacked), xs), rtol=RTOL)
    x = randn(getseed(), (3,))
    out = eqx.filter_vmap(quaxlike.quaxify(g), in_axes=(0, None))(stacked, x)
    assert tree_allclose(out, jax.vmap(g, in_axes=(0, None))(dense(stacked), x), rtol=RTOL)


# --- inside: quaxify(lambda ...: transform(g)(...)) ------------------------------


def test_jit_inside(setup):
    lora, x = setup
    out = quaxlike.quaxify(lambda m, x: jax.jit(g)(m, x))(lora, x)
    assert tree_allclose(out, g(dense(lora), x), rtol=RTOL)


def test_filter_jit_inside(setup):
    lora, x = setup
    out = quaxlike.quaxify(lambda m, x: eqx.filter_jit(g)(m, x))(lora, x)
    assert tree_allclose(out, g(dense(lora), x), rtol=RTOL)


def test_grad_inside_wrt_dense_input(setup):
    lora, x = setup
    out = quaxlike.quaxify(lambda m, x: jax.grad(loss, argnums=1)(m, x))(lora, x)
    assert tree_allclose(out, jax.grad(loss, argnums=1)(dense(lora), x), rtol=RTOL, atol=ATOL)


def test_grad_inside_wrt_value(setup):
    # Inside quaxify the Value is an array: its gradient is d loss / d(w + a b).
    lora, x = setup
    out = quaxlike.quaxify(lambda m, x: jax.grad(loss)(m, x))(lora, x)
    assert tree_allclose(out, jax.grad(loss)(dense(lora), x), rtol=RTOL, atol=ATOL)


def test_value_and_grad_inside(setup):
    lora, x = setup
    out = quaxlike.quaxify(lambda m, x: jax.value_and_grad(loss, argnums=1)(m, x))(lora, x)
    expected = jax.value_and_grad(loss, argnums=1)(dense(lora), x)
    assert tree_allclose(out, expected, rtol=RTOL, atol=ATOL)


def test_jvp_vjp_inside(setup, getseed):
    lora, x = setup
    tx = randn(getseed(), (3,))
    ct = randn(getseed(), (4,))
    got = quaxlike.quaxify(lambda m, x: jax.jvp(lambda y: g(m, y), (x,), (tx,)))(lora, x)
    expected = jax.jvp(lambda y: g(dense(lora), y), (x,), (tx,))
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)

    def pull(m, x):
        out, pullback = jax.vjp(lambda y: g(m, y), x)
        return out, pullback(ct)

    got = quaxlike.quaxify(pull)(lora, x)
    assert tree_allclose(got, pull(dense(lora), x), rtol=RTOL, atol=ATOL)


def test_filter_grad_inside(setup):
    lora, x = setup
    out = quaxlike.quaxify(lambda m, x: eqx.filter_grad(lambda x, m: loss(m, x))(x, m))(lora, x)
    assert tree_allclose(out, jax.grad(loss, argnums=1)(dense(lora), x), rtol=RTOL, atol=ATOL)


def test_grad_of_quaxify_of_grad(setup):
    # The outer gradient goes through an inner one, with respect to the factors.
    lora, x = setup

    def f(a, b):
        inner = quaxlike.quaxify(lambda m, x: jax.grad(loss, argnums=1)(m, x))
        return jnp.sum(inner(lora.with_factors(lora.w, a, b), x))

    def ref(a, b):
        return jnp.sum(jax.grad(loss_factors, argnums=3)(lora.w, a, b, x))

    got = jax.jit(jax.grad(f, (0, 1)))(lora.a, lora.b)
    expected = jax.jit(jax.grad(ref, (0, 1)))(lora.a, lora.b)
    assert tree_allclose(got, expected, rtol=1e-3, atol=1e-4)


def test_vmap_inside_over_plain_input(setup, getseed):
    lora, _ = setup
    xs = randn(getseed(), (6, 3))
    out = quaxlike.quaxify(lambda m, xs: jax.vmap(lambda x: g(m, x))(xs))(lora, xs)
    assert tree_allclose(out, jax.vmap(g, in_axes=(None, 0))(dense(lora), xs), rtol=RTOL)
    out = quaxlike.quaxify(lambda m, xs: eqx.filter_vmap(g, in_axes=(None, 0))(m, xs))(lora, xs)
    assert tree_allclose(out, jax.vmap(g, in_axes=(None, 0))(dense(lora), xs), rtol=RTOL)


def test_vmap_inside_over_value_and_input(getseed):
    # Both batched: a dot_general with batch dimensions, which the LoRA rule handles.
    stacked = make_lora(getseed(), (5, 4, 3))
    xs = randn(getseed(), (5, 3))
    out = quaxlike.quaxify(lambda s, xs: jax.vmap(g)(s, xs))(stacked, xs)
    assert tree_allclose(out, jax.vmap(g)(dense(stacked), xs), rtol=RTOL)


def test_vmap_inside_over_value_materialising(getseed):
    stacked = make_lora(getseed(), (5, 4, 3), allow_materialise=True)
    x = randn(getseed(), (3,))
    out = quaxlike.quaxify(lambda s, x: jax.vmap(g, in_axes=(0, None))(s, x))(stacked, x)
    assert tree_allclose(out, jax.vmap(g, in_axes=(0, None))(dense(stacked), x), rtol=RTOL)


def test_vmap_inside_over_value_no_materialise(getseed):
    stacked = make_lora(getseed(), (5, 4, 3))
    x = randn(getseed(), (3,))
    out = quaxlike.quaxify(lambda s, x: jax.vmap(g, in_axes=(0, None))(s, x))(stacked, x)
    assert tree_allclose(out, jax.vmap(g, in_axes=(0, None))(dense(stacked), x), rtol=RTOL)


def test_vmap_inside_zero(getseed):
    xs = randn(getseed(), (6, 3))
    out = quaxlike.quaxify(lambda z, xs: jax.vmap(lambda x: z * x + x)(xs))(
        Zero((3,), jnp.float32), xs
    )
    assert tree_allclose(out, xs)


def test_jit_grad_vmap_stack(getseed):
    # jit(grad(vmap(quaxify(f)))) with respect to the factors of a shared LoRA.
    lora = make_lora(getseed())
    xs = randn(getseed(), (6, 3))

    @jax.jit
    def f(a, b):
        m = lora.with_factors(lora.w, a, b)
        return jnp.sum(jax.vmap(quaxlike.quaxify(loss), in_axes=(None, 0))(m, xs))

    def ref(a, b):
        return jnp.sum(jax.vmap(loss_factors, in_axes=(None, None, None, 0))(lora.w, a, b, xs))

    got = f(lora.a, lora.b), jax.grad(f, (0, 1))(lora.a, lora.b)
    expected = ref(lora.a, lora.b), jax.grad(ref, (0, 1))(lora.a, lora.b)
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)
