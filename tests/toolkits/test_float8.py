"""Float8 training (`float8_training`, `Float8Weight`): equal to torchao's CPU
emulation (tests/golden/float8, made by tests/golden/make_float8.py with
torchao 0.18.0's `Float8LinearConfig(emulate=True)`), to a plain-JAX emulation
with explicit casts written here, float8 dots in the lowered program, and the
compositions (LoRA, `where=`, sharding specs, explain, checked mode, jit, optax)."""

import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import quaxlike
from quaxlike.lora import LoraArray, loraify
from quaxlike.quantized import float8_training, Float8Weight, unwrap_float8
from quaxlike.selection import module


GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "float8")
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
CASES = [(r, d) for r in ("tensorwise", "rowwise") for d in ("float32", "bfloat16")]


def _golden(name):
    return dict(np.load(os.path.join(GOLDEN, f"{name}.npz")))


# --- a plain-JAX emulation, written from torchao's code with explicit casts ----------


def _q(t, dtype, axis, power_of_2):
    """torchao's cast and its emulated dequantisation: `x8.float() / scale`."""
    amax = jnp.max(jnp.abs(t), axis=axis, keepdims=axis is not None).astype(jnp.float32)
    fmax = float(jnp.finfo(dtype).max)
    scale = fmax / jnp.maximum(amax, jnp.float32(1e-12))
    if power_of_2:  # 2 ** floor(log2(scale)); XLA's log2 is off at some powers of 2
        _, exponent = jnp.frexp(scale)
        scale = jnp.ldexp(jnp.float32(1), exponent - 1)
    t8 = jnp.clip(t.astype(jnp.float32) * scale, -fmax, fmax).astype(dtype)
    return t8.astype(jnp.float32) / scale


def _emulated_linear(recipe, x, w, g):
    """`matmul_with_hp_or_float8_args` with `emulate=True`, for `x @ w.T`: the
    output and the gradients of `x` and `w` for the cotangent `g`."""
    rowwise = recipe == "rowwise"
    gdt = E4M3 if rowwise else E5M2
    ax = lambda a: a if rowwise else None  # noqa: E731
    x2, g2, wt = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]), w.T
    out = _q(x2, E4M3, ax(-1), rowwise) @ _q(wt, E4M3, ax(0), rowwise)
    grad_x = _q(g2, gdt, ax(-1), rowwise) @ _q(wt, E4M3, ax(-1), rowwise).T
    grad_w = _q(g2, gdt, ax(0), rowwise).T @ _q(x2, E4M3, ax(0), rowwise)
    dt = x.dtype
    return (
        out.astype(dt).reshape(*x.shape[:-1], -1),
        grad_x.astype(dt).reshape(x.shape),
        grad_w.astype(dt),
    )


def _vjp_linear(f8, x, g, bias=None):
    def f(f8, x):
        y = x @ f8.T
        return y if bias is None else y + bias

    out, vjp = jax.vjp(quaxlike.quaxify(f), f8, x)
    grad_f8, grad_x = vjp(g)
    return out, grad_x, grad_f8


def _close(got, want, *, bf16_ulps=0, rtol=2e-6):
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    scale = np.abs(want).max()
    if bf16_ulps:  # 2 ** -8 relative per bfloat16 ulp
        np.testing.assert_allclose(got, want, rtol=bf16_ulps * 2**-8, atol=1e-6 * scale)
    else:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


# --- against torchao's files ------------------------------------------------------


