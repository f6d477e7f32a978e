"""Quantisation-aware training: `fake_quantize`, `FakeQuantized` (weights
rounded in the forward pass, straight-through gradients),
`ActivationFakeQuantized`, per-token activations, and `quantize` of a
fake-quantised model; against plain JAX, against torchao's fake quantisation
(golden files from tests/golden/make_qat.py), and with LoRA and DoRA."""

from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file

import quaxlike
from quaxlike.lora import DoraArray, LoraArray, loraify, partition, qlora
from quaxlike.quantized import (
    ActivationFakeQuantized,
    fake_quantize,
    fake_quantize_tokens,
    FakeQuantized,
    Int4Array,
    Int8Array,
    NF4Array,
    quantize,
    quantize_int4,
    quantize_int8,
    quantize_nf4,
    with_matmul,
)
from quaxlike.quantized._rounding import fake_quantize as rounded_on, grid_for


GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "qat"
GRIDS = {  # golden name: (bits, group size)
    "int8": (8, None),
    "int4_g32": (4, 32),
    "int4_g64": (4, 64),
    "int3_g32": (3, 32),
    "int2_g32": (2, 32),
}
SETTINGS = [(8, None), (4, 32), (3, 32), (2, 32), ("nf4", 64)]


def randn(seed, shape, scale=1.0):
    return scale * jr.normal(jr.key(seed), shape)


def ste_dense(w, bits, group_size):
    """The plain-JAX straight-through weight: `Q(w)` forward, identity backward."""
    q = rounded_on(grid_for(bits, group_size), w)
    return w + lax.stop_gradient(q - w)


