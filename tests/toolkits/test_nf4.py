"""`NF4Array`: the NormalFloat levels, quantisation to the nearest level, double
quantisation of the absmaxes, bits per parameter measured from the arrays, the
error against `Int4Array`, and gradients of a quantised model against plain JAX
on the dequantised weights.

The products, indexing and transforms of `NF4Array` are tested with the other
quantised arrays in test_quantized.py (kinds "nf4" and "nf4-dq"), and under LoRA
in test_qlora.py."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import randn, tree_allclose

import quaxlike
from quaxlike.lora import LoraArray, qlora
from quaxlike.quantized import (
    dequantize,
    Int4Array,
    NF4_LEVELS,
    NF4Array,
    normal_float_levels,
    quantize,
    quantize_int4,
    quantize_nf4,
)
from quaxlike.quantized._nf4 import double_quant_layout


# Appendix E of the QLoRA paper (Dettmers et al., 2023) prints the NF4 levels; the
# module computes them from the normal quantiles.
PUBLISHED_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]

dequantized = eqx.filter_jit(lambda q: q.dequantize())


def bits_per_parameter(q) -> float:
    """Bits of every stored leaf (codes and scales alike), per element of the weight
    the array stands for. Works on arrays and on `eval_shape`'s abstract ones."""
    leaves = jtu.tree_leaves(q)
    nbytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
    return 8 * nbytes / int(np.prod(q.shape))


# --- the levels --------------------------------------------------------------------


def test_levels_are_the_papers():
    levels = normal_float_levels(4)
    assert levels.shape == (16,) and np.all(np.diff(levels) > 0)
    assert levels[0] == -1 and levels[-1] == 1 and np.sum(levels == 0) == 1
    assert np.sum(levels > 0) == 8 and np.sum(levels < 0) == 7  # asymmetric, exact zero
    np.testing.assert_allclose(levels, PUBLISHED_NF4, atol=2e-7)
    assert np.array_equal(NF4_LEVELS, levels)


def test_levels_use_their_codes_on_normal_weights():
    # What makes them "normal float": normally distributed groups, divided by their
    # absmax, round to the 16 levels far more evenly than to evenly spaced ones
    # (the entropy of the codes is closer to the 4 bits they cost).
    x = np.random.default_rng(0).standard_normal((4096, 64))
    x /= np.abs(x).max(axis=-1, keepdims=True)

    def entropy(levels):
        midpoints = (levels[1:] + levels[:-1]) / 2
        share = np.bincount(np.searchsorted(midpoints, x.ravel())) / x.size
        share = share[share > 0]
        return -np.sum(share * np.log2(share))

    nf4, int4 = entropy(NF4_LEVELS), entropy(np.linspace(-1, 1, 15))  # int4: [-7, 7] / 7
    print(f"entropy of the codes: NF4 {nf4:.3f} bits, int4 {int4:.3f} bits")
    assert nf4 > 3.85 and nf4 > int4 + 0.3


# --- quantisation ------------------------------------------------------------------


