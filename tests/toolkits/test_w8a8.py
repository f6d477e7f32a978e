"""Int8 dynamic activations x int8 weights (`W8A8Array`, `quantize(model, bits=8,
activations=8)`), against torchao's own numbers (tests/golden/w8a8, written by
tests/golden/make_w8a8.py with torchao 0.18.0) and against plain JAX.

Derivatives are the straight-through estimator's: plain JAX's
`(x + stop_gradient(fq(x) - x)) @ W.T`, `fq` the activations' quantise-dequantise
and `W` the dequantised weight, whose value is the quantised product and whose
derivative treats the rounding as the identity.
"""

import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import randn
from jax import lax
from jax.sharding import PartitionSpec as P

import quaxlike
from quaxlike.lora import loraify, trainable_filter
from quaxlike.quantized import (
    dequantize,
    InputScaled,
    Int8Array,
    quantize,
    quantize_rows_int8,
    quantize_w8a8,
    W8A8Array,
)


GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "w8a8")
CASES = ["w8a8_f32", "w8a8_bf16", "w8a8_f32_wide"]


def golden(case):
    from safetensors.numpy import load_file

    return load_file(os.path.join(GOLDEN, f"{case}.safetensors"))


def fake_quantized(x):
    """The activations' quantise-dequantise, per row, in plain JAX."""
    codes, scale = quantize_rows_int8(x)
    return codes.astype(jnp.float32) * scale[..., None]


def ste_product(x, values, w_scale):
    """Plain JAX: the W8A8 product's value, with straight-through derivatives."""
    x_ste = x + lax.stop_gradient(fake_quantized(x).astype(x.dtype) - x)
    return x_ste @ (values.astype(w_scale.dtype) * w_scale[:, None]).T


def product(w, x):
    return x @ w.T


# --- torchao's numbers --------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_equals_torchao(case):
    g = golden(case)
    dtype = jnp.bfloat16 if "bf16" in case else jnp.float32
    weight, bias, x = (jnp.asarray(g[k]).astype(dtype) for k in ("weight", "bias", "x"))
    out, size = weight.shape
    linear = eqx.nn.Linear(size, out, key=jr.key(0), dtype=dtype)
    linear = eqx.tree_at(lambda m: (m.weight, m.bias), linear, (weight, bias))
    q = quantize(linear, bits=8, activations=8)
    assert isinstance(q.weight, W8A8Array) and q.weight.dtype == dtype
    # The weight's codes and scales, and the activations', bit for bit.
    np.testing.assert_array_equal(np.asarray(q.weight.values), g["qdata"])
    np.testing.assert_array_equal(np.asarray(q.weight.scale, np.float32), g["w_scale"])
    codes, scale = jax.jit(quantize_rows_int8)(x)
    np.testing.assert_array_equal(np.asarray(codes), g["x_qdata"])
    np.testing.assert_array_equal(np.asarray(scale), g["x_scale"])
    assert g["x_scale"][1] == 2**-23  # the zero row: float32's eps
    if dtype == jnp.float32:
        assert (g["x_qdata"] == -128).any() and (g["qdata"] == -128).any()
    # The outputs: per example (vmapped, as Equinox calls a layer) and with the
    # tokens in two leading axes.
    y = eqx.filter_jit(lambda m, x: jax.vmap(quaxlike.quaxify(m))(x))(q, x)
    y3 = jax.jit(quaxlike.quaxify(lambda w, x: x @ w.T + bias))(q.weight, x.reshape(2, 3, -1))
    # float32: the same integers and scales, to rounding. bfloat16: torchao adds
    # the bias in float32 before rounding, Equinox after; one bf16 step apart.
    rtol, atol = (1e-6, 1e-5) if dtype == jnp.float32 else (2**-7, 2**-7)
    np.testing.assert_allclose(np.asarray(y, np.float32), g["y"], rtol=rtol, atol=atol)
    y3 = np.asarray(y3, np.float32).reshape(y.shape)
    np.testing.assert_allclose(y3, g["y"], rtol=rtol, atol=atol)


def test_lowered_product_is_int8_times_int8_into_int32():
    w = quantize_w8a8(randn(0, (48, 64)))
    x = randn(1, (5, 64))
    text = jax.jit(quaxlike.quaxify(product)).lower(w, x).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 1, dots
    assert re.search(r"\(tensor<5x64xi8>, tensor<64x48xi8>\) -> tensor<5x48xi32>", dots[0])
    # Equinox's layout (weight first) too, and under vmap over the tokens.
    text = jax.jit(jax.vmap(quaxlike.quaxify(lambda w, x: w @ x), (None, 0))).lower(w, x).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and "xi8>, tensor<" in dots[0] and "xi32>" in dots[0], dots


