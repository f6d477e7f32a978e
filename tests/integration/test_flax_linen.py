"""Flax linen: LoRA and quantised weights in a linen `params` dict, run with
`quaxlike.quaxify(model.apply)`.

Every result is compared with plain linen on dense parameters: the merged
kernel `W + A @ B` computed here by hand, or the dequantised kernel. Shapes are
small, to keep compile time down.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import tree_allclose
from lora_helpers import dense, is_lora, randn, with_nonzero_b

import quaxlike
from quaxlike.lora import loraify, partition
from quaxlike.quantized import dequantize, Int4Array, quantize, QuantizedArray


RTOL, ATOL = 1e-4, 1e-5
IN, WIDTH, OUT, BATCH = 16, 24, 4, 8


class MLP(nn.Module):
    """Two Dense layers with a LayerNorm between: its scale and bias are
    parameters that LoRA leaves alone."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(WIDTH, name="hidden")(x))
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(OUT, name="out")(x)


MODEL = MLP()


@pytest.fixture(scope="module")
def data():
    x = randn(0, (BATCH, IN))
    return x, jnp.sin(x[:, :OUT])


@pytest.fixture(scope="module")
def params(data):
    return jax.jit(MODEL.init)(jr.key(1), data[0])


@pytest.fixture(scope="module")
def lora_params(params):
    return with_nonzero_b(loraify(params, rank=2, key=jr.key(2), where="**.kernel", scale=0.3))


def mse(apply, params, x, y):
    return jnp.mean((apply(params, x) - y) ** 2)


def test_loraify_selects_the_kernels(lora_params):
    layers = lora_params["params"]
    assert is_lora(layers["hidden"]["kernel"]) and is_lora(layers["out"]["kernel"])
    assert layers["hidden"]["kernel"].a.shape == (IN, 2)
    assert layers["out"]["kernel"].b.shape == (2, OUT)
    others = [layers["hidden"]["bias"], layers["norm"]["scale"], layers["norm"]["bias"]]
    assert not any(map(is_lora, others))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_forward_equals_merged(lora_params, data, jit):
    apply = quaxlike.quaxify(MODEL.apply)
    out = (jax.jit(apply) if jit else apply)(lora_params, data[0])
    expected = MODEL.apply(dense(lora_params), data[0])
    assert tree_allclose(out, expected, rtol=RTOL, atol=ATOL)


def test_grads_equal_merged_grads(lora_params, data):
    trainable, frozen = partition(lora_params)

    def loss(trainable):
        return mse(quaxlike.quaxify(MODEL.apply), eqx.combine(trainable, frozen), *data)

    def merged_loss(trainable):
        return mse(MODEL.apply, dense(eqx.combine(trainable, frozen)), *data)

    grads = jax.jit(jax.grad(loss))(trainable)
    expected = jax.jit(jax.grad(merged_loss))(trainable)
    assert tree_allclose(grads, expected, rtol=RTOL, atol=ATOL)
    # Only the factors train: the kernels, biases and LayerNorm are frozen.
    assert [x.shape for x in jax.tree.leaves(grads)] == [
        (IN, 2),
        (2, WIDTH),
        (WIDTH, 2),
        (2, OUT),
    ]


def train(loss, trainable, steps=5):
    """Adam on `trainable` under `jax.jit`; the loss at each step."""
    optimiser = optax.adam(3e-2)

    @jax.jit
    def step(trainable, opt_state):
        value, grads = jax.value_and_grad(loss)(trainable)
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, value

    opt_state, losses = optimiser.init(trainable), []
    for _ in range(steps):
        trainable, opt_state, value = step(trainable, opt_state)
        losses.append(float(value))
    return trainable, losses


def test_optax_loop_matches_merged_model(lora_params, data):
    trainable, frozen = partition(lora_params)
    lora_loss = lambda t: mse(quaxlike.quaxify(MODEL.apply), eqx.combine(t, frozen), *data)  # noqa: E731
    merged_loss = lambda t: mse(MODEL.apply, dense(eqx.combine(t, frozen)), *data)  # noqa: E731
    trained, losses = train(lora_loss, trainable)
    trained_merged, expected = train(merged_loss, trainable)
    assert losses[-1] < losses[0]
    assert np.allclose(losses, expected, rtol=RTOL)
    assert tree_allclose(trained, trained_merged, rtol=1e-3, atol=1e-5)
    # The frozen kernels are where they were: the trained model is still a LoRA.
    model = eqx.combine(trained, frozen)
    assert is_lora(model["params"]["out"]["kernel"])
    assert model["params"]["out"]["kernel"].w is frozen["params"]["out"]["kernel"].w


# --- quantised kernels ----------------------------------------------------------


def kernels(params):
    """The Dense kernels of a linen params dict, for `quantize(..., where=kernels)`."""
    return [params["params"]["hidden"]["kernel"], params["params"]["out"]["kernel"]]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_kernels(params, data, bits):
    # A linen kernel is stored `(in, out)`; `quantize` takes the last axis as the
    # input axis of a row, so here a row is one input feature. Any layout computes
    # the same product.
    qparams = quantize(params, bits=bits, group_size=4, where=kernels)
    assert all(isinstance(k, QuantizedArray) for k in kernels(qparams))
    out = jax.jit(quaxlike.quaxify(MODEL.apply))(qparams, data[0])
    expected = jax.jit(lambda q, x: MODEL.apply(dequantize(q), x))(qparams, data[0])
    assert tree_allclose(out, expected, rtol=RTOL, atol=ATOL)


def test_quantize_without_where_does_not_silently_do_nothing(params):
    try:
        qparams = quantize(params, bits=8)
    except ValueError:
        return  # refusing, with a message pointing at `where=`, is fine
    assert all(isinstance(k, QuantizedArray) for k in kernels(qparams))


def test_qlora_forward_grads_and_training(params, data):
    qparams = quantize(params, bits=4, group_size=4, where=kernels)
    model = with_nonzero_b(loraify(qparams, rank=2, key=jr.key(2), where="**.kernel", scale=0.3))
    assert all(is_lora(k) and isinstance(k.w, Int4Array) for k in kernels(model))

    apply = quaxlike.quaxify(MODEL.apply)
    out = jax.jit(apply)(model, data[0])
    assert tree_allclose(out, MODEL.apply(dense(dequantize(model)), data[0]), rtol=RTOL, atol=ATOL)

    trainable, frozen = partition(model)
    lora_loss = lambda t: mse(apply, eqx.combine(t, frozen), *data)  # noqa: E731
    merged_loss = lambda t: mse(MODEL.apply, dense(dequantize(eqx.combine(t, frozen))), *data)  # noqa: E731
    grads = jax.jit(jax.grad(lora_loss))(trainable)
    assert tree_allclose(grads, jax.grad(merged_loss)(trainable), rtol=RTOL, atol=ATOL)
    _, losses = train(lora_loss, trainable)
    _, expected = train(merged_loss, trainable)
    assert losses[-1] < losses[0]
    assert np.allclose(losses, expected, rtol=RTOL)
