"""Calibrated post-training quantisation: `quantize(method="gptq" | "awq",
calibration=...)`, the statistics it records, and `InputScaled`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax import lax

import quaxlike
from quaxlike.lora import loraify
from quaxlike.quantized import (
    AWQ,
    CalibrationError,
    dequantize,
    GPTQ,
    InputScaled,
    Int4Array,
    Int8Array,
    NF4Array,
    quantize,
    quantize_int4,
)
from quaxlike.quantized._calibration import collect_statistics
from quaxlike.quantized._gptq import gptq_codes
from quaxlike.quantized._rounding import fake_quantize, grid_for, layer_error


IN, OUT = 64, 32


def correlated_inputs(n: int, size: int = IN, seed: int = 0):
    """Rows with correlated features of very different magnitudes, as the
    activations of a trained network have."""
    k1, k2, k3 = jr.split(jr.key(seed), 3)
    mixing = jr.normal(k1, (size, size)) / np.sqrt(size) + jnp.eye(size)
    magnitudes = jnp.exp(jr.normal(k2, (size,)))
    return (jr.normal(k3, (n, size)) @ mixing) * magnitudes


X = correlated_inputs(512)
BATCHES = [X[i : i + 128] for i in range(0, 512, 128)]
GRAM = X.T @ X


@pytest.fixture(scope="module")
def linear():
    return eqx.nn.Linear(IN, OUT, key=jr.key(1))


def weight_error(model, quantized, gram=GRAM):
    """`‖(W - Ŵ) X‖²` of the Linear `model` quantised as `quantized`."""
    return float(layer_error(model.weight, dequantize(quantized).weight, gram))


# --- the statistics ------------------------------------------------------------------


def test_statistics_of_a_linear_and_an_mlp(linear):
    positions, (stats,) = collect_statistics(linear, lambda m: m.weight, BATCHES, None, "gptq")
    assert positions == [0]
    np.testing.assert_allclose(stats.gram, GRAM, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(stats.absum, jnp.sum(jnp.abs(X), axis=0), rtol=1e-5)
    assert float(stats.rows) == 512

    mlp = eqx.nn.MLP(IN, 4, 16, depth=2, key=jr.key(2))
    getter = lambda m: [layer.weight for layer in m.layers]  # noqa: E731
    _, stats = collect_statistics(mlp, getter, BATCHES, None, "gptq")
    hidden = jax.vmap(lambda x: jax.nn.relu(mlp.layers[0](x)))(X)
    np.testing.assert_allclose(stats[1].gram, hidden.T @ hidden, rtol=1e-4, atol=1e-3)
    assert [s.gram.shape for s in stats] == [(IN, IN), (16, 16), (16, 16)]


def test_statistics_with_a_run_of_ones_own_under_jit(linear):
    # Two calls of the weight per example: both uses are summed.
    run = jax.jit(lambda m, b: jax.vmap(lambda x: m(x) + m(2 * x))(b))
    _, (stats,) = collect_statistics(linear, lambda m: m.weight, BATCHES[:1], run, "gptq")
    x = BATCHES[0]
    np.testing.assert_allclose(stats.gram, 5 * x.T @ x, rtol=1e-5, atol=1e-2)
    assert float(stats.rows) == 256
    # `x @ W.T`, as a model written for a (in, out) kernel multiplies: the same.
    transposed = lambda m, b: b @ m.weight.T + m.bias  # noqa: E731
    _, (same,) = collect_statistics(linear, lambda m: m.weight, BATCHES[:1], transposed, "gptq")
    np.testing.assert_allclose(same.gram, x.T @ x, rtol=1e-5, atol=1e-2)


def test_statistics_through_remat_and_cond(linear):
    # Only the branch taken records; `jax.checkpoint` recomputes, records once.
    def run(m, b):
        remat = jax.checkpoint(lambda b: jax.vmap(m)(b))
        doubled = lambda b: jax.vmap(m)(2 * b)  # noqa: E731
        return lax.cond(jnp.sum(b[:, 0]) > 0, remat, doubled, b)

    # `x` and `-x` take opposite branches: x xᵀ from one, (2x)(2x)ᵀ from the
    # other (both branches recording would give 10 x xᵀ).
    x = BATCHES[0]
    _, (stats,) = collect_statistics(linear, lambda m: m.weight, [x, -x], run, "gptq")
    np.testing.assert_allclose(stats.gram, 5 * x.T @ x, rtol=1e-5, atol=1e-2)
    assert float(stats.rows) == 256


class Stack(eqx.Module):
    """Layers made by `eqx.filter_vmap`, applied in a `lax.scan` over the stack."""

    layers: eqx.nn.Linear

    def __init__(self, depth, key):
        make = lambda k: eqx.nn.Linear(IN, IN, key=k)  # noqa: E731
        self.layers = eqx.filter_vmap(make)(jr.split(key, depth))

    def __call__(self, x):
        arrays, static = eqx.partition(self.layers, eqx.is_array)

        def step(x, layer):
            return jnp.tanh(eqx.combine(layer, static)(x)), None

        return lax.scan(step, x, arrays)[0]


def test_stacked_layers_each_get_their_own_statistics():
    stack = Stack(3, jr.key(3))
    _, (stats,) = collect_statistics(stack, lambda m: m.layers.weight, BATCHES[:1], None, "gptq")
    assert stats.gram.shape == (3, IN, IN) and stats.rows.shape == (3,)
    h = BATCHES[0]
    for i in range(3):
        np.testing.assert_allclose(stats.gram[i], h.T @ h, rtol=1e-4, atol=1e-2)
        layer = jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, stack.layers)
        h = jnp.tanh(jax.vmap(layer)(h))

    quantized = quantize(stack, bits=4, method="gptq", calibration=BATCHES, where="layers.weight")
    assert isinstance(quantized.layers.weight, Int4Array)
    assert quantized.layers.weight.shape == (3, IN, IN)
    out = jax.vmap(quaxlike.quaxify(quantized))(X[:8])
    np.testing.assert_allclose(out, jax.vmap(dequantize(quantized))(X[:8]), rtol=1e-4, atol=1e-5)
    rtn = quantize(stack, bits=4, where="layers.weight")
    dense = jax.vmap(stack)(X)
    gap = lambda q: float(jnp.mean((jax.vmap(dequantize(q))(X) - dense) ** 2))  # noqa: E731
    assert gap(quantized) < 0.8 * gap(rtn)


# --- GPTQ ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_gptq_beats_round_to_nearest_on_a_linear(linear, bits):
    rtn = quantize(linear, bits=bits)
    # At 2 bits (codes -1, 0, 1) a group's scale taken from the weight as updated
    # can grow past what its codes reach (1.6 times RTN's error here): act-order
    # fixes the scales beforehand.
    method = GPTQ(act_order=True) if bits == 2 else "gptq"
    gptq = quantize(linear, bits=bits, method=method, calibration=BATCHES)
    assert isinstance(gptq.weight, Int4Array) and gptq.weight.group_size == 32
    assert weight_error(linear, gptq) < 0.8 * weight_error(linear, rtn)
    # The model's output is the dequantised weight's.
    y = jax.vmap(quaxlike.quaxify(gptq))(X[:8])
    np.testing.assert_allclose(y, jax.vmap(dequantize(gptq))(X[:8]), rtol=1e-5, atol=1e-5)


def test_gptq_beats_round_to_nearest_on_an_mlp():
    mlp = eqx.nn.MLP(IN, 8, 64, depth=2, key=jr.key(4))
    getter = lambda m: [layer.weight for layer in m.layers]  # noqa: E731
    _, stats = collect_statistics(mlp, getter, BATCHES, None, "gptq")
    rtn = quantize(mlp, bits=4)
    gptq = quantize(mlp, bits=4, method="gptq", calibration=BATCHES)
    for i, s in enumerate(stats):
        errors = [
            float(layer_error(mlp.layers[i].weight, q.layers[i].weight.dequantize(), s.gram))
            for q in (rtn, gptq)
        ]
        assert errors[1] < 0.8 * errors[0], (i, errors)
    dense = jax.vmap(mlp)(X)
    gap = lambda q: float(jnp.mean((jax.vmap(quaxlike.quaxify(q))(X) - dense) ** 2))  # noqa: E731
    assert gap(gptq) < 0.8 * gap(rtn)


def test_sequential_gptq_calibrates_on_the_quantised_inputs():
    mlp = eqx.nn.MLP(IN, 8, 64, depth=2, key=jr.key(4))
    plain = quantize(mlp, bits=3, method="gptq", calibration=BATCHES)
    sequential = quantize(mlp, bits=3, method=GPTQ(sequential=True), calibration=BATCHES)
    # The first layer sees the same inputs either way; the later ones do not.
    first, later = (lambda q: q.layers[0].weight.codes()), (lambda q: q.layers[2].weight.codes())
    assert jnp.array_equal(first(plain), first(sequential))
    assert not jnp.array_equal(later(plain), later(sequential))
    # The last layer is GPTQ on the inputs that the quantised layers before it give.
    before = dequantize(sequential)
    hidden = jax.vmap(lambda x: jax.nn.relu(before.layers[1](jax.nn.relu(before.layers[0](x)))))(X)
    codes, _ = gptq_codes(grid_for(3, None), mlp.layers[2].weight, hidden.T @ hidden, GPTQ())
    assert jnp.mean(codes == later(sequential)) > 0.99
    assert jnp.mean(codes == later(plain)) < 0.95


@pytest.mark.parametrize("bits", [8, 4, 3, 2, "nf4"])
def test_gptq_with_an_identity_hessian_is_round_to_nearest(linear, bits):
    # Rows of the identity: X^T X = I, so no column's error reaches another.
    identity = [jnp.eye(IN)]
    rtn = quantize(linear, bits=bits)
    gptq = quantize(linear, bits=bits, method="gptq", calibration=identity)
    assert type(gptq.weight) is type(rtn.weight)
    assert jnp.array_equal(gptq.weight.codes(), rtn.weight.codes())
    assert jnp.array_equal(gptq.weight.scale, rtn.weight.scale)
    # Not so for correlated inputs.
    calibrated = quantize(linear, bits=bits, method="gptq", calibration=BATCHES)
    assert not jnp.array_equal(calibrated.weight.codes(), rtn.weight.codes())


def test_gptq_options_change_what_they_should(linear):
    def run(**options):
        q = quantize(linear, bits=4, method=GPTQ(**options), calibration=BATCHES)
        return q, weight_error(linear, q)

    rtn_error = weight_error(linear, quantize(linear, bits=4))
    default, default_error = run()
    # Blocks only batch the updates: the same codes for any block size.
    blocked, _ = run(block_size=16)
    same = jnp.mean(blocked.weight.codes() == default.weight.codes())
    assert same > 0.999
    # Act-order rounds the high-energy inputs first: different codes, less error
    # on inputs of very different magnitudes.
    ordered, ordered_error = run(act_order=True)
    assert not jnp.array_equal(ordered.weight.codes(), default.weight.codes())
    assert ordered_error < default_error
    # Heavy damping drowns the correlations: back towards round-to-nearest.
    damped, damped_error = run(percdamp=1e4)
    assert default_error < damped_error <= 1.001 * rtn_error
    assert jnp.mean(damped.weight.codes() == quantize(linear, bits=4).weight.codes()) > 0.99
    # Static groups: the scales are those of round-to-nearest.
    static, _ = run(static_groups=True)
    assert jnp.array_equal(static.weight.scale, quantize(linear, bits=4).weight.scale)
    assert not jnp.array_equal(default.weight.scale, static.weight.scale)


def test_gptq_on_nf4_and_int8(linear):
    for bits, kind in (("nf4", NF4Array), (8, Int8Array)):
        rtn = quantize(linear, bits=bits, group_size=32)
        gptq = quantize(linear, bits=bits, group_size=32, method="gptq", calibration=BATCHES)
        assert isinstance(gptq.weight, kind)
        assert weight_error(linear, gptq) < 0.8 * weight_error(linear, rtn)
    # Double quantisation: GPTQ rounds against the absmaxes as stored.
    rtn = quantize(linear, bits="nf4", group_size=32, double_quant=True)
    gptq = quantize(
        linear, bits="nf4", group_size=32, double_quant=True, method="gptq", calibration=BATCHES
    )
    assert gptq.weight.double_quantized
    assert jnp.array_equal(gptq.weight.absmax, rtn.weight.absmax)
    assert weight_error(linear, gptq) < 0.8 * weight_error(linear, rtn)


# --- AWQ -------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 3])
def test_awq_beats_round_to_nearest(linear, bits):
    rtn = quantize(linear, bits=bits)
    awq = quantize(linear, bits=bits, method="awq", calibration=BATCHES)
    weight = awq.weight
    assert isinstance(weight, InputScaled) and isinstance(weight.base, Int4Array)
    assert weight.scale.shape == (IN,)
    assert weight_error(linear, awq) < 0.9 * weight_error(linear, rtn)
    y = jax.vmap(quaxlike.quaxify(awq))(X[:8])
    np.testing.assert_allclose(y, jax.vmap(dequantize(awq))(X[:8]), rtol=1e-4, atol=1e-4)
    # The base is the weight with scaled inputs, rounded to nearest.
    scaled = eqx.tree_at(lambda m: m.weight, linear, linear.weight * weight.scale)
    assert jnp.array_equal(weight.base.codes(), quantize(scaled, bits=bits).weight.codes())


def test_awq_grid_of_one_is_round_to_nearest(linear):
    awq = quantize(linear, bits=4, method=AWQ(grid=1), calibration=BATCHES)
    assert jnp.array_equal(awq.weight.scale, jnp.ones(IN))
    assert jnp.array_equal(awq.weight.base.codes(), quantize(linear, bits=4).weight.codes())


def test_input_scaled_products_and_derivatives_match_the_dense_weight():
    w = jr.normal(jr.key(5), (8, IN))
    s = jnp.exp(jr.normal(jr.key(6), (IN,)))
    q = InputScaled(quantize_int4(w * s), s)
    dense = q.dequantize()
    np.testing.assert_allclose(dense, fake_quantize(grid_for(4, None), w * s) / s, rtol=1e-6)
    x = X[:5]

    def f(w, x):
        return jnp.sum(jnp.sin(jax.vmap(lambda v: w @ v)(x)) + x @ w.T)

    value = jax.jit(quaxlike.quaxify(f))(q, x)
    np.testing.assert_allclose(value, f(dense, x), rtol=1e-4)
    grad = jax.jit(jax.grad(quaxlike.quaxify(f), argnums=1))(q, x)
    np.testing.assert_allclose(grad, jax.grad(f, argnums=1)(dense, x), rtol=1e-4, atol=1e-5)
    tangent = jr.normal(jr.key(7), x.shape)
    _, jvp = jax.jvp(lambda x: quaxlike.quaxify(f)(q, x), (x,), (tangent,))
    _, dense_jvp = jax.jvp(lambda x: f(dense, x), (x,), (tangent,))
    np.testing.assert_allclose(jvp, dense_jvp, rtol=1e-4)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_lora_over_a_calibrated_base(linear, method):
    # QLoRA over GPTQ (an Int4Array) and over AWQ (an InputScaled): the LoRA
    # factors' gradients are those of the dense computation.
    base = quantize(linear, bits=4, method=method, calibration=BATCHES)
    tuned = loraify(base, rank=2, key=jr.key(8))
    tuned = eqx.tree_at(lambda m: m.weight.a, tuned, 0.1 * jnp.ones_like(tuned.weight.a))
    dense_w = dequantize(base).weight
    a, b = tuned.weight.a, tuned.weight.b
    x = X[:6]

    def loss(a, b):
        model = eqx.tree_at(lambda m: (m.weight.a, m.weight.b), tuned, (a, b))
        return jnp.sum(jax.vmap(quaxlike.quaxify(model))(x) ** 2)

    def dense_loss(a, b):
        y = x @ (dense_w + a @ b).T + linear.bias
        return jnp.sum(y**2)

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    want = jax.grad(dense_loss, argnums=(0, 1))(a, b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)


# --- selection and errors --------------------------------------------------------------


def test_where_selects_what_is_calibrated():
    mlp = eqx.nn.MLP(IN, 8, 64, depth=2, key=jr.key(4))
    q = quantize(mlp, bits=4, method="gptq", calibration=BATCHES, where="layers.1.weight")
    assert isinstance(q.layers[1].weight, Int4Array)
    assert all(isinstance(q.layers[i].weight, jax.Array) for i in (0, 2))
    assert jnp.array_equal(q.layers[0].weight, mlp.layers[0].weight)


def test_errors_name_the_problem_and_the_way_out(linear):
    with pytest.raises(CalibrationError, match="leading batch axis"):
        quantize(linear, bits=4, method="gptq", calibration=[X[0]])  # one example
    with pytest.raises(CalibrationError, match="needs calibration data"):
        quantize(linear, bits=4, method="gptq")
    with pytest.raises(CalibrationError, match="needs calibration data"):
        quantize(linear, bits=4, method="awq", calibration=[])
    with pytest.raises(CalibrationError, match="takes no calibration data"):
        quantize(linear, bits=4, calibration=BATCHES)
    with pytest.raises(ValueError, match='`method` must be "rtn"'):
        quantize(linear, bits=4, method="hqq", calibration=BATCHES)
    with pytest.raises(ValueError, match="`bits` must be 8, 4, 3 or 2"):
        quantize(linear, bits=5, method="gptq", calibration=BATCHES)
    with pytest.raises(ValueError, match="group_size=48.*divide the input dimension 64"):
        quantize(linear, bits=4, group_size=48, method="gptq", calibration=BATCHES)

    mlp = eqx.nn.MLP(IN, 8, 64, depth=2, key=jr.key(4))
    first_only = lambda m, b: jax.vmap(m.layers[0])(b)  # noqa: E731
    with pytest.raises(CalibrationError, match=r"`layers.1.weight`, `layers.2.weight` never met"):
        quantize(mlp, bits=4, method="gptq", calibration=BATCHES, run=first_only)

    # A weight used other than as a factor of a product, or along another axis.
    squared = lambda m, b: b @ (m.weight * m.weight).T  # noqa: E731
    with pytest.raises(quaxlike.MaterialisationError, match="Recording.*Leave this weight out"):
        quantize(linear, bits=4, method="gptq", calibration=BATCHES, run=squared)
    kernel = lambda m, b: b[:, :OUT] @ m.weight  # noqa: E731
    with pytest.raises(CalibrationError, match="contracts exactly that axis"):
        quantize(linear, bits=4, method="awq", calibration=BATCHES, run=kernel)
    with pytest.raises(ValueError, match="`GPTQ`: `block_size`"):
        GPTQ(block_size=0)
    with pytest.raises(ValueError, match="`AWQ`: `grid`"):
        AWQ(grid=0)


def test_lower_bits_round_to_nearest(linear):
    for bits, code_max in ((3, 3), (2, 1)):
        q = quantize(linear, bits=bits)
        codes = q.weight.codes()
        assert isinstance(q.weight, Int4Array)
        assert int(jnp.max(jnp.abs(codes))) == code_max
        grid = grid_for(bits, None)
        np.testing.assert_array_equal(q.weight.dequantize(), fake_quantize(grid, linear.weight))
