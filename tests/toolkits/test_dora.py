"""DoRA: `DoraArray` over a plain and a quantised base, against the dense formula.

Every result is compared with plain JAX on dense arrays: PEFT's DoRA
`(m / stop_gradient(‖V‖)) ⊙ V` with `V = W + A B` formed densely (the dequantised
weight for a quantised base), the norm per row over the input axis. Values,
`jax.jvp` and `jax.grad` with respect to `A`, `B`, `m` and the input, eagerly and
under `jax.jit` / `eqx.filter_jit`. The quantised bases refuse to materialise, so
a result at all shows no rule fell back to the dense weight; `largest_dequantized`
checks that no program holds more than half of a base weight in dense form.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest
from helpers import randn
from jax import lax

import quaxlike
from quaxlike.lora import DoraArray, loraify, merge, partition, qlora, row_norms
from quaxlike.lora._dora import row_norms_squared
from quaxlike.quantized import (
    largest_dequantized,
    quantize_int4,
    quantize_int8,
    quantize_nf4,
)


M, N, R = 12, 16, 3
KINDS = ["plain", "int8", "int4", "nf4-dq"]


def make_base(kind, seed, shape=(M, N)):
    w = randn(seed, shape)
    if kind == "plain":
        return w
    if kind == "nf4-dq":
        return quantize_nf4(w, group_size=8, double_quant=True, double_quant_block=4)
    return quantize_int8(w) if kind == "int8" else quantize_int4(w, group_size=8)


def dense_base(base):
    return base if isinstance(base, jax.Array) else base.dequantize()


def make_dora(base, seed, rank=R):
    *batch, m, n = base.shape
    dora = DoraArray(base, rank=rank, key=jr.key(seed))
    # B away from zero and m away from the norm, so every term of the norm counts.
    b = randn(seed + 1, (*batch, rank, n), 0.3)
    a = randn(seed + 2, (*batch, m, rank), 0.5)
    return dora._replaced(a=a, b=b, m=dora.m * (1 + 0.2 * randn(seed + 3, dora.m.shape)))


def dense_dora(w, a, b, m):
    """PEFT's DoRA weight, formed densely: the reference."""
    v = w + jnp.matmul(a, b)
    norm = lax.stop_gradient(jnp.linalg.norm(v, axis=-1))
    return (m / norm)[..., None] * v


def close(x, y, tol=2e-5):
    return bool(jnp.allclose(x, y, rtol=tol, atol=tol))


# --- the norm ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_norm_equals_dense_norm(kind):
    base = make_base(kind, 0)
    dora = make_dora(base, 1)
    expected = jnp.linalg.norm(dense_base(base) + dora.a @ dora.b, axis=-1)
    assert close(dora.norm(), expected)
    assert close(row_norms(base), jnp.linalg.norm(dense_base(base), axis=-1))


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4-dq"])
def test_row_norms_blockwise(kind):
    base = make_base(kind, 2, (3, 32, 16))  # a stack: every layer's rows at once
    jaxpr = jax.make_jaxpr(row_norms_squared)(base)
    assert 0 < largest_dequantized(jaxpr) <= base.size // 2
    small = jax.make_jaxpr(lambda w: row_norms_squared(w, block_elements=3 * 16 * 4))(base)
    assert largest_dequantized(small) == 3 * 16 * 4
    expected = jnp.sum(dense_base(base) ** 2, axis=-1)
    assert close(row_norms_squared(base, block_elements=3 * 16 * 5), expected)  # a remainder


def test_norm_clipped_at_zero():
    # W = -A B: every row of W + A B is zero, and n² sums to round-off, often
    # below zero; the square root of the clipped sum is 0, never NaN.
    a, b = randn(0, (M, R)), randn(1, (R, N))
    w = -(a @ b)
    dora = DoraArray.from_factors(w, a, b, jnp.ones(M))
    assert bool(jnp.all(jnp.isfinite(dora.norm()))) and bool(jnp.all(dora.norm() < 1e-2))


# --- products, derivatives, transforms ---------------------------------------