@pytest.mark.parametrize("double_quant", [False, True])
def test_each_element_takes_the_nearest_level(double_quant, getseed):
    w = randn(getseed(), (3, 8, 64))  # leading batch dimensions quantise too
    q = quantize_nf4(w, group_size=16, double_quant=double_quant, double_quant_block=8)
    assert isinstance(q, NF4Array) and q.shape == w.shape and q.group_size == 16
    assert q.double_quantized == double_quant
    codes = np.asarray(eqx.filter_jit(lambda q: q.codes())(q))
    assert codes.dtype == np.uint8 and codes.shape == w.shape and codes.max() <= 15
    absmax = np.asarray(eqx.filter_jit(lambda q: q.group_absmax(*q.row_leaves()[1:]))(q))
    assert absmax.shape == (3, 8, 4)
    ratio = np.asarray(w).reshape(3, 8, 4, 16) / absmax[..., None]
    nearest = np.argmin(np.abs(ratio[..., None] - NF4_LEVELS), axis=-1)
    assert np.array_equal(codes.reshape(nearest.shape), nearest)
    expected = NF4_LEVELS[codes].reshape(ratio.shape) * absmax[..., None]
    np.testing.assert_allclose(dequantized(q), expected.reshape(w.shape), rtol=1e-6, atol=1e-7)
    # The absmaxes as stored are the groups' own, or within half a code of them.
    true_absmax = np.abs(np.asarray(w)).reshape(3, 8, 4, 16).max(-1)
    if not double_quant:
        assert np.array_equal(absmax, true_absmax)
    else:
        second = np.repeat(np.asarray(q.scale), 8 // q.scale.shape[-2], axis=-2)
        assert q.absmax.dtype == jnp.uint8 and q.scale.shape == (3, 4, 1)
        assert np.all(np.abs(absmax - true_absmax) <= second / 2 + 1e-6)
        assert 0 < np.abs(absmax - true_absmax).max()


def test_zero_groups_and_known_values():
    # A group of zeros stays zero (absmax 0); a group holding the levels times 2
    # is stored exactly.
    w = jnp.stack([jnp.zeros(16), 2 * jnp.asarray(NF4_LEVELS, jnp.float32)])
    for double_quant in (False, True):
        q = quantize_nf4(w, group_size=16, double_quant=double_quant)
        np.testing.assert_allclose(dequantized(q), w, rtol=1e-6)
    q = quantize_nf4(w, group_size=16)
    assert np.array_equal(q.codes()[1], np.arange(16))
    assert np.array_equal(q.packed[1, :2], [0x10, 0x32])  # code 2j low, 2j + 1 high


@pytest.mark.parametrize(
    "shape, groups, block, expected",
    [
        ((4096, 4096), 64, 256, (4, 1)),  # 4 rows of 64 absmaxes per block
        ((4096, 14336), 224, 256, (1, 1)),  # a row of 224 (Llama's down projection)
        ((8, 32768), 512, 256, (1, 2)),  # half a row
        ((6, 16), 2, 4, (2, 1)),
        ((7, 16), 2, 4, (1, 1)),  # 7 rows: a block cannot take two
    ],
)
def test_double_quant_layout(shape, groups, block, expected):
    assert double_quant_layout(shape[0], groups, block) == expected


def test_constructor_errors():
    with pytest.raises(ValueError, match="quantize_nf4.*group_size=48.*divide the input"):
        quantize_nf4(jnp.ones((2, 64)), group_size=48)
    with pytest.raises(ValueError, match="double_quant_block.*positive int; got 0"):
        quantize_nf4(jnp.ones((2, 64)), double_quant=True, double_quant_block=0)
    with pytest.raises(ValueError, match="NF4Array.*`packed` must have shape"):
        NF4Array(jnp.zeros((2, 8), jnp.uint8), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="NF4Array.*got packed"):  # 3 rows per block of 4
        NF4Array(jnp.zeros((4, 8), jnp.uint8), jnp.ones((3, 1)), jnp.zeros((4, 2), jnp.uint8))
    with pytest.raises(ValueError, match='double_quant=True.*"nf4"` only.*bits=4'):
        quantize([jnp.ones((2, 64))], bits=4, double_quant=True, where=lambda m: m[0])
    with pytest.raises(ValueError, match='matmul.*"loop" or "fused"; got \'blocked\''):
        quantize_nf4(jnp.ones((2, 64)), matmul="blocked")


# --- what it costs and what it loses -----------------------------------------------

# The weights of a Llama-8B layer (d = 4096, SwiGLU width 14336, 8 of 32 heads for
# keys and values), quantised abstractly: no memory is used.
LLAMA_8B_WEIGHTS = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]