@pytest.mark.parametrize("recipe,dtype", CASES)
def test_equals_torchao_emulation(recipe, dtype):
    d = _golden(f"{recipe}_{dtype}")
    dt = jnp.dtype(dtype)
    w, b, x, g = (jnp.asarray(d[k]).astype(dt) for k in ("weight", "bias", "x", "g"))
    f8 = Float8Weight(w, scaling=recipe)
    out, grad_x, grad_f8 = jax.jit(lambda f8, x, g: _vjp_linear(f8, x, g, b))(f8, x, g)
    assert out.dtype == grad_x.dtype == grad_f8.weight.dtype == dt
    assert isinstance(grad_f8, Float8Weight)
    exact = recipe == "rowwise" or dtype == "bfloat16"
    # Power-of-2 scales (rowwise) divide out exactly, and a bfloat16 result hides
    # the summation order: bit for bit. Tensorwise float32 differs from torchao's
    # emulation, which divides every element by its scale before the sum, by
    # float32 rounding only.
    for got, key in ((out, "out"), (grad_x, "grad_x"), (grad_f8.weight, "grad_weight")):
        if exact:
            np.testing.assert_array_equal(np.asarray(got, np.float32), d[key])
        else:
            _close(got, d[key], rtol=1e-6)


@pytest.mark.parametrize("recipe,dtype", CASES)
def test_casts_bit_for_bit(recipe, dtype):
    from quaxlike.quantized._float8_scaling import cast, RECIPES

    d = _golden(f"{recipe}_{dtype}")
    dt = jnp.dtype(dtype)
    x, w = jnp.asarray(d["x"]).astype(dt), jnp.asarray(d["weight"]).astype(dt)
    r = RECIPES[recipe]
    for t, axes, key in ((x, (2,), "x"), (w.T, (0,), "weight_t")):
        t8, scale = cast(t, np.dtype(E4M3), axes if r.rowwise else None, r.power_of_2)
        bits = np.asarray(lax.bitcast_convert_type(t8, jnp.uint8))
        np.testing.assert_array_equal(bits, d[f"cast_{key}_bits"])
        np.testing.assert_array_equal(
            np.asarray(scale).reshape(d[f"cast_{key}_scale"].shape), d[f"cast_{key}_scale"]
        )


def test_lora_over_float8_equals_peft_over_torchao():
    d = _golden("lora_tensorwise_float32")
    linear = eqx.nn.Linear(32, 32, key=jr.key(0))
    linear = eqx.tree_at(lambda m: (m.weight, m.bias), linear, (d["weight"], d["bias"]))
    linear = jax.tree_util.tree_map(jnp.asarray, linear)
    scaling = float(d["scaling"])
    # PEFT: W x + s B (A x); LoraArray: W + a @ b with a = s B, b = A.
    a, b = jnp.asarray(d["lora_B"]) * scaling, jnp.asarray(d["lora_A"])
    both = [
        loraify(float8_training(linear), rank=4, key=jr.key(1)),
        float8_training(loraify(linear, rank=4, key=jr.key(1))),
    ]
    assert eqx.tree_equal(
        jax.tree_util.tree_structure(both[0]), jax.tree_util.tree_structure(both[1])
    )
    for first, model in zip((True, False), both):
        model = eqx.tree_at(lambda m: (m.weight.a, m.weight.b), model, (a, b))
        assert isinstance(model.weight, LoraArray) and isinstance(model.weight.w, Float8Weight)
        x, g = jnp.asarray(d["x"]), jnp.asarray(d["g"])
        run = lambda m, x: jax.vmap(jax.vmap(quaxlike.quaxify(m)))(x)  # noqa: E731
        # quaxify outside the vmaps: the product sees the whole batch.
        run_batch = quaxlike.quaxify(lambda m, x: jax.vmap(jax.vmap(m))(x))
        vjp = lambda m, x, g: (lambda o, f: (o, *f(g)))(*jax.vjp(run_batch, m, x))  # noqa: E731
        out, grad_model, grad_x = eqx.filter_jit(vjp)(model, x, g)
        _close(out, d["out"], rtol=1e-5)
        _close(grad_x, d["grad_x"], rtol=1e-5)
        _close(grad_model.weight.a, d["grad_lora_B"] / scaling, rtol=1e-5)
        _close(grad_model.weight.b * 1.0, d["grad_lora_A"], rtol=1e-5)
        # The base is frozen under LoRA: no gradient reaches it.
        assert not np.any(np.asarray(grad_model.weight.w.weight))
        if not first:
            continue
        # Mapped per example (jax.vmap outside quaxify), the input scales are
        # per token: close to torchao's tensor scale, not equal.
        per_token = jax.jit(run)(model, x)
        assert not np.array_equal(np.asarray(per_token), d["out"])
        _close(per_token, d["out"], rtol=0.05)