PRODUCTS = {
    "d @ x": (lambda d, x: d @ x, lambda d, x: d @ x, (N, 5)),
    "x @ d.T": (lambda d, x: x @ d.T, lambda d, x: x @ d.T, (5, N)),
    "d.T @ x": (lambda d, x: d.T @ x, lambda d, x: d.T @ x, (M, 5)),
    "x @ d": (lambda d, x: x @ d, lambda d, x: x @ d, (5, M)),
    "einsum": (
        lambda d, x: jnp.einsum("oi,bi->bo", d, x),
        lambda d, x: jnp.einsum("oi,bi->bo", d, x),
        (4, N),
    ),
}


# Every orientation on a plain and a double-quantised NF4 base; `d @ x` on all.
CASES = [(k, p) for k in ("plain", "nf4-dq") for p in PRODUCTS] + [
    (k, "d @ x") for k in ("int8", "int4")
]


@pytest.mark.parametrize("kind,product", CASES)
def test_values_and_grads(kind, product):
    ours, reference, x_shape = PRODUCTS[product]
    base = make_base(kind, 3)
    dora = make_dora(base, 4)
    w = dense_base(base)
    x = randn(5, x_shape)

    def loss_ours(a, b, m, x):
        d = dora._replaced(a=a, b=b, m=m)
        return jnp.sum(jnp.sin(quaxlike.quaxify(ours)(d, x)))

    def loss_dense(a, b, m, x):
        return jnp.sum(jnp.sin(reference(dense_dora(w, a, b, m), x)))

    args = (dora.a, dora.b, dora.m, x)
    assert close(loss_ours(*args), loss_dense(*args))
    grads = jax.jit(jax.grad(loss_ours, argnums=(0, 1, 2, 3)))(*args)
    expected = jax.grad(loss_dense, argnums=(0, 1, 2, 3))(*args)
    for g, e in zip(grads, expected):
        assert close(g, e, 1e-4), (g, e)
    tangents = tuple(randn(10 + i, jnp.shape(v)) for i, v in enumerate(args))
    _, t_ours = jax.jvp(loss_ours, args, tangents)
    _, t_dense = jax.jvp(loss_dense, args, tangents)
    assert close(t_ours, t_dense, 1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_filter_jit_grad_of_the_value(kind):
    # The DoraArray itself as the argument, under eqx.filter_jit: gradients land
    # on `a`, `b` and `m`; the frozen base and ‖W‖² get none.
    base = make_base(kind, 6)
    dora = make_dora(base, 7)
    x = randn(8, (N,))

    @eqx.filter_jit
    def grads(dora, x):
        return eqx.filter_grad(lambda d: jnp.sum(quaxlike.quaxify(lambda d, x: d @ x)(d, x) ** 2))(
            dora
        )

    g = grads(dora, x)
    w = dense_base(base)
    expected = jax.grad(lambda a, b, m: jnp.sum((dense_dora(w, a, b, m) @ x) ** 2), (0, 1, 2))(
        dora.a, dora.b, dora.m
    )
    assert close(g.a, expected[0], 1e-4) and close(g.b, expected[1], 1e-4)
    assert close(g.m, expected[2], 1e-4)
    assert not bool(jnp.any(g.w_norm_sq))


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4-dq"])
def test_nothing_dense_forward_and_backward(kind):
    base = make_base(kind, 9, (32, 16))
    dora = make_dora(base, 10)
    x = randn(11, (16, 4))

    def loss(dora, x):
        return jnp.sum(quaxlike.quaxify(lambda d, x: d @ x)(dora, x) ** 2)

    jaxpr = jax.make_jaxpr(eqx.filter_grad(loss))(dora, x)
    assert 0 < largest_dequantized(jaxpr) <= base.size // 2
    report = quaxlike.explain(lambda d, x: d @ x)(dora, x)
    assert not report.materialised


@pytest.mark.parametrize("x_shape", [(N,), (N, 5), (5, N)])
def test_one_product_of_the_base_per_forward(x_shape):
    # `D x` for a vector or a batch of columns or rows multiplies the base once:
    # `W [x | Bᵀ]` gives the product and the norm's cross term together.
    base = make_base("nf4-dq", 30, (M, N))
    dora = make_dora(base, 31)
    x = randn(32, x_shape)
    fn = (lambda d, x: x @ d.T) if x_shape == (5, N) else (lambda d, x: d @ x)
    records = str(quaxlike.explain(fn)(dora, x)).split("rules:")[0]
    assert records.count("quantized._matmul.dot_general") == 1, records
    expected = fn(dense_dora(base.dequantize(), dora.a, dora.b, dora.m), x)
    assert close(quaxlike.quaxify(fn)(dora, x), expected)


@pytest.mark.parametrize("kind", ["plain", "nf4-dq"])
def test_stacked_layers_through_scan(kind):
    layers = 3
    base = make_base(kind, 12, (layers, N, N))
    dora = make_dora(base, 13)
    w = dense_base(base)
    x = randn(14, (N,))

    def run(stack, x, apply):
        def body(h, layer):
            return jnp.tanh(apply(layer, h)), None

        return jnp.sum(lax.scan(body, x, stack)[0] ** 2)

    def loss_ours(a, b, m, x):
        d = dora._replaced(a=a, b=b, m=m)
        return quaxlike.quaxify(lambda d, x: run(d, x, lambda layer, h: layer @ h))(d, x)

    def loss_dense(a, b, m, x):
        return run(dense_dora(w, a, b, m), x, lambda layer, h: layer @ h)

    args = (dora.a, dora.b, dora.m, x)
    assert close(jax.jit(loss_ours)(*args), loss_dense(*args), 1e-4)
    grads = jax.jit(jax.grad(loss_ours, argnums=(0, 1, 2, 3)))(*args)
    expected = jax.grad(loss_dense, argnums=(0, 1, 2, 3))(*args)
    for g, e in zip(grads, expected):
        assert close(g, e, 1e-4)
    # Indexing a layer gives a DoraArray of that layer.
    one = quaxlike.quaxify(lambda d: d[1])(dora)
    assert isinstance(one, DoraArray) and one.shape == (N, N)
    assert close(one.merged(), dense_dora(w, dora.a, dora.b, dora.m)[1], 1e-5)


def test_vmap_over_inputs_and_structural_rules():
    dora = make_dora(make_base("plain", 15), 16)
    ref = dense_dora(dora.w, dora.a, dora.b, dora.m)
    xs = randn(17, (6, N))
    out = quaxlike.quaxify(jax.vmap(lambda d, x: d @ x, in_axes=(None, 0)))(dora, xs)
    assert close(out, xs @ ref.T)
    scaled = quaxlike.quaxify(lambda d: (-2.0 * d).astype(jnp.float32))(dora)
    assert isinstance(scaled, DoraArray) and close(scaled.merged(), -2.0 * ref)
    assert quaxlike.quaxify(lambda d: d.T)(dora).transposed
    assert close(quaxlike.quaxify(lambda d: d.T.T)(dora).merged(), ref)


def test_refusals_name_the_type_and_the_way_out():
    dora = make_dora(make_base("plain", 18), 19)
    with pytest.raises(Exception, match="DoraArray.*merge"):
        quaxlike.quaxify(lambda d: jnp.exp(d))(dora)
    with pytest.raises(Exception, match="DoraArray"):
        quaxlike.quaxify(lambda d: d[:, 1:3])(dora)  # columns cut from their norm


# --- models --------------------------------------------------------------------


def test_loraify_dora_starts_at_the_base_and_merges():
    mlp = eqx.nn.MLP(N, 4, 32, depth=2, key=jr.key(0))
    model = loraify(mlp, rank=R, key=jr.key(1), dora=True)
    assert all(isinstance(layer.weight, DoraArray) for layer in model.layers)
    x = randn(2, (N,))
    assert close(quaxlike.quaxify(model)(x), mlp(x))
    trainable, frozen = partition(model)
    assert trainable.layers[0].weight.m is not None and trainable.layers[0].weight.w is None
    assert frozen.layers[0].weight.m is None
    # Train the factors away from zero: merge stays equal to the quaxified model.
    moved = jax.tree_util.tree_map(lambda t: t + 0.1 * jnp.ones_like(t), trainable)
    model = eqx.combine(moved, frozen)
    assert close(merge(model)(x), quaxlike.quaxify(model)(x), 1e-4)
    only = loraify(mlp, rank=R, key=jr.key(1), dora=True, where="layers.1.weight")
    kinds = [isinstance(layer.weight, DoraArray) for layer in only.layers]
    assert kinds == [False, True, False]


def test_qlora_dora_magnitude_from_the_unquantised_weight():
    mlp = eqx.nn.MLP(N, 4, 32, depth=1, key=jr.key(0))
    peft_like = qlora(mlp, rank=R, key=jr.key(1), bits="nf4", group_size=8, dora=True)
    answer_ai = qlora(
        mlp, rank=R, key=jr.key(1), bits="nf4", group_size=8, dora=True, magnitude_from=mlp
    )
    w = mlp.layers[0].weight
    q = peft_like.layers[0].weight
    assert type(q.w).__name__ == "NF4Array"
    assert close(q.m, jnp.linalg.norm(q.w.dequantize(), axis=-1))
    assert close(answer_ai.layers[0].weight.m, jnp.linalg.norm(w, axis=-1))
    assert not close(q.m, answer_ai.layers[0].weight.m, 1e-7)
    with pytest.raises(ValueError, match="magnitude_from"):
        loraify(mlp, rank=R, key=jr.key(1), dora=True, magnitude_from={"x": 1})


def test_optax_step_decreases_the_loss_with_the_dense_gradient():
    mlp = eqx.nn.MLP(N, 4, 32, depth=2, key=jr.key(0))
    model = qlora(mlp, rank=4, key=jr.key(1), bits="nf4", group_size=8, dora=True)
    x, y = randn(2, (8, N)), randn(3, (8, 4))
    trainable, frozen = partition(model)
    optimiser = optax.adam(1e-2)
    opt_state = optimiser.init(trainable)

    def loss(trainable, x, y):
        out = quaxlike.quaxify(lambda m, x: jax.vmap(m)(x))(eqx.combine(trainable, frozen), x)
        return jnp.mean((out - y) ** 2)

    @eqx.filter_jit
    def step(trainable, opt_state):
        value, grads = eqx.filter_value_and_grad(loss)(trainable, x, y)
        updates, opt_state = optimiser.update(grads, opt_state, trainable)
        return eqx.apply_updates(trainable, updates), opt_state, value, grads

    # The gradient equals the dense DoRA model's (dequantised bases, norm detached).
    def dense_loss(params):
        layers = [
            eqx.tree_at(
                lambda lin: lin.weight,
                lin,
                dense_dora(lin.weight.w.dequantize(), *params[i]),
            )
            for i, lin in enumerate(model.layers)
        ]
        dense = eqx.tree_at(lambda m: m.layers, model, tuple(layers))
        return jnp.mean((jax.vmap(dense)(x) - y) ** 2)

    params = [(lin.weight.a, lin.weight.b, lin.weight.m) for lin in model.layers]
    expected = jax.grad(dense_loss)(params)
    losses = []
    for i in range(20):
        trainable, opt_state, value, grads = step(trainable, opt_state)
        if i == 0:
            for lin, e in zip(grads.layers, expected):
                assert close(lin.weight.a, e[0], 1e-4) and close(lin.weight.b, e[1], 1e-4)
                assert close(lin.weight.m, e[2], 1e-4)
        losses.append(float(value))
    assert losses[-1] < 0.7 * losses[0]


def test_trained_base_keeps_its_norm_current():
    """With `stop_gradient=False` the base trains: after a step moves `W`, the
    norm is `‖W' + A B‖` of the new `W'`, never the one cached when the array
    was made; and the gradient reaches `W` as the dense formula's does."""
    dora = make_dora(randn(0, (M, N)), 1)._replaced(stop_gradient=False)
    moved = dora._replaced(w=dora.w + 0.5 * randn(9, (M, N)))
    x = randn(5, (N,))
    expected = dense_dora(moved.w, moved.a, moved.b, moved.m) @ x
    assert close(moved.norm(), jnp.linalg.norm(moved.w + moved.a @ moved.b, axis=-1))
    assert close(quaxlike.quaxify(lambda d, x: d @ x)(moved, x), expected)

    def loss(w):
        return jnp.sum(quaxlike.quaxify(lambda d, x: d @ x)(moved._replaced(w=w), x) ** 2)

    dense_loss = lambda w: jnp.sum((dense_dora(w, moved.a, moved.b, moved.m) @ x) ** 2)  # noqa: E731
    assert close(jax.grad(loss)(moved.w), jax.grad(dense_loss)(moved.w), 1e-4)
