"""Ports of the two seed documents to quaxlike.

- Quax's "Advanced tutorial - rules that redispatch back to Quax": a rank-1 LoRA
  whose matmul rule redispatches on the other operand, a sparse vector written
  "by someone else", the ambiguous-lookup failure and its two fixes.
- Qax's README: symbolic zeros (add/mul/broadcast rules, biases of a GPT-2-like
  model replaced by zeros), a LoRA matrix on a T5-like model (identical output at
  init, training where only the LoRA factors move), and nesting (a LoRA whose
  factors are symbolic zeros).

HuggingFace models cannot be downloaded here, so GPT-2 and T5 are replaced by
small hand-written forward functions over plain pytrees of parameters (and, for
the Equinox-native variants, by `eqx.nn.MLP`).

Rules registered with `quaxlike.register` are global and persist across tests, so
every type whose rules would be ambiguous (or whose rules change during a test) is
created fresh inside the test that uses it.
"""

import functools as ft
import math
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from helpers import tree_allclose
from jax import lax
from jaxtyping import Array, ArrayLike, Int, Shaped

import quaxlike
from quaxlike import lora as ql_lora
from quaxlike.internal import ShapedArray
from quaxlike.symbolic import zero as ql_zero


# Seed scenarios and training loops are user code, written with JAX's default
# dtype and rank promotion.
pytestmark = pytest.mark.loose_promotion


@pytest.fixture
def allow_rank_promotion():
    # The seed examples add a (d,) bias to (..., d) activations. The test suite runs
    # with rank promotion set to "raise"; these examples need the usual numpy rule.
    with jax.numpy_rank_promotion("allow"):
        yield


def _randn(rng, shape, scale=1.0, offset=0.0):
    # Random arrays come from numpy: every distinct shape drawn (or converted) with
    # JAX outside jit costs an XLA compilation, which dominates this file's run time.
    return jax.device_put((offset + scale * rng.standard_normal(shape)).astype(np.float32))


def _np_zeros(shape, dtype=np.float32):
    return jax.device_put(np.zeros(shape, dtype))


# =============================================================================
# Quax: advanced tutorial -- rules that redispatch back to quax(like)
# =============================================================================


def _tutorial_types(*, ambiguous=False, lora_precedence=0, combination_rule=False):
    """Fresh copies of the tutorial's `LoraArray` and `SomeKindOfSparseVector`,
    with their `dot_general` rules registered.

    - `ambiguous`: register the sparse rule with `x: ArrayLike | ArrayValue`
      (the tutorial's ambiguous version) instead of `x: Array`.
    - `lora_precedence`: precedence of the LoRA rule.
    - `combination_rule`: also register an explicit (LoraArray, sparse) rule.

    Returns a namespace with the classes and a `calls` list recording which rule
    ran, so tests can check which rule dispatch picked.
    """
    calls = []

    # Here's a rank-1 LoRA: a simple version of `quaxlike.lora.LoraArray`.
    class LoraArray(quaxlike.ArrayValue):
        w: Shaped[Array, "dim1 dim2"]  # noqa: F722
        a: Shaped[Array, " dim1"]  # noqa: F722
        b: Shaped[Array, " dim2"]  # noqa: F722

        def aval(self):
            shape = jnp.shape(self.w)
            dtype = jnp.result_type(self.w)
            return ShapedArray(shape, dtype)

        def materialise(self):
            raise ValueError("Refusing to materialise `LoraArray`")

    def _lora_matmul(w, a, b, y):
        return w @ y + a * jnp.dot(b, y)

    @quaxlike.register(lax.dot_general_p, precedence=lora_precedence)
    def dot_general_lora_any(
        x: LoraArray, y: ArrayLike | quaxlike.ArrayValue, *, dimension_numbers, **params
    ):
        calls.append("lora_any")
        ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch)) = dimension_numbers
        if x.ndim != 2 or jnp.ndim(y) != 1:
            raise NotImplementedError(
                "Have not implemented dot_general except for matrix-vector products"
            )
        if lhs_batch == () and rhs_batch == () and lhs_contract == (1,) and rhs_contract == (0,):
            # redispatch based on the type of `y`!
            return quaxlike.quaxify(_lora_matmul)(x.w, x.a, x.b, y)
        raise NotImplementedError(f"Have not implemented dot_general for {dimension_numbers}.")

    class SomeKindOfSparseVector(quaxlike.ArrayValue):
        """This represents a sparse vector with a single non-zero value."""

        index: Int[ArrayLike, ""]  # noqa: F722
        value: Shaped[ArrayLike, ""]  # noqa: F722
        length: int = eqx.field(static=True)

        def aval(self):
            shape = (self.length,)
            dtype = jnp.result_type(self.value)
            return ShapedArray(shape, dtype)

        def materialise(self):
            raise ValueError("Refusing to materialise `SomeKindOfSparseVector`")

    left_type = (ArrayLike | quaxlike.ArrayValue) if ambiguous else Array

    @quaxlike.register(lax.dot_general_p)
    def dot_general_any_sparse(
        x: left_type, y: SomeKindOfSparseVector, *, dimension_numbers, **params
    ):
        calls.append("any_sparse")
        if jnp.ndim(x) == 1:
            (length,) = x.shape
            if length != y.length:
                raise ValueError("Mismatched vector shapes")
            return x[y.index] * y.value
        elif jnp.ndim(x) == 2:
            rows, cols = x.shape
            if cols != y.length:
                raise ValueError("Mismatched matrix and vector shapes")
            return x[:, y.index] * y.value
        raise NotImplementedError(
            "Have not implemented dot_general except for matrix-vector products"
        )

    if combination_rule:

        @quaxlike.register(lax.dot_general_p)
        def dot_general_lora_sparse(
            x: LoraArray, y: SomeKindOfSparseVector, *, dimension_numbers, **params
        ):
            calls.append("lora_sparse")
            # (W + a b^T) e_i v = v * (W[:, i] + a * b[i])
            return y.value * (x.w[:, y.index] + x.a * x.b[y.index])

    return SimpleNamespace(
        LoraArray=LoraArray, SomeKindOfSparseVector=SomeKindOfSparseVector, calls=calls
    )