# --- values and derivatives against plain JAX ----------------------------------------


@pytest.fixture(scope="module")
def weight():
    return quantize_w8a8(randn(2, (12, 16)))


def test_value_and_derivatives_are_the_straight_through_estimators(weight):
    x = randn(3, (5, 16)) * jnp.linspace(0.1, 4.0, 5)[:, None]
    dx, ds = randn(4, (5, 16)), randn(5, weight.scale.shape)
    with_scale = lambda s: eqx.tree_at(lambda w: w.scale, weight, s)  # noqa: E731
    loss = lambda w, x: jnp.sum(jnp.sin(quaxlike.quaxify(product)(w, x)))  # noqa: E731

    @eqx.filter_jit
    def ours(weight, x, dx, ds):
        f = lambda x, s: quaxlike.quaxify(product)(with_scale(s), x)  # noqa: E731
        y, t = jax.jvp(f, (x, weight.scale), (dx, ds))
        # eqx.filter_grad: the scales get a gradient, the codes None.
        return y, t, eqx.filter_grad(loss)(weight, x), jax.grad(loss, argnums=1)(weight, x)

    @jax.jit
    def reference(x, dx, ds):
        f = lambda x, s: ste_product(x, weight.values, s)  # noqa: E731
        y, t = jax.jvp(f, (x, weight.scale), (dx, ds))
        grads = jax.grad(lambda s, x: jnp.sum(jnp.sin(f(x, s))), argnums=(0, 1))(weight.scale, x)
        return y, t, *grads

    y, t, gw, gx = ours(weight, x, dx, ds)
    y_ref, t_ref, gs_ref, gx_ref = reference(x, dx, ds)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(t, t_ref, rtol=1e-5, atol=1e-5)
    # The straight-through tangent is the dense weight's, not zero (rounding's).
    t_x = jax.jvp(lambda x: ste_product(x, weight.values, weight.scale), (x,), (dx,))[1]
    assert float(jnp.abs(t_x).max()) > 0.1
    assert gw.values is None
    np.testing.assert_allclose(gw.scale, gs_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-4, atol=1e-5)


@jax.custom_vjp
def user_product(w, x):
    return x @ w.T


def _user_fwd(w, x):
    return x @ w.T, (w, x)


def _user_bwd(residuals, g):
    w, x = residuals
    return g.T @ x, g @ w  # the cotangents of the weight `(out, in)` and of `x`


user_product.defvjp(_user_fwd, _user_bwd)


def test_custom_vjp_and_custom_jvp_over_w8a8(weight):
    # A user's custom_vjp holding the W8A8 weight as a residual: forward the int8
    # product, backward the user's rule, whose weight cotangent reaches the
    # scales through the dequantised weight `values * scale`.
    x = randn(15, (5, 16))
    loss = lambda w, x: jnp.sum(jax.nn.relu(quaxlike.quaxify(user_product)(w, x)))  # noqa: E731
    gw, gx = eqx.filter_jit(eqx.filter_grad(lambda wx: loss(*wx)))((weight, x))
    y = ste_product(x, weight.values, weight.scale)
    g = (y > 0).astype(y.dtype)  # relu's custom_jvp
    dense = weight.dequantize()
    np.testing.assert_allclose(gx, g @ dense, rtol=1e-5, atol=1e-5)
    ct_w = g.T @ x
    np.testing.assert_allclose(
        gw.scale, jnp.sum(ct_w * weight.values, axis=-1), rtol=1e-4, atol=1e-4
    )


def test_grad_inside_quaxify_is_the_straight_through_gradient(weight):
    # Reverse mode inside `quaxify` meets the weight in the transposed product
    # `g @ W`, the weight-only product: the same straight-through gradient.
    x = randn(6, (5, 16))
    f = lambda w, x: jnp.sum(jnp.tanh(x @ w.T))  # noqa: E731
    gx = jax.jit(quaxlike.quaxify(jax.grad(f, argnums=1)))(weight, x)
    ref = jax.grad(lambda x: jnp.sum(jnp.tanh(ste_product(x, weight.values, weight.scale))))(x)
    np.testing.assert_allclose(gx, ref, rtol=1e-4, atol=1e-5)


