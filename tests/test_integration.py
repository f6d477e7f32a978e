"""End to end: a LoRA'd Equinox MLP, an optax training loop, the demo, and
recovery after an exception raised mid-trace."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import quaxlike
import quaxlike.demo
from quaxlike.lora import LoraArray, loraify, merge, trainable_filter
from quaxlike.symbolic.zero import Zero


# Seed scenarios and training loops are user code, written with JAX's default
# dtype and rank promotion.
pytestmark = pytest.mark.loose_promotion


def is_lora(x):
    return isinstance(x, LoraArray)


def loras(model):
    return [x for x in jax.tree_util.tree_leaves(model, is_leaf=is_lora) if is_lora(x)]


@pytest.fixture(scope="module")
def mlp():
    return eqx.nn.MLP(5, 3, 8, depth=2, key=jr.key(0))


@pytest.fixture(scope="module")
def xs():
    return jnp.asarray(np.random.default_rng(0).standard_normal((16, 5)), dtype=jnp.float32)


def test_loraify_mlp_matches_original_at_init(mlp, xs):
    model = loraify(mlp, rank=2, key=jr.key(1))
    assert len(loras(model)) == 3
    for lora in loras(model):
        assert not np.any(np.asarray(lora.b))
    out = jax.jit(jax.vmap(quaxlike.quaxify(model)))(xs)
    assert tree_allclose(out, jax.vmap(mlp)(xs), rtol=1e-5, atol=1e-6)
    # Eagerly, on one input, too.
    assert tree_allclose(quaxlike.quaxify(model)(xs[0]), mlp(xs[0]), rtol=1e-5, atol=1e-6)


def test_loraify_mlp_matches_merge_after_update(mlp, xs):
    model = loraify(mlp, rank=2, key=jr.key(1))
    rng = np.random.default_rng(1)
    model = jax.tree_util.tree_map(
        lambda x: (
            x.with_factors(x.w, x.a, jnp.asarray(rng.standard_normal(x.b.shape), jnp.float32))
            if is_lora(x)
            else x
        ),
        model,
        is_leaf=is_lora,
    )
    merged = merge(model)
    assert not loras(merged)
    out = jax.jit(jax.vmap(quaxlike.quaxify(model)))(xs)
    expected = jax.vmap(merged)(xs)
    assert tree_allclose(out, expected, rtol=1e-4, atol=1e-5)
    # The update changed the function.
    assert not tree_allclose(out, jax.vmap(mlp)(xs), rtol=1e-3, atol=1e-3)


def test_optax_training_loop(mlp, xs):
    ys = jnp.sin(xs[:, :3])
    model = loraify(mlp, rank=2, key=jr.key(2))
    trainable, frozen = eqx.partition(model, trainable_filter(model))
    optimiser = optax.adam(1e-2)
    opt_state = optimiser.init(trainable)

    def loss_fn(trainable):
        model = eqx.combine(trainable, frozen)
        return jnp.mean((jax.vmap(quaxlike.quaxify(model))(xs) - ys) ** 2)

    @eqx.filter_jit
    def step(trainable, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(trainable)
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, loss

    losses = []
    new_trainable = trainable
    for _ in range(15):
        new_trainable, opt_state, loss = step(new_trainable, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert float(loss_fn(new_trainable)) < losses[0]

    before = loras(eqx.combine(trainable, frozen))
    after = loras(eqx.combine(new_trainable, frozen))
    for old, new in zip(before, after):
        assert tree_allclose(new.w, old.w)  # frozen weight untouched
        assert not tree_allclose(new.a, old.a)
        assert not tree_allclose(new.b, old.b)
    # Everything outside the LoRA factors (biases, activations) is unchanged too.
    is_factor = trainable_filter(model)
    rest_before = eqx.filter(eqx.combine(trainable, frozen), is_factor, inverse=True)
    rest_after = eqx.filter(eqx.combine(new_trainable, frozen), is_factor, inverse=True)
    assert tree_allclose(rest_before, rest_after)


@pytest.mark.slow
def test_demo_runs():
    # A minute of training: a slow test, since .ci/run runs the README's first
    # command itself (the whole demo, on two Pythons, in fresh environments).
    # The width-1024 memory comparison (two compilations) is left to that command.
    quaxlike.demo.main(steps=30, compare_width=0)


# --- exceptions mid-trace --------------------------------------------------------


class _Boom(ValueError):
    pass


def _raise_midway(m, x, *, fail):
    y = m @ x  # a Value operation has already happened in this trace
    if fail:
        raise _Boom("user error mid-trace")
    return jnp.tanh(y)


def _lora():
    w = jnp.asarray(np.random.default_rng(3).standard_normal((4, 3)), jnp.float32)
    lora = LoraArray(w, rank=2, key=jr.key(3))
    return lora.with_factors(w, lora.a, jnp.ones_like(lora.b))


def test_exception_mid_trace_propagates_and_recovers():
    lora, x = _lora(), jnp.arange(3.0)
    expected = jnp.tanh((lora.w + lora.a @ lora.b) @ x)
    f = quaxlike.quaxify(_raise_midway)
    with pytest.raises(ValueError, match="user error mid-trace"):
        f(lora, x, fail=True)
    assert tree_allclose(f(lora, x, fail=False), expected, rtol=1e-5)
    # Again, under jit, and then an eager call and a Zero.
    with pytest.raises(ValueError, match="user error mid-trace"):
        jax.jit(lambda m, x: f(m, x, fail=True))(lora, x)
    assert tree_allclose(jax.jit(lambda m, x: f(m, x, fail=False))(lora, x), expected, rtol=1e-5)
    z = quaxlike.quaxify(lambda z, x: z * x)(Zero((3,), jnp.float32), x)
    assert isinstance(z, Zero)


def test_exception_inside_higher_order_propagates_and_recovers():
    lora, x = _lora(), jnp.arange(3.0)
    expected = jnp.tanh((lora.w + lora.a @ lora.b) @ x)

    def g(m, x, fail):
        return jax.jit(lambda m, x: _raise_midway(m, x, fail=fail))(m, x)

    f = quaxlike.quaxify(g)
    with pytest.raises(ValueError, match="user error mid-trace"):
        f(lora, x, True)
    assert tree_allclose(f(lora, x, False), expected, rtol=1e-5)

    def h(m, x, fail):
        return jax.lax.cond(x[0] > -1, lambda: _raise_midway(m, x, fail=fail), lambda: m @ x)

    with pytest.raises(ValueError, match="user error mid-trace"):
        quaxlike.quaxify(h)(lora, x, True)
    assert tree_allclose(quaxlike.quaxify(h)(lora, x, False), expected, rtol=1e-5)