def tokens_reference(x, bits):
    """torchao's per-token asymmetric fake quantisation, written out in plain
    JAX along the last axis, with its clipped straight-through gradient."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    xs = lax.stop_gradient(x)
    low = jnp.minimum(xs.min(-1, keepdims=True), 0.0)
    high = jnp.maximum(xs.max(-1, keepdims=True), 0.0)
    scale = jnp.maximum((high - low) / (qmax - qmin), np.finfo(np.float32).eps)
    zero = jnp.clip(qmin - jnp.round(low / scale), qmin, qmax)
    codes = jnp.round(xs * (1.0 / scale)) + zero
    dq = (jnp.clip(codes, qmin, qmax) - zero) * scale
    keep = ((codes >= qmin) & (codes <= qmax)).astype(x.dtype)
    return dq + keep * (x - xs)


def matmul(w, x):
    return w @ x


@pytest.fixture(scope="module")
def mlp():
    # Drawn by NumPy (Equinox's initialisers compile a program per shape).
    shapes = eqx.filter_eval_shape(eqx.nn.MLP, 64, 8, 64, 1, key=jr.key(0))
    rng = np.random.default_rng(0)

    def fill(x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jnp.asarray(rng.uniform(-0.125, 0.125, x.shape).astype(np.float32))

    return jax.tree.map(fill, shapes)


@eqx.filter_jit
def run(model, xs):
    return jax.vmap(quaxlike.quaxify(model))(xs)


# --- the grid: what quantize stores -------------------------------------------------


@pytest.mark.parametrize(
    "bits, group_size",
    [(8, None), (4, 32), (3, 32), (2, 32), pytest.param("nf4", 64, marks=pytest.mark.slow)],
)
def test_rounds_onto_quantizes_grid_bit_for_bit(bits, group_size):
    w = randn(1, (2, 16, 128))  # with a leading batch axis
    fq = FakeQuantized(w, bits=bits, group_size=group_size)
    stored = fq.to_quantized()
    make = {
        8: lambda: quantize_int8(w),
        4: lambda: quantize_int4(w, group_size=32),
        "nf4": lambda: quantize_nf4(w, group_size=64),
    }.get(bits)
    dense = stored.dequantize()
    if make is not None:
        expected = make()
        assert type(stored) is type(expected)
        assert np.array_equal(dense, expected.dequantize())
    x = randn(2, (2, 128, 3))

    @eqx.filter_jit
    def uses(fq, x):  # materialised (an elementwise op), and a product
        return quaxlike.quaxify(lambda w: w + 0.0)(fq), quaxlike.quaxify(matmul)(fq, x)

    materialised, product = uses(fq, x)
    assert np.array_equal(fq.dequantize(), dense)
    assert np.array_equal(materialised, dense)
    assert np.allclose(product, dense @ x, rtol=1e-6, atol=1e-6)


def test_group_sizes_and_defaults():
    w = randn(3, (4, 128))
    assert FakeQuantized(w, bits=4).group_size == 32
    assert FakeQuantized(w, bits="nf4").group_size == 64
    assert FakeQuantized(w, bits=8, group_size=16).group_size is None
    assert FakeQuantized(w, bits=3, group_size=128).to_quantized().scale.shape == (4, 1)


# --- torchao's numbers -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(GRIDS))
def test_weight_grids_equal_torchaos_fake_quantisation(name):
    # torchao's `_fake_quantize_affine` on quaxlike's grids (scales from
    # `choose_qparams_affine`, under no_grad): the same values, and its
    # gradient `(ct * s) * (1 / s)`, the identity to float rounding.
    golden = load_file(GOLDEN / "weights.safetensors")
    bits, group_size = GRIDS[name]
    fq = FakeQuantized(golden["w"], bits=bits, group_size=group_size)
    forward = lambda w: fq.with_weight(w).materialise()  # noqa: E731
    value, pullback = jax.vjp(jax.jit(forward), jnp.asarray(golden["w"]))
    # Within a few ulps: XLA may divide by a constant (the absmax by `code_max`)
    # as a product with its reciprocal, a last bit off torch's division in some
    # scales. A code that differs would be a whole step off.
    expected = golden[f"{name}.fq"]
    ulps = np.spacing(np.abs(expected).max(-1, keepdims=True))
    assert np.all(np.abs(np.asarray(value) - expected) <= 4 * ulps)
    (grad,) = pullback(jnp.asarray(golden["ct"]))
    assert np.array_equal(grad, golden["ct"])  # exactly the identity here
    assert np.allclose(grad, golden[f"{name}.grad"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("bits", [8, 4])
def test_per_token_activations_equal_torchao(bits):
    golden = load_file(GOLDEN / "activations.safetensors")
    x, ct = jnp.asarray(golden["x"]), jnp.asarray(golden["ct"])
    value, pullback = jax.vjp(jax.jit(lambda x: fake_quantize_tokens(x, bits, -1)), x)
    (grad,) = pullback(ct)
    expected, expected_grad = golden[f"int{bits}.fq"], golden[f"int{bits}.grad"]
    # XLA's float32 division may differ from torch's in the last bit of a
    # scale; no code differs (that would be a whole step, not a few ulps).
    ulps = np.spacing(np.abs(expected).max(-1, keepdims=True))
    assert np.all(np.abs(np.asarray(value) - expected) <= 4 * ulps)
    # The clipped STE: zero exactly where torchao's clamp cut the code.
    assert np.array_equal(np.asarray(grad) == 0, expected_grad == 0)
    if bits == 8:
        assert (expected_grad == 0).sum() == 1  # the row made to clamp
    assert np.allclose(grad, expected_grad, rtol=1e-5, atol=1e-7)
    # And the plain-JAX reference of the test agrees with both.
    assert np.allclose(jax.jit(tokens_reference, static_argnums=1)(x, bits), value, 1e-6, 1e-6)


def test_linear_layer_equals_torchaos_fake_quantized_linear():
    # torchao's FakeQuantizedLinear (8-bit per-token activations, the int4
    # group-32 grid on the weight): output and every gradient.
    g = load_file(GOLDEN / "linear.safetensors")
    layer = eqx.nn.Linear(64, 16, key=jr.key(0))
    layer = eqx.tree_at(lambda m: (m.weight, m.bias), layer, (g["weight"], g["bias"]))
    qat = fake_quantize(layer, bits=4, group_size=32, activations=8)
    assert isinstance(qat.weight, FakeQuantized) and qat.weight.activations == 8

    @eqx.filter_jit
    def forward_and_back(model, x, ct):
        y, pullback = jax.vjp(run, model, x)
        return y, *pullback(ct)

    y, grad_model, grad_x = forward_and_back(qat, jnp.asarray(g["x"]), jnp.asarray(g["ct"]))
    assert np.allclose(y, g["y"], rtol=1e-5, atol=1e-5)
    assert np.allclose(grad_model.weight.weight, g["grad_weight"], rtol=1e-5, atol=1e-5)
    assert np.allclose(grad_model.bias, g["grad_bias"], rtol=1e-5, atol=1e-5)
    assert np.allclose(grad_x, g["grad_x"], rtol=1e-5, atol=1e-5)
    # The converted layer computes the same.
    converted = quantize(qat)
    assert isinstance(converted.weight, ActivationFakeQuantized)
    assert isinstance(converted.weight.base, Int4Array)
    assert np.allclose(run(converted, jnp.asarray(g["x"])), g["y"], rtol=1e-5, atol=1e-5)


# --- derivatives: the straight-through estimator ---------------------------------------


def loss_of(apply):
    return lambda w, x: jnp.sum(jnp.tanh(apply(w, x)) ** 2)


@pytest.mark.parametrize("bits, group_size", [(8, None), (4, 32), (2, 32), ("nf4", 64)])
def test_grad_and_jvp_are_straight_through(bits, group_size):
    w, x = randn(4, (16, 64), 0.3), randn(5, (64, 3))
    tangents = (randn(6, w.shape), randn(7, x.shape))
    fq = FakeQuantized(w, bits=bits, group_size=group_size)
    f = loss_of(lambda w, x: w @ x)

    @jax.jit
    def both(w, x):
        dense = lambda w, x: f(ste_dense(w, bits, group_size), x)  # noqa: E731
        ours = lambda w, x: quaxlike.quaxify(f)(fq.with_weight(w), x)  # noqa: E731
        grads = [jax.grad(g, argnums=(0, 1))(w, x) for g in (ours, dense)]
        jvps = [jax.jvp(g, (w, x), tangents) for g in (ours, dense)]
        # The true derivative of rounding: zero but at each group's absmax
        # (through its scale).
        true = jax.grad(lambda w: f(rounded_on(grid_for(bits, group_size), w), x))(w)
        return grads, jvps, true

    (got, want), (jvp_got, jvp_want), true = both(w, x)
    assert all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want))
    assert np.allclose(jvp_got[0], jvp_want[0], rtol=1e-5)
    assert np.allclose(jvp_got[1], jvp_want[1], rtol=1e-5)
    # Not that derivative: the STE passes a gradient to every weight.
    assert np.mean(np.asarray(true) == 0) > 0.9
    assert np.mean(np.asarray(got[0]) == 0) < 0.01


@pytest.mark.slow
def test_grad_under_vmap_over_inputs_and_over_stacked_weights():
    w, xs = randn(8, (3, 16, 64), 0.3), randn(9, (3, 64))
    fq = FakeQuantized(w, bits=4)
    f = loss_of(lambda w, x: w @ x)
    ours = jax.jit(jax.vmap(jax.grad(lambda w, x: quaxlike.quaxify(f)(fq.with_weight(w), x))))
    dense = jax.jit(jax.vmap(jax.grad(lambda w, x: f(ste_dense(w, 4, 32), x))))
    assert np.allclose(ours(w, xs), dense(w, xs), rtol=1e-5, atol=1e-6)
    one = fq.with_weight(w[0])
    grads = jax.jit(jax.vmap(jax.grad(lambda x: quaxlike.quaxify(f)(one, x))))(xs)
    want = jax.jit(jax.vmap(jax.grad(lambda x: f(ste_dense(w[0], 4, 32), x))))(xs)
    assert np.allclose(grads, want, rtol=1e-5, atol=1e-6)


def test_activations_gradients_against_plain_jax():
    w, x = randn(10, (16, 64), 0.3), randn(11, (5, 64))
    fq = FakeQuantized(w, bits=4, activations=8)
    f = loss_of(lambda w, x: x @ w.T)
    ours = jax.jit(jax.grad(lambda w, x: quaxlike.quaxify(f)(fq.with_weight(w), x), (0, 1)))
    dense = jax.jit(
        jax.grad(lambda w, x: f(ste_dense(w, 4, 32), tokens_reference(x, 8)), argnums=(0, 1))
    )
    got, want = ours(w, x), dense(w, x)
    assert np.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert np.allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    # `w @ x` (x a column per token): tokens along the other axis.
    g = lambda w, x: quaxlike.quaxify(loss_of(matmul))(fq.with_weight(w), x)  # noqa: E731
    h = lambda w, x: loss_of(matmul)(ste_dense(w, 4, 32), tokens_reference(x.T, 8).T)  # noqa: E731
    got, want = jax.jit(jax.grad(g, 1))(w, x.T), jax.jit(jax.grad(h, 1))(w, x.T)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "fn",
    [
        lambda w, x: jnp.sum(w**2) * x,  # elementwise: materialised
        lambda w, x: jnp.sum(w[:, :5] * x[:5]),  # cuts the groups: materialised
        lambda w, x: jnp.sum(jnp.sin(w) @ x),
        lambda w, x: jnp.sum(jnp.cumsum(w, axis=0) @ x),
    ],
)
def test_every_other_primitive_materialises_with_the_ste(fn):
    w, x = randn(12, (16, 64), 0.3), randn(13, (64,))
    fq = FakeQuantized(w, bits=4)
    ours = jax.jit(jax.grad(lambda w: jnp.sum(quaxlike.quaxify(fn)(fq.with_weight(w), x))))(w)
    want = jax.jit(jax.grad(lambda w: jnp.sum(fn(ste_dense(w, 4, 32), x))))(w)
    assert np.allclose(ours, want, rtol=1e-5, atol=1e-6)
    assert np.any(np.asarray(ours) != 0)
    report = quaxlike.explain(fn)(fq, x)
    assert "materialised FakeQuantized" in str(report)


def test_custom_jvp_gets_the_straight_through_tangent():
    w, x = randn(14, (16, 64), 0.3), randn(15, (64,))
    fq = FakeQuantized(w, bits=4)
    f = lambda w: jnp.sum(jax.nn.relu(w) * x)  # noqa: E731  (relu is a custom_jvp)
    got = jax.jit(jax.grad(lambda w: quaxlike.quaxify(f)(fq.with_weight(w))))(w)
    want = jax.jit(jax.grad(lambda w: f(ste_dense(w, 4, 32))))(w)
    assert np.allclose(got, want, rtol=1e-6)


# --- rules that keep the type ----------------------------------------------------------


def test_layout_rules_keep_the_type_and_the_values():
    w = randn(16, (3, 16, 64))
    fq = FakeQuantized(w, bits=4, activations=8)
    dense = fq.dequantize()
    cases = {
        "transpose": lambda w: jnp.swapaxes(w, -1, -2),
        "layer": lambda w: w[1],
        "layers": lambda w: w[1:],
        "rows": lambda w: w[:, 2:9],
        "dynamic rows": lambda w: lax.dynamic_slice_in_dim(w, 4, 5, axis=1),
        "stop_gradient": lax.stop_gradient,
        "reshape batch": lambda w: w.reshape(1, 3, 16, 64),
    }
    outs = eqx.filter_jit(lambda fq: {k: quaxlike.quaxify(op)(fq) for k, op in cases.items()})(fq)
    for name, op in cases.items():
        out = outs[name]
        assert isinstance(out, FakeQuantized), name
        assert out.activations == 8 and out.group_size == 32, name
        assert np.array_equal(out.dequantize(), op(dense)), name
    flipped = quaxlike.quaxify(lambda w: w.T)(FakeQuantized(w[0], bits=4))
    back = quaxlike.quaxify(lambda w: jnp.swapaxes(w, -1, -2))(flipped)
    assert isinstance(flipped, FakeQuantized) and flipped.transposed
    assert isinstance(back, FakeQuantized) and not back.transposed


def test_scan_over_stacked_fake_quantized_layers():
    w, x = randn(17, (3, 32, 32), 0.3), randn(18, (32,))
    fq = FakeQuantized(w, bits=4)

    def net(stack, x):
        return jnp.sum(lax.scan(lambda h, layer: (jnp.tanh(layer @ h), None), x, stack)[0])

    ours = jax.jit(jax.value_and_grad(lambda w: quaxlike.quaxify(net)(fq.with_weight(w), x)))
    want = jax.jit(jax.value_and_grad(lambda w: net(ste_dense(w, 4, 32), x)))
    (v1, g1), (v2, g2) = ours(w), want(w)
    assert np.allclose(v1, v2, rtol=1e-6) and np.allclose(g1, g2, rtol=1e-5, atol=1e-6)
    report = quaxlike.explain(net)(fq, x)
    assert not report.materialised


# --- whole models: fake_quantize and quantize ------------------------------------------


@pytest.mark.parametrize(
    "bits, group_size, activations",
    [
        (8, None, None),
        (4, 32, 8),
        pytest.param(3, 32, None, marks=pytest.mark.slow),
        pytest.param(2, 32, 4, marks=pytest.mark.slow),
        ("nf4", 64, 8),
    ],
)
def test_quantize_converts_with_the_same_outputs(mlp, bits, group_size, activations):
    qat = fake_quantize(mlp, bits=bits, group_size=group_size, activations=activations)
    assert all(isinstance(layer.weight, FakeQuantized) for layer in qat.layers)
    # No settings: they come from the FakeQuantized (the fused products here,
    # quicker to compile; the linear layer's golden test takes the loop).
    converted = quantize(qat, matmul="fused")
    kind = {8: Int8Array, "nf4": NF4Array}.get(bits, Int4Array)
    for layer in converted.layers:
        weight = layer.weight
        if activations is not None:
            assert isinstance(weight, ActivationFakeQuantized) and weight.bits == activations
            weight = weight.base
        assert type(weight) is kind
    xs = randn(19, (6, 64))
    fake, real = run(qat, xs), run(converted, xs)
    assert np.allclose(fake, real, rtol=1e-5, atol=1e-6)
    # The codes and scales of quantize's own round to nearest.
    direct = quantize(mlp, bits=bits, group_size=group_size)
    for ours, theirs in zip(converted.layers, direct.layers):
        stored = ours.weight.base if activations is not None else ours.weight
        assert np.array_equal(stored.dequantize(), theirs.weight.dequantize())


def test_quantize_passes_its_options_on_and_refuses_other_settings(mlp):
    qat = fake_quantize(mlp, bits=4)
    converted = quantize(qat, bits=4, group_size=32, block_bytes=4096, matmul="fused")
    assert converted.layers[0].weight.block_bytes == 4096
    assert converted.layers[0].weight.matmul == "fused"
    bad_settings: list[dict[str, Any]] = [
        dict(bits=3),
        dict(group_size=64),
        dict(method="gptq", calibration=[jnp.ones((4, 64))]),
        dict(where="layers.0"),
        dict(double_quant=True),
    ]
    for bad in bad_settings:
        with pytest.raises(ValueError, match="FakeQuantized.*settings it was trained with"):
            quantize(qat, **bad)


def test_where_selects_what_is_fake_quantized(mlp):
    qat = fake_quantize(mlp, bits=3, where="layers.1")
    assert eqx.is_array(qat.layers[0].weight) and isinstance(qat.layers[1].weight, FakeQuantized)
    converted = quantize(qat)
    assert isinstance(converted.layers[1].weight, Int4Array)
    assert eqx.is_array(converted.layers[0].weight)
    qat = fake_quantize(mlp, where=lambda path, leaf: path.endswith("0.weight"), bits=8)
    assert isinstance(qat.layers[0].weight, FakeQuantized)
    assert eqx.is_array(qat.layers[1].weight)


def test_training_steps_under_filter_jit_in_checked_mode(mlp):
    qat = fake_quantize(mlp, bits=2, activations=8)
    xs, ys = randn(20, (16, 64)), randn(21, (16, 8))

    def loss(model):
        out = jax.vmap(quaxlike.quaxify(model, check=True))(xs)
        return jnp.mean((out - ys) ** 2)

    @eqx.filter_jit
    def step(model):
        value, grads = eqx.filter_value_and_grad(loss)(model)
        return eqx.apply_updates(model, jax.tree.map(lambda g: -0.05 * g, grads)), value

    losses = []
    for _ in range(15):
        qat, value = step(qat)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    assert isinstance(qat.layers[0].weight, FakeQuantized)


# --- LoRA, QLoRA and DoRA ----------------------------------------------------------------


def _with_nonzero_b(model):
    is_lora = lambda x: isinstance(x, (LoraArray, DoraArray))  # noqa: E731
    adapters = [x for x in jax.tree.leaves(model, is_leaf=is_lora) if is_lora(x)]
    return eqx.tree_at(
        lambda m: [a.b for a in [x for x in jax.tree.leaves(m, is_leaf=is_lora) if is_lora(x)]],
        model,
        [randn(30 + i, a.b.shape, 0.05) for i, a in enumerate(adapters)],
    )


@pytest.mark.parametrize("activations, dora", [(8, False), (None, True)])
def test_qat_with_lora_then_quantize_gives_qlora(mlp, activations, dora):
    qat = fake_quantize(mlp, bits=4, activations=activations)
    adapted = _with_nonzero_b(loraify(qat, rank=4, key=jr.key(3), dora=dora))
    xs = randn(22, (5, 64))
    # Only the adapters train; the fake-quantised base is frozen.
    trainable, frozen = partition(adapted)
    loss = lambda t, f: jnp.sum(run(eqx.combine(t, f), xs) ** 2)  # noqa: E731
    grads = eqx.filter_jit(eqx.filter_grad(loss))(trainable, frozen)
    is_fake = lambda x: isinstance(x, FakeQuantized)  # noqa: E731
    fakes = [x for x in jax.tree.leaves(trainable, is_leaf=is_fake) if is_fake(x)]
    assert fakes and all(fake.weight is None for fake in fakes)
    assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads))
    converted = quantize(adapted, matmul="fused")
    layer = converted.layers[0].weight
    assert isinstance(layer, DoraArray if dora else LoraArray)
    base = layer.w
    if activations:
        assert isinstance(base, ActivationFakeQuantized)
        base = base.base
    assert isinstance(base, Int4Array)
    assert np.allclose(run(adapted, xs), run(converted, xs), rtol=1e-5, atol=1e-6)


def test_weight_only_qat_lora_is_qlora_over_the_rtn_base(mlp):
    # With the base frozen, its fake-quantised weight is round-to-nearest's
    # dequantised weight: QAT + LoRA trains exactly as QLoRA (same outputs,
    # same adapter gradients).
    adapted = _with_nonzero_b(loraify(fake_quantize(mlp, bits=4), rank=4, key=jr.key(4)))
    reference = _with_nonzero_b(with_matmul(qlora(mlp, rank=4, key=jr.key(4), bits=4), "fused"))
    xs = randn(23, (5, 64))

    @eqx.filter_jit
    def grads(model):
        t, f = partition(model)
        return eqx.filter_grad(lambda t: jnp.sum(run(eqx.combine(t, f), xs) ** 2))(t)

    assert np.allclose(run(adapted, xs), run(reference, xs), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads(adapted)), jax.tree.leaves(grads(reference))):
        assert np.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_activations_round_only_the_base_product_under_lora():
    # torchtune's QAT + LoRA: `fq(W) q(x) + A (B x)`, the adapters' path on the
    # float input.
    w, x = randn(24, (16, 64), 0.3), randn(25, (3, 64))
    lora = LoraArray(FakeQuantized(w, bits=4, activations=8), rank=2, key=jr.key(5))
    lora = eqx.tree_at(lambda x: x.b, lora, randn(26, lora.b.shape))
    got = eqx.filter_jit(quaxlike.quaxify(lambda w, x: x @ w.T))(lora, x)
    reference = lambda x, a, b: tokens_reference(x, 8) @ ste_dense(w, 4, 32).T + x @ (a @ b).T  # noqa: E731
    want = jax.jit(reference)(x, lora.a, lora.b)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)


# --- sharding, explain, refusals --------------------------------------------------------


def test_leaf_specs_follow_the_logical_spec():
    fq = FakeQuantized(randn(27, (2, 16, 64)), bits=4)
    specs = quaxlike.leaf_specs(fq, P(None, "data", "model"))
    assert specs.weight == P(None, "data", "model")
    flipped = quaxlike.quaxify(lambda w: jnp.swapaxes(w, -1, -2))(fq)
    assert quaxlike.leaf_specs(flipped, P(None, "model", "data")).weight == specs.weight
    converted = FakeQuantized(randn(27, (16, 64)), bits=4, activations=8).to_quantized()
    specs = quaxlike.leaf_specs(converted, P("data", None))
    assert specs.base.packed == P("data") and specs.base.scale == P("data")


def test_placed_by_logical_sharding(mlp):
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    qat = fake_quantize(mlp, bits=4, activations=8)
    placed = quaxlike.device_put(qat, NamedSharding(mesh, P("data")))
    assert placed.layers[0].weight.weight.sharding.spec == P("data")

    @eqx.filter_jit
    def constrained(model, xs):
        def apply(model, xs):
            sharding = NamedSharding(mesh, P("data", None))
            w = jax.lax.with_sharding_constraint(model.layers[0].weight, sharding)
            return xs @ w.T

        return quaxlike.quaxify(apply)(model, xs)

    xs = randn(28, (4, 64))
    out = constrained(placed, xs)
    want = tokens_reference(xs, 8) @ qat.layers[0].weight.dequantize().T
    assert np.allclose(out, want, rtol=1e-5, atol=1e-5)


def test_explain_names_the_rules(mlp):
    qat = fake_quantize(mlp, bits=4, activations=8)
    report = quaxlike.explain(qat)(jnp.ones(64))
    text = str(report)
    assert text.count("-> quaxlike.quantized._qat_rules.dot_general_p_fakequantized_any") == 2
    assert not report.materialised
    report = quaxlike.explain(quantize(qat))(jnp.ones(64))
    text = str(report)
    # The converted weight's rule, and under it the Int4Array's own product.
    assert text.count("dot_general(ActivationFakeQuantized[float32[64,64]], float32[64])") == 1
    assert text.count("_qat_rules.dot_general_p_activationfakequantized_any") == 3  # + listing
    assert "dot_general(Int4Array[float32[8,64]], float32[64])" in text
    assert not report.materialised


def test_refusals_name_the_type_and_the_way_out(mlp):
    with pytest.raises(ValueError, match="`bits` must be 8, 4, 3 or 2"):
        fake_quantize(mlp, bits=5)
    with pytest.raises(ValueError, match="`activations` must be None"):
        fake_quantize(mlp, activations=16)
    with pytest.raises(ValueError, match="group_size=48"):
        fake_quantize(mlp, bits=4, group_size=48)
    with pytest.raises(ValueError, match="FakeQuantized.*fake-quantised already"):
        fake_quantize(fake_quantize(mlp))
    with pytest.raises(ValueError, match="Int4Array.*quantised already.*qlora"):
        fake_quantize(quantize(mlp, bits=4))
    with pytest.raises(ValueError, match=r"LoraArray.*loraify\(fake_quantize\(model\)"):
        fake_quantize(loraify(mlp, rank=2, key=jr.key(0)))
    with pytest.raises(ValueError, match="selected no weight"):
        fake_quantize(mlp, where="nothing.here")
    with pytest.raises(ValueError, match="FakeQuantized.*floating-point"):
        FakeQuantized(jnp.ones((4, 64), jnp.int32))


@pytest.mark.slow
def test_bfloat16_weights():
    w = randn(28, (8, 64)).astype(jnp.bfloat16)
    fq = FakeQuantized(w, bits=4, activations=8)
    x = randn(29, (64,)).astype(jnp.bfloat16)
    product = eqx.filter_jit(quaxlike.quaxify(matmul))
    out = product(fq, x)
    assert out.dtype == jnp.bfloat16
    # bfloat16 products round differently block by block: close in norm.
    real = np.asarray(product(fq.to_quantized(), x), np.float32)
    got = np.asarray(out, np.float32)
    assert np.linalg.norm(got - real) <= 1e-2 * np.linalg.norm(real)


def test_activation_rounding_with_derivatives_taken_inside_quaxify():
    """`activations=` with the derivative taken inside `quaxify`, where JAX forms
    the tangent and cotangent products with the weight before any rule sees
    them: the input's gradient is the straight-through one (the transposed
    product `g @ q(W)` meets no activation), equal to the gradient taken outside;
    a tangent product is evaluated as every product with the weight is, its
    input (the tangent) rounded per token; and the weight's own gradient is
    JAX's `gᵀ x` with the input as it is (that product does not meet the
    weight), where the gradient taken outside is `gᵀ fq(x)`."""
    w = FakeQuantized(jr.normal(jr.key(0), (16, 32)), bits=4, group_size=32, activations=8)
    x, dx = jr.normal(jr.key(1), (5, 32)), jr.normal(jr.key(2), (5, 32))
    qw = rounded_on(grid_for(4, 32), w.weight)
    fq = lambda x: fake_quantize_tokens(x, 8, -1)  # noqa: E731
    f = lambda w, x: jnp.sum(jnp.sin(x @ w.T))  # noqa: E731
    inner = jax.jit(quaxlike.quaxify(jax.grad(f, argnums=(0, 1))))(w, x)
    outer = jax.jit(jax.grad(quaxlike.quaxify(f), argnums=(0, 1)))(w, x)
    g = jnp.cos(fq(x) @ qw.T)
    np.testing.assert_allclose(inner[1], g @ qw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outer[1], g @ qw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(inner[0], g.T @ x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outer[0].weight, g.T @ fq(x), rtol=1e-5, atol=1e-5)
    jvp_inner = quaxlike.quaxify(lambda w, x, dx: jax.jvp(lambda x: x @ w.T, (x,), (dx,))[1])
    np.testing.assert_allclose(jvp_inner(w, x, dx), fq(dx) @ qw.T, rtol=1e-5, atol=1e-5)


def test_two_fake_quantized_weights_multiply_without_ambiguity():
    """A product of two fake-quantised weights (`matrix_power` of one) takes the
    rule for both, each rounded, rather than failing between the one-sided rules."""
    w = FakeQuantized(jr.normal(jr.key(0), (4, 4)), bits=8)
    got = quaxlike.quaxify(lambda a: jnp.linalg.matrix_power(a, 3))(w)
    np.testing.assert_allclose(got, jnp.linalg.matrix_power(w.materialise(), 3), rtol=1e-6)