def matmul(a, b):
    return a @ b


def _tutorial_values(types):
    w = jnp.ones((3, 4))
    a = jnp.ones(3)
    b = jnp.ones(4)
    lora_array = types.LoraArray(w, a, b)
    sparse_vector = types.SomeKindOfSparseVector(index=2, value=5, length=4)
    dense_lora = w + jnp.outer(a, b)
    dense_sparse = jnp.zeros(4).at[2].set(5.0)
    return lora_array, sparse_vector, dense_lora, dense_sparse


# Two people's types, in two codebases, with unambiguous rules.
_TUT = _tutorial_types()


def test_tutorial_lora_matmul_with_plain_vector():
    lora_array, _, dense_lora, _ = _tutorial_values(_TUT)
    y = jnp.arange(4.0)
    out = quaxlike.quaxify(matmul)(lora_array, y)
    # The tutorial shows Array([12., 12., 12.]), which is (W + a b^T) y here.
    assert tree_allclose(out, dense_lora @ y)
    assert tree_allclose(out, jnp.full(3, 12.0))


def test_tutorial_sparse_vector_with_plain_matrix():
    _, sparse_vector, _, dense_sparse = _tutorial_values(_TUT)
    rng = np.random.default_rng(0)
    x = _randn(rng, (3, 4))
    out = quaxlike.quaxify(matmul)(x, sparse_vector)
    assert tree_allclose(out, x @ dense_sparse)
    v = _randn(rng, (4,))
    assert tree_allclose(quaxlike.quaxify(matmul)(v, sparse_vector), v @ dense_sparse)


def test_tutorial_redispatch_lora_times_sparse():
    lora_array, sparse_vector, dense_lora, dense_sparse = _tutorial_values(_TUT)
    del _TUT.calls[:]
    out = quaxlike.quaxify(matmul)(lora_array, sparse_vector)
    # The tutorial shows Array([10., 10., 10.]).
    assert tree_allclose(out, dense_lora @ dense_sparse)
    assert tree_allclose(out, jnp.full(3, 10.0))
    # The LoRA rule ran first and redispatched the two products with the sparse
    # vector (`w @ y` and `jnp.dot(b, y)`) to the sparse rule.
    assert _TUT.calls == ["lora_any", "any_sparse", "any_sparse"]


def test_tutorial_redispatch_under_jit_and_with_random_factors():
    rng = np.random.default_rng(2)
    w, a, b = _randn(rng, (3, 4)), _randn(rng, (3,)), _randn(rng, (4,))
    lora_array = _TUT.LoraArray(w, a, b)
    sparse_vector = _TUT.SomeKindOfSparseVector(index=jnp.array(1), value=jnp.array(-2.5), length=4)
    dense_sparse = jnp.zeros(4).at[1].set(-2.5)
    out = jax.jit(quaxlike.quaxify(matmul))(lora_array, sparse_vector)
    assert tree_allclose(out, (w + jnp.outer(a, b)) @ dense_sparse)


def test_tutorial_ambiguous_lookup_error():
    types = _tutorial_types(ambiguous=True)
    lora_array, sparse_vector, _, _ = _tutorial_values(types)
    with pytest.raises(
        quaxlike.AmbiguousRuleError,
        match=(
            r"(?s)Ambiguous rules for primitive `dot_general`.*LoraArray.*SomeKindOfSparseVector"
            r".*Nest `quaxify`.*filter_spec.*precedence=1"
        ),
    ) as info:
        quaxlike.quaxify(matmul)(lora_array, sparse_vector)
    message = str(info.value)
    # Both candidate rules are listed.
    assert "dot_general_lora_any" in message
    assert "dot_general_any_sparse" in message
    # It is also a LookupError, like plum's AmbiguousLookupError.
    assert isinstance(info.value, LookupError)
    # Neither rule ran: the ambiguity is detected before dispatching.
    assert types.calls == []


def test_tutorial_fix1_nested_quaxify_by_type():
    types = _tutorial_types(ambiguous=True)
    lora_array, sparse_vector, dense_lora, dense_sparse = _tutorial_values(types)

    def is_lora_array(x):
        return isinstance(x, types.LoraArray)

    def is_sparse(x):
        return isinstance(x, types.SomeKindOfSparseVector)

    fn = quaxlike.quaxify(
        quaxlike.quaxify(matmul, filter_spec=is_lora_array), filter_spec=is_sparse
    )
    out = fn(lora_array, sparse_vector)
    assert tree_allclose(out, dense_lora @ dense_sparse)
    assert tree_allclose(out, jnp.full(3, 10.0))
    # The inner quaxify (LoRA) was dispatched first.
    assert types.calls[0] == "lora_any"
    # ... and it also works under jit.
    assert tree_allclose(jax.jit(fn)(lora_array, sparse_vector), dense_lora @ dense_sparse)


def test_tutorial_fix1_nested_quaxify_by_position():
    types = _tutorial_types(ambiguous=True)
    lora_array, sparse_vector, dense_lora, dense_sparse = _tutorial_values(types)
    inner = quaxlike.quaxify(matmul, filter_spec=(False, (True, False), False))
    outer = quaxlike.quaxify(inner, filter_spec=(False, (False, True), False))
    out = outer(lora_array, sparse_vector)
    assert tree_allclose(out, dense_lora @ dense_sparse)
    assert types.calls[0] == "lora_any"