# --- against a plain-JAX emulation ----------------------------------------------------


@pytest.mark.parametrize("recipe,dtype", [("tensorwise", "float32"), ("rowwise", "bfloat16")])
def test_grad_equals_plain_emulation(recipe, dtype):
    dt = jnp.dtype(dtype)
    kw, kx, kg = jr.split(jr.key(3), 3)
    w = (jr.normal(kw, (24, 40)) * jnp.logspace(-2, 1, 40)).astype(dt)
    x = (jr.normal(kx, (2, 9, 40)) * jnp.logspace(-1, 2, 9)[:, None]).astype(dt)
    g = jr.normal(kg, (2, 9, 24)).astype(dt)
    out, grad_x, grad_f8 = jax.jit(_vjp_linear)(Float8Weight(w, scaling=recipe), x, g)
    want = jax.jit(_emulated_linear, static_argnums=0)(recipe, x, w, g)
    ulps = 1 if dtype == "bfloat16" else 0
    for got, ref in zip((out, grad_x, grad_f8.weight), want):
        _close(got, ref, bf16_ulps=ulps, rtol=1e-6)
    # And it is a float8 computation: not the dense one.
    dense = jnp.einsum("bti,oi->bto", x.astype(jnp.float32), w.astype(jnp.float32))
    assert not np.allclose(np.asarray(out, np.float32), np.asarray(dense), rtol=1e-3)
    _close(out, dense, rtol=0.1)


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.slow)])
def test_other_layouts(recipe):
    """`w @ x` with `x` (in, tokens), and `w.T` on the left: the same as the
    Linear's `x @ w.T`, transposed (the scales follow the contracted axes)."""
    kw, kx, kg = jr.split(jr.key(4), 3)
    w = jr.normal(kw, (16, 32))
    x = jr.normal(kx, (6, 32)) * jnp.logspace(-1, 1, 6)[:, None]
    g = jr.normal(kg, (6, 16))
    f8 = Float8Weight(w, scaling=recipe)
    out, grad_x, grad_f8 = jax.jit(_vjp_linear)(f8, x, g)

    @jax.jit
    def vjps(f8, x, g):
        outs = []
        for f in (lambda f8, x: (f8 @ x.T).T, lambda f8, x: jnp.einsum("ki,ok->io", x.T, f8)):
            got, vjp = jax.vjp(quaxlike.quaxify(f), f8, x)
            outs.append((got, *vjp(g)))
        return outs

    for got, g_f8, g_x in vjps(f8, x, g):
        _close(got, out, rtol=1e-6)
        _close(g_x, grad_x, rtol=1e-6)
        _close(g_f8.weight, grad_f8.weight, rtol=1e-6)


def test_stacked_weights_scale_per_layer():
    """A dot_general with the weight's stacking axis as a batch axis scales each
    layer on its own, as `jax.vmap` over the layers does."""
    kw, kx = jr.split(jr.key(5))
    w = jr.normal(kw, (3, 8, 16)) * jnp.array([0.01, 1.0, 100.0])[:, None, None]
    x = jr.normal(kx, (3, 5, 16))
    batched = quaxlike.quaxify(lambda f8, x: jnp.einsum("lok,lmk->lmo", f8, x))
    per_layer = jax.vmap(quaxlike.quaxify(lambda f8, x: x @ f8.T))

    @jax.jit
    def both(f8, x):
        return [
            jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), (0, 1))(f8, x)
            for f in (batched, per_layer)
        ]

    for recipe in ("tensorwise",):  # rowwise: test_other_layouts's labels, the same code
        (v, (g_f8, g_x)), (v2, (g_f82, g_x2)) = both(Float8Weight(w, scaling=recipe), x)
        _close(v, v2, rtol=1e-6)
        _close(g_f8.weight, g_f82.weight, rtol=1e-5)
        _close(g_x, g_x2, rtol=1e-5)


