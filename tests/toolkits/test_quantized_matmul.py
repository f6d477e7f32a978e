"""The matrix-product strategies of quantised arrays, both run on CPU: `"loop"`
(blocks of rows inside a `lax.scan`, the CPU default) and `"fused"` (the weight
dequantised whole into one product, the default on other backends), against
plain JAX on the dequantised weights; and what each costs in peak memory on
XLA:CPU, which is why the loop is its default."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from helpers import randn, tree_allclose
from jax import lax

import quaxlike
from quaxlike.demo import peak_bytes
from quaxlike.lora import qlora
from quaxlike.quantized import (
    default_matmul,
    dequantize,
    largest_dequantized,
    quantize,
    quantize_int4,
    quantize_int8,
    quantize_nf4,
    with_matmul,
)


OUT, IN, BATCH, LAYERS = 12, 32, 3, 2
KINDS = ["int8", "int4", "nf4", "nf4-dq"]


def make(kind, seed, shape):
    w = randn(seed, shape)
    if kind == "int8":
        return quantize_int8(w)
    if kind == "int4":
        return quantize_int4(w, group_size=8)
    return quantize_nf4(w, group_size=8, double_quant=kind == "nf4-dq", double_quant_block=8)


def scans(jaxpr) -> int:
    """How many `scan`s `jaxpr` and its sub-programs hold."""
    found = sum(e.primitive.name == "scan" for e in jaxpr.eqns)
    for eqn in jaxpr.eqns:
        for sub in quaxlike.internal.jaxprs_in_params(eqn.params):
            found += scans(sub)
    return found


def test_default_matmul_per_backend():
    assert default_matmul("cpu") == "loop"
    assert all(default_matmul(p) == "fused" for p in ("gpu", "cuda", "rocm", "tpu"))
    assert default_matmul() == default_matmul(jax.default_backend())


@pytest.mark.parametrize("kind", KINDS)
def test_both_strategies_compute_the_dequantised_model(kind, getseed):
    w = make(kind, getseed(), (OUT, IN))
    stacked = make(kind, getseed(), (LAYERS, IN, IN))
    xs, h = randn(getseed(), (BATCH, IN)), randn(getseed(), (IN,))

    def programs(w, stacked, xs, h):
        def loss(x):
            return jnp.sum(jnp.tanh(w @ x) ** 2)

        return {
            "w @ x": w @ xs[0],
            "x @ w.T": xs @ w.T,
            "y @ w": jnp.ones((BATCH, OUT)) @ w,
            "vmap": jax.vmap(lambda x: w @ x)(xs),
            "grad": jax.grad(loss)(xs[0]),
            "scan": lax.scan(lambda h, v: (jnp.tanh(v @ h), None), h, stacked)[0],
            "vmap over layers": jax.vmap(lambda v: v @ h)(stacked),
        }

    expected = jax.jit(programs)(*dequantize((w, stacked)), xs, h)
    for matmul in ("loop", "fused"):
        w_, stacked_ = with_matmul((w, stacked), matmul)
        jaxpr = jax.make_jaxpr(quaxlike.quaxify(programs))(w_, stacked_, xs, h)
        got = eqx.filter_jit(quaxlike.quaxify(programs))(w_, stacked_, xs, h)
        for name in expected:
            assert tree_allclose(got[name], expected[name], rtol=1e-5, atol=1e-5), (matmul, name)
        largest = largest_dequantized(jaxpr)
        if matmul == "loop":  # never more than half a weight at a time
            assert 0 < largest <= stacked.size // 2
        else:  # each weight dequantised whole, into its product
            assert largest == stacked.size


def test_quantized_by_quantized_with_either_strategy(getseed):
    a = make("nf4-dq", getseed(), (OUT, IN))
    b = make("int4", getseed(), (BATCH, IN))
    expected = jax.jit(lambda a, b: a @ b.T)(*dequantize((a, b)))
    for pair in (("loop", "fused"), ("fused", "loop"), ("fused", "fused")):
        a_, b_ = with_matmul(a, pair[0]), with_matmul(b, pair[1])
        got = eqx.filter_jit(quaxlike.quaxify(lambda a, b: a @ b.T))(a_, b_)
        assert tree_allclose(got, expected, rtol=1e-5, atol=1e-5), pair


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU default")
def test_unset_strategy_is_the_loop_on_cpu(getseed):
    w = make("int4", getseed(), (OUT, IN))
    assert w.matmul is None

    def product(w, x):
        return w @ x

    x = randn(getseed(), (IN,))
    unset = jax.make_jaxpr(quaxlike.quaxify(product))(w, x).jaxpr
    fused = jax.make_jaxpr(quaxlike.quaxify(product))(with_matmul(w, "fused"), x).jaxpr
    assert scans(unset) == 1 and scans(fused) == 0
    assert 0 < largest_dequantized(unset) <= w.size // 2


def test_choosing_the_strategy():
    mlp = eqx.nn.MLP(16, 4, 16, depth=1, key=jr.key(0))
    model = quantize(mlp, bits=4, group_size=8, matmul="fused")
    assert [layer.weight.matmul for layer in model.layers] == ["fused", "fused"]
    # Also under LoRA: the bases of a QLoRA model.
    bases = with_matmul(qlora(mlp, rank=2, key=jr.key(1), group_size=8), "loop")
    assert [layer.weight.w.matmul for layer in bases.layers] == ["loop", "loop"]
    with pytest.raises(ValueError, match='with_matmul.*"loop" or "fused"; got \'gpu\''):
        with_matmul(model, "gpu")
    with pytest.raises(ValueError, match='Int8Array.*"loop" or "fused"; got \'fast\''):
        quantize(mlp, bits=8, matmul="fast")


def test_peak_memory_of_each_strategy_on_cpu():
    # benchmarks/quantized.py's model (8 `Linear(1024, 1024)` + relu, batch 8),
    # compiled for abstract arguments on XLA:CPU: with the loop a quantised model's
    # forward and backward passes take at most a fifth of the float32 model's
    # memory; dequantised whole ("fused"), more than the float32 model, since
    # XLA:CPU dequantises every weight ahead of the products (the reason the loop
    # is the CPU default). Bytes are exact.
    width, depth, batch = 1024, 8, 8
    mlp = eqx.filter_eval_shape(
        eqx.nn.MLP, width, width, width, depth - 1, activation=jax.nn.relu, key=jr.key(0)
    )
    xs = jax.ShapeDtypeStruct((batch, width), jnp.float32)

    def forward(m, xs):
        return jax.vmap(quaxlike.quaxify(m))(xs)

    def grad(m, xs):
        return jax.grad(lambda xs: jnp.sum(forward(m, xs)))(xs)

    def peak(fn, model):
        arrays, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
        run = jax.jit(lambda arrays, xs: fn(eqx.combine(arrays, static), xs))
        return peak_bytes(run.lower(arrays, xs).compile())

    dense = {fn: peak(fn, mlp) for fn in (forward, grad)}
    for options in (dict(bits=4), dict(bits="nf4", double_quant=True)):
        ratios = {}
        for matmul in ("loop", "fused"):
            model = eqx.filter_eval_shape(lambda m: quantize(m, matmul=matmul, **options), mlp)
            for fn in (forward, grad):
                ratios[matmul, fn.__name__] = peak(fn, model) / dense[fn]
        print(options, {key: round(ratio, 3) for key, ratio in ratios.items()})
        assert all(ratios["loop", fn] <= 0.20 for fn in ("forward", "grad")), ratios
        assert all(ratios["fused", fn] > 1.0 for fn in ("forward", "grad")), ratios
