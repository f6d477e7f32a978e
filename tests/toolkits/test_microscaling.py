"""MX (mxfp8, mxfp4) and NVFP4 storage types: codes, scales and dequantised values
against torchao 0.18 and compressed-tensors 0.20.1 (golden files written by
tests/golden/make_microscaling.py), products, derivatives, rules, selection,
sharding specs, checked mode, QLoRA and DoRA over them."""

import dataclasses
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import randn, tree_allclose
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

import quaxlike
from quaxlike.checkpoints import load_safetensors
from quaxlike.lora import LoraArray, loraify, qlora, trainable_filter
from quaxlike.quantized import (
    dequantize,
    largest_dequantized,
    MicroscaledArray,
    MXArray,
    NVFP4Array,
    quantize,
    quantize_int4,
    quantize_mx,
    quantize_nf4,
    quantize_nvfp4,
    with_matmul,
)
from quaxlike.quantized._microscaling import E4M3_LEVELS
from quaxlike.quantized._microscaling_quantize import _round_e2m1


GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "microscaling")
KINDS = {
    "mxfp8": lambda w, **kw: quantize_mx(w, format="mxfp8", **kw),
    "mxfp4": lambda w, **kw: quantize_mx(w, format="mxfp4", **kw),
    "nvfp4": quantize_nvfp4,
}


