"""Flax NNX: LoRA and quantised weights inside an `nnx.Module` (a PyTree since
Flax 0.12) or its `nnx.State`, run with `quaxlike.quaxify`, under `jax.jit` and
`nnx.jit`.

Every result is compared with the plain NNX model on dense weights: the merged
kernel `W + A @ B` computed here by hand, or the dequantised kernel.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tree_allclose
from lora_helpers import dense, is_lora, randn, with_nonzero_b

import quaxlike
from quaxlike.lora import LoraArray, loraify, partition
from quaxlike.quantized import (
    dequantize,
    Int4Array,
    quantize,
    quantize_int4,
    QuantizedArray,
)


RTOL, ATOL = 1e-4, 1e-5
IN, WIDTH, OUT, BATCH = 16, 24, 4, 8


class MLP(nnx.Module):
    """Two Linear layers with a LayerNorm between: its scale and bias are
    parameters that LoRA leaves alone."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(IN, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.out = nnx.Linear(WIDTH, OUT, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(nnx.gelu(self.hidden(x))))


def kernels(model):
    """The values of the Linear kernels, for `quantize(..., where=kernels)`."""
    return [model.hidden.kernel.get_value(), model.out.kernel.get_value()]


@pytest.fixture(scope="module")
def data():
    x = randn(0, (BATCH, IN))
    return x, jnp.sin(x[:, :OUT])


def plain_model():
    # Under `nnx.jit`: run eagerly, each initialiser would compile on its own.
    return nnx.jit(lambda: MLP(nnx.Rngs(1)))()


@pytest.fixture(scope="module")
def lora_model():
    # NNX modules are mutable: tests that train in place make their own copy.
    model = loraify(plain_model(), rank=2, key=jr.key(2), where="**.kernel.value", scale=0.3)
    return with_nonzero_b(model)


def copy(model):
    return jax.tree.map(lambda x: x, model)


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def test_loraify_selects_the_kernels(lora_model):
    assert isinstance(lora_model, MLP)
    kernel = lora_model.hidden.kernel
    assert isinstance(kernel, nnx.Param) and is_lora(kernel.get_value())
    assert kernel.get_value().a.shape == (IN, 2)
    assert lora_model.out.kernel.get_value().b.shape == (2, OUT)
    others = [lora_model.hidden.bias, lora_model.norm.scale, lora_model.norm.bias]
    assert not any(is_lora(v.get_value()) for v in others)


@pytest.mark.parametrize("jit", [None, jax.jit, nnx.jit], ids=["eager", "jax.jit", "nnx.jit"])
def test_forward_equals_merged(lora_model, data, jit):
    forward = lambda model, x: quaxlike.quaxify(model)(x)  # noqa: E731
    out = (jit(forward) if jit else forward)(lora_model, data[0])
    assert tree_allclose(out, dense(lora_model)(data[0]), rtol=RTOL, atol=ATOL)


def test_split_state_path(data):
    # The functional route, as in Flax versions whose modules are not PyTrees:
    # `nnx.split`, a LoRA `State`, and `nnx.merge` inside the quaxified function.
    graphdef, state = nnx.split(plain_model())
    state = with_nonzero_b(loraify(state, rank=2, key=jr.key(2), where="**.kernel.value"))
    assert is_lora(state["hidden"]["kernel"].get_value())

    @jax.jit
    def forward(state, x):
        return quaxlike.quaxify(lambda state, x: nnx.merge(graphdef, state)(x))(state, x)

    expected = nnx.merge(graphdef, dense(state))(data[0])
    assert tree_allclose(forward(state, data[0]), expected, rtol=RTOL, atol=ATOL)


def test_grads_equal_merged_grads(lora_model, data):
    trainable, frozen = partition(lora_model)

    @nnx.jit
    def grads(trainable, frozen, x, y):
        return jax.grad(lambda t: mse(quaxlike.quaxify(eqx.combine(t, frozen)), x, y))(trainable)

    merged_loss = lambda t: mse(dense(eqx.combine(t, frozen)), *data)  # noqa: E731
    out = grads(trainable, frozen, *data)
    assert tree_allclose(out, jax.jit(jax.grad(merged_loss))(trainable), rtol=RTOL, atol=ATOL)
    # Only the factors train: the kernels, biases and LayerNorm are frozen.
    assert [x.shape for x in jax.tree.leaves(out)] == [(IN, 2), (2, WIDTH), (WIDTH, 2), (2, OUT)]


