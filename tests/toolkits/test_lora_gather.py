"""Gathers from a `LoraArray` that cut across its matrix axes (token ids into a LoRA'd
embedding table, columns, single elements, `take_along_axis`, `vmap` of `W[i]`),
compared with plain JAX on the dense `W + A @ B`: forward and gradients with
respect to `W`, `A` and `B`, under `jit`, `vmap` and `grad`.

Speed: the case table is run as one jitted program (and its reference as another),
then checked case by case.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import tree_allclose
from jax import lax

import quaxlike
from quaxlike.lora import LoraArray, loraify, merge, partition
from quaxlike.symbolic.zero import Zero


RTOL, ATOL = 1e-4, 1e-5
M, N, R = 11, 7, 3  # distinct sizes, so that an (M, N) block is recognisable in a jaxpr
L = 2  # layers, for stacked tables

jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def randn(seed, shape, scale=1.0):
    rng = np.random.default_rng(seed)
    return jax.device_put((scale * rng.standard_normal(shape)).astype(np.float32))


def ints(values):
    return jax.device_put(np.asarray(values, dtype=np.int32))


@functools.cache
def _template(**flags):
    return LoraArray(jnp.zeros((1, 1)), rank=1, key=jr.key(0), **flags)


def lora_from(w, a, b, **flags):
    return _template(**flags).with_factors(w, a, b)


def dense(w, a, b):
    return w + jnp.einsum("...mr,...rn->...mn", a, b)


IDS = ints([1, 5, 7, 10, 0, 5])  # a repeated id: its gradients add up
ROWS = ints([[3, 0, 10, 3, 6, 1, 2]] * 2)  # for take_along_axis over rows, (2, N)
COLS = ints([[6, 0, 2]] * M)  # over columns, (M, 3)
_embedding = eqx.filter_eval_shape(eqx.nn.Embedding, M, N, key=jr.key(0))

# name -> (function of (table, ids), table shape)
CASES = {
    "rows": (lambda m, i: m[i], (M, N)),
    "rows_2d_ids": (lambda m, i: m[i.reshape(2, 3)], (M, N)),
    "rows_negative_ids": (lambda m, i: m[i - M], (M, N)),
    "rows_take": (lambda m, i: jnp.take(m, i, axis=0), (M, N)),
    "rows_vmap": (lambda m, i: jax.vmap(lambda j: m[j])(i), (M, N)),
    "rows_vmap_embedding": (
        lambda m, i: jax.vmap(eqx.tree_at(lambda e: e.weight, _embedding, m))(i),
        (M, N),
    ),
    "rows_vmap_dynamic_slice": (
        lambda m, i: jax.vmap(lambda j: lax.dynamic_slice_in_dim(m, j, 2, 0))(i % (M - 1)),
        (M, N),
    ),
    "rows_fill": (lambda m, i: m.at[i - 3].get(mode="fill", fill_value=2.5), (M, N)),
    "rows_fill_nan": (lambda m, i: jnp.nan_to_num(m.at[i + 3].get(mode="fill")), (M, N)),
    "rows_clip": (lambda m, i: m.at[i + 5].get(mode="clip"), (M, N)),
    "columns": (lambda m, i: m[:, i % N], (M, N)),
    "columns_take": (lambda m, i: jnp.take(m, i % N, axis=1), (M, N)),
    "elements": (lambda m, i: m[i, i % N], (M, N)),
    "elements_vmap": (lambda m, i: jax.vmap(lambda j: m[j, (j + 2) % N])(i), (M, N)),
    "take_along_rows": (lambda m, i: jnp.take_along_axis(m, ROWS, axis=0), (M, N)),
    "take_along_columns": (lambda m, i: jnp.take_along_axis(m, COLS, axis=1), (M, N)),
    "stacked_rows": (lambda m, i: m[:, i], (L, M, N)),
    "stacked_layer_and_row": (lambda m, i: m[i % L, i], (L, M, N)),
    "stacked_columns": (lambda m, i: m[..., i % N], (L, M, N)),
    "vmap_over_layers_rows": (
        lambda m, i: jax.vmap(lambda layer, j: layer[j])(m, jnp.stack([i, i[::-1]])),
        (L, M, N),
    ),
    "vmap_over_layers_elements": (
        lambda m, i: jax.vmap(lambda layer, j: layer[j, j % N])(m, jnp.stack([i, i[::-1]])),
        (L, M, N),
    ),
}


def _params():
    params = {}
    for k, (name, (_, shape)) in enumerate(CASES.items()):
        *batch, m, n = shape
        seed = 10 * k
        params[name] = (
            randn(seed, shape, 0.5),
            randn(seed + 1, (*batch, m, R), 0.5),
            randn(seed + 2, (*batch, R, n), 0.5),
        )
    return params


def _loss(params, table, run):
    outs = {name: run(CASES[name][0], table(*p), IDS) for name, p in params.items()}
    probes = {name: randn(1000 + k, out.shape) for k, (name, out) in enumerate(outs.items())}
    return sum(jnp.vdot(outs[name], probes[name]) for name in outs), outs


@functools.cache
def _results():
    """Outputs and gradients with respect to (W, A, B), LoRA and dense."""
    params = _params()

    def lora_loss(params):
        table = functools.partial(lora_from, stop_gradient=False)
        return _loss(params, table, lambda fn, m, i: quaxlike.quaxify(fn)(m, i))

    def dense_loss(params):
        return _loss(params, dense, lambda fn, m, i: fn(m, i))

    got = jit(jax.value_and_grad(lora_loss, has_aux=True))(params)
    want = jit(jax.value_and_grad(dense_loss, has_aux=True))(params)
    return got, want


@pytest.mark.parametrize("case", list(CASES))
def test_gather_forward_and_grads(case):
    ((_, got_out), got_grads), ((_, want_out), want_grads) = _results()
    assert got_out[case].shape == want_out[case].shape
    assert tree_allclose(got_out[case], want_out[case], rtol=RTOL, atol=ATOL)
    assert tree_allclose(got_grads[case], want_grads[case], rtol=RTOL, atol=ATOL)


def _dense_blocks(fn, *args):
    """The `dot_general`s or `add`s in `fn`'s program whose output holds an (M, N)
    block, as forming `W + A @ B` would."""
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("dot_general", "add", "add_any"):
                shape = tuple(eqn.outvars[0].aval.shape)
                if any(shape[i : i + 2] == (M, N) for i in range(len(shape) - 1)):
                    found.append((eqn.primitive.name, shape))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        visit(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_never_forms_the_table():
    # W frozen (the default): the gradients with respect to A and B go through the
    # gathered rows (scatter-adds into A's and B's shapes), never an (M, N) block.
    def loss(params):
        return _loss(params, lora_from, lambda fn, m, i: quaxlike.quaxify(fn)(m, i))[0]

    assert _dense_blocks(jax.grad(loss), _params()) == []
    # The check can fail: the same gathers from the dense table.
    assert _dense_blocks(jax.grad(lambda p: _loss(p, dense, lambda f, m, i: f(m, i))[0]), _params())


def test_whole_matrix_gathers_stay_lora():
    # Gathers along the batch axes of a stack of tables still give a LoraArray.
    w, a, b = _params()["stacked_rows"]
    out = quaxlike.quaxify(lambda m, i: m[i % L])(lora_from(w, a, b), IDS)
    assert isinstance(out, LoraArray) and out.shape == (len(IDS), M, N)


# --- an embedding table, as a language model uses it -------------------------------


@pytest.fixture(scope="module")
def embedding():
    k, k2 = jr.key(0), jr.key(1)
    emb = loraify(eqx.nn.Embedding(40, 16, key=k), rank=4, where="**.weight", key=k2)
    # A non-zero B, so that the update matters.
    return eqx.tree_at(lambda e: e.weight.b, emb, randn(0, (4, 16), 0.5))


def test_embedding_lookup(embedding):
    # The two lookups of the issue, eagerly and under jit, against the merged table.
    ids = jnp.array([1, 5, 7])
    table = merge(embedding).weight
    by_index = quaxlike.quaxify(lambda m, ids: m.weight[ids])
    by_vmap = quaxlike.quaxify(lambda m, ids: jax.vmap(m)(ids))
    for lookup in (by_index, by_vmap, jit(by_index), jit(by_vmap)):
        assert tree_allclose(lookup(embedding, ids), table[ids], rtol=RTOL, atol=ATOL)
    # vmap outside quaxify, over a batch of sequences.
    batch = jnp.array([[1, 5, 7], [0, 39, 2]])
    outside = jax.vmap(by_index, in_axes=(None, 0))(embedding, batch)
    assert tree_allclose(outside, table[batch], rtol=RTOL, atol=ATOL)


def test_embedding_training_gradients(embedding):
    ids = ints([[3, 1, 3, 0], [39, 3, 2, 2]])
    trainable, frozen = partition(embedding)
    target = randn(1, (2, 4, 16))

    def loss(trainable, lookup):
        model = eqx.combine(trainable, frozen)
        return jnp.mean((lookup(model, ids) - target) ** 2)

    def lora_lookup(model, ids):
        return jax.vmap(quaxlike.quaxify(lambda m, i: jax.vmap(m)(i)), in_axes=(None, 0))(
            model, ids
        )

    def merged_lookup(model, ids):
        lora = model.weight
        table = lax.stop_gradient(lora.w) + lora.a @ lora.b
        return table[ids]

    got = jit(jax.grad(loss, argnums=0), static_argnums=1)(trainable, lora_lookup)
    want = jit(jax.grad(loss, argnums=0), static_argnums=1)(trainable, merged_lookup)
    assert tree_allclose(got, want, rtol=RTOL, atol=ATOL)
    # Rows never looked up get no gradient in A; every column of B does.
    grad_a = np.asarray(got.weight.a)
    assert not np.any(grad_a[4:39]) and np.all(np.any(grad_a[[0, 1, 2, 3, 39]], axis=1))


def test_lookup_never_allocates_the_table():
    # Compiled memory (bytes are deterministic): looking up 16 rows of a (4096, 64)
    # LoRA table, and its gradients with respect to A and B, allocate far less than
    # the 1 MiB table; the merged table's lookup allocates at least the table.
    vocab, width = 4096, 64
    w, a, b = randn(0, (vocab, width)), randn(1, (vocab, R)), randn(2, (R, width))
    ids = ints(np.arange(16) * 97)
    table_bytes = vocab * width * 4

    def lookup(m):
        return jax.vmap(lambda i: m[i])(ids)

    def lora_loss(a, b):
        return jnp.sum(quaxlike.quaxify(lookup)(lora_from(w, a, b)) ** 2)

    def merged_loss(a, b):
        return jnp.sum(lookup(lax.stop_gradient(w) + a @ b) ** 2)

    def temp_bytes(fn):
        return jax.jit(fn).lower(a, b).compile().memory_analysis().temp_size_in_bytes

    for lora_fn, merged_fn in (
        (lora_loss, merged_loss),
        (jax.grad(lora_loss, (0, 1)), jax.grad(merged_loss, (0, 1))),
    ):
        assert temp_bytes(lora_fn) < table_bytes / 16
        assert temp_bytes(merged_fn) >= table_bytes


def test_arrays_may_be_values():
    # The rule redispatches through quaxify, so W, A and B may be Values: symbolic
    # zeros for the factors, then for the weight.
    w, a, b = _params()["rows"]
    zero_factors = lora_from(w, Zero((M, R), jnp.float32), Zero((R, N), jnp.float32))
    zero_weight = lora_from(Zero((M, N), jnp.float32), a, b)

    def f(m, i):
        return (m[i], m[:, i % N], jax.vmap(lambda j: m[j, j % N])(i))

    got = jit(lambda *ms: [quaxlike.quaxify(f)(m, IDS) for m in ms])(zero_factors, zero_weight)
    expected = [f(w, IDS), f(a @ b, IDS)]
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)