# --- the lowered program --------------------------------------------------------------


def _dot_types(text):
    return re.findall(r"stablehlo\.dot_general.*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_lowered_dots_are_float8(recipe):
    model = float8_training(eqx.nn.Linear(32, 16, key=jr.key(0)), scaling=recipe)
    x = jnp.ones((4, 32))
    loss = lambda m, x: jnp.sum(quaxlike.quaxify(lambda m, x: jax.vmap(m)(x))(m, x) ** 2)  # noqa: E731
    fwd = eqx.filter_jit(loss).lower(model, x).as_text()  # pyright: ignore
    assert [("f8E4M3FN" in a, "f8E4M3FN" in b) for a, b in _dot_types(fwd)] == [(True, True)]
    both = eqx.filter_value_and_grad(lambda mx: loss(*mx))  # grads of the weight and input
    step = eqx.filter_jit(both).lower((model, x)).as_text()  # pyright: ignore
    dots = _dot_types(step)
    assert len(dots) == 3
    grad_type = "f8E5M2" if recipe == "tensorwise" else "f8E4M3FN"
    for a, b in dots:
        assert "f8E" in a and "f8E" in b, (a, b)
    assert sum(grad_type in a + b for a, b in dots) >= 2
    assert all(
        re.search(r"-> tensor<[^>]*xf32>", line)
        for line in step.splitlines()
        if "stablehlo.dot_general" in line
    )


# --- model functions, compositions -----------------------------------------------------


def _mlp():
    return eqx.nn.MLP(32, 16, 64, depth=2, key=jr.key(0))


def test_float8_training_where_and_unwrap():
    mlp = _mlp()
    f8 = float8_training(mlp)
    assert all(isinstance(layer.weight, Float8Weight) for layer in f8.layers)
    assert eqx.tree_equal(unwrap_float8(f8), mlp)
    last = float8_training(mlp, scaling="rowwise", where=module(eqx.nn.Linear, out_features=16))
    kinds = [type(layer.weight).__name__ for layer in last.layers]
    assert kinds == ["ArrayImpl", "ArrayImpl", "Float8Weight"]
    assert last.layers[2].weight.scaling == "rowwise"
    assert float8_training(mlp, where="layers.0.weight").layers[0].weight.scaling == "tensorwise"
    # Again on a float8 model: the scaling changes.
    assert float8_training(f8, scaling="rowwise").layers[1].weight.scaling == "rowwise"


def test_errors_teach():
    mlp = _mlp()
    with pytest.raises(ValueError, match="`scaling` must be one of.*'tensorwise', 'rowwise'"):
        float8_training(mlp, scaling="blockwise")
    with pytest.raises(ValueError, match=r"floating-point array.*selected an array.*\(64,\)"):
        float8_training(mlp, where=lambda m: m.layers[0].bias)
    with pytest.raises(ValueError, match="found no `eqx.nn.Linear`"):
        float8_training({"w": jnp.ones((3, 3))})
    with pytest.raises(ValueError, match="selected no weight"):
        float8_training(mlp, where="nothing.*")
    with pytest.raises(TypeError, match="Float8Weight.*dtype int32.*no float8"):
        quaxlike.quaxify(lambda w, x: w @ x)(Float8Weight(jnp.ones((3, 4))), jnp.ones(4, jnp.int32))


def test_jvp_refused_naming_the_type():
    f8 = Float8Weight(jr.normal(jr.key(0), (8, 16)))
    f = quaxlike.quaxify(lambda w, x: w @ x)
    x = jnp.ones(16)
    with pytest.raises(TypeError, match=r"Float8Weight.*forward mode.*unwrap_float8"):
        jax.jvp(lambda x: f(f8, x), (x,), (x,))
    # A product traced by `jit` before the jvp reaches it: JAX's own refusal of a
    # custom_vjp, raised where JAX differentiates the traced program.
    with pytest.raises(TypeError, match=r"forward-mode autodiff \(jvp\) to a custom_vjp"):
        jax.jvp(lambda x: jax.jit(f)(f8, x), (x,), (x,))
    # The way out: the high-precision weight.
    jax.jvp(lambda x: unwrap_float8(f8) @ x, (x,), (x,))


def test_transpose_astype_and_materialise():
    w = jr.normal(jr.key(0), (8, 16))
    f8 = Float8Weight(w)
    assert f8.shape == (8, 16) and f8.swapped().shape == (16, 8)
    jq = lambda f: jax.jit(quaxlike.quaxify(f))  # noqa: E731
    t = jq(lambda w: w.T)(f8)
    assert isinstance(t, Float8Weight) and t.transposed and t.shape == (16, 8)
    assert eqx.tree_equal(jq(lambda w: w.T.T)(f8), f8)
    h = jq(lambda w: w.astype(jnp.bfloat16))(f8)
    assert isinstance(h, Float8Weight) and h.dtype == jnp.bfloat16
    # Anything else sees the master weight.
    total = jq(lambda w: jnp.sum(w * 2))(f8)
    np.testing.assert_allclose(total, jnp.sum(w * 2), rtol=1e-6)
    # Two float8 weights: the right one takes the input's role.
    v = jr.normal(jr.key(1), (4, 16))
    both = jq(lambda a, b: a @ b.T)(f8, Float8Weight(v))
    np.testing.assert_array_equal(both, jq(lambda a, b: a @ b.T)(f8, v))
    # bfloat16 operands with a float32 result: the product's dtype, and
    # cotangents in the operands' dtypes.
    h16, v16 = Float8Weight(w.astype(jnp.bfloat16)), v.astype(jnp.bfloat16)

    def f32_product(h, v):
        return jnp.matmul(v, h.T, preferred_element_type=jnp.float32)

    loss = lambda h, v: jnp.sum(quaxlike.quaxify(f32_product)(h, v))  # noqa: E731
    product = jq(f32_product)(h16, v16)
    g_h, g_v = jax.jit(jax.grad(loss, (0, 1)))(h16, v16)
    assert product.dtype == jnp.float32
    assert g_h.weight.dtype == g_v.dtype == jnp.bfloat16
    _close(product, v16.astype(jnp.float32) @ w.T, rtol=0.1)


def test_leaf_specs():
    f8 = Float8Weight(jnp.ones((2, 8, 16)))
    specs = quaxlike.leaf_specs(f8, P(None, "model", "data"))
    assert specs.weight == P(None, "model", "data")
    specs = quaxlike.leaf_specs(f8.swapped(), P(None, "model", "data"))
    assert specs.weight == P(None, "data", "model")
    lora = loraify(float8_training(eqx.nn.Linear(16, 8, key=jr.key(0))), rank=2, key=jr.key(1))
    specs = quaxlike.leaf_specs(lora.weight, P("model", None))
    assert specs.w.weight == P("model") and specs.a == P("model") and specs.b == P()


def test_explain_and_checked_mode():
    model = float8_training(_mlp())
    x = jnp.ones((4, 32))
    report = quaxlike.explain(lambda m, x: jax.vmap(m)(x))(model, x)
    assert not report.materialised
    handlers = [r.handler for r in report.walk() if r.primitive == "dot_general"]
    assert len(handlers) == 3 and all("float8" in h for h in handlers), handlers
    text = str(report)
    assert "dot_general_p_any_float8" in text or "dot_general_p_float8_any" in text
    run = lambda m, x: jnp.sum(quaxlike.quaxify(lambda m, x: jax.vmap(m)(x), check=True)(m, x))  # noqa: E731
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(run))(model, x)
    plain = lambda m, x: jnp.sum(quaxlike.quaxify(lambda m, x: jax.vmap(m)(x))(m, x))  # noqa: E731
    value2, grads2 = eqx.filter_jit(eqx.filter_value_and_grad(plain))(model, x)
    assert value == value2 and eqx.tree_equal(grads, grads2)