def test_bits_per_parameter_from_the_arrays():
    def bits(double_quant):
        total_bits = total_size = 0
        for shape in LLAMA_8B_WEIGHTS:
            w = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            q = eqx.filter_eval_shape(lambda w: quantize_nf4(w, double_quant=double_quant), w)
            total_bits += bits_per_parameter(q) * np.prod(shape)
            total_size += np.prod(shape)
            assert 4 < bits_per_parameter(q) <= (4.13 if double_quant else 4.25), shape
        return total_bits / total_size

    plain, double = bits(False), bits(True)
    print(f"NF4 on Llama-8B's weights: {plain:.4f} bits/parameter, double-quantised {double:.4f}")
    assert plain == 4.25  # a bfloat16 absmax per 64
    assert 4.125 < double <= 4.13  # 8 bits per 64, a bfloat16 scale per ~256 of those
    # With float32 weights (scales): 0.5 bits of scales per parameter, and 0.127.
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    assert bits_per_parameter(eqx.filter_eval_shape(quantize_nf4, w)) == 4.5
    dq = eqx.filter_eval_shape(lambda w: quantize_nf4(w, double_quant=True), w)
    assert bits_per_parameter(dq) == 4 + 8 / 64 + 32 / (64 * 256)  # 4.127


def test_error_on_normal_weights_against_int4(getseed):
    # The paper's claim: on normally distributed weights NF4 loses less than evenly
    # spaced 4-bit codes with the same groups, double quantisation or not.
    w = randn(getseed(), (1024, 1024))
    mse = eqx.filter_jit(lambda q, w: jnp.mean((q.dequantize() - w) ** 2))
    errors = {
        "int4": mse(quantize_int4(w, group_size=64), w),
        "nf4": mse(quantize_nf4(w, group_size=64), w),
        "nf4 + double quant": mse(quantize_nf4(w, group_size=64, double_quant=True), w),
    }
    print({name: f"{float(e):.5f}" for name, e in errors.items()})
    assert errors["nf4"] < 0.8 * errors["int4"]
    assert errors["nf4 + double quant"] < 1.01 * errors["nf4"]


# --- gradients and whole models ----------------------------------------------------


@pytest.mark.parametrize("double_quant", [False, True])
def test_grad_with_respect_to_the_scales(double_quant, getseed):
    # `eqx.filter_grad` differentiates the floating-point leaves: the absmaxes, or
    # with double quantisation the second-level scales; the codes get `None`.
    model = eqx.nn.Linear(64, 8, key=jr.key(0))
    model = eqx.tree_at(lambda m: m.weight, model, randn(getseed(), (8, 64)))
    qmodel = quantize(model, bits="nf4", group_size=16, double_quant=double_quant)
    assert isinstance(qmodel.weight, NF4Array) and qmodel.weight.group_size == 16
    x = randn(getseed(), (64,))

    def loss(m, x):
        return jnp.sum(jnp.tanh(quaxlike.quaxify(m)(x)) ** 2)

    grads = eqx.filter_jit(eqx.filter_grad(loss))(qmodel, x)
    assert grads.weight.packed is None and grads.weight.absmax is None
    expected = eqx.filter_jit(eqx.filter_grad(lambda m, x: loss(dequantize(m), x)))(qmodel, x)
    assert tree_allclose(grads.bias, expected.bias, rtol=1e-5, atol=1e-6)
    # A scale's gradient is a sum of products with cancellation: its float32
    # round-off is relative to the largest gradients, not to the entry itself (an
    # entry of 3e-4 was 1.8e-6 off with jax 0.12's summation order, at a largest
    # gradient of 0.9, against 1e-6 allowed). The tolerance scales with the largest.
    got, want = np.asarray(grads.weight.scale), np.asarray(expected.weight.scale)
    largest = float(np.max(np.abs(want)))
    assert largest > 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * largest)