def test_tutorial_nested_quaxify_wrong_order_fails_at_trace_time():
    # Swapping the quaxifies hits `ArrayValue @ SomeKindOfSparseVector` first; that
    # indexes into the LoraArray, which has no rule for indexing and refuses to
    # materialise.
    types = _tutorial_types(ambiguous=True)
    lora_array, sparse_vector, _, _ = _tutorial_values(types)

    def is_lora_array(x):
        return isinstance(x, types.LoraArray)

    def is_sparse(x):
        return isinstance(x, types.SomeKindOfSparseVector)

    fn = quaxlike.quaxify(
        quaxlike.quaxify(matmul, filter_spec=is_sparse), filter_spec=is_lora_array
    )
    with pytest.raises(Exception, match="Refusing to materialise `LoraArray`"):
        fn(lora_array, sparse_vector)
    assert types.calls[0] == "any_sparse"


def test_tutorial_fix2_precedence():
    types = _tutorial_types(ambiguous=True, lora_precedence=1)
    lora_array, sparse_vector, dense_lora, dense_sparse = _tutorial_values(types)
    out = quaxlike.quaxify(matmul)(lora_array, sparse_vector)
    assert tree_allclose(out, dense_lora @ dense_sparse)
    assert types.calls[0] == "lora_any"


def test_tutorial_fix2_explicit_combination_rule():
    types = _tutorial_types(ambiguous=True, combination_rule=True)
    lora_array, sparse_vector, dense_lora, dense_sparse = _tutorial_values(types)
    out = quaxlike.quaxify(matmul)(lora_array, sparse_vector)
    assert tree_allclose(out, dense_lora @ dense_sparse)
    assert types.calls == ["lora_sparse"]
    # The other combinations still use their own rules.
    y = jnp.arange(4.0)
    assert tree_allclose(quaxlike.quaxify(matmul)(lora_array, y), dense_lora @ y)
    x = jnp.arange(12.0).reshape(3, 4)
    assert tree_allclose(quaxlike.quaxify(matmul)(x, sparse_vector), x @ dense_sparse)


# =============================================================================
# Qax README, example 1: a symbolic zero
# =============================================================================


def _make_qax_zeros():
    """A fresh qax-style `Zeros` class (no rules yet). `Zeros.materialised` counts
    how often one was materialised (qax warns each time)."""

    class Zeros(quaxlike.ArrayValue):
        _shape: tuple[int, ...] = eqx.field(static=True)
        _dtype: np.dtype = eqx.field(static=True)

        materialised = []  # class attribute, not a field

        def __init__(self, shape, dtype=jnp.float32):
            self._shape = tuple(int(d) for d in shape)
            self._dtype = np.dtype(dtype)

        def aval(self):
            return ShapedArray(self._shape, self._dtype)

        def materialise(self):
            type(self).materialised.append(self._shape)
            return jnp.zeros(self._shape, self._dtype)

        def __str__(self):
            return f"Zeros({self.shape}, {self.dtype})"

    return Zeros


def _dtype_of(x):
    return x.dtype if isinstance(x, quaxlike.ArrayValue) else jnp.result_type(x)


def get_binop_result_shape_dtype(a, b):
    out_shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    out_dtype = jnp.result_type(_dtype_of(a), _dtype_of(b))
    return out_shape, out_dtype


def _register_qax_add(Zeros):
    # quaxlike.register takes a primitive, a `jax.lax` primitive's name, or a list.
    @quaxlike.register("add")
    def my_add_handler(a: Zeros, b: ArrayLike | quaxlike.ArrayValue, **params):
        out_shape, out_dtype = get_binop_result_shape_dtype(a, b)
        if isinstance(b, Zeros):
            # We can return further Values if we want.
            return Zeros(shape=out_shape, dtype=out_dtype)
        # Return b, possibly modifying its shape or dtype (redispatching, in case
        # `b` is some other Value).
        return quaxlike.quaxify(lambda v: jnp.broadcast_to(v, out_shape).astype(out_dtype))(b)


def _register_qax_mul(Zeros):
    @quaxlike.register("mul")
    def handle_mul(a: Zeros, b: ArrayLike | quaxlike.ArrayValue, **params):
        out_shape, out_dtype = get_binop_result_shape_dtype(a, b)
        return Zeros(shape=out_shape, dtype=out_dtype)


def _register_qax_broadcast(Zeros):
    @quaxlike.register("broadcast_in_dim")
    def broadcast(a: Zeros, *, shape, broadcast_dimensions, **params):
        # The biases get broadcast in order to add them to the activations.
        result_shape = jax.eval_shape(
            ft.partial(
                lax.broadcast_in_dim, shape=shape, broadcast_dimensions=broadcast_dimensions
            ),
            a.aval(),
        ).shape
        return Zeros(shape=result_shape, dtype=a.dtype)


# The fully-equipped qax Zeros used by the later examples.
QaxZeros = _make_qax_zeros()
_register_qax_add(QaxZeros)
_register_qax_mul(QaxZeros)
_register_qax_broadcast(QaxZeros)


def test_qax_zeros_add_mul_walkthrough(allow_rank_promotion):
    Zeros = _make_qax_zeros()  # fresh: its rules are registered during this test
    z = Zeros(shape=(2, 3))
    assert z.shape == (2, 3) and z.dtype == jnp.float32

    @quaxlike.quaxify
    def f(x, y):
        return (x + y)[0, 0]

    def f_plain(x, y):
        return (x + y)[0, 0]

    expected = f_plain(jnp.zeros((2, 3)), jnp.ones(3))
    # No rule yet: `add` materialises the zeros (qax warns here).
    out = f(z, jnp.ones(3))
    assert tree_allclose(out, expected)
    assert tree_allclose(out, jnp.array(1.0))
    assert Zeros.materialised == [(2, 3)]

    # x + 0 == x: after registering the add rule, nothing is materialised.
    _register_qax_add(Zeros)
    del Zeros.materialised[:]
    out = f(z, jnp.ones(3))
    assert tree_allclose(out, expected)
    assert Zeros.materialised == []
    # Commutative: the rule written for (Zeros, b) is also used for (b, Zeros).
    assert tree_allclose(f(jnp.ones(3), z), f_plain(jnp.ones(3), jnp.zeros((2, 3))))
    assert Zeros.materialised == []

    # x * 0 == 0.
    _register_qax_mul(Zeros)

    @jax.jit
    @quaxlike.quaxify
    def g(x, y):
        return (1 + x) * y

    result = g(z, z)
    assert isinstance(result, Zeros)
    assert str(result) == "Zeros((2, 3), float32)"
    plain = jax.jit(lambda x, y: (1 + x) * y)(jnp.zeros((2, 3)), jnp.zeros((2, 3)))
    assert tree_allclose(quaxlike.internal.materialise_value(result), plain)
    assert Zeros.materialised == [(2, 3)]  # only by the check just above