def test_optax_step_under_filter_jit():
    """One adam step on float8 weights: the update is adam's on the float8
    gradient, and the master weights stay float32."""
    model = float8_training(_mlp(), scaling="rowwise")
    x = jr.normal(jr.key(1), (8, 32))
    y = jr.normal(jr.key(2), (8, 16))
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    def loss(m, x, y):
        return jnp.mean((quaxlike.quaxify(lambda m, x: jax.vmap(m)(x))(m, x) - y) ** 2)

    @eqx.filter_jit
    def step(m, state, x, y):
        value, grads = eqx.filter_value_and_grad(loss)(m, x, y)
        updates, state = opt.update(grads, state, eqx.filter(m, eqx.is_inexact_array))
        return eqx.apply_updates(m, updates), state, value

    losses = []
    for _ in range(20):
        model, state, value = step(model, state, x, y)
        losses.append(float(value))
    assert isinstance(model.layers[0].weight, Float8Weight)
    assert model.layers[0].weight.weight.dtype == jnp.float32
    assert losses[-1] < 0.5 * losses[0], losses


def test_float8_dot_probe_and_fallback(monkeypatch):
    from quaxlike.quantized import _float8_scaling

    assert _float8_scaling.float8_dot_compiles()  # XLA:CPU compiles it
    w = jr.normal(jr.key(0), (8, 16))
    x = jr.normal(jr.key(1), (3, 16))
    f = quaxlike.quaxify(lambda w, x: x @ w.T)
    want = jax.jit(f)(Float8Weight(w), x)
    monkeypatch.setitem(_float8_scaling._FLOAT8_DOT, jax.default_backend(), False)
    fallback = jax.jit(lambda w, x: f(w, x))  # a new function: traced again
    text = fallback.lower(Float8Weight(w), x).as_text()
    assert _dot_types(text) and not any("f8E" in a + b for a, b in _dot_types(text))
    np.testing.assert_array_equal(fallback(Float8Weight(w), x), want)