def train_merged(model, data, steps):
    """The reference: Adam on the factors of the merged model, under `jax.jit`."""
    trainable, frozen = partition(model)
    optimiser = optax.adam(3e-2)

    @jax.jit
    def step(trainable, opt_state):
        loss, grads = jax.value_and_grad(lambda t: mse(dense(eqx.combine(t, frozen)), *data))(
            trainable
        )
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss

    opt_state, losses = optimiser.init(trainable), []
    for _ in range(steps):
        trainable, opt_state, loss = step(trainable, opt_state)
        losses.append(float(loss))
    return eqx.combine(trainable, frozen), losses


def train_in_place(model, data, steps):
    """Adam on the LoRA factors under `nnx.jit`, updating `model` in place."""
    optimiser = optax.adam(3e-2)
    opt_state = optimiser.init(partition(model)[0])

    @nnx.jit
    def step(model, opt_state, x, y):
        trainable, frozen = partition(model)
        loss_fn = lambda t: mse(quaxlike.quaxify(eqx.combine(t, frozen)), x, y)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        nnx.update(model, nnx.state(eqx.combine(optax.apply_updates(trainable, updates), frozen)))
        return opt_state, loss

    losses = []
    for _ in range(steps):
        opt_state, loss = step(model, opt_state, *data)
        losses.append(float(loss))
    return losses


def test_optax_loop_in_place_matches_merged_model(lora_model, data):
    model = copy(lora_model)
    frozen_w = model.out.kernel.get_value().w
    losses = train_in_place(model, data, steps=5)
    trained_merged, expected = train_merged(lora_model, data, steps=5)
    assert losses[-1] < losses[0]
    assert np.allclose(losses, expected, rtol=RTOL)
    # Still a LoRA model, with the factors trained and the frozen weight untouched.
    kernel = model.out.kernel.get_value()
    assert is_lora(kernel) and np.array_equal(kernel.w, frozen_w)
    assert not np.allclose(kernel.a, lora_model.out.kernel.get_value().a)
    assert tree_allclose(model, trained_merged, rtol=1e-3, atol=1e-5)


# --- quantised kernels ----------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_kernels(data, bits):
    qmodel = quantize(plain_model(), bits=bits, group_size=4, where=kernels)
    assert all(isinstance(k, QuantizedArray) for k in kernels(qmodel))
    out = nnx.jit(lambda m, x: quaxlike.quaxify(m)(x))(qmodel, data[0])
    expected = nnx.jit(lambda m, x: dequantize(m)(x))(qmodel, data[0])
    assert tree_allclose(out, expected, rtol=RTOL, atol=ATOL)


def test_qlora_lora_array_over_int4_kernel(data):
    layer = nnx.Linear(IN, WIDTH, rngs=nnx.Rngs(0))
    int4 = quantize_int4(layer.kernel.get_value(), group_size=4)
    layer.kernel.set_value(
        LoraArray(int4, rank=2, key=jr.key(3)).with_factors(
            int4, randn(1, (IN, 2), 0.3), randn(2, (2, WIDTH), 0.3)
        )
    )
    out = nnx.jit(lambda m, x: quaxlike.quaxify(m)(x))(layer, data[0])
    assert tree_allclose(out, dense(dequantize(layer))(data[0]), rtol=RTOL, atol=ATOL)


def test_qlora_training_in_place(data):
    qmodel = quantize(plain_model(), bits=4, group_size=4, where=kernels)
    model = with_nonzero_b(loraify(qmodel, rank=2, key=jr.key(2), where="**.kernel.value"))
    assert all(is_lora(k) and isinstance(k.w, Int4Array) for k in kernels(model))
    out = nnx.jit(lambda m, x: quaxlike.quaxify(m)(x))(model, data[0])
    assert tree_allclose(out, dense(dequantize(model))(data[0]), rtol=RTOL, atol=ATOL)
    _, expected = train_merged(dequantize(model), data, steps=5)
    losses = train_in_place(model, data, steps=5)
    assert losses[-1] < losses[0]
    assert np.allclose(losses, expected, rtol=RTOL)