def test_quantize_and_qlora_select_nf4():
    mlp = eqx.nn.MLP(128, 4, 128, depth=2, key=jr.key(0))
    for double_quant in (False, True):
        qmlp = quantize(mlp, bits="nf4", double_quant=double_quant)
        weights = [layer.weight for layer in qmlp.layers]
        assert all(isinstance(w, NF4Array) and w.group_size == 64 for w in weights)
        assert all(w.double_quantized == double_quant for w in weights)
        model = qlora(mlp, rank=2, key=jr.key(1), bits="nf4", double_quant=double_quant)
        assert all(isinstance(layer.weight, LoraArray) for layer in model.layers)
        assert tree_allclose([layer.weight.w for layer in model.layers], weights)
    # `bits=4` keeps its default groups of 32.
    assert isinstance(quantize(mlp, bits=4).layers[0].weight, Int4Array)
    assert quantize(mlp, bits=4).layers[0].weight.group_size == 32


# --- indexing with double quantisation ---------------------------------------------
#
# A stack of 3 weights (32, 128), groups of 16 (8 per row) and second-level blocks of
# 32 absmaxes: each second-level scale covers 4 rows, 8 per weight.

STACK, ROWS, COLUMNS = 3, 32, 128


def _stacked_dq(seed):
    w = randn(seed, (STACK, ROWS, COLUMNS))
    q = quantize_nf4(w, group_size=16, double_quant=True, double_quant_block=32)
    assert q.scale.shape == (STACK, ROWS // 4, 1)  # blocks of 4 rows
    return q


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jtu.tree_leaves(tree))