def test_jvp_inside_quaxify_is_the_int8_product_of_the_tangent(weight):
    """Forward mode inside `quaxify`: JAX's rule for `dot_general` (bilinear) forms
    the tangent as the product of the tangent with the weight, and every product
    with a `W8A8Array` that contracts its input axis is evaluated with int8
    activations, the tangent's as any other's (as `precision=` lowers a
    `dot_general`'s tangent product with it). So the tangent is exactly the int8
    product of `dx`, and the straight-through tangent `dx @ W.T` (what the same
    jvp gives outside `quaxify`) to int8 precision: one code step of the tangent's
    largest entry per token."""
    x, dx = randn(7, (5, 16)), randn(8, (5, 16))
    inner = lambda w, x, dx: jax.jvp(lambda x: x @ w.T, (x,), (dx,))[1]  # noqa: E731
    t = quaxlike.quaxify(inner)(weight, x, dx)
    np.testing.assert_allclose(
        t, ste_product(dx, weight.values, weight.scale), rtol=1e-6, atol=1e-6
    )
    outside = jax.jvp(lambda x: quaxlike.quaxify(product)(weight, x), (x,), (dx,))[1]
    dense = weight.dequantize()
    np.testing.assert_allclose(outside, dx @ dense.T, rtol=1e-5, atol=1e-5)
    # Per token, the int8 rounding of `dx` moves each entry by at most half a step.
    step = jnp.max(jnp.abs(dx), axis=-1, keepdims=True) / 127.5
    bound = 0.5 * step * jnp.sum(jnp.abs(dense), axis=-1)[None, :]
    assert bool(jnp.all(jnp.abs(t - outside) <= bound * (1 + 1e-5) + 1e-6))
    assert not np.allclose(t, outside, rtol=1e-6, atol=1e-6)  # evaluated in int8 indeed


def test_products_that_meet_no_activation_are_weight_only(weight):
    g = randn(9, (5, 12))
    y = quaxlike.quaxify(lambda w, g: g @ w)(weight, g)  # contracts the outputs
    np.testing.assert_allclose(y, g @ weight.dequantize(), rtol=1e-5, atol=1e-5)


def test_stacked_weights_and_batched_products():
    w = quantize_w8a8(randn(10, (3, 12, 16)))
    x = randn(11, (3, 5, 16))
    y = jax.jit(quaxlike.quaxify(lambda w, x: jnp.einsum("loi,lti->lto", w, x)))(w, x)
    ref = jax.vmap(ste_product)(x, w.values, w.scale)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    layer = quaxlike.quaxify(lambda w, x: x @ w[1].T)(w, x[1])  # indexing keeps the type
    np.testing.assert_allclose(layer, ref[1], rtol=1e-5, atol=1e-5)

    # `lax.scan` over the layers: each step gets one layer's W8A8Array.
    def scanned(w, x):
        return lax.scan(lambda carry, wx: (carry, wx[1] @ wx[0].T), 0.0, (w, x))[1]

    np.testing.assert_allclose(jax.jit(quaxlike.quaxify(scanned))(w, x), ref, rtol=1e-5, atol=1e-5)


def test_under_input_scales_the_scaled_input_is_quantised():
    # An AWQ (or SmoothQuant-like) `InputScaled` over a W8A8 weight: the input is
    # divided by the per-channel scales, then quantised per token.
    w, s = randn(12, (12, 16)), jnp.exp(0.5 * randn(13, (16,)))
    base = quantize_w8a8(w * s)
    x = randn(14, (5, 16))
    y = quaxlike.quaxify(product)(InputScaled(base, s), x)
    np.testing.assert_allclose(y, ste_product(x / s, base.values, base.scale), rtol=1e-5, atol=1e-5)


# --- models: where=, checked mode, filter_jit, explain, sharding specs ---------------


@pytest.fixture(scope="module")
def mlp():
    return eqx.nn.MLP(16, 4, 32, depth=1, key=jr.key(0))


def dense_ste_mlp(model, x):
    """`model` (a W8A8 MLP, dequantised) in plain JAX, each Linear's input
    quantised straight through."""
    for i, layer in enumerate(model.layers):
        w = layer.weight
        x = ste_product(x[None], w.values, w.scale)[0] + layer.bias
        x = model.activation(x) if i < len(model.layers) - 1 else x
    return x