def _load(name: str) -> dict[str, np.ndarray]:
    with safe_open(os.path.join(GOLDEN, name), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def torchao_ref():
    return _load("torchao.safetensors")


def _same(a, b) -> bool:
    """Equal bit for bit as float32 values, NaN where NaN."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


# --- the references -----------------------------------------------------------------


@pytest.mark.parametrize("weight", ["f32", "bf16"])
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("mode", ["floor", "rceil", "even"])
def test_mx_equals_torchao_to_mx(torchao_ref, weight, fmt, mode):
    w = jnp.asarray(torchao_ref[f"w_{weight}"])
    key = f"{fmt}.{mode}.{weight}"
    q = quantize_mx(w, format=fmt, scale_mode=mode)
    assert q.dtype == w.dtype and q.shape == w.shape
    assert np.array_equal(q.qdata, torchao_ref[f"{key}.codes"])
    assert np.array_equal(q.scale, torchao_ref[f"{key}.scale"])
    dense = q.dequantize()
    assert dense.dtype == w.dtype and _same(dense, torchao_ref[f"{key}.dequant"])


def test_the_scale_modes_differ_on_the_golden_weight(torchao_ref):
    # The special rows (block maxima just under a power of two, 7.5, 1.9 * 2**12)
    # give each mode scales of its own: the comparisons above can tell them apart.
    for fmt in ("mxfp8", "mxfp4"):
        scales = [torchao_ref[f"{fmt}.{m}.f32.scale"] for m in ("floor", "rceil", "even")]
        assert not np.array_equal(scales[0], scales[1])
        assert not np.array_equal(scales[0], scales[2])
    # The all-zero block and a NaN-free weight: no NaN exponent.
    assert torchao_ref["mxfp8.floor.f32.scale"][0, 0] == 0


@pytest.mark.parametrize("weight", ["f32", "bf16"])
@pytest.mark.parametrize("tensor", [True, False])
def test_nvfp4_equals_torchao(torchao_ref, weight, tensor):
    w = jnp.asarray(torchao_ref[f"w_{weight}"])
    key = f"nvfp4.{'tensor' if tensor else 'block'}.{weight}"
    q = quantize_nvfp4(w, tensor_scale=tensor)
    assert np.array_equal(q.qdata, torchao_ref[f"{key}.codes"])
    assert np.array_equal(q.scale, torchao_ref[f"{key}.scale"])
    if tensor:
        assert np.array_equal(q.per_tensor_scale.ravel(), torchao_ref[f"{key}.per_tensor_scale"])
    else:
        assert np.all(q.per_tensor_scale == 1)
    assert _same(q.dequantize(), torchao_ref[f"{key}.dequant"])
    assert _same(q.with_dtype(jnp.float32).dequantize(), torchao_ref[f"{key}.dequant_f32"])


def test_element_rounding_ties_to_even():
    # e2m1: the midpoints go to the even code (0, 1, 1, 2, 2, 4, 4), saturation at
    # 6, the sign bit kept on a negative zero.
    x = jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 9.0, -0.1, -0.0, -6.0])
    expected = [0, 2, 2, 4, 4, 6, 6, 7, 7, 8, 8, 15]
    assert _round_e2m1(jnp.clip(x, -6, 6)).tolist() == expected
    # e4m3's table: 448 the largest, 0x7F and 0xFF NaN.
    assert np.nanmax(E4M3_LEVELS) == 448 and np.isnan(E4M3_LEVELS[[0x7F, 0xFF]]).all()


@pytest.mark.parametrize("case", ["ct_nvfp4", "ct_mxfp4", "ct_mxfp8"])
def test_compressed_tensors_checkpoints_load(case):
    ref = _load(f"{case}.reference.safetensors")
    linear = eqx.nn.Linear(64, 48, key=jr.key(0), dtype=jnp.bfloat16)
    model = load_safetensors(
        linear, os.path.join(GOLDEN, case), {"weight": "proj.weight", "bias": "proj.bias"}
    )
    w = model.weight
    assert isinstance(w, NVFP4Array if case == "ct_nvfp4" else MXArray)
    assert case == "ct_nvfp4" or w.format == case[3:]
    assert w.dtype == jnp.bfloat16 and w.shape == (48, 64)
    # The library's `decompress`, bit for bit.
    assert _same(w.dequantize(), ref["weight"])
    x = jnp.asarray(ref["x"], jnp.bfloat16)
    y = eqx.filter_jit(lambda m, x: jax.vmap(quaxlike.quaxify(m))(x))(model, x)
    # bfloat16 products summed in another order: within a few bfloat16 ulps.
    assert tree_allclose(np.asarray(y, np.float32), ref["y"], rtol=2e-2, atol=2e-2)
    # A float32 model gets the same values in float32.
    f32 = load_safetensors(
        eqx.nn.Linear(64, 48, key=jr.key(0)),
        os.path.join(GOLDEN, case),
        {"weight": "proj.weight", "bias": "proj.bias"},
    )
    assert f32.weight.dtype == jnp.float32
    assert _same(f32.weight.dequantize().astype(jnp.bfloat16), ref["weight"])


def test_compressed_tensors_codes_against_ours():
    # compressed-tensors' mxfp4 is the EVEN rule: its codes and exponents are
    # `quantize_mx(scale_mode="even")`'s, bit for bit; FLOOR's differ.
    ref = _load("ct_mxfp4.reference.safetensors")
    w = jnp.asarray(ref["w_original"])
    ours = quantize_mx(w, format="mxfp4", scale_mode="even")
    loaded = load_safetensors(
        eqx.nn.Linear(64, 48, key=jr.key(0), dtype=jnp.bfloat16),
        os.path.join(GOLDEN, "ct_mxfp4"),
        {"weight": "proj.weight", "bias": "proj.bias"},
    ).weight
    assert np.array_equal(ours.qdata, loaded.qdata) and np.array_equal(ours.scale, loaded.scale)
    assert not np.array_equal(quantize_mx(w, format="mxfp4").scale, loaded.scale)
    # NVFP4: the same e4m3 block scales; compressed-tensors' global scale is
    # `448 * 6 / amax` rounded to bfloat16 where torchao keeps `amax / (448 * 6)`
    # in float32, so a few elements near a midpoint round the other way.
    ref = _load("ct_nvfp4.reference.safetensors")
    ours = quantize_nvfp4(jnp.asarray(ref["w_original"]))
    loaded = load_safetensors(
        eqx.nn.Linear(64, 48, key=jr.key(0), dtype=jnp.bfloat16),
        os.path.join(GOLDEN, "ct_nvfp4"),
        {"weight": "proj.weight", "bias": "proj.bias"},
    ).weight
    assert np.array_equal(ours.scale, loaded.scale)
    assert np.mean(np.asarray(ours.qdata) != np.asarray(loaded.qdata)) < 0.02


# --- products and derivatives -------------------------------------------------------


@pytest.fixture(params=sorted(KINDS), scope="module")
def kind(request):
    return request.param


def _weight(kind, shape=(96, 64), seed=0, **kw):
    q = KINDS[kind](randn(seed, shape), **kw)
    # Small blocks of rows, so that the products loop.
    return dataclasses.replace(q, block_bytes=16 * shape[-1] * 4)


def test_products_on_either_side_under_jit(kind):
    q = _weight(kind)
    dense = q.dequantize()
    x, xs = randn(1, (64, 3)), randn(2, (5, 96))

    def products(w, x, xs):
        return w @ x, xs @ w, x.T @ w.T, jnp.einsum("oi,bo->bi", w, xs)

    ours = eqx.filter_jit(quaxlike.quaxify(products))(q, x, xs)
    assert tree_allclose(ours, products(dense, x, xs), rtol=1e-5, atol=1e-5)
    jaxpr = jax.make_jaxpr(quaxlike.quaxify(products))(q, x, xs)
    assert 0 < largest_dequantized(jaxpr) <= q.size // 2
    report = quaxlike.explain(products)(q, x, xs)
    assert not report.materialised and "dot_general_p_quantized_dense" in str(report)
    assert type(q).__name__ in str(report)


def test_grad_and_jvp_with_respect_to_the_input(kind):
    q = _weight(kind)
    dense = q.dequantize()
    x, t = randn(3, (64,)), randn(4, (64,))

    def loss(w, x):
        return jnp.sum(jnp.tanh(w @ x) ** 2)

    grad = jax.jit(jax.grad(lambda x: quaxlike.quaxify(loss)(q, x)))(x)
    assert tree_allclose(grad, jax.grad(loss, argnums=1)(dense, x), rtol=1e-4, atol=1e-4)
    ours = jax.jit(lambda x, t: jax.jvp(lambda x: quaxlike.quaxify(loss)(q, x), (x,), (t,)))
    theirs = jax.jvp(lambda x: loss(dense, x), (x,), (t,))
    assert tree_allclose(ours(x, t), theirs, rtol=1e-4, atol=1e-4)


def test_custom_vjp_and_custom_jvp_around_the_product():
    # A custom_vjp holding the weight as a residual (its backward doubles the
    # input's cotangent, so the rule must run it, not differentiate the primal)
    # and relu's custom_jvp after it: against the same on the dense weight.
    q = _weight("nvfp4")
    dense = q.dequantize()

    @jax.custom_vjp
    def product(w, x):
        return x @ w.T

    def product_fwd(w, x):
        return x @ w.T, (w, x)

    def product_bwd(res, g):
        w, _ = res
        return None, 2.0 * (g @ w)

    product.defvjp(product_fwd, product_bwd)

    def loss(w, x):
        return jnp.sum(jax.nn.relu(product(w, x)) ** 2)

    x = randn(13, (4, 64))
    grad = jax.jit(jax.grad(lambda x: quaxlike.quaxify(loss)(q, x)))(x)
    assert tree_allclose(grad, jax.grad(loss, argnums=1)(dense, x), rtol=1e-4, atol=1e-3)


def test_derivatives_of_the_per_tensor_scale():
    # NVFP4's per-tensor scale is its one float leaf: grad and jvp through the
    # quantised products equal those of the dense dequantisation (plain JAX).
    torchao = _weight("nvfp4")
    x = randn(5, (4, 64))
    for divide in (False, True):
        # The same weight in compressed-tensors' convention: `block / (1 / s)`.
        s = 1 / torchao.per_tensor_scale if divide else torchao.per_tensor_scale
        q = dataclasses.replace(torchao, divide=divide, per_tensor_scale=s)

        def loss_q(s):
            w = dataclasses.replace(q, per_tensor_scale=s)
            return jnp.sum(quaxlike.quaxify(lambda w, x: jnp.sin(x @ w.T))(w, x) ** 2)

        def loss_dense(s):
            w = dataclasses.replace(q, per_tensor_scale=s).dequantize()
            return jnp.sum(jnp.sin(x @ w.T) ** 2)

        grad = jax.jit(jax.grad(loss_q))(s)
        assert tree_allclose(grad, jax.grad(loss_dense)(s), rtol=1e-4)
        t = jnp.full_like(s, 0.1) * s
        ours = jax.jit(lambda s, t: jax.jvp(loss_q, (s,), (t,)))(s, t)
        assert tree_allclose(ours, jax.jvp(loss_dense, (s,), (t,)), rtol=1e-4)


def test_filter_grad_reaches_only_float_leaves():
    mlp = eqx.nn.MLP(64, 8, 8, depth=1, key=jr.key(0))
    x = randn(6, (64,))
    for bits in ("mxfp8", "nvfp4"):
        model = quantize(mlp, bits=bits, where=lambda m: m.layers[0].weight, matmul="fused")
        loss = lambda m, x: jnp.sum(quaxlike.quaxify(m)(x) ** 2)  # noqa: E731
        grads = eqx.filter_jit(eqx.filter_grad(loss))(model, x)
        w = grads.layers[0].weight
        assert w.qdata is None and w.scale is None  # codes are not differentiable
        if bits == "nvfp4":
            assert w.per_tensor_scale.shape == (1, 1) and jnp.all(jnp.isfinite(w.per_tensor_scale))
        assert grads.layers[0].bias is not None


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("mxfp8", marks=pytest.mark.slow),
        "mxfp4",
        pytest.param("nvfp4", marks=pytest.mark.slow),
    ],
)
def test_stacked_layers_under_scan_and_row_lookups(kind):
    stack = KINDS[kind](randn(7, (3, 32, 64)), matmul="fused")
    dense = stack.dequantize()
    h = randn(8, (2, 64))[:, :32]

    def run(ws, h):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w[:, :32].T @ w[:, :32]), None), h, ws)[0]

    def run_q(ws, h):
        # Whole matrices from the stack stay quantised; columns cut would not:
        # multiply first, then cut.
        def body(h, w):
            hw = jnp.pad(h, ((0, 0), (0, 32))) @ w.T
            return jnp.tanh((hw @ w)[:, :32]), None

        return jax.lax.scan(body, h, ws)[0]

    assert tree_allclose(jax.jit(quaxlike.quaxify(run_q))(stack, h), run_q(dense, h), atol=1e-4)
    ids = jnp.array([3, 0, 31])
    rows = quaxlike.quaxify(lambda w, i: w[1][i])(stack, ids)
    assert _same(rows, dense[1][ids])
    one = quaxlike.quaxify(lambda w: w[2])(stack)
    assert isinstance(one, type(stack)) and _same(one.dequantize(), dense[2])
    del run


# --- rules that stay quantised, and refusals ---------------------------------------


def test_layout_rules(kind):
    q = _weight(kind)
    dense = q.dequantize()
    f = quaxlike.quaxify(lambda w: (-w, w.T, w.astype(jnp.bfloat16), jax.lax.stop_gradient(w)))
    neg, t, bf16, stopped = f(q)
    assert isinstance(neg, MicroscaledArray) and _same(neg.dequantize(), -dense)
    assert t.transposed and _same(t.dequantize(), dense.T)
    assert bf16.dtype == jnp.bfloat16 and _same(bf16.dequantize(), dense.astype(jnp.bfloat16))
    assert isinstance(stopped, type(q)) and _same(stopped.dequantize(), dense)


def test_scalar_factors():
    for divide in (False, True):
        q = dataclasses.replace(_weight("nvfp4"), divide=divide)
        scaled = quaxlike.quaxify(lambda w: w * 3.0 / 2.0)(q)
        assert isinstance(scaled, NVFP4Array)
        assert tree_allclose(scaled.dequantize(), q.dequantize() * 1.5, rtol=1e-6)
    mx = _weight("mxfp4")
    with pytest.raises(TypeError, match=r"MXArray: `mul` of an mxfp4 array by a scalar"):
        quaxlike.quaxify(lambda w: w * 3.0)(mx)
    allowed = dataclasses.replace(mx, allow_materialise=True)
    assert _same(quaxlike.quaxify(lambda w: w / 2.0)(allowed), mx.dequantize() / 2.0)


def test_materialise_is_refused_naming_the_type():
    q = _weight("mxfp8")
    with pytest.raises(RuntimeError, match="Refusing to materialise an MXArray"):
        quaxlike.quaxify(jnp.sin)(q)
    with pytest.raises(RuntimeError, match="Refusing to materialise an NVFP4Array"):
        quaxlike.quaxify(lambda w: w[:, :8])(_weight("nvfp4"))


def test_constructor_errors():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        quantize_mx(jnp.ones((4, 48)))
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        quantize_nvfp4(jnp.ones((4, 40)))
    with pytest.raises(ValueError, match='`format` must be "mxfp8"'):
        quantize_mx(jnp.ones((4, 64)), format="mxfp6")
    with pytest.raises(ValueError, match="`scale_mode` must be"):
        quantize_mx(jnp.ones((4, 64)), scale_mode="ceil")
    q = quantize_mx(jnp.ones((4, 64)))
    with pytest.raises(ValueError, match="MXArray: `qdata` must be `uint8`"):
        MXArray(qdata=q.qdata, scale=q.scale[:, :1])
    # (jaxtyping's annotation check, or ours without it.)
    with pytest.raises((ValueError, TypeError), match="per_tensor_scale"):
        NVFP4Array(
            qdata=jnp.zeros((4, 32), jnp.uint8),
            scale=jnp.zeros((4, 4), jnp.uint8),
            per_tensor_scale=jnp.ones((1,)),
        )
    with pytest.raises(ValueError, match="blocks of 32 inputs fixed by the format"):
        quantize(
            eqx.nn.Linear(64, 8, key=jr.key(0)),
            bits="mxfp4",
            group_size=64,
            where=lambda m: m.weight,
        )


# --- selection, sharding specs, checked mode ---------------------------------------


def test_where_selects(kind):
    mlp = eqx.nn.MLP(64, 8, 64, depth=2, key=jr.key(0))
    model = quantize(mlp, bits=kind, where="layers.1.weight", matmul="fused")
    assert not isinstance(model.layers[0].weight, MicroscaledArray)
    assert isinstance(model.layers[1].weight, NVFP4Array if kind == "nvfp4" else MXArray)
    assert kind == "nvfp4" or model.layers[1].weight.format == kind
    if kind == "mxfp4":
        x = randn(9, (64,))
        ours = eqx.filter_jit(quaxlike.quaxify(model))(x)
        dense = eqx.filter_jit(lambda m, x: dequantize(m)(x))(model, x)
        assert tree_allclose(ours, dense, atol=1e-5)


def test_leaf_specs():
    mx = _weight("mxfp4")
    specs = quaxlike.leaf_specs(mx, P("data", "model"))
    assert specs.qdata == P("data", "model") and specs.scale == P("data", "model")
    specs = quaxlike.leaf_specs(mx.swapped(), P("model", "data"))
    assert specs.qdata == P("data", "model")
    nv = KINDS["nvfp4"](randn(0, (3, 32, 64)))
    specs = quaxlike.leaf_specs(nv, P("layers", "data", "model"))
    assert specs.qdata == P("layers", "data", "model") and specs.scale == specs.qdata
    assert specs.per_tensor_scale == P("layers")
    lora = loraify(
        quantize(eqx.nn.Linear(64, 32, key=jr.key(0)), bits="nvfp4", where=lambda m: m.weight),
        rank=2,
        key=jr.key(1),
        where=lambda m: m.weight,
    )
    specs = quaxlike.leaf_specs(lora.weight, P("data", None))
    assert specs.w.per_tensor_scale == P() and specs.w.qdata == P("data")


@pytest.mark.parametrize("kind", [pytest.param("mxfp8", marks=pytest.mark.slow), "mxfp4", "nvfp4"])
def test_checked_mode_forward_and_grad(kind):
    mlp = eqx.nn.Sequential([eqx.nn.Linear(64, 32, key=jr.key(0)), eqx.nn.Lambda(jnp.tanh)])
    model = quantize(mlp, bits=kind, block_bytes=16 * 64 * 4, where=lambda m: m.layers[0].weight)
    x = randn(10, (4, 64))

    def run(m, x):
        return jnp.sum(quaxlike.quaxify(lambda m, x: jax.vmap(m)(x), check=True)(m, x) ** 2)

    assert tree_allclose(
        eqx.filter_jit(run)(model, x), jnp.sum(jax.vmap(dequantize(model))(x) ** 2), rtol=1e-5
    )
    grads = eqx.filter_jit(eqx.filter_grad(run))(model, x)
    dense = eqx.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2))(dequantize(model), x)
    assert tree_allclose(grads.layers[0].bias, dense.layers[0].bias, rtol=1e-4, atol=1e-5)
    if kind == "nvfp4":
        ours, theirs = grads.layers[0].weight.per_tensor_scale, _scale_grad(model, x)
        assert tree_allclose(ours, theirs, rtol=1e-4)


def _scale_grad(model, x):
    # The per-tensor scale's gradient through the dense dequantisation.
    def loss(s):
        w = dataclasses.replace(model.layers[0].weight, per_tensor_scale=s).dequantize()
        m = eqx.tree_at(lambda m: m.layers[0].weight, model, w)
        return jnp.sum(jax.vmap(m)(x) ** 2)

    return jax.grad(loss)(model.layers[0].weight.per_tensor_scale)


# --- QLoRA and DoRA over them -------------------------------------------------------


@eqx.filter_jit
def _dense_bases(model):
    is_q = lambda x: isinstance(x, MicroscaledArray)  # noqa: E731
    return jax.tree.map(lambda x: x.dequantize() if is_q(x) else x, model, is_leaf=is_q)


@pytest.mark.parametrize(
    "kind, dora",
    [
        ("mxfp8", False),
        ("mxfp4", False),
        ("nvfp4", False),
        ("mxfp8", True),
        pytest.param("mxfp4", True, marks=pytest.mark.slow),
        pytest.param("nvfp4", True, marks=pytest.mark.slow),
    ],
)
def test_qlora_and_dora_over_microscaled_bases(kind, dora):
    # One layer, its base dequantised whole into the product ("fused"): the
    # loop's products are the tests above.
    mlp = eqx.nn.MLP(64, 8, 32, depth=1, key=jr.key(0))
    if dora:
        model = loraify(quantize(mlp, bits=kind, matmul="fused"), rank=4, key=jr.key(1), dora=True)
    else:
        model = qlora(mlp, rank=4, key=jr.key(1), bits=kind)
        model = with_matmul(model, "fused")
        assert isinstance(model.layers[0].weight, LoraArray)
    base = model.layers[0].weight.w
    assert isinstance(base, MicroscaledArray)
    # A non-trivial adapter: B (zero at creation) made random.
    model = jax.tree.map(
        lambda x: (
            x + 0.05 * jr.normal(jr.key(2), x.shape)
            if eqx.is_inexact_array(x) and x.ndim == 2 and 4 in x.shape
            else x
        ),
        model,
    )
    dense = _dense_bases(model)
    x = randn(11, (5, 64))

    def loss(m, x):
        return jnp.sum(jnp.tanh(jax.vmap(quaxlike.quaxify(m))(x)) ** 2)

    loss = eqx.filter_jit(loss)
    assert tree_allclose(loss(model, x), loss(dense, x), rtol=1e-5)
    trainable = trainable_filter(model)
    params, frozen = eqx.partition(model, trainable)
    dparams, dfrozen = eqx.partition(dense, trainable_filter(dense))
    grads = eqx.filter_jit(jax.grad(lambda p: loss(eqx.combine(p, frozen), x)))(params)
    dgrads = eqx.filter_jit(jax.grad(lambda p: loss(eqx.combine(p, dfrozen), x)))(dparams)
    leaves, dleaves = jax.tree.leaves(grads), jax.tree.leaves(dgrads)
    assert len(leaves) == len(dleaves) == (6 if dora else 4)
    assert all(jnp.any(leaf != 0) for leaf in leaves)
    assert tree_allclose(leaves, dleaves, rtol=1e-4, atol=1e-5)


# --- storage and error --------------------------------------------------------------


def _bits_per_parameter(q) -> float:
    return sum(x.nbytes for x in jax.tree.leaves(q)) * 8 / q.size


def test_bits_per_parameter_and_error_on_normal_weights():
    w = randn(12, (256, 512))
    rms = eqx.filter_jit(lambda q: jnp.sqrt(jnp.mean((q.dequantize() - w) ** 2)))
    mxfp8, mxfp4, nvfp4 = quantize_mx(w), quantize_mx(w, format="mxfp4"), quantize_nvfp4(w)
    assert _bits_per_parameter(mxfp8) == 8.25
    assert _bits_per_parameter(mxfp4) == 4.25
    assert _bits_per_parameter(nvfp4) == 4.5 + 32 / w.size
    errors = {
        "mxfp8": rms(mxfp8),
        "mxfp4": rms(mxfp4),
        "nvfp4": rms(nvfp4),
        "int4 g32": rms(quantize_int4(w, group_size=32)),
        "nf4 g64": rms(quantize_nf4(w)),
    }
    print({k: round(float(v), 5) for k, v in errors.items()})
    # fp8 elements: far below every 4-bit format; NVFP4's finer blocks and e4m3
    # scales beat MX's power-of-two ones.
    assert errors["mxfp8"] < errors["nvfp4"] / 3
    assert errors["nvfp4"] < errors["mxfp4"]