def test_scan_over_stacked_layers():
    """A stack of float8 layers (`eqx.filter_vmap`) run by `lax.scan`: each step
    gets one layer's `Float8Weight`, the same as the layers run one by one."""
    linear = eqx.nn.Linear(16, 16, use_bias=False, key=jr.key(0))
    weights = jr.normal(jr.key(2), (3, 16, 16)) * 0.3  # a stack, as eqx.filter_vmap makes it
    stack = float8_training(eqx.tree_at(lambda m: m.weight, linear, weights), scaling="rowwise")
    assert stack.weight.shape == (3, 16, 16)
    params, static = eqx.partition(stack, eqx.is_array)

    def scanned(params, x):
        def body(x, p):
            return jnp.tanh(eqx.combine(p, static)(x)), None

        return jnp.sum(lax.scan(body, x, params)[0])

    def looped(params, x):
        for i in range(3):
            layer = eqx.combine(jax.tree_util.tree_map(lambda a: a[i], params), static)
            x = jnp.tanh(layer(x))
        return jnp.sum(x)

    x = jr.normal(jr.key(1), (16,))
    # `w[i]` on the stack stays a Float8Weight: nothing falls back to the master weight.
    assert not quaxlike.explain(looped)(params, x).materialised
    run = lambda f: eqx.filter_jit(jax.value_and_grad(quaxlike.quaxify(f)))(params, x)  # noqa: E731
    (v1, g1), (v2, g2) = run(scanned), run(looped)
    _close(v1, v2, rtol=1e-6)
    assert isinstance(g1.weight, Float8Weight)
    _close(g1.weight.weight, g2.weight.weight, rtol=1e-6)
    dense = jax.value_and_grad(looped)(unwrap_float8(params), x)
    assert not np.allclose(g1.weight.weight, dense[1].weight, rtol=1e-4)  # float8, not dense


