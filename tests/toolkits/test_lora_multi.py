"""Many adapters over one base: `stack_adapters`, `with_adapter`, `MultiLoraArray`.

A batch in which request `i` uses adapter `k(i)` is compared with running each
adapter alone (through `quaxify`) and with plain JAX (`W x + A (B x)` by hand),
over a dense and a quantised base, under `jit` and `vmap`. The memory claim is
checked on compiled programs at N = 1 and N = 16 adapters.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import randn

import quaxlike
from quaxlike.demo import peak_bytes
from quaxlike.lora import (
    adapter_count,
    LoraArray,
    loraify,
    merge,
    multi_loraify,
    MultiLoraArray,
    partition,
    qlora,
    stack_adapters,
    with_adapter,
)
from quaxlike.quantized import dequantize, Int4Array


IN, OUT, HIDDEN, R, COUNT, REQUESTS = 16, 4, 32, 2, 3, 7


def trained(model, seed):
    """`model` with non-zero `B`s (as after training), so every adapter matters."""
    is_lora = lambda x: isinstance(x, LoraArray)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(model, is_leaf=is_lora)
    out = [
        x.with_factors(x.w, x.a, randn(seed + i, x.b.shape, 0.5)) if is_lora(x) else x
        for i, x in enumerate(leaves)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def serve(bank, ids, xs):
    return jax.vmap(lambda k, x: quaxlike.quaxify(with_adapter(bank, k))(x))(ids, xs)


@pytest.fixture(scope="module")
def base():
    return eqx.nn.MLP(IN, OUT, HIDDEN, depth=2, key=jr.key(0))


@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_batch_equals_each_adapter_alone(base, kind):
    if kind == "dense":
        adapters = [trained(loraify(base, rank=R, key=jr.key(i)), 10 * i) for i in range(COUNT)]
    else:
        adapters = [
            trained(qlora(base, rank=R, key=jr.key(i), group_size=16), 10 * i) for i in range(COUNT)
        ]
    bank = stack_adapters(adapters)
    assert adapter_count(bank) == COUNT
    w = bank.layers[0].weight
    assert isinstance(w, MultiLoraArray) and w.a.shape == (COUNT, HIDDEN, R)
    assert w.w is adapters[0].layers[0].weight.w  # one base, not a copy
    if kind == "int4":
        assert isinstance(w.w, Int4Array)
    xs = randn(1, (REQUESTS, IN))
    ids = jnp.array([0, 2, 1, 2, 0, 1, 1])
    got = eqx.filter_jit(serve)(bank, ids, xs)
    for i in range(REQUESTS):
        alone = quaxlike.quaxify(adapters[int(ids[i])])(xs[i])
        np.testing.assert_allclose(got[i], alone, rtol=1e-5, atol=1e-6)
        # Plain JAX: the merged model of that adapter (the dequantised base).
        plain = merge(dequantize(adapters[int(ids[i])]))
        np.testing.assert_allclose(got[i], plain(xs[i]), rtol=1e-4, atol=1e-5)
    # A concrete index gives that adapter back, sharing the base.
    one = with_adapter(bank, 1)
    assert one.layers[0].weight.w is w.w
    np.testing.assert_array_equal(one.layers[2].weight.b, adapters[1].layers[2].weight.b)


def test_plain_jax_by_hand(base):
    # y_i = W x_i + A[k(i)] (B[k(i)] x_i), written out for one Linear.
    layer = base.layers[0]
    bank = trained(multi_loraify(layer, count=COUNT, rank=R, key=jr.key(3)), 0)
    assert isinstance(bank.weight, MultiLoraArray)
    bank = eqx.tree_at(lambda m: m.weight.b, bank, randn(5, (COUNT, R, IN)))
    xs, ids = randn(2, (REQUESTS, IN)), jnp.array([2, 2, 0, 1, 0, 2, 1])
    got = eqx.filter_jit(serve)(bank, ids, xs)
    a, b = bank.weight.a[ids], bank.weight.b[ids]
    low = jnp.einsum("imr,irn,in->im", a, b, xs)
    expected = xs @ layer.weight.T + low + layer.bias
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_training_every_adapter_at_once(base):
    # Gradients through the batch reach only the adapters the requests used.
    bank = multi_loraify(base, count=COUNT, rank=R, key=jr.key(4), scale=0.1)
    trainable, frozen = partition(bank)
    xs, ids = randn(3, (REQUESTS, IN)), jnp.array([0, 0, 2, 2, 0, 2, 2])

    def loss(trainable):
        return jnp.sum(serve(eqx.combine(trainable, frozen), ids, xs) ** 2)

    grads = eqx.filter_jit(eqx.filter_grad(loss))(trainable)
    g = grads.layers[0].weight.a
    assert g.shape == (COUNT, HIDDEN, R)
    assert not np.any(grads.layers[1].weight.b[1])  # adapter 1 served nobody
    assert np.any(grads.layers[1].weight.b[0]) and np.any(grads.layers[1].weight.b[2])
    # Adapter 2's gradient is that of its requests run through it alone.
    alone = with_adapter(bank, 2)
    mask = ids == 2
    train2, frozen2 = partition(alone)

    def loss2(t):
        return jnp.sum(jax.vmap(quaxlike.quaxify(eqx.combine(t, frozen2)))(xs[mask]) ** 2)

    g2 = eqx.filter_grad(loss2)(train2)
    np.testing.assert_allclose(
        grads.layers[1].weight.b[2], g2.layers[1].weight.b, rtol=1e-4, atol=1e-6
    )


def test_scanned_stack_of_layers():
    # Adapters over a stack of layers run with lax.scan: the chosen adapter keeps
    # its layer axis, and each step slices it.
    layers, width = 3, 8
    w = randn(0, (layers, width, width), 0.3)
    base = {"w": w}
    adapters = [
        trained(loraify(base, rank=R, key=jr.key(i), where="w"), 100 * i) for i in range(COUNT)
    ]
    bank = stack_adapters(adapters)

    def run(params, x):
        def body(h, w):
            return jnp.tanh(w @ h), None

        return jax.lax.scan(body, x, params["w"])[0]

    xs, ids = randn(1, (REQUESTS, width)), jnp.array([1, 0, 2, 1, 1, 0, 2])
    got = jax.jit(jax.vmap(lambda k, x: quaxlike.quaxify(run)(with_adapter(bank, k), x)))(ids, xs)
    for i in range(REQUESTS):
        plain = run(merge(adapters[int(ids[i])]), xs[i])
        np.testing.assert_allclose(got[i], plain, rtol=1e-5, atol=1e-6)


def _compiled_peak(quantised: bool, count: int, width: int = 1024, requests: int = 16):
    def build():
        base = eqx.nn.Linear(width, width, use_bias=False, key=jr.key(0))
        if quantised:
            keys = jr.split(jr.key(1), count)
            return stack_adapters([qlora(base, rank=8, key=k, group_size=64) for k in keys])
        return multi_loraify(base, count=count, rank=8, key=jr.key(1))

    bank = eqx.filter_eval_shape(build)
    is_array = lambda x: isinstance(x, (jax.ShapeDtypeStruct, jax.Array))  # noqa: E731
    arrays, static = eqx.partition(bank, is_array)
    ids = jax.ShapeDtypeStruct((requests,), jnp.int32)
    xs = jax.ShapeDtypeStruct((requests, width), jnp.float32)
    # The bank is an argument, not a constant, so XLA counts it.
    program = (
        jax.jit(lambda arrays, ids, xs: serve(eqx.combine(arrays, static), ids, xs))
        .lower(arrays, ids, xs)
        .compile()
    )
    return peak_bytes(program), program.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("quantised", [False, True], ids=["dense", "int4"])
def test_memory_does_not_grow_with_copies_of_the_base(quantised):
    width, rank, requests = 1024, 8, 16
    dense_weight = width * width * 4
    adapter = 2 * width * rank * 4  # A and B in float32
    peak_1, temp_1 = _compiled_peak(quantised, 1)
    peak_16, temp_16 = _compiled_peak(quantised, 16)
    # Sixteen adapters cost the fifteen extra adapters' factors, and nothing else:
    # no copy of W (4 MiB here, 64 adapters' worth), nothing per adapter beyond
    # its factors.
    assert peak_16 - peak_1 <= 15 * adapter + 4096, (peak_1, peak_16)
    assert peak_16 - peak_1 < dense_weight / 4
    assert temp_16 <= temp_1 + 4096
    # No merged W + A[k] B[k] per request: the temporaries (the requests' own
    # factors and activations) stay under one dense weight, let alone sixteen.
    assert temp_16 < dense_weight / 2, temp_16
    assert temp_16 <= requests * adapter + dense_weight / 4


def test_errors(base):
    bank = multi_loraify(base, count=2, rank=R, key=jr.key(0))
    with pytest.raises(RuntimeError, match="with_adapter"):
        quaxlike.quaxify(bank)(jnp.ones(IN))
    with pytest.raises(ValueError, match="with_adapter"):
        merge(bank)
    other = eqx.nn.MLP(IN, OUT, HIDDEN, depth=2, key=jr.key(9))
    with pytest.raises(ValueError, match="one base.*layers.0.weight"):
        stack_adapters(
            [loraify(base, rank=R, key=jr.key(1)), loraify(other, rank=R, key=jr.key(1))]
        )
    with pytest.raises(ValueError, match="ranks"):
        stack_adapters([loraify(base, rank=1, key=jr.key(1)), loraify(base, rank=2, key=jr.key(1))])
    with pytest.raises(ValueError, match="structure"):
        stack_adapters([loraify(base, rank=R, key=jr.key(1)), base])