def test_qax_zeros_grad_and_vmap():
    # "compatible with all the usual JAX transformations such as jit, vmap, grad"
    z = QaxZeros(shape=(3,))

    def h(x, y):
        return jnp.sum((x + y) * y)

    y = jnp.arange(3.0)
    grad = jax.grad(quaxlike.quaxify(h), argnums=1)(z, y)
    assert tree_allclose(grad, jax.grad(h, argnums=1)(jnp.zeros(3), y))
    batched = jax.vmap(quaxlike.quaxify(h), in_axes=(None, 0))(z, jnp.arange(6.0).reshape(2, 3))
    assert tree_allclose(
        batched, jax.vmap(h, in_axes=(None, 0))(jnp.zeros(3), jnp.arange(6.0).reshape(2, 3))
    )


# --- GPT-2-like model with its biases replaced by zeros ------------------------


def _gpt_params(seed, *, vocab=13, seq=9, dim=8, layers=2):
    rng = np.random.default_rng(seed)

    def dense(fan_in, fan_out):
        return {
            "kernel": _randn(rng, (fan_in, fan_out), 1 / math.sqrt(fan_in)),
            "bias": _randn(rng, (fan_out,)),
        }

    def ln():
        return {"scale": _randn(rng, (dim,), 0.1, offset=1.0), "bias": _randn(rng, (dim,), 0.1)}

    h = {}
    for i in range(layers):
        h[str(i)] = {
            "ln_1": ln(),
            "attn": {"c_attn": dense(dim, 3 * dim), "c_proj": dense(dim, dim)},
            "ln_2": ln(),
            "mlp": {"c_fc": dense(dim, 4 * dim), "c_proj": dense(4 * dim, dim)},
        }
    return {
        "transformer": {
            "wte": {"embedding": _randn(rng, (vocab, dim))},
            "wpe": {"embedding": _randn(rng, (seq, dim))},
            "h": h,
            "ln_f": ln(),
        }
    }


def _layer_norm(x, p):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def gpt_forward(inputs, params):
    """A GPT-2-style decoder: logits of shape (batch, seq, vocab)."""
    t = params["transformer"]
    seq = inputs.shape[-1]
    h = t["wte"]["embedding"][inputs] + t["wpe"]["embedding"][:seq]
    dim = h.shape[-1]
    mask = jnp.tril(jnp.ones((seq, seq), bool))
    for name in sorted(t["h"]):
        layer = t["h"][name]
        x = _layer_norm(h, layer["ln_1"])
        qkv = x @ layer["attn"]["c_attn"]["kernel"] + layer["attn"]["c_attn"]["bias"]
        q, k, v = jnp.split(qkv, 3, axis=-1)
        scores = jnp.einsum("btd,bsd->bts", q, k) / math.sqrt(dim)
        scores = jnp.where(mask, scores, -1e9)
        attn = jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, axis=-1), v)
        h = h + attn @ layer["attn"]["c_proj"]["kernel"] + layer["attn"]["c_proj"]["bias"]
        x = _layer_norm(h, layer["ln_2"])
        m = jax.nn.gelu(x @ layer["mlp"]["c_fc"]["kernel"] + layer["mlp"]["c_fc"]["bias"])
        h = h + m @ layer["mlp"]["c_proj"]["kernel"] + layer["mlp"]["c_proj"]["bias"]
    h = _layer_norm(h, t["ln_f"])
    return h @ t["wte"]["embedding"].T


def replace_biases(params, replacer):
    """Switch every (non-layernorm) bias in `params` for `replacer(shape=, dtype=)`."""

    def maybe_replace_val(path, val):
        if val.ndim != 1:
            return val
        # Skip layernorms
        if any(isinstance(p, jtu.DictKey) and p.key.startswith("ln") for p in path):
            return val
        return replacer(shape=val.shape, dtype=val.dtype)

    return jtu.tree_map_with_path(maybe_replace_val, params)


def test_qax_zeros_replace_gpt_biases(allow_rank_promotion):
    params = _gpt_params(0)
    inputs = jnp.arange(1, 10)[None]
    original_bias = params["transformer"]["h"]["0"]["attn"]["c_attn"]["bias"]

    # Dense zero biases, plain JAX. (Everything is jitted to keep the test fast:
    # `quaxify` runs the same way eagerly, see the walkthrough test above.)
    plain_forward = jax.jit(gpt_forward)
    params_with_dense_zeros = replace_biases(params, _np_zeros)
    expected = plain_forward(inputs, params_with_dense_zeros)
    # The replacement did something (the biases were not already zero).
    assert not tree_allclose(expected, plain_forward(inputs, params), atol=1e-3)

    # Symbolic zero biases.
    params_with_zeros = replace_biases(params, QaxZeros)
    zero_biases = [
        x
        for x in jtu.tree_leaves(params_with_zeros, is_leaf=lambda x: isinstance(x, QaxZeros))
        if isinstance(x, QaxZeros)
    ]
    assert len(zero_biases) == 8
    # The original params are untouched.
    assert params["transformer"]["h"]["0"]["attn"]["c_attn"]["bias"] is original_bias

    del QaxZeros.materialised[:]
    output = jax.jit(quaxlike.quaxify(gpt_forward))(inputs, params=params_with_zeros)
    assert tree_allclose(output, expected, rtol=1e-5, atol=1e-5)
    assert tree_allclose(jnp.mean(output[0, -1]), jnp.mean(expected[0, -1]), rtol=1e-5, atol=1e-5)
    # Same result, using 0 FLOPs for adding the biases: no zeros were built.
    assert QaxZeros.materialised == []