def test_grad_inside_quaxify_is_straight_through():
    """`quaxify(jax.grad(f))`: JAX differentiates `dot_general` before the rule
    sees it, so torchao's backward is not used (that needs `jax.grad` outside
    `quaxify`). What it gives, as documented: the forward in float8, the input's
    gradient as JAX's transposed product, a float8 product of the cotangent and
    the weight with the forward's e4m3 casts, and the weight's gradient in
    float32 from the float8 output's cotangent (straight through the casts)."""
    w = jr.normal(jr.key(0), (16, 32))
    x = jr.normal(jr.key(1), (5, 32))
    loss = lambda w, x: jnp.sum(jnp.sin(x @ w.T))  # noqa: E731
    inner = jax.jit(quaxlike.quaxify(jax.grad(loss, (0, 1))))(Float8Weight(w), x)
    outer = jax.jit(jax.grad(quaxlike.quaxify(loss), (0, 1)))(Float8Weight(w), x)

    def emulated(w, x):
        out = _q(x, E4M3, None, False) @ _q(w, E4M3, None, False).T
        ct = jnp.cos(out)
        return ct.T @ x, _q(ct, E4M3, None, False) @ _q(w, E4M3, None, False)

    want_w, want_x = jax.jit(emulated)(w, x)
    _close(inner[0], want_w, rtol=1e-5)
    _close(inner[1], want_x, rtol=1e-5)
    # Not torchao's backward (the outer gradient: the cotangent in e5m2, the
    # weight's gradient a float8 product too).
    assert not np.allclose(inner[0], outer[0].weight, rtol=1e-3)
    assert not np.allclose(inner[1], outer[1], rtol=1e-3)


def test_dora_over_float8():
    """DoRA over a float8 base: the base product is a float8 product (DoRA's rule
    multiplies the base with the input and, for its detached norm, with `B`),
    close to DoRA over the dense weight, and nothing materialises."""
    linear = eqx.nn.Linear(32, 16, key=jr.key(0))
    dora = loraify(float8_training(linear), rank=4, key=jr.key(1), dora=True)
    dense = loraify(linear, rank=4, key=jr.key(1), dora=True)
    x = jr.normal(jr.key(2), (5, 32))
    apply = lambda m, x: jax.vmap(m)(x)  # noqa: E731
    report = quaxlike.explain(apply)(dora, x)
    assert not report.materialised
    assert any("float8" in r.handler for r in report.walk())
    loss = lambda m, x: jnp.sum(quaxlike.quaxify(apply)(m, x) ** 2)  # noqa: E731
    (v, g), (vd, gd) = (
        eqx.filter_jit(eqx.filter_value_and_grad(loss))(m, x) for m in (dora, dense)
    )
    assert not np.isclose(v, vd, rtol=1e-4)
    _close(v, vd, rtol=0.05)
    _close(g.weight.b, gd.weight.b, rtol=0.1)


def test_jvp_inside_quaxify_is_the_float8_product_of_the_tangent():
    """`quaxify(jax.jvp(...))`: JAX's bilinear rule for `dot_general` forms the
    tangent as the product of the tangent with the weight before the rule sees
    it, and a product with a `Float8Weight` is evaluated in float8, the tangent's
    as any other's (as `precision=` lowers a `dot_general`'s tangent product with
    it). So the tangent is exactly the float8 product of `dx`, and the dense
    tangent `dx @ W.T` to float8 precision. (Outside `quaxify` forward mode is
    refused: `test_jvp_refused_naming_the_type`.)"""
    w = jr.normal(jr.key(0), (16, 32))
    x, dx = jr.normal(jr.key(1), (5, 32)), jr.normal(jr.key(2), (5, 32))
    inner = lambda w, x, dx: jax.jvp(lambda x: x @ w.T, (x,), (dx,))[1]  # noqa: E731
    t = jax.jit(quaxlike.quaxify(inner))(Float8Weight(w), x, dx)
    want = _q(dx, E4M3, None, False) @ _q(w, E4M3, None, False).T
    _close(t, want, rtol=1e-5)
    dense = dx @ w.T
    assert not np.allclose(t, dense, rtol=1e-4)  # evaluated in float8 indeed
    _close(t, dense, rtol=0.1)
