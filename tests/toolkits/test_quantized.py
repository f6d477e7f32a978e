"""`Int8Array` and `Int4Array`: quantisation, the matrix-product rules (compared with
plain JAX on the dequantised weight), transforms, loops and quantised models.

Unless a test says otherwise, every quantised array here refuses to materialise (the
default), so getting a result at all shows that the rules handled it;
`assert_dequantized_in_blocks` also checks the jaxpr."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import randn, tree_allclose
from jax import lax

import quaxlike
from quaxlike.demo import peak_bytes as compiled_peak_bytes
from quaxlike.quantized import (
    dequantize,
    Int4Array,
    Int8Array,
    largest_dequantized,
    quantize,
    quantize_int4,
    quantize_int8,
    quantize_nf4,
    QuantizedArray,
)


OUT, IN, BATCH, LAYERS = 6, 16, 3, 2
GROUP = 8  # int4 group size used with IN = 16: two groups per row
KINDS = ["int8", "int4"]
# ... and NF4, with float absmaxes or double-quantised ones (in second-level blocks
# of two rows here, so that products and indexing meet several blocks).
ALL_KINDS = [*KINDS, "nf4", "nf4-dq"]


# Jitted, so that each compiles once per shape rather than once per primitive.
dequantized = eqx.filter_jit(lambda q: q.dequantize())
codes_of = eqx.filter_jit(lambda q: q.codes())


def make(kind, seed, shape=(OUT, IN), **kwargs):
    w = randn(seed, shape)
    if kind == "int8":
        return quantize_int8(w, **kwargs)
    if kind == "int4":
        return quantize_int4(w, group_size=GROUP, **kwargs)
    double_quant = dict(double_quant=True, double_quant_block=4) if kind == "nf4-dq" else {}
    return quantize_nf4(w, group_size=GROUP, **double_quant, **kwargs)


def run_both(fn, *args):
    """`quaxify(fn)(*args)`, and `fn` on the same arguments with every quantised array
    dequantised (plain JAX), each compiled once. `quaxify(fn)` is traced only once
    (each trace runs the tracer-leak checker, which is slow); its jaxpr is returned
    too."""
    closed, out_shape = jax.make_jaxpr(quaxlike.quaxify(fn), return_shape=True)(*args)
    flat = jax.jit(jax.extend.core.jaxpr_as_fun(closed))(*jtu.tree_leaves(args))
    got = jtu.tree_unflatten(jtu.tree_structure(out_shape), flat)
    expected = eqx.filter_jit(lambda *args: fn(*dequantize(args)))(*args)
    return got, expected, closed.jaxpr


def assert_dequantized_in_blocks(jaxpr, *weights):
    """Check that `jaxpr` dequantises (converts integer codes to floating point), and
    never more than half of the largest of `weights` at once: no dense copy."""
    largest = largest_dequantized(jaxpr)
    assert 0 < largest <= max(w.size for w in weights) // 2, largest


def dot_generals(jaxpr):
    """Every `dot_general` equation of `jaxpr` and its sub-programs."""
    found = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    for eqn in jaxpr.eqns:
        for sub in quaxlike.internal.jaxprs_in_params(eqn.params):
            found += dot_generals(sub)
    return found


# --- quantisation ----------------------------------------------------------------


def test_quantize_int8_known_values():
    w = jnp.array([[1.0, -0.25, 0.0], [0.5, 2.0, -2.0], [0.0, 0.0, 0.0]])
    q = quantize_int8(w)
    assert q.values.dtype == jnp.int8 and q.scale.dtype == jnp.float32
    assert np.array_equal(q.values, [[127, -32, 0], [32, 127, -127], [0, 0, 0]])
    assert np.allclose(q.scale, [1 / 127, 2 / 127, 1.0])  # an all-zero row gets scale 1
    assert q.shape == (3, 3) and q.dtype == jnp.float32


def test_quantize_int4_packs_two_codes_per_byte():
    # One group of four: absmax 7 gives scale 1, so the codes are the values.
    q = quantize_int4(jnp.array([[7.0, -7.0, 1.0, 0.0]]), group_size=4)
    # Stored plus 8, low nibble first: (15, 1) -> 0x1F and (9, 8) -> 0x89.
    assert q.packed.dtype == jnp.uint8
    assert np.array_equal(q.packed, [[0x1F, 0x89]])
    assert np.array_equal(codes_of(q), [[7, -7, 1, 0]])
    assert q.shape == (1, 4) and q.group_size == 4


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_within_half_a_step(kind, getseed):
    w = randn(getseed(), (LAYERS, OUT, IN))  # leading batch dimensions quantise too
    q = quantize_int8(w) if kind == "int8" else quantize_int4(w, group_size=GROUP)
    code_max = 127 if kind == "int8" else 7
    ints = np.asarray(codes_of(q))
    assert ints.shape == w.shape and np.abs(ints).max() == code_max
    step = np.asarray(q.scale)[..., None]
    if kind == "int4":
        assert q.scale.shape == (LAYERS, OUT, IN // GROUP)
        step = np.repeat(step[..., 0], GROUP, axis=-1)
    error = np.abs(np.asarray(dequantized(q)) - np.asarray(w))
    assert np.all(error <= step / 2 + 1e-6)
    assert error.max() > 0  # it really was quantised


def test_constructor_errors():
    with pytest.raises(ValueError, match="group_size=6.*divide the input dimension 16"):
        quantize_int4(jnp.ones((2, 16)), group_size=6)
    with pytest.raises(ValueError, match="group_size=3.*must be even"):
        quantize_int4(jnp.ones((2, 6)), group_size=3)
    with pytest.raises(ValueError, match="quantize_int8.*at least two dimensions"):
        quantize_int8(jnp.ones(4))
    with pytest.raises(ValueError, match="floating-point.*int32"):
        quantize_int8(jnp.ones((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="even group size"):  # 6 inputs in 2 groups of 3
        Int4Array(jnp.zeros((2, 3), jnp.uint8), jnp.ones((2, 2)))
    with pytest.raises(ValueError, match="`bits` must be 8, 4, 3 or 2"):
        quantize([jnp.ones((2, 2))], bits=5, where=lambda m: m[0])


def test_refuses_to_materialise_with_a_teaching_error(getseed):
    q = make("int8", getseed())
    with pytest.raises(quaxlike.MaterialisationError, match=r"`sin`[\s\S]*Int8Array") as info:
        quaxlike.quaxify(jnp.sin)(q)
    assert "dequantize()" in str(info.value.__cause__)
    assert "allow_materialise=True" in str(info.value.__cause__)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_allowed_materialisation_falls_back(kind, getseed):
    q = make(kind, getseed(), allow_materialise=True)
    got, expected, _ = run_both(jnp.sin, q)
    assert tree_allclose(got, expected)


# --- dot_general layouts ---------------------------------------------------------


def _dot(dimension_numbers):
    return lambda w, a: lax.dot_general(w, a, dimension_numbers)


# (name, function of (weight, other), shape of the weight, shape of the other)
LAYOUTS = [
    ("w@x", lambda w, x: w @ x, (OUT, IN), (IN,)),
    ("w@X", lambda w, x: w @ x, (OUT, IN), (IN, BATCH)),
    ("x@w.T", lambda w, x: x @ w.T, (OUT, IN), (IN,)),
    ("X@w.T", lambda w, x: x @ w.T, (OUT, IN), (BATCH, IN)),
    ("y@w", lambda w, y: y @ w, (OUT, IN), (OUT,)),
    ("Y@w", lambda w, y: y @ w, (OUT, IN), (BATCH, OUT)),
    ("w.T@Y", lambda w, y: w.T @ y, (OUT, IN), (OUT, BATCH)),
    ("w,X->oB", _dot((((1,), (1,)), ((), ()))), (OUT, IN), (BATCH, IN)),
    (
        "X,w->Bo",
        lambda w, x: lax.dot_general(x, w, (((1,), (1,)), ((), ()))),
        (OUT, IN),
        (BATCH, IN),
    ),
    ("einsum", lambda w, x: jnp.einsum("oi,bi->bo", w, x), (OUT, IN), (BATCH, IN)),
    ("oi,oB->oiB", _dot((((), ()), ((0,), (0,)))), (OUT, IN), (OUT, BATCH)),
    ("oi,oi->oi", _dot((((), ()), ((0, 1), (0, 1)))), (OUT, IN), (OUT, IN)),
    ("loi,li->lo", _dot((((2,), (1,)), ((0,), (0,)))), (LAYERS, OUT, IN), (LAYERS, IN)),
    ("loi,lo->li", _dot((((1,), (1,)), ((0,), (0,)))), (LAYERS, OUT, IN), (LAYERS, OUT)),
    ("loi,ix->lox", _dot((((2,), (0,)), ((), ()))), (LAYERS, OUT, IN), (IN, BATCH)),
    ("l(w.T)@Y", lambda w, y: w.mT @ y, (LAYERS, OUT, IN), (LAYERS, OUT, BATCH)),
]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_dot_general_layouts(kind, getseed):
    # All layouts in one trace and one compilation: a trace per layout is slow.
    matrix = make(kind, getseed(), (OUT, IN))
    stacked = make(kind, getseed(), (LAYERS, OUT, IN))
    others = [randn(getseed(), other_shape) for *_, other_shape in LAYOUTS]

    def all_layouts(matrix, stacked, others):
        return [
            fn(matrix if len(w_shape) == 2 else stacked, other)
            for (_, fn, w_shape, _), other in zip(LAYOUTS, others)
        ]

    got, expected, jaxpr = run_both(all_layouts, matrix, stacked, others)
    for (name, *_), g, e in zip(LAYOUTS, got, expected):
        assert tree_allclose(g, e, rtol=1e-5, atol=1e-5), name
    assert_dequantized_in_blocks(jaxpr, matrix, stacked)


@pytest.mark.parametrize(
    "kinds",
    [
        ("int8", "int4"),
        ("int4", "int8"),
        ("int8", "int8"),
        ("int4", "int4"),
        ("nf4-dq", "int4"),
        ("int8", "nf4"),
    ],
)
def test_dot_general_quantized_quantized(kinds, getseed):
    # Blocks of one operand meet the other, still quantised, whose own rule takes
    # it block by block too: `a @ b.T` (rows of `b` free), `a.T @ c` (rows of
    # both contracted).
    a = make(kinds[0], getseed())
    b, c = make(kinds[1], getseed(), (BATCH + 1, IN)), make(kinds[1], getseed(), (OUT, IN))
    got, expected, jaxpr = run_both(lambda a, b, c: (a @ b.T, a.T @ c), a, b, c)
    assert tree_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert_dequantized_in_blocks(jaxpr, a, b, c)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_blocks_that_do_not_divide_the_rows(kind, getseed):
    # Blocks of two rows: for 5 or 7 rows the last block overlaps the one before,
    # and its rows are counted once whether they are free (w @ x) or contracted
    # (y @ w, w.T @ Y); one row is one block.
    qs = [
        dataclasses.replace(make(kind, getseed(), (rows, IN)), block_bytes=2 * IN * 4)
        for rows in (1, 2, 5, 7)
    ]
    x = randn(getseed(), (IN, BATCH))
    ys = [randn(getseed(), (BATCH, q.shape[0])) for q in qs]

    def products(qs, x, ys):
        return [(w @ x, y @ w, w.T @ y.T) for w, y in zip(qs, ys)]

    got, expected, jaxpr = run_both(products, qs, x, ys)
    assert tree_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert 0 < largest_dequantized(jaxpr) <= 2 * IN  # two rows at most


def test_block_bytes_sets_the_block(getseed):
    # The weight of 64 rows of 16 float32 (4 KiB) in blocks of at most 1 KiB.
    w = randn(getseed(), (64, IN))
    for q in (
        quantize_int8(w, block_bytes=1024),
        quantize_int4(w, group_size=GROUP, block_bytes=1024),
    ):
        jaxpr = jax.make_jaxpr(quaxlike.quaxify(lambda w, x: w @ x))(q, jnp.ones(IN))
        # (An Int4Array converts the codes of its low and high nibbles apart.)
        assert 0 < largest_dequantized(jaxpr) <= 1024 // 4
    with pytest.raises(ValueError, match="block_bytes.*positive int; got 0"):
        quantize_int8(w, block_bytes=0)


def test_layout_contracting_a_batch_axis_of_the_weight(getseed):
    # Contracting the layer axis while keeping `out`: each output mixes rows with
    # different scales. Blocks of rows still work, as every block holds all layers.
    fn = _dot((((0, 2), (0, 1)), ((), ())))
    x = randn(getseed(), (LAYERS, IN))
    q = make("int8", getseed(), (LAYERS, OUT, IN))
    got, expected, jaxpr = run_both(fn, q, x)
    assert tree_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert_dequantized_in_blocks(jaxpr, q)


def test_dot_keeps_precision_and_preferred_type(getseed):
    q = make("int8", getseed())
    q = q.with_scale(q.scale.astype(jnp.bfloat16))
    x = randn(getseed(), (IN,)).astype(jnp.bfloat16)

    def fn(w, x):
        return lax.dot(w, x, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    out, expected, jaxpr = run_both(fn, q, x)
    assert out.dtype == jnp.float32
    assert tree_allclose(out, expected, rtol=1e-2, atol=1e-2)
    (dot,) = dot_generals(jaxpr)
    assert dot.params["precision"] == (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    assert dot.params["preferred_element_type"] == jnp.float32


# --- operations that stay quantised ----------------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_transpose_scalars_and_convert_stay_quantized(kind, getseed):
    q = make(kind, getseed())

    def fn(w):
        return (-(w.T * 0.5) / 3.0).astype(jnp.bfloat16)

    out, expected, _ = run_both(fn, q)
    assert isinstance(out, type(q)) and out.transposed and out.dtype == jnp.bfloat16
    assert out.shape == (IN, OUT)
    assert tree_allclose(dequantized(out), expected, rtol=1e-2, atol=1e-2)
    # Transposing twice gives back the stored layout.
    twice = jax.eval_shape(quaxlike.quaxify(lambda w: jnp.transpose(w.T)), q)
    assert isinstance(twice, type(q)) and not twice.transposed


def test_transpose_of_a_batch_axis_materialises(getseed):
    q = make("int8", getseed(), (LAYERS, OUT, IN))
    with pytest.raises(quaxlike.MaterialisationError, match="transpose"):
        jax.eval_shape(quaxlike.quaxify(lambda w: jnp.transpose(w, (1, 0, 2))), q)


# --- transforms ------------------------------------------------------------------


def assert_pairs_close(pairs, rtol=1e-5, atol=1e-5):
    for name, (got, expected) in pairs.items():
        assert tree_allclose(got, expected, rtol=rtol, atol=atol), name


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_jit_vmap_grad_over_inputs(kind, getseed):
    q = make(kind, getseed())
    xs = randn(getseed(), (BATCH, IN))

    def f(w, x):
        return jnp.tanh(w @ x)

    def loss(w, x):
        return jnp.sum(f(w, x) ** 2)

    @jax.jit  # a quantised array is a PyTree of arrays (static fields aside)
    def run(q, xs):
        dense, x = q.dequantize(), xs[0]
        batched = jax.vmap(quaxlike.quaxify(f), in_axes=(None, 0))(q, xs)
        grad = jax.grad(lambda x: quaxlike.quaxify(loss)(q, x))(x)
        expected_grad = jax.grad(loss, argnums=1)(dense, x)
        return {
            "vmap": (batched, jax.vmap(f, in_axes=(None, 0))(dense, xs)),
            "grad": (grad, expected_grad),
            # `jax.grad` inside `quaxify`: the transposed product it needs (`out`
            # contracted) goes to the rule too.
            "grad inside": (quaxlike.quaxify(jax.grad(loss, argnums=1))(q, x), expected_grad),
            "vmap inside": (quaxlike.quaxify(jax.vmap(f, in_axes=(None, 0)))(q, xs), batched),
        }

    assert_pairs_close(run(q, xs))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_vmap_over_stacked_quantized_arrays(kind, getseed):
    q = make(kind, getseed(), (LAYERS, OUT, IN))  # quantised row by row, per layer
    # Two separately built arrays, stacked leaf by leaf.
    stacked = jtu.tree_map(lambda *leaves: jnp.stack(leaves), *[make(kind, s) for s in (1, 2)])
    xs = randn(getseed(), (LAYERS, IN))

    def f(w, x):
        return w @ x

    @eqx.filter_jit
    def run(q, stacked, xs):
        return {
            "built stacked": (
                jax.vmap(quaxlike.quaxify(f))(q, xs),
                jax.vmap(f)(q.dequantize(), xs),
            ),
            "stacked later": (
                jax.vmap(quaxlike.quaxify(f))(stacked, xs),
                jax.vmap(lambda w, x: w.dequantize() @ x)(stacked, xs),
            ),
        }

    assert_pairs_close(run(q, stacked, xs))


# --- indexing ------------------------------------------------------------------


VOCAB = 10  # an embedding table of VOCAB rows of IN


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_embedding_rows(kind, getseed):
    # Looking up rows of a quantised table dequantises those rows only.
    table = make(kind, getseed(), (VOCAB, IN))
    ids = jnp.asarray(np.random.default_rng(getseed()).integers(0, VOCAB, (2, 3)), jnp.int32)
    embedding = eqx.nn.Embedding(weight=table)  # type: ignore[arg-type]

    def lookups(table, embedding, ids):
        return {
            "table[ids]": table[ids],
            "table[ids[0]]": table[ids[0]],
            "vmap(table[i])": jax.vmap(lambda i: table[i])(ids[0]),
            "table[i]": table[ids[0, 0]],
            "dynamic_slice": lax.dynamic_slice(table, (ids[0, 1], 0), (3, IN)),
            "static rows": table[2:5],
            "embedding": embedding(ids[0, 0]),
            "vmap(embedding)": jax.vmap(embedding)(ids[1]),
            "w.T[:, rows]": table.T[:, 3:5],  # stored rows, through the transpose
        }

    got, expected, jaxpr = run_both(lookups, table, embedding, ids)
    assert_pairs_close({name: (got[name], expected[name]) for name in got})
    # At most the rows asked for (the six of `table[ids]`), never the table.
    assert 0 < largest_dequantized(jaxpr) <= ids.size * IN < table.size


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_indexing_whole_matrices_stays_quantized(kind, getseed):
    stacked = make(kind, getseed(), (LAYERS + 1, OUT, IN))
    x = randn(getseed(), (IN,))

    def pieces(w, i):
        return {
            "w[i]": w[i],
            "w[1]": w[1],
            "w[1:]": w[1:],
            "vmap(w[i])": jax.vmap(lambda i: w[i])(jnp.stack([i, 0])),
            "reshape": jnp.reshape(w, (1, *w.shape)),
            "broadcast": jnp.broadcast_to(w, (2, *w.shape)),
            "squeeze": jnp.squeeze(w[:1], 0),
        }

    shapes = jax.eval_shape(quaxlike.quaxify(pieces), stacked, 2)
    assert all(isinstance(p, type(stacked)) for p in shapes.values()), shapes
    got, expected, _ = run_both(
        lambda w, i, x: jtu.tree_map(lambda p: p @ x, pieces(w, i)), stacked, 2, x
    )
    assert_pairs_close({name: (got[name], expected[name]) for name in got})


def test_indexing_that_cuts_stored_rows_materialises(getseed):
    # Some of the inputs of each row: an Int4Array's groups and bytes would be cut.
    q = make("int4", getseed())
    for fn in (lambda w: w[:, :4], lambda w: w.T[2:4], lambda w, i=1: w[:, i]):
        with pytest.raises(quaxlike.MaterialisationError, match="Int4Array"):
            jax.eval_shape(quaxlike.quaxify(fn), q)


# --- peak memory -----------------------------------------------------------------


def peak_bytes(fn, *args):
    """Arguments + outputs + temporaries - aliased bytes of `jax.jit(fn)` compiled
    for `args` (abstract arguments do: nothing runs)."""
    arrays, static = eqx.partition(args, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    run = jax.jit(lambda arrays: fn(*eqx.combine(arrays, static)))
    return compiled_peak_bytes(run.lower(arrays).compile())


def test_peak_memory_ratios():
    # benchmarks/quantized.py's model: 8 `Linear(1024, 1024)` + relu (32 MiB of
    # float32 weights), a batch of 8; compiled only, for abstract arguments. The
    # bytes XLA plans are exact: a quantised program that kept a dense copy of its
    # weights (all of them at once, as XLA's scheduler would without the loop over
    # blocks) would take more than the float32 one.
    width, depth, batch = 1024, 8, 8
    mlp = eqx.filter_eval_shape(
        eqx.nn.MLP, width, width, width, depth - 1, activation=jax.nn.relu, key=jr.key(0)
    )
    xs = jax.ShapeDtypeStruct((batch, width), jnp.float32)
    stacked = jax.ShapeDtypeStruct((depth, width, width), jnp.float32)
    per_layer_xs = jax.ShapeDtypeStruct((depth, batch, width), jnp.float32)

    def forward(m, xs):
        return jax.vmap(quaxlike.quaxify(m))(xs)

    def grad(m, xs):
        return jax.grad(lambda xs: jnp.sum(forward(m, xs)))(xs)

    def scan(ws, xs):
        return lax.scan(lambda h, w: (jax.nn.relu(h @ w.T), None), xs, ws)[0]

    def vmap(ws, xs):
        return jax.vmap(lambda w, x: x @ w.T)(ws, xs)

    dense = {
        "forward": peak_bytes(forward, mlp, xs),
        "grad": peak_bytes(grad, mlp, xs),
        "scan": peak_bytes(scan, stacked, xs),
        "vmap": peak_bytes(vmap, stacked, per_layer_xs),
    }
    nf4 = dict(bits="nf4", double_quant=True)
    for options, kind, target in (
        (dict(bits=8), quantize_int8, 0.30),
        (dict(bits=4), quantize_int4, 0.20),
        (nf4, lambda w: quantize_nf4(w, double_quant=True), 0.20),
    ):
        model = eqx.filter_eval_shape(lambda m: quantize(m, **options), mlp)
        weights = eqx.filter_eval_shape(kind, stacked)
        ratios = {
            "forward": peak_bytes(forward, model, xs),
            "grad": peak_bytes(grad, model, xs),
            "scan": peak_bytes(quaxlike.quaxify(scan), weights, xs),
            "vmap": peak_bytes(quaxlike.quaxify(vmap), weights, per_layer_xs),
        }
        ratios = {case: peak / dense[case] for case, peak in ratios.items()}
        assert all(ratio <= target for ratio in ratios.values()), (options, ratios)


# --- control flow inside quaxify -------------------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_scan_over_inputs_and_over_layers(kind, getseed):
    q = make(kind, getseed())
    square = make(kind, getseed(), (LAYERS, IN, IN))
    xs = randn(getseed(), (BATCH, IN))

    def over_inputs(w, xs):
        def body(total, x):
            y = w @ x
            return total + y, jnp.tanh(y)

        return lax.scan(body, jnp.zeros(OUT), xs)

    def over_layers(ws, h):
        return lax.scan(lambda h, w: (jnp.tanh(w @ h), None), h, ws)[0]

    @eqx.filter_jit
    def run(q, square, xs):
        return {
            "inputs": (quaxlike.quaxify(over_inputs)(q, xs), over_inputs(q.dequantize(), xs)),
            "layers": (
                quaxlike.quaxify(over_layers)(square, xs[0]),
                over_layers(square.dequantize(), xs[0]),
            ),
        }

    assert_pairs_close(run(q, square, xs))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_cond_and_while_loop(kind, getseed):
    q = make(kind, getseed(), (IN, IN))
    x = randn(getseed(), (IN,))

    def branchy(w, x, p):
        w = lax.cond(p, lambda w: w, lambda w: -w, w)  # returns the quantised array
        return lax.cond(p, lambda x: w @ x, lambda x: jnp.sin(w @ x), x)

    def looped(w, x, n):
        return lax.fori_loop(0, n, lambda i, h: jnp.tanh(w @ h), x)  # traced n: a while

    @eqx.filter_jit
    def run(q, x, p, n):
        dense = q.dequantize()
        return {
            "cond": (quaxlike.quaxify(branchy)(q, x, p), branchy(dense, x, p)),
            "while": (quaxlike.quaxify(looped)(q, x, n), looped(dense, x, n)),
        }

    for p in (True, False):  # one trace: `p` is traced
        assert_pairs_close(run(q, x, jnp.array(p), 3))


# --- quantised Equinox models ----------------------------------------------------


@pytest.fixture(scope="module")
def mlp():
    # Built abstractly and filled from NumPy (uniform in +-1/sqrt(fan in), like
    # Equinox's own initialisation): initialising with JAX keys would compile a
    # program per layer.
    shapes = eqx.filter_eval_shape(
        eqx.nn.MLP, 64, 8, 64, depth=2, activation=jax.nn.gelu, key=jr.key(0)
    )
    rng = np.random.default_rng(0)
    leaves, treedef = jtu.tree_flatten(shapes)
    leaves = [
        jnp.asarray(rng.uniform(-(64**-0.5), 64**-0.5, x.shape), x.dtype)
        if isinstance(x, jax.ShapeDtypeStruct)
        else x
        for x in leaves
    ]
    return jtu.tree_unflatten(treedef, leaves)


@pytest.mark.parametrize("bits, bound", [(8, 0.02), (4, 0.15)])
def test_quantize_mlp_accuracy(mlp, bits, bound, getseed):
    qmlp = quantize(mlp, bits=bits, group_size=32)
    kind = Int8Array if bits == 8 else Int4Array
    assert all(isinstance(layer.weight, kind) for layer in qmlp.layers)
    assert all(not isinstance(layer.bias, QuantizedArray) for layer in qmlp.layers)
    xs = randn(getseed(), (16, 64))

    @eqx.filter_jit
    def run(qmlp, mlp, xs):
        out = jax.vmap(quaxlike.quaxify(qmlp))(xs)
        return out, jax.vmap(dequantize(qmlp))(xs), jax.vmap(mlp)(xs)

    out, dequantized_out, reference = run(qmlp, mlp, xs)
    # Exactly what plain JAX computes with the dequantised weights ...
    assert tree_allclose(out, dequantized_out, rtol=1e-5, atol=1e-5)
    # ... and close to the original model.
    max_abs = float(jnp.max(jnp.abs(out - reference)))
    relative = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
    print(f"int{bits}: max abs error {max_abs:.2e}, relative error (2-norm) {relative:.2%}")
    assert 0 < relative < bound


def test_quantize_where_selects_weights(mlp, getseed):
    qmlp = quantize(mlp, bits=4, group_size=16, where=lambda m: m.layers[0].weight)
    assert isinstance(qmlp.layers[0].weight, Int4Array) and qmlp.layers[0].weight.group_size == 16
    assert all(not isinstance(layer.weight, QuantizedArray) for layer in qmlp.layers[1:])
    x = randn(getseed(), (64,))
    run = eqx.filter_jit(lambda m, x: (quaxlike.quaxify(m)(x), dequantize(m)(x)))
    assert tree_allclose(*run(qmlp, x), rtol=1e-5, atol=1e-5)


def test_grad_with_respect_to_a_quantized_model(mlp, getseed):
    model = mlp.layers[-1]  # an `eqx.nn.Linear(64, 8)`
    qmodel = quantize(model, bits=4, group_size=GROUP)
    x = randn(getseed(), (64,))

    def loss(m, x):
        return jnp.sum(jnp.tanh(quaxlike.quaxify(m)(x)) ** 2)

    # Only the floating-point leaves (scales, bias) are differentiated; the codes,
    # being integers, get `None`.
    grads = eqx.filter_jit(eqx.filter_grad(loss))(qmodel, x)
    assert grads.weight.packed is None and grads.weight.scale.shape == (8, 64 // GROUP)
    expected = eqx.filter_jit(eqx.filter_grad(lambda m, x: loss(dequantize(m), x)))(qmodel, x)
    assert tree_allclose(grads, expected, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(grads.weight.scale))) > 0
    # `jax.grad` refuses the integer leaves outright.
    with pytest.raises(TypeError, match="uint8"):
        jax.grad(loss)(qmodel, x)
