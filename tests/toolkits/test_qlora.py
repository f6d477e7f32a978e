"""QLoRA: a `LoraArray` whose frozen base is itself a Value (an `Int8Array` or
`Int4Array`, a sparse matrix, another `LoraArray`), composed through redispatch.

Every result is compared with plain JAX on dense arrays: the dequantised base plus
`A @ B`, with `lax.stop_gradient` on the base. The quantised bases refuse to
materialise (the default), so a result at all shows that no rule fell back to the
dense weight; `largest_dequantized` also checks that no program, forward or
backward, holds more than half of a base weight in dense form.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import randn, tree_allclose
from jax import lax

import quaxlike
from quaxlike.demo import peak_bytes as compiled_peak_bytes
from quaxlike.lora import LoraArray, loraify, merge, partition, qlora, trainable_filter
from quaxlike.quantized import (
    dequantize,
    Int4Array,
    Int8Array,
    largest_dequantized,
    NF4Array,
    quantize,
    quantize_int4,
    quantize_int8,
    quantize_nf4,
    QuantizedArray,
)
from quaxlike.sparse import BCOO


M, N, R, BATCH, LAYERS = 12, 16, 2, 3, 2
KINDS = ["int8", "int4", "nf4-dq"]


def make_base(kind, seed, shape=(M, N)):
    w = randn(seed, shape)
    if kind == "nf4-dq":  # second-level blocks of two rows: several per weight
        return quantize_nf4(w, group_size=8, double_quant=True, double_quant_block=4)
    return quantize_int8(w) if kind == "int8" else quantize_int4(w, group_size=8)


@pytest.fixture(scope="module")
def template():
    # `LoraArray(...)` draws `A` with a compiled program per shape: build one and
    # replace its arrays instead.
    return LoraArray(jnp.zeros((1, 1)), rank=1, key=jr.key(0))


def make_qlora(template, base, seed, rank=R):
    *batch, m, n = base.shape
    a = randn(seed + 1000, (*batch, m, rank), 0.5)
    b = randn(seed + 2000, (*batch, rank, n), 0.5)  # non-zero, so that A @ B matters
    return template.with_factors(base, a, b)


def is_lora(x):
    return isinstance(x, LoraArray)


def dense(tree):
    """`tree` in plain JAX: every LoraArray replaced by the dequantised base (behind
    `stop_gradient`) plus `A @ B`, computed by hand."""

    def to_dense(x):
        if not is_lora(x):
            return x
        w = x.w.dequantize() if isinstance(x.w, QuantizedArray) else x.w
        return lax.stop_gradient(w) + jnp.einsum("...mr,...rn->...mn", x.a, x.b)

    return jtu.tree_map(to_dense, tree, is_leaf=is_lora)


# --- the example, and the composition under transforms -------------------


def test_lora_over_a_quantized_linear_weight():
    # A `LoraArray` over the Int4Array weight of a quantised MLP used to fail on
    # `stop_gradient` of the Int4Array.
    key = jr.key(0)
    q = quantize(eqx.nn.MLP(64, 8, 128, 2, key=key), bits=4)
    lw = LoraArray(q.layers[0].weight, rank=4, key=key)
    model = eqx.tree_at(lambda m: m.layers[0].weight, q, lw)
    x = jnp.ones(64)
    run = eqx.filter_jit(lambda m, x: (quaxlike.quaxify(m)(x), dense(dequantize(m))(x)))
    assert tree_allclose(*run(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_grad_jit_vmap(kind, template, getseed):
    lora = make_qlora(template, make_base(kind, getseed()), getseed())
    xs = randn(getseed(), (BATCH, N))

    def loss(w, xs):
        return jnp.sum(jnp.tanh(jax.vmap(lambda x: w @ x)(xs)) ** 2)

    def programs(lora, xs):
        trainable, frozen = partition(lora)
        grad = jax.grad(lambda t: quaxlike.quaxify(loss)(eqx.combine(t, frozen), xs))
        return {
            "forward": quaxlike.quaxify(lambda w, xs: jax.vmap(lambda x: w @ x)(xs))(lora, xs),
            "x @ w.T": quaxlike.quaxify(lambda w, xs: xs @ w.T)(lora, xs),
            "grad": grad(trainable),
        }

    jaxpr = jax.make_jaxpr(programs)(lora, xs)
    got = jax.jit(programs)(lora, xs)
    w = jax.jit(dense)(lora)
    assert tree_allclose(got["forward"], xs @ w.T, rtol=1e-5, atol=1e-5)
    assert tree_allclose(got["x @ w.T"], xs @ w.T, rtol=1e-5, atol=1e-5)

    def hand(a, b):  # d/dA and d/dB by hand, on the dequantised base
        w = lax.stop_gradient(lora.w.dequantize()) + a @ b
        return jnp.sum(jnp.tanh(xs @ w.T) ** 2)

    expected = jax.jit(jax.grad(hand, argnums=(0, 1)))(lora.a, lora.b)
    grads = got["grad"]
    assert tree_allclose((grads.a, grads.b), expected, rtol=1e-4, atol=1e-5)
    # No dense copy of the base anywhere, the backward pass included.
    assert 0 < largest_dequantized(jaxpr) <= lora.w.size // 2


@pytest.mark.parametrize("kind", KINDS)
def test_scan_and_vmap_over_stacked_layers(kind, template, getseed):
    stack = make_qlora(template, make_base(kind, getseed(), (LAYERS, N, N)), getseed())
    h = randn(getseed(), (N,))

    def over_layers(ws, h):
        return lax.scan(lambda h, w: (jnp.tanh(w @ h), None), h, ws)[0]

    def per_layer(ws, h):
        return jax.vmap(lambda w: w @ h)(ws)

    def loss(ws, h):
        return jnp.sum(over_layers(ws, h) ** 2)

    def programs(stack, h):
        trainable, frozen = partition(stack)
        grad = jax.grad(lambda t: quaxlike.quaxify(loss)(eqx.combine(t, frozen), h))
        return (
            quaxlike.quaxify(over_layers)(stack, h),
            quaxlike.quaxify(per_layer)(stack, h),
            grad(trainable),
        )

    jaxpr = jax.make_jaxpr(programs)(stack, h)
    scanned, vmapped, grads = jax.jit(programs)(stack, h)
    w = jax.jit(dense)(stack)
    reference = jax.jit(lambda w, h: (over_layers(w, h), per_layer(w, h)))(w, h)
    assert tree_allclose((scanned, vmapped), reference, rtol=1e-5, atol=1e-5)

    def hand(a, b):
        base = lax.stop_gradient(stack.w.dequantize())
        return loss(base + a @ b, h)

    expected = jax.jit(jax.grad(hand, argnums=(0, 1)))(stack.a, stack.b)
    assert tree_allclose((grads.a, grads.b), expected, rtol=1e-4, atol=1e-5)
    assert 0 < largest_dequantized(jaxpr) <= stack.w.size // 2


def test_stop_gradient_reaches_the_scales(template, getseed):
    # Differentiating the whole model: the frozen base's scales get zero gradients
    # (the base is behind stop_gradient), unless the LoRA is built unfrozen.
    base = make_base("int4", getseed())
    x = randn(getseed(), (N,))

    def loss(lora, x):
        return jnp.sum(quaxlike.quaxify(lambda w, x: jnp.tanh(w @ x))(lora, x) ** 2)

    frozen = make_qlora(template, base, getseed())
    unfrozen = LoraArray(base, rank=R, stop_gradient=False, key=jr.key(0))
    unfrozen = unfrozen.with_factors(base, frozen.a, frozen.b)
    grad = eqx.filter_jit(eqx.filter_grad(loss))
    g_frozen, g_unfrozen = grad(frozen, x), grad(unfrozen, x)
    assert g_frozen.w.packed is None  # integer codes: no gradient
    assert not np.any(np.asarray(g_frozen.w.scale))
    assert np.any(np.asarray(g_unfrozen.w.scale))
    # ... and those are the dequantised weight's: d/dscale of the same loss.
    expected = eqx.filter_jit(eqx.filter_grad(lambda s, x: _loss_of_scales(s, frozen, x)))(
        base.scale, x
    )
    assert tree_allclose(g_unfrozen.w.scale, expected, rtol=1e-4, atol=1e-5)
    assert tree_allclose((g_frozen.a, g_frozen.b), (g_unfrozen.a, g_unfrozen.b), rtol=1e-5)


def _loss_of_scales(scale, lora, x):
    w = lora.w.with_scale(scale).dequantize() + lora.a @ lora.b
    return jnp.sum(jnp.tanh(w @ x) ** 2)


def test_structural_operations_keep_the_quantized_base(template, getseed):
    # Transposing, scaling, converting and indexing a stack of QLoRA weights give
    # LoRAs over quantised bases (the LoRA rules redispatch to the base's rules).
    stack = make_qlora(template, make_base("int4", getseed(), (LAYERS, M, N)), getseed())
    x, y = randn(getseed(), (N,)), randn(getseed(), (M,))

    def pieces(w, i):
        return {
            "w[i].T": w[i].T,
            "w[1] * 2": w[1] * 2.0,
            "-w[0]": -w[0],
            "w[1:]": w[1:],
            "stop_gradient(w)[0]": lax.stop_gradient(w)[0],
            "w.astype": w[0].astype(jnp.bfloat16).astype(jnp.float32),
        }

    shapes = jax.eval_shape(quaxlike.quaxify(pieces), stack, 1)
    assert all(is_lora(p) and isinstance(p.w, Int4Array) for p in shapes.values()), shapes

    def products(w, i, x, y):
        return {name: (p @ y if name == "w[i].T" else p @ x) for name, p in pieces(w, i).items()}

    got = eqx.filter_jit(quaxlike.quaxify(products))(stack, 1, x, y)
    expected = eqx.filter_jit(products)(jax.jit(dense)(stack), 1, x, y)
    for name in got:
        tolerance = 2e-2 if name == "w.astype" else 1e-5  # through bfloat16
        assert tree_allclose(got[name], expected[name], rtol=tolerance, atol=tolerance), name


# --- other Value bases -------------------------------------------------------------


def test_lora_over_a_sparse_base_and_over_another_lora(template, getseed):
    dense_w = randn(getseed(), (M, N)) * (np.arange(N) % 3 == 0)  # a third nonzero
    sparse = BCOO.fromdense(dense_w)
    inner = make_qlora(template, make_base("int8", getseed()), getseed())
    outer = make_qlora(template, inner, getseed())  # LoRA over LoRA over int8
    over_sparse = make_qlora(template, sparse, getseed())
    x = randn(getseed(), (N,))

    def loss(w, x):
        return jnp.sum(jnp.tanh(w @ x) ** 2)

    def run(lora, x):
        trainable, frozen = partition(lora)
        out = quaxlike.quaxify(lambda w, x: w @ x)(lora, x)
        grad = jax.grad(lambda t: quaxlike.quaxify(loss)(eqx.combine(t, frozen), x))
        return out, grad(trainable)

    run = eqx.filter_jit(run)
    inner_dense = lax.stop_gradient(dense(inner))
    for lora, base in ((over_sparse, dense_w), (outer, inner_dense)):
        out, grads = run(lora, x)

        def hand(a, b, base=base):
            return jnp.sum(jnp.tanh((lax.stop_gradient(base) + a @ b) @ x) ** 2)

        assert tree_allclose(out, (base + lora.a @ lora.b) @ x, rtol=1e-5, atol=1e-5)
        expected = jax.grad(hand, argnums=(0, 1))(lora.a, lora.b)
        assert tree_allclose((grads.a, grads.b), expected, rtol=1e-4, atol=1e-5)
    # Only the outer factors train: the inner LoRA is part of the frozen base.
    _, grads = run(outer, x)
    assert grads.w is None or all(g is None for g in jtu.tree_leaves(grads.w))


def test_the_trainable_half_alone_says_to_combine(template, getseed):
    # Passing `partition`'s trainable half (no `w`) to quaxify is a common slip.
    trainable, _ = partition(make_qlora(template, make_base("int8", getseed()), getseed()))
    with pytest.raises(TypeError, match=r"trainable half[\s\S]*eqx.combine"):
        quaxlike.quaxify(lambda w, x: w @ x)(trainable, jnp.ones(N))


# --- whole models: loraify, qlora, training --------------------------------------


@pytest.fixture(scope="module")
def mlp():
    return eqx.nn.MLP(32, 4, 32, depth=2, key=jr.key(0))


@pytest.mark.parametrize("bits", [8, 4, "nf4"])
def test_loraify_selects_quantized_weights_whole(mlp, bits):
    quantized = quantize(mlp, bits=bits, group_size=16)
    kind = {8: Int8Array, 4: Int4Array, "nf4": NF4Array}[bits]
    for where in (None, "layers.*.weight", lambda path, leaf: path.endswith("weight")):
        model = loraify(quantized, rank=R, key=jr.key(1), where=where)
        weights = [layer.weight for layer in model.layers]
        assert all(is_lora(w) and isinstance(w.w, kind) for w in weights), where
    spec = trainable_filter(model)
    assert spec.layers[0].weight.a and spec.layers[0].weight.b
    assert not any(jtu.tree_leaves(spec.layers[0].weight.w))
    # A quantised weight is one leaf: its codes and scales are not matched on their own.
    with pytest.raises(ValueError, match="selected no leaf"):
        loraify(quantized, rank=R, key=jr.key(1), where="layers.*.weight.scale")
    # `qlora` is the same, in one call.
    same = qlora(mlp, rank=R, key=jr.key(1), bits=bits, group_size=16)
    assert jtu.tree_structure(same) == jtu.tree_structure(model)
    assert tree_allclose(same, model)


def test_qlora_training_step_and_merge(mlp):
    model = qlora(mlp, rank=R, key=jr.key(1), group_size=16)
    model = jtu.tree_map(  # non-zero B, so that the update matters
        lambda x: x.with_factors(x.w, x.a, 0.1 * jnp.ones_like(x.b)) if is_lora(x) else x,
        model,
        is_leaf=is_lora,
    )
    xs, ys = randn(1, (8, 32)), randn(2, (8, 4))
    optimiser = optax.adam(1e-2)
    trainable, frozen = partition(model)

    @eqx.filter_jit
    def step(trainable, opt_state, model_of):
        def loss(trainable):
            out = jax.vmap(quaxlike.quaxify(model_of(trainable)))(xs)
            return jnp.mean((out - ys) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(trainable)
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, value

    new, _, value = step(trainable, optimiser.init(trainable), lambda t: eqx.combine(t, frozen))
    # The same step in plain JAX on the dequantised, merged weights.
    hand_trainable, hand_frozen = partition(dequantize(model))
    hand, _, hand_value = step(
        hand_trainable,
        optimiser.init(hand_trainable),
        lambda t: dense(eqx.combine(t, hand_frozen)),
    )
    assert tree_allclose(value, hand_value, rtol=1e-5)
    assert tree_allclose(jtu.tree_leaves(new), jtu.tree_leaves(hand), rtol=1e-4, atol=1e-6)
    # `merge` bakes the update into a dense weight: dequantise the base first.
    trained = eqx.combine(new, frozen)
    merged = merge(dequantize(trained))
    run = eqx.filter_jit(lambda m, d, x: (quaxlike.quaxify(m)(x), d(x)))
    assert tree_allclose(*run(trained, merged, xs[0]), rtol=1e-5, atol=1e-5)


def test_training_step_peak_memory():
    # benchmarks/qlora.py's step (8 `Linear(1024, 1024)` + relu, batch 8, rank 8,
    # adam), compiled only, for abstract arguments: QLoRA at 4 bits against LoRA on
    # the dense model. Bytes are exact; the target is 0.35.
    width, depth, batch = 1024, 8, 8
    mlp = eqx.filter_eval_shape(
        eqx.nn.MLP, width, width, width, depth - 1, activation=jax.nn.relu, key=jr.key(0)
    )
    optimiser = optax.adam(1e-3)
    xs = ys = jax.ShapeDtypeStruct((batch, width), jnp.float32)

    def peak(model):
        trainable, frozen = partition(model)
        opt_state = eqx.filter_eval_shape(optimiser.init, trainable)
        arrays, static = eqx.partition(
            (trainable, opt_state, frozen), lambda x: isinstance(x, jax.ShapeDtypeStruct)
        )

        def step(arrays, xs, ys):
            trainable, opt_state, frozen = eqx.combine(arrays, static)

            def loss(trainable):
                out = jax.vmap(quaxlike.quaxify(eqx.combine(trainable, frozen)))(xs)
                return jnp.mean((out - ys) ** 2)

            grads = eqx.filter_grad(loss)(trainable)
            updates, opt_state = optimiser.update(grads, opt_state, trainable)
            return eqx.filter(eqx.apply_updates(trainable, updates), eqx.is_array), opt_state

        return compiled_peak_bytes(jax.jit(step).lower(arrays, xs, ys).compile())

    lora = eqx.filter_eval_shape(lambda m: loraify(m, rank=8, key=jr.key(1)), mlp)
    quantized = eqx.filter_eval_shape(lambda m: qlora(m, rank=8, key=jr.key(1)), mlp)
    ratio = peak(quantized) / peak(lora)
    print(f"QLoRA step peak / LoRA step peak: {ratio:.3f}")
    assert ratio <= 0.35, ratio
    # The paper's setting: NF4 in groups of 64, double-quantised.
    nf4 = eqx.filter_eval_shape(
        lambda m: qlora(m, rank=8, key=jr.key(1), bits="nf4", double_quant=True), mlp
    )
    nf4_ratio = peak(nf4) / peak(lora)
    print(f"QLoRA (NF4, double quantisation) step peak / LoRA step peak: {nf4_ratio:.3f}")
    assert nf4_ratio <= 0.35, nf4_ratio