def test_zero_example_type_replaces_equinox_biases():
    # The Equinox-native version: the biases of an `eqx.nn.MLP` become
    # `quaxlike.symbolic.zero.Zero`.
    model = eqx.filter_jit(lambda key: eqx.nn.MLP(5, 3, 16, 2, key=key))(jr.key(0))

    def is_linear(x):
        return isinstance(x, eqx.nn.Linear)

    def get_biases(m):
        return [lin.bias for lin in jtu.tree_leaves(m, is_leaf=is_linear) if is_linear(lin)]

    dense = eqx.tree_at(get_biases, model, [_np_zeros(b.shape) for b in get_biases(model)])
    symbolic = eqx.tree_at(
        get_biases, model, [ql_zero.Zero(b.shape, b.dtype) for b in get_biases(model)]
    )
    x = _randn(np.random.default_rng(0), (5,))
    call = eqx.filter_jit(lambda m, x: m(x))
    expected = call(dense, x)
    assert not tree_allclose(expected, call(model, x), atol=1e-3)
    out = eqx.filter_jit(lambda m, x: quaxlike.quaxify(m)(x))(symbolic, x)
    assert tree_allclose(out, expected, rtol=1e-5, atol=1e-6)


# =============================================================================
# Qax README, example 2: LoRA
# =============================================================================


class LoraMatrix(quaxlike.ArrayValue):
    """Represent W + A B^T"""

    w: ArrayLike | quaxlike.ArrayValue
    a: ArrayLike | quaxlike.ArrayValue
    b: ArrayLike | quaxlike.ArrayValue

    # auxiliary (static) data example
    is_array_happy: bool = eqx.field(static=True, default=True)

    materialised = []  # class attribute, not a field

    def __check_init__(self):
        # Validation (qax's `__post_init__`).
        w_shape, a_shape, b_shape = jnp.shape(self.w), jnp.shape(self.a), jnp.shape(self.b)
        assert len(w_shape) == len(a_shape) == len(b_shape) == 2
        assert a_shape[1] == b_shape[1]
        assert a_shape[0] == w_shape[0]
        assert b_shape[0] == w_shape[1]
        assert _dtype_of(self.a) == _dtype_of(self.b) == _dtype_of(self.w)

    def aval(self):
        return ShapedArray(jnp.shape(self.w), _dtype_of(self.w))

    def materialise(self):
        type(self).materialised.append(jnp.shape(self.w))
        # The factors may themselves be Values (see example 3), so redispatch.
        return quaxlike.quaxify(lambda w, a, b: w + a @ b.T)(self.w, self.a, self.b)


def default_handler(primitive, *args, **params):
    """qax's `default_handler`: apply `primitive` to `args` as if no rule of ours
    existed. On plain arrays this is just `primitive.bind`; Values among the
    arguments are redispatched to their own rules."""
    return quaxlike.quaxify(lambda *xs: primitive.bind(*xs, **params))(*args)


@quaxlike.register("dot_general")
def lora_dot_general(x: Array, w: LoraMatrix, *, dimension_numbers, **kwargs):
    # For this example, we only handle the simple case of x @ w.
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if not (
        len(w.shape) == 2
        and lhs_contract == (x.ndim - 1,)
        and rhs_contract == (0,)
        and lhs_batch == ()
        and rhs_batch == ()
    ):
        # Only partially handle the primitive: fall back to the default logic.
        return NotImplemented

    kwargs = {**kwargs, "dimension_numbers": dimension_numbers}
    primitive = lax.dot_general_p
    result = default_handler(primitive, x, w.w, **kwargs)
    xa = default_handler(primitive, x, w.a, **kwargs)
    b_t = quaxlike.quaxify(jnp.transpose)(w.b)
    xab = default_handler(primitive, xa, b_t, **kwargs)
    return quaxlike.quaxify(jnp.add)(result, xab)


def lora_from_tree(tree, seed, lora_dim=8):
    """Replace every non-embedding weight matrix with a `LoraMatrix`."""
    rng = np.random.default_rng(seed)

    def map_fn(path, val):
        if val.ndim != 2:
            return val
        # Skip embedding params
        if any(isinstance(p, jtu.DictKey) and p.key == "embedding" for p in path):
            return val
        a = _randn(rng, (val.shape[0], lora_dim))
        b = _np_zeros((val.shape[1], lora_dim), val.dtype)
        return LoraMatrix(val, a, b)

    return jtu.tree_map_with_path(map_fn, tree)


def _is_lora(x):
    return isinstance(x, LoraMatrix)


@jax.jit
def _densify(tree):
    """Plain JAX: every LoraMatrix materialised to W + A B^T."""
    return jtu.tree_map(lambda x: x.w + x.a @ x.b.T if _is_lora(x) else x, tree, is_leaf=_is_lora)


# --- T5-like encoder-decoder ---------------------------------------------------


def _t5_params(seed, *, vocab=11, dim=8, ff=16):
    rng = np.random.default_rng(seed)

    def kernel(fan_in, fan_out):
        return {"kernel": _randn(rng, (fan_in, fan_out), 1 / math.sqrt(fan_in))}

    def attention():
        return {n: kernel(dim, dim) for n in ("q", "k", "v", "o")}

    def ln():
        return {"scale": _randn(rng, (dim,), 0.1, offset=1.0)}

    def ffn():
        return {"wi": kernel(dim, ff), "wo": kernel(ff, dim)}

    return {
        "shared": {"embedding": _randn(rng, (vocab, dim))},
        "encoder": {
            "layer_0": {"ln_attn": ln(), "attn": attention(), "ln_ff": ln(), "ff": ffn()},
            "final_ln": ln(),
        },
        "decoder": {
            "layer_0": {
                "ln_self": ln(),
                "self_attn": attention(),
                "ln_cross": ln(),
                "cross_attn": attention(),
                "ln_ff": ln(),
                "ff": ffn(),
            },
            "final_ln": ln(),
        },
    }


