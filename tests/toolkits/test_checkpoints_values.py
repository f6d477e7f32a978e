"""The Values the checkpoint layouts give (`GroupedIntArray`, `Bnb4bitArray`) under
quaxlike's transforms, against plain JAX on their dequantised weights: matrix
products with a dense operand on either side, `jax.jit`, `jax.grad` and `jax.jvp`
with respect to the dense operand, row slicing (what DoRA's blockwise row norms
take), a `LoraArray` over them (QLoRA over a GPTQ base), and no gradient for the
codes."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from checkpoint_layouts import awq, bnb, compressed, gptq
from helpers import tree_allclose
from jax import lax
from safetensors.numpy import save_file

import quaxlike
from quaxlike.checkpoints import load_safetensors
from quaxlike.lora import LoraArray
from quaxlike.quantized import largest_dequantized


OUT, IN = 32, 64
KINDS = ["gptq-act-order", "gptq-8bit", "awq", "ct-asymmetric", "bnb", "bnb-nested"]


def _tensors(kind, rng):
    if kind == "gptq-act-order":
        return gptq(rng, OUT, IN, act_order=True)[0], None
    if kind == "gptq-8bit":
        return gptq(rng, OUT, IN, bits=8)[0], None
    if kind == "awq":
        return awq(rng, OUT, IN)[0], None
    if kind == "ct-asymmetric":
        tensors, _, config = compressed(rng, OUT, IN, symmetric=False)
        return tensors, config
    return bnb(rng, OUT, IN, nested=kind == "bnb-nested")[0], None


@pytest.fixture(params=KINDS)
def weight(request, tmp_path):
    """The layout `kind`'s weight, read into a float32 leaf, with blocks of four
    rows in products (so that a product takes several)."""
    tensors, config = _tensors(request.param, np.random.default_rng(KINDS.index(request.param)))
    file = os.path.join(tmp_path, "model.safetensors")
    save_file(tensors, file)
    if config:
        with open(os.path.join(tmp_path, "config.json"), "w") as f:
            json.dump({"quantization_config": config}, f)
    skeleton = {"w": jax.ShapeDtypeStruct((OUT, IN), jnp.float32)}
    return load_safetensors(skeleton, tmp_path, {"w": "proj.weight"}, block_bytes=4 * IN * 4)["w"]


def dense_of(w):
    return np.asarray(eqx.filter_jit(lambda w: w.dequantize())(w))


def test_products_on_either_side_under_jit(weight):
    dense = dense_of(weight)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((IN, 3)), jnp.float32)
    xs = jnp.asarray(rng.standard_normal((5, OUT)), jnp.float32)

    def products(w, x, xs):
        return w @ x, xs @ w, x.T @ w.T, jnp.einsum("oi,bo->bi", w, xs)

    ours = eqx.filter_jit(quaxlike.quaxify(products))(weight, x, xs)
    theirs = products(jnp.asarray(dense), x, xs)
    assert tree_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    # Dequantised a block of rows at a time, never the whole weight.
    jaxpr = jax.make_jaxpr(quaxlike.quaxify(products))(weight, x, xs)
    assert 0 < largest_dequantized(jaxpr) <= OUT * IN // 2
    report = quaxlike.explain(products)(weight, x, xs)
    assert not report.materialised and "dot_general_p_quantized_dense" in str(report)


def test_grad_and_jvp_with_respect_to_the_input(weight):
    dense = jnp.asarray(dense_of(weight))
    x = jnp.asarray(np.random.default_rng(1).standard_normal(IN), jnp.float32)
    t = jnp.ones(IN, jnp.float32)

    def loss(w, x):
        return jnp.sum(jnp.tanh(w @ x) ** 2)

    # The products sum the inputs in another order (a block and a phase at a
    # time): float32 rounding, amplified where the tangent's terms cancel.
    grad = jax.jit(jax.grad(lambda x: quaxlike.quaxify(loss)(weight, x)))(x)
    assert tree_allclose(grad, jax.grad(loss, argnums=1)(dense, x), rtol=1e-4, atol=1e-4)
    ours = jax.jit(lambda x, t: jax.jvp(lambda x: quaxlike.quaxify(loss)(weight, x), (x,), (t,)))
    theirs = jax.jvp(lambda x: loss(dense, x), (x,), (t,))
    assert tree_allclose(ours(x, t), theirs, rtol=1e-4, atol=1e-4)


def test_row_slicing(weight):
    dense = dense_of(weight)
    ids = jnp.array([3, 0, 31, 7])

    def rows(w, i):
        return (
            lax.dynamic_slice(w, (i, 0), (4, IN)),
            lax.slice(w, (8, 0), (12, IN)),
            w[ids],
            w[5:9],
        )

    ours = jax.jit(quaxlike.quaxify(rows))(weight, 10)
    theirs = rows(jnp.asarray(dense), 10)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)
    # The quantised array's own row blocks: still quantised, the same rows.
    block = weight.stored_rows(4, 8)
    assert type(block) is type(weight)
    np.testing.assert_array_equal(dense_of(block), dense[4:12])


def test_lora_over_a_loaded_base(weight):
    dense = jnp.asarray(dense_of(weight))
    a = 0.1 * jr.normal(jr.key(0), (OUT, 4))
    b = 0.1 * jr.normal(jr.key(1), (4, IN))
    lora = LoraArray.from_factors(weight, a, b)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((IN, 2)), jnp.float32)

    def loss(ab, x, w):
        return jnp.sum(jnp.sin(quaxlike.quaxify(lambda m, x: m @ x)(w(ab), x)))

    ours = jax.jit(jax.value_and_grad(lambda ab, x: loss(ab, x, lambda ab: lora_with(lora, ab))))
    theirs = jax.value_and_grad(lambda ab, x: jnp.sum(jnp.sin((dense + ab[0] @ ab[1]) @ x)))
    # 8-bit codes make weights of ~10: float32 sums in another order.
    assert tree_allclose(ours((a, b), x), theirs((a, b), x), rtol=1e-4, atol=1e-4)


def lora_with(lora, ab):
    return eqx.tree_at(lambda m: (m.a, m.b), lora, ab)


def test_no_gradient_for_the_codes(weight):
    x = jnp.asarray(np.random.default_rng(3).standard_normal(IN), jnp.float32)

    def loss(w, x):
        return jnp.sum(quaxlike.quaxify(lambda w, x: w @ x)(w, x) ** 2)

    grads = eqx.filter_jit(eqx.filter_grad(loss))(weight, x)
    assert grads.packed is None  # integer codes: no gradient
    with pytest.raises(TypeError, match="int32|uint8"):
        jax.grad(loss)(weight, x)


def test_dtype_conversion_and_negation(weight):
    dense = dense_of(weight)
    half = quaxlike.quaxify(lambda w: w.astype(jnp.bfloat16))(weight)
    assert type(half) is type(weight) and half.dtype == jnp.bfloat16
    np.testing.assert_array_equal(dense_of(half), dense.astype(jnp.bfloat16))
    negated = quaxlike.quaxify(lambda w: -w)(weight)
    np.testing.assert_array_equal(dense_of(negated), -dense)
    transposed = quaxlike.quaxify(lambda w: w.T)(weight)
    np.testing.assert_array_equal(dense_of(transposed), dense.T)


def test_dora_over_a_loaded_base(weight):
    # DoRA's row norms over a loaded 4-bit base: blockwise through its row
    # slices and product rule, equal to the dense formula with the norm detached.
    from quaxlike.lora import DoraArray

    dense = jnp.asarray(dense_of(weight))
    a = 0.1 * jr.normal(jr.key(3), (OUT, 4))
    b = 0.1 * jr.normal(jr.key(4), (4, IN))
    m = 1.0 + 0.1 * jr.normal(jr.key(5), (OUT,))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((IN, 2)), jnp.float32)

    def ours(params, x):
        dora = DoraArray.from_factors(weight, *params)
        return jnp.sum(jnp.sin(quaxlike.quaxify(lambda d, x: d @ x)(dora, x)))

    def theirs(params, x):
        a, b, m = params
        v = dense + a @ b
        norm = lax.stop_gradient(jnp.linalg.norm(v, axis=1))
        return jnp.sum(jnp.sin((m / norm)[:, None] * (v @ x)))

    got = jax.jit(jax.value_and_grad(ours))((a, b, m), x)
    assert tree_allclose(got, jax.value_and_grad(theirs)((a, b, m), x), rtol=1e-4, atol=1e-4)


def test_a_scalar_factor(tmp_path):
    # Folded into the scales where the product is in the scales' dtype; else (a
    # later cast, or bitsandbytes' float32 product) refused rather than rounded
    # differently from the dense weight.
    tensors, dense = gptq(np.random.default_rng(5), OUT, IN)
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    half = load_safetensors(
        {"w": jax.ShapeDtypeStruct((OUT, IN), jnp.float16)}, tmp_path, {"w": "proj.weight"}
    )["w"]
    doubled = quaxlike.quaxify(lambda w: w * jnp.float16(2))(half)
    assert type(doubled) is type(half)
    np.testing.assert_array_equal(dense_of(doubled), (dense * 2).astype(np.float16))
    wide = load_safetensors(
        {"w": jax.ShapeDtypeStruct((OUT, IN), jnp.float32)}, tmp_path, {"w": "proj.weight"}
    )["w"]
    with pytest.raises(RuntimeError, match="Refusing to materialise an GroupedIntArray"):
        quaxlike.quaxify(lambda w: w * 2.0)(wide)