def test_double_quant_whole_matrices_keep_one_scale_per_block(getseed):
    # Indexing the stack (a layer loop's `w[i]`, `dynamic_index_in_dim`, a gather of
    # layers) gives the layers as `quantize_nf4` stores them: one second-level scale
    # per block of rows, not one per row (four times the bytes here).
    from jax import lax

    q = _stacked_dq(getseed())
    layer = jtu.tree_map(lambda leaf: leaf[2], q)  # the stored layout of layer 2
    layers = jtu.tree_map(lambda leaf: leaf[jnp.array([2, 0])], q)

    def pieces(w, i, ids):
        return {
            "w[i]": w[i],
            "dynamic_index_in_dim": lax.dynamic_index_in_dim(w, i, keepdims=False),
            "dynamic_slice": lax.dynamic_slice(w, (i, 0, 0), (1, ROWS, COLUMNS))[0],
            "vmap(w[i])": jax.vmap(lambda i: w[i])(ids)[0],
            "squeeze": jnp.squeeze(w[2:], 0),
            "w[ids]": w[ids],
        }

    got = eqx.filter_jit(quaxlike.quaxify(pieces))(q, 2, jnp.array([2, 0]))
    for name, piece in got.items():
        assert isinstance(piece, NF4Array), name
        want = layers if name == "w[ids]" else layer
        # The same leaves, bit for bit: the same layout, the same bytes.
        assert jtu.tree_structure(piece) == jtu.tree_structure(want), name
        assert all(
            a.shape == b.shape and bool(jnp.all(a == b))
            for a, b in zip(jtu.tree_leaves(piece), jtu.tree_leaves(want))
        ), name
        assert _nbytes(piece) == _nbytes(want), name
    dense = dequantized(q)
    assert tree_allclose(dequantized(got["w[i]"]), dense[2])
    assert tree_allclose(dequantized(got["w[ids]"]), dense[jnp.array([2, 0])])
    # One scale per row would have been 4 * 8 * 4 bytes more per layer.
    per_row = _nbytes(layer) + (ROWS - ROWS // 4) * 4
    assert _nbytes(got["w[i]"]) < per_row


def _lookups(table, ids):
    from jax import lax

    embedding = eqx.nn.Embedding(weight=table)  # type: ignore[arg-type]
    return {
        "table[ids]": table[ids],
        "dynamic_slice": lax.dynamic_slice(table, (ids[1], 0), (3, COLUMNS)),
        "vmap(embedding)": jax.vmap(embedding)(ids),
    }


def test_double_quant_embedding_lookup_values_and_derivatives(getseed):
    # Rows looked up in a double-quantised table (cut out of their blocks) are the
    # dequantised table's rows; derivatives with respect to the second-level
    # scales (the float leaves) through a quaxified lookup equal those of the
    # same lookup in the dense table built from them.
    table = _stacked_dq(getseed())
    table = jtu.tree_map(lambda leaf: leaf[0], table)  # (32, 128), 8 blocks of 4 rows
    ids = jnp.array([5, 17, 0, 31, 6], jnp.int32)  # rows of several blocks
    weights = randn(getseed(), (COLUMNS,))

    def with_scale(scale):
        return eqx.tree_at(lambda t: t.scale, table, scale)

    def loss_of(lookups):
        return sum(jnp.sum(jnp.tanh(v * weights) ** 2) for v in jtu.tree_leaves(lookups))

    def quaxified(scale):
        return loss_of(quaxlike.quaxify(_lookups)(with_scale(scale), ids))

    def dense(scale):
        return loss_of(_lookups(with_scale(scale).dequantize(), ids))

    got = eqx.filter_jit(quaxlike.quaxify(_lookups))(table, ids)
    want = eqx.filter_jit(_lookups)(dequantized(table), ids)
    assert tree_allclose(got, want)
    assert tree_allclose(got["table[ids]"], dequantized(table)[ids])
    # The rows are dense, as the dense table's lookup gives them.
    assert got["table[ids]"].nbytes == ids.size * COLUMNS * 4

    scale = table.scale
    tangent = randn(getseed(), scale.shape)
    grad = jax.jit(jax.grad(quaxified))(scale)
    want_grad = jax.jit(jax.grad(dense))(scale)
    assert float(jnp.max(jnp.abs(want_grad))) > 0
    assert tree_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    primal, jvp = jax.jit(lambda s, t: jax.jvp(quaxified, (s,), (t,)))(scale, tangent)
    want_primal, want_jvp = jax.jit(lambda s, t: jax.jvp(dense, (s,), (t,)))(scale, tangent)
    assert tree_allclose((primal, jvp), (want_primal, want_jvp), rtol=1e-5, atol=1e-5)


def test_double_quant_layer_loop_derivatives(getseed):
    # Layers taken from the stack by index inside a loop (as benchmarks/_decoder.py's
    # grouped checkpoints do), each per block: gradient and JVP of the scales
    # against the dense stack's.
    from jax import lax

    q = _stacked_dq(getseed())
    x = randn(getseed(), (COLUMNS,))

    def run(w, x):
        def layer(h, i):
            w_i = lax.dynamic_index_in_dim(w, i, keepdims=False)
            return h + 0.1 * (jnp.tanh(w_i @ h) @ w_i), None

        return jnp.sum(lax.scan(layer, x, jnp.arange(STACK))[0] ** 2)

    def quaxified(scale):
        return quaxlike.quaxify(run)(eqx.tree_at(lambda w: w.scale, q, scale), x)

    def dense(scale):
        return run(eqx.tree_at(lambda w: w.scale, q, scale).dequantize(), x)

    assert tree_allclose(jax.jit(quaxified)(q.scale), jax.jit(dense)(q.scale))
    grad, want = jax.jit(jax.grad(quaxified))(q.scale), jax.jit(jax.grad(dense))(q.scale)
    assert float(jnp.max(jnp.abs(want))) > 0
    assert tree_allclose(grad, want, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    tangent = randn(getseed(), q.scale.shape)
    got_jvp = jax.jit(lambda s, t: jax.jvp(quaxified, (s,), (t,)))(q.scale, tangent)
    want_jvp = jax.jit(lambda s, t: jax.jvp(dense, (s,), (t,)))(q.scale, tangent)
    assert tree_allclose(got_jvp, want_jvp, rtol=1e-4, atol=1e-4)