def _rms_norm(x, p):
    return x * lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6) * p["scale"]


def _attention(p, x, context, *, causal, heads=2):
    q = x @ p["q"]["kernel"]
    k = context @ p["k"]["kernel"]
    v = context @ p["v"]["kernel"]

    def split(t):
        return t.reshape(*t.shape[:-1], heads, t.shape[-1] // heads)

    q, k, v = split(q), split(k), split(v)
    scores = jnp.einsum("bthd,bshd->bhts", q, k)
    if causal:
        t, s = scores.shape[-2:]
        scores = jnp.where(jnp.tril(jnp.ones((t, s), bool)), scores, -1e9)
    out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(*x.shape) @ p["o"]["kernel"]


def _ffn(p, x):
    return jax.nn.relu(x @ p["wi"]["kernel"]) @ p["wo"]["kernel"]


def t5_forward(params, input_ids, decoder_input_ids):
    """A T5-style encoder-decoder: logits of shape (batch, dec_seq, vocab)."""
    emb = params["shared"]["embedding"]
    enc = params["encoder"]["layer_0"]
    h = emb[input_ids]
    x = _rms_norm(h, enc["ln_attn"])
    h = h + _attention(enc["attn"], x, x, causal=False)
    h = h + _ffn(enc["ff"], _rms_norm(h, enc["ln_ff"]))
    encoded = _rms_norm(h, params["encoder"]["final_ln"])

    dec = params["decoder"]["layer_0"]
    h = emb[decoder_input_ids]
    x = _rms_norm(h, dec["ln_self"])
    h = h + _attention(dec["self_attn"], x, x, causal=True)
    h = h + _attention(dec["cross_attn"], _rms_norm(h, dec["ln_cross"]), encoded, causal=False)
    h = h + _ffn(dec["ff"], _rms_norm(h, dec["ln_ff"]))
    h = _rms_norm(h, params["decoder"]["final_ln"])
    return h @ emb.T


_ENCODER_INPUTS = jnp.array([[3, 7, 1, 4, 1]])
_DECODER_INPUTS = jnp.array([[0, 5, 9, 2, 6, 1]])


def t5_loss(params):
    decoder_ids = _DECODER_INPUTS[:, :-1]
    targets = _DECODER_INPUTS[:, 1:]
    logits = t5_forward(params, _ENCODER_INPUTS, decoder_ids)
    logprobs = jax.nn.log_softmax(logits)
    target_logprobs = jnp.take_along_axis(logprobs, targets[:, :, None], axis=-1)
    return -jnp.sum(target_logprobs)


def test_qax_lora_matrix_matmul_and_fallback():
    rng = np.random.default_rng(3)
    w = _randn(rng, (4, 5))
    lora = LoraMatrix(w, _randn(rng, (4, 2)), _randn(rng, (5, 2)))
    assert lora.is_array_happy
    dense = w + lora.a @ lora.b.T
    x = _randn(rng, (3, 4))

    del LoraMatrix.materialised[:]
    # x @ w is handled by the rule, without forming W + A B^T.
    out = quaxlike.quaxify(matmul)(x, lora)
    assert tree_allclose(out, x @ dense, rtol=1e-5, atol=1e-5)
    assert LoraMatrix.materialised == []
    # A contraction the rule does not handle returns NotImplemented: the default
    # materialises the LoraMatrix and still gives the right answer.
    y = _randn(rng, (3, 5))
    out = quaxlike.quaxify(lambda y, w: jnp.einsum("in,mn->im", y, w))(y, lora)
    assert tree_allclose(out, jnp.einsum("in,mn->im", y, dense), rtol=1e-5, atol=1e-5)
    assert LoraMatrix.materialised == [(4, 5)]
    # The validation runs on construction.
    with pytest.raises(AssertionError):
        LoraMatrix(w, jnp.ones((4, 2)), jnp.ones((4, 2)))


def test_qax_lora_t5_identical_at_init(allow_rank_promotion):
    params = _t5_params(0)
    lora_params = lora_from_tree(params, 1234)
    loras = [x for x in jtu.tree_leaves(lora_params, is_leaf=_is_lora) if _is_lora(x)]
    assert len(loras) == 16  # 4 + 2 in the encoder, 4 + 4 + 2 in the decoder
    # The embedding was skipped.
    assert not _is_lora(lora_params["shared"]["embedding"])

    # (Jitted to keep the test fast; `quaxify` runs the same way eagerly.)
    plain_forward = jax.jit(t5_forward)
    lora_forward = jax.jit(quaxlike.quaxify(t5_forward))
    orig_output = plain_forward(params, _ENCODER_INPUTS, _DECODER_INPUTS)
    del LoraMatrix.materialised[:]
    lora_output = lora_forward(lora_params, _ENCODER_INPUTS, _DECODER_INPUTS)
    # Identical to the unmodified network ...
    assert float(jnp.max(jnp.abs(lora_output - orig_output))) == 0.0
    # ... and W + A B^T was never built.
    assert LoraMatrix.materialised == []

    # With non-zero B the LoRA output matches the network with merged weights.
    nonzero = jtu.tree_map(
        lambda x: (
            eqx.tree_at(lambda m: m.b, x, jax.device_put(np.full(x.b.shape, 0.1, np.float32)))
            if _is_lora(x)
            else x
        ),
        lora_params,
        is_leaf=_is_lora,
    )
    merged_output = plain_forward(_densify(nonzero), _ENCODER_INPUTS, _DECODER_INPUTS)
    assert not tree_allclose(merged_output, orig_output, atol=1e-3)
    assert tree_allclose(
        lora_forward(nonzero, _ENCODER_INPUTS, _DECODER_INPUTS),
        merged_output,
        rtol=1e-4,
        atol=1e-4,
    )
    assert LoraMatrix.materialised == []


def _lora_factor_spec(tree, *, w, a, b, other):
    """A pytree matching `tree`: `w`/`a`/`b` on the LoraMatrix fields, `other` on
    every other leaf."""
    return jtu.tree_map(
        lambda x: eqx.tree_at(lambda m: (m.w, m.a, m.b), x, (w, a, b)) if _is_lora(x) else other,
        tree,
        is_leaf=_is_lora,
    )


def test_qax_lora_training_only_factors_update(allow_rank_promotion):
    params = _t5_params(0)
    lora_params = lora_from_tree(params, 1234, lora_dim=4)
    # Only the LoRA factors are trained: partition them out (qax's freeze_keys,
    # and more: embeddings and norms are frozen too).
    spec = _lora_factor_spec(lora_params, w=False, a=True, b=True, other=False)
    trainable, frozen = eqx.partition(lora_params, spec)
    optimizer = optax.adam(1e-2)

    # No code changes from an ordinary training loop other than quaxify.
    @quaxlike.quaxify
    def loss_fn(params):
        return t5_loss(params)

    def loss_of(trainable, frozen):
        return loss_fn(eqx.combine(trainable, frozen))

    grad_fn = jax.value_and_grad(loss_of)

    @jax.jit
    def update(trainable, frozen, opt_state):
        loss, grads = grad_fn(trainable, frozen)
        updates, new_opt_state = optimizer.update(grads, opt_state, params=trainable)
        new_trainable = optax.apply_updates(trainable, updates)
        return loss, grads, new_trainable, new_opt_state

    opt_state = jax.jit(optimizer.init)(trainable)
    losses = []
    for _ in range(10):
        before = trainable
        loss, grads, trainable, opt_state = update(trainable, frozen, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1
    trained = eqx.combine(trainable, frozen)

    # Plain JAX, on the network with merged weights W + A B^T.
    dense_grad_fn = jax.jit(jax.value_and_grad(lambda t, f: t5_loss(_densify(eqx.combine(t, f)))))
    # At step 0 the loss was that of the original network.
    initial_trainable = eqx.filter(lora_params, spec)
    assert np.allclose(losses[0], dense_grad_fn(initial_trainable, frozen)[0], rtol=1e-5, atol=0)
    # The last gradients (B is no longer zero, so neither is the gradient with
    # respect to A) are those of the network with merged weights.
    expected_loss, expected_grads = dense_grad_fn(before, frozen)
    assert np.allclose(losses[-1], expected_loss, rtol=1e-5, atol=0)
    assert tree_allclose(grads, expected_grads, rtol=1e-3, atol=1e-4)
    # Everything but the factors is unchanged ...
    assert tree_allclose(
        eqx.filter(trained, spec, inverse=True), eqx.filter(lora_params, spec, inverse=True)
    )
    # ... and every factor moved (B is no longer zero).
    for new, old in zip(
        jtu.tree_leaves(trained, is_leaf=_is_lora), jtu.tree_leaves(lora_params, is_leaf=_is_lora)
    ):
        if _is_lora(new):
            assert not tree_allclose(new.a, old.a)
            assert np.abs(np.asarray(new.b)).max() > 0


def freeze_keys(optimizer, arr_type, keys):
    """qax.utils.freeze_keys: leave the fields `keys` of every `arr_type` in the
    parameters untouched; everything else is updated by `optimizer`."""

    def labels(params):
        def label(x):
            if isinstance(x, arr_type):
                x = jtu.tree_map(lambda _: "train", x)
                return eqx.tree_at(
                    lambda m: [getattr(m, k) for k in keys], x, ["freeze"] * len(keys)
                )
            return "train"

        return jtu.tree_map(label, params, is_leaf=lambda x: isinstance(x, arr_type))

    return optax.multi_transform({"train": optimizer, "freeze": optax.set_to_zero()}, labels)


def test_qax_lora_training_freeze_keys_matches_plain_jax(allow_rank_promotion):
    params = _t5_params(0)
    lora_params = lora_from_tree(params, 1234, lora_dim=4)
    optimizer = freeze_keys(optax.sgd(0.05), LoraMatrix, ["w"])
    grad_fn = jax.value_and_grad(quaxlike.quaxify(t5_loss))

    @jax.jit
    def update(params, opt_state):
        loss, grads = grad_fn(params)
        updates, new_opt_state = optimizer.update(grads, opt_state, params=params)
        return loss, optax.apply_updates(params, updates), new_opt_state

    # The same training in plain JAX: each LoraMatrix is a dict of its three arrays,
    # materialised densely by the forward pass, with `w` frozen.
    def as_dict(tree):
        return jtu.tree_map(
            lambda x: {"w": x.w, "a": x.a, "b": x.b} if _is_lora(x) else x, tree, is_leaf=_is_lora
        )

    def is_factors(x):
        return isinstance(x, dict) and set(x) == {"w", "a", "b"}

    def plain_loss(p):
        dense = jtu.tree_map(
            lambda x: x["w"] + x["a"] @ x["b"].T if is_factors(x) else x, p, is_leaf=is_factors
        )
        return t5_loss(dense)

    plain_labels = jtu.tree_map(
        lambda x: {"w": "freeze", "a": "train", "b": "train"} if is_factors(x) else "train",
        as_dict(lora_params),
        is_leaf=is_factors,
    )
    plain_optimizer = optax.multi_transform(
        {"train": optax.sgd(0.05), "freeze": optax.set_to_zero()}, plain_labels
    )

    @jax.jit
    def plain_update(p, opt_state):
        loss, grads = jax.value_and_grad(plain_loss)(p)
        updates, new_opt_state = plain_optimizer.update(grads, opt_state, params=p)
        return loss, optax.apply_updates(p, updates), new_opt_state

    p, state = lora_params, jax.jit(optimizer.init)(lora_params)
    q, plain_state = as_dict(lora_params), jax.jit(plain_optimizer.init)(as_dict(lora_params))
    losses, plain_losses = [], []
    for _ in range(5):
        loss, p, state = update(p, state)
        plain_loss_value, q, plain_state = plain_update(q, plain_state)
        losses.append(float(loss))
        plain_losses.append(float(plain_loss_value))

    assert tree_allclose(np.array(losses), np.array(plain_losses), rtol=1e-4, atol=1e-4)
    assert losses[-1] < losses[0]
    assert tree_allclose(as_dict(p), q, rtol=1e-3, atol=1e-4)
    for new, old in zip(
        jtu.tree_leaves(p, is_leaf=_is_lora), jtu.tree_leaves(lora_params, is_leaf=_is_lora)
    ):
        if _is_lora(new):
            assert tree_allclose(new.w, old.w)  # frozen
            assert np.abs(np.asarray(new.b)).max() > 0  # trained


def test_lora_example_type_on_equinox_model():
    # The Equinox-native version with `quaxlike.lora`: identical output at
    # init; training with optax changes only the factors.
    make = eqx.filter_jit(
        lambda k1, k2: (lambda m: (m, ql_lora.loraify(m, rank=2, key=k2)))(
            eqx.nn.MLP(4, 2, 8, 2, key=k1)
        )
    )
    model, lora_model = make(jr.key(1), jr.key(2))
    rng = np.random.default_rng(4)
    x = _randn(rng, (16, 4))
    y = _randn(rng, (16, 2))
    batched = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    batched_quax = eqx.filter_jit(lambda m, x: jax.vmap(quaxlike.quaxify(m))(x))
    expected = batched(model, x)
    assert tree_allclose(batched_quax(lora_model, x), expected)

    spec = ql_lora.trainable_filter(lora_model)
    trainable, frozen = eqx.partition(lora_model, spec)
    optimizer = optax.adam(3e-2)
    opt_state = jax.jit(optimizer.init)(trainable)

    def loss_fn(trainable):
        m = eqx.combine(trainable, frozen)
        return jnp.mean((jax.vmap(quaxlike.quaxify(m))(x) - y) ** 2)

    @jax.jit
    def step(trainable, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return loss, optax.apply_updates(trainable, updates), opt_state

    losses = []
    for _ in range(10):
        loss, trainable, opt_state = step(trainable, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    trained = eqx.combine(trainable, frozen)
    assert tree_allclose(
        eqx.filter(trained, spec, inverse=True), eqx.filter(lora_model, spec, inverse=True)
    )
    merged = eqx.filter_jit(lambda m, x: jax.vmap(ql_lora.merge(m))(x))
    assert tree_allclose(
        batched_quax(trained, x),
        merged(trained, x),
        rtol=1e-4,
        atol=1e-5,
    )


# =============================================================================
# Qax README, example 3: nesting
# =============================================================================


def test_qax_nesting_lora_with_symbolic_zero_factors():
    @quaxlike.quaxify
    def g(w, x):
        return jnp.sum(x @ w)

    w = jnp.ones((3, 5))
    x = jnp.arange(3, dtype=jnp.float32)
    original = g(w, x)
    assert tree_allclose(original, jnp.sum(x @ w))
    assert tree_allclose(original, jnp.array(15.0))  # as printed by the README

    lora_with_symbolic_zero = LoraMatrix(
        w=w,
        a=QaxZeros(shape=(w.shape[0], 6)),
        b=QaxZeros(shape=(w.shape[1], 6)),
    )
    del QaxZeros.materialised[:]
    del LoraMatrix.materialised[:]
    out = g(lora_with_symbolic_zero, x)
    assert tree_allclose(out, original)
    # The LoraMatrix itself was never materialised; its qax Zeros factors were, for
    # `dot_general` and `transpose` (the two warnings qax prints), since they have
    # no rules for those.
    assert LoraMatrix.materialised == []
    assert sorted(QaxZeros.materialised) == [(3, 6), (5, 6)]

    # With `quaxlike.symbolic.zero.Zero` (which has dot_general and transpose rules)
    # as the factors, nothing needs materialising; the result is the same.
    lora_with_zero = LoraMatrix(
        w=w,
        a=ql_zero.Zero((w.shape[0], 6), jnp.float32),
        b=ql_zero.Zero((w.shape[1], 6), jnp.float32),
    )
    assert tree_allclose(g(lora_with_zero, x), original)
    assert tree_allclose(jax.jit(g)(lora_with_zero, x), original)
    assert LoraMatrix.materialised == []

    # Non-trivial weights: still what plain JAX computes.
    w2 = _randn(np.random.default_rng(5), (3, 5))
    lora2 = LoraMatrix(w=w2, a=QaxZeros(shape=(3, 2)), b=QaxZeros(shape=(5, 2)))
    assert tree_allclose(g(lora2, x), jnp.sum(x @ w2), rtol=1e-5, atol=1e-5)


def test_lora_example_type_with_zero_factors():
    # The same nesting with both example types of quaxlike.
    w = _randn(np.random.default_rng(6), (3, 5))
    lora = ql_lora.LoraArray(w, rank=2, key=jr.key(7))
    lora = lora.with_factors(
        w, ql_zero.Zero((3, 2), jnp.float32), ql_zero.Zero((2, 5), jnp.float32)
    )
    x = jnp.arange(3, dtype=jnp.float32)
    v = jnp.arange(5, dtype=jnp.float32)
    assert tree_allclose(quaxlike.quaxify(matmul)(x, lora), x @ w, rtol=1e-5, atol=1e-5)
    assert tree_allclose(quaxlike.quaxify(matmul)(lora, v), w @ v, rtol=1e-5, atol=1e-5)