def test_model_where_and_checked_mode(mlp):
    q = quantize(mlp, bits=8, activations=8)
    assert all(isinstance(layer.weight, W8A8Array) for layer in q.layers)
    x = randn(12, (16,))
    loss = lambda m, x: jnp.sum(quaxlike.quaxify(m, check=True)(x) ** 2)  # noqa: E731
    (value, y), grads = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m, x: (loss(m, x), quaxlike.quaxify(m)(x)), has_aux=True)
    )(q, x)
    np.testing.assert_allclose(y, dense_ste_mlp(q, x), rtol=1e-5, atol=1e-5)
    assert jnp.allclose(y, mlp(x), atol=0.05)
    assert grads.layers[0].weight.values is None and grads.layers[0].weight.scale is not None
    only = quantize(mlp, bits=8, activations=8, where="layers.1.weight")
    kinds = [type(layer.weight) for layer in only.layers]
    assert kinds[1] is W8A8Array and kinds[0] is not W8A8Array
    # dequantize gives the dense weights; `int8_weight` the weight-only array.
    assert isinstance(dequantize(q).layers[0].weight, jax.Array)
    int8 = q.layers[0].weight.int8_weight()
    assert type(int8) is Int8Array
    assert jnp.array_equal(int8.dequantize(), q.layers[0].weight.dequantize())


def test_explain_names_the_int8_product(weight):
    report = quaxlike.explain(product)(weight, randn(13, (5, 16)))
    text = str(report)
    assert "dot_general_p_dense_w8a8" in text and "W8A8Array" in text, text
    assert not report.materialised


def test_leaf_specs_follow_rows_and_columns(weight):
    rows = quaxlike.leaf_specs(weight, P("data"))
    assert (rows.values, rows.scale) == (P("data"), P("data"))
    columns = quaxlike.leaf_specs(weight, P(None, "model"))
    assert (columns.values, columns.scale) == (P(None, "model"), P())
    transposed = quaxlike.leaf_specs(weight.swapped(), P("model", "data"))
    assert (transposed.values, transposed.scale) == (P("data", "model"), P("data"))


def test_qlora_over_w8a8_against_plain_jax(mlp):
    q = quantize(mlp, bits=8, activations=8)
    model = loraify(q, rank=2, key=jr.key(1))
    # Nonzero B, so that the adapters matter forward and backward.
    model = eqx.tree_at(
        lambda m: [layer.weight.b for layer in m.layers],
        model,
        [randn(20 + i, layer.weight.b.shape, 0.3) for i, layer in enumerate(model.layers)],
    )
    x = randn(14, (4, 16))

    def dense(factors, x):
        for i, (layer, (a, b)) in enumerate(zip(model.layers, factors)):
            w = layer.weight.w
            x = ste_product(x, w.values, w.scale) + x @ (a @ b).T + layer.bias
            x = model.activation(x) if i < len(model.layers) - 1 else x
        return x

    factors = [(layer.weight.a, layer.weight.b) for layer in model.layers]
    trainable, frozen = eqx.partition(model, trainable_filter(model))

    @eqx.filter_jit
    def ours(trainable, x):
        def loss(trainable):
            y = jax.vmap(quaxlike.quaxify(eqx.combine(trainable, frozen)))(x)
            return jnp.sum(jnp.sin(y)), y

        return eqx.filter_grad(loss, has_aux=True)(trainable)

    @jax.jit
    def reference(factors, x):
        return jax.grad(lambda f: jnp.sum(jnp.sin(dense(f, x))), has_aux=False)(factors)

    grads, y = ours(trainable, x)
    np.testing.assert_allclose(y, jax.jit(dense)(factors, x), rtol=1e-5, atol=1e-5)
    ref = reference(factors, x)
    for layer, (ga, gb) in zip(grads.layers, ref):
        np.testing.assert_allclose(layer.weight.a, ga, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(layer.weight.b, gb, rtol=1e-4, atol=1e-5)


# --- refusals -------------------------------------------------------------------------


def test_refusals_name_the_type_and_the_way_out(weight, mlp):
    with pytest.raises(TypeError, match="W8A8Array.*floating-point.*`dequantize`"):
        quaxlike.quaxify(product)(weight, jnp.ones((2, 16), jnp.int32))
    with pytest.raises(RuntimeError, match="W8A8Array.*`.dequantize\\(\\)`"):
        quaxlike.quaxify(jnp.sin)(weight)
    with pytest.raises(ValueError, match="takes `bits=8` weights; got `bits=4`"):
        quantize(mlp, bits=4, activations=8)
    with pytest.raises(ValueError, match="not a width quaxlike has"):
        quantize(mlp, bits=8, activations=4)
    with pytest.raises(ValueError, match="rounded to nearest; got `method='gptq'`"):
        quantize(mlp, bits=8, activations=8, method="gptq", calibration=[jnp.ones((2, 16))])
