"""A broad sweep of JAX operations run through `quaxlike.quaxify`.

Every case runs (a) on plain arrays, (b) with every array argument wrapped in
`PassThrough` and (c) with every array argument wrapped in `DenseArrayValue`, and
compares the result with plain JAX. PassThrough results must come back as
PassThrough (the operation ran on the Value); DenseArrayValue results must come
back as plain arrays (it materialises).
"""

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import materialise_tree, PassThrough, tree_allclose

import quaxlike


# --- inputs ------------------------------------------------------------------

_rng = np.random.default_rng(0)


def f32(*shape, low=-2.0, high=2.0):
    return jnp.asarray(_rng.uniform(low, high, shape).astype(np.float32))


def pos(*shape):
    return f32(*shape, low=0.5, high=2.0)


def i32(*shape, low=-5, high=6):
    return jnp.asarray(_rng.integers(low, high, shape).astype(np.int32))


def b(*shape):
    return jnp.asarray(_rng.integers(0, 2, shape).astype(bool))


def c64(*shape):
    return jnp.asarray(
        (_rng.normal(size=shape) + 1j * _rng.normal(size=shape)).astype(np.complex64)
    )


def spd(n):
    a = _rng.normal(size=(n, n)).astype(np.float32)
    return jnp.asarray(a @ a.T + n * np.eye(n, dtype=np.float32))


def sym(n):
    a = _rng.normal(size=(n, n)).astype(np.float32)
    return jnp.asarray((a + a.T) / 2)


def lower(n):
    a = np.tril(_rng.normal(size=(n, n)).astype(np.float32)) + 3 * np.eye(n, dtype=np.float32)
    return jnp.asarray(a)


@jax.custom_jvp
def my_custom_sin(x):
    return jnp.sin(x)


@my_custom_sin.defjvp
def _my_custom_sin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.sin(x), jnp.cos(x) * t


@jax.custom_jvp
def my_custom_binary(x, y):
    return x * y + jnp.exp(y)


@my_custom_binary.defjvp
def _my_custom_binary_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    return my_custom_binary(x, y), tx * y + ty * (x + jnp.exp(y))


# (id, function, args). Every array argument is wrapped when testing Values;
# non-array arguments (Python ints, tuples) are passed through as they are.
CASES = [
    # elementwise unary, float
    ("neg", jnp.negative, (f32(3, 4),)),
    ("abs", jnp.abs, (f32(3, 4),)),
    ("sign", jnp.sign, (f32(3, 4),)),
    ("floor", jnp.floor, (f32(3, 4),)),
    ("round", jnp.round, (f32(3, 4),)),
    ("exp", jnp.exp, (f32(3, 4),)),
    ("expm1", jnp.expm1, (f32(3, 4),)),
    ("log", jnp.log, (pos(3, 4),)),
    ("log1p", jnp.log1p, (pos(3, 4),)),
    ("sqrt", jnp.sqrt, (pos(3, 4),)),
    ("rsqrt", jax.lax.rsqrt, (pos(3, 4),)),
    ("sin", jnp.sin, (f32(3, 4),)),
    ("cos", jnp.cos, (f32(3, 4),)),
    ("arcsin", jnp.arcsin, (f32(3, 4, low=-0.9, high=0.9),)),
    ("arctan", jnp.arctan, (f32(3, 4),)),
    ("tanh", jnp.tanh, (f32(3, 4),)),
    ("arctanh", jnp.arctanh, (f32(3, 4, low=-0.9, high=0.9),)),
    ("logistic", jax.nn.sigmoid, (f32(3, 4),)),
    ("erf", jax.scipy.special.erf, (f32(3, 4),)),
    ("lgamma", jax.scipy.special.gammaln, (pos(3, 4),)),
    ("isfinite", jnp.isfinite, (f32(3, 4),)),
    ("square", jnp.square, (f32(3, 4),)),
    # elementwise binary, float
    ("add", jnp.add, (f32(3, 4), f32(3, 4))),
    ("sub", jnp.subtract, (f32(3, 4), f32(3, 4))),
    ("mul", jnp.multiply, (f32(3, 4), f32(3, 4))),
    ("div", jnp.divide, (f32(3, 4), pos(3, 4))),
    ("max", jnp.maximum, (f32(3, 4), f32(3, 4))),
    ("min", jnp.minimum, (f32(3, 4), f32(3, 4))),
    ("atan2", jnp.arctan2, (f32(3, 4), f32(3, 4))),
    ("fmod", jnp.fmod, (f32(3, 4), pos(3, 4))),
    ("broadcast_add", jnp.add, (f32(3, 1), f32(1, 4))),
    ("scalar_mul_left", lambda x: 2.0 * x, (f32(3, 4),)),
    ("scalar_mul_right", lambda x: x * 2.0, (f32(3, 4),)),
    ("scalar_rsub", lambda x: 1.0 - x, (f32(3, 4),)),
    ("scalar_rdiv", lambda x: 1.0 / x, (pos(3, 4),)),
    ("operators", lambda x, y: (x + y) * (x - y) / (y * y + 1.0) ** 2, (f32(3, 4), f32(3, 4))),
    # integer
    ("int_add", jnp.add, (i32(3, 4), i32(3, 4))),
    ("int_mul", jnp.multiply, (i32(3, 4), i32(3, 4))),
    ("int_floor_divide", jnp.floor_divide, (i32(3, 4), i32(3, 4, low=1, high=5))),
    ("int_rem", jax.lax.rem, (i32(3, 4), i32(3, 4, low=1, high=5))),
    ("int_abs", jnp.abs, (i32(3, 4),)),
    ("int_bitwise_and", jnp.bitwise_and, (i32(3, 4), i32(3, 4))),
    ("int_bitwise_or", jnp.bitwise_or, (i32(3, 4), i32(3, 4))),
    ("int_bitwise_xor", jnp.bitwise_xor, (i32(3, 4), i32(3, 4))),
    ("int_shift_left", jnp.left_shift, (i32(3, 4), i32(3, 4, low=0, high=4))),
    ("int_shift_right", jnp.right_shift, (i32(3, 4), i32(3, 4, low=0, high=4))),
    ("int_population_count", jax.lax.population_count, (i32(3, 4, low=0, high=100),)),
    ("int_scalar", lambda x: 3 * x + 1, (i32(3, 4),)),
    ("int_true_divide", jnp.true_divide, (i32(3, 4), i32(3, 4, low=1, high=5))),
    # bool
    ("bool_and", jnp.logical_and, (b(3, 4), b(3, 4))),
    ("bool_or", jnp.logical_or, (b(3, 4), b(3, 4))),
    ("bool_not", jnp.logical_not, (b(3, 4),)),
    ("bool_operators", lambda x, y: (x & y) | ~x, (b(3, 4), b(3, 4))),
    ("bool_any", jnp.any, (b(3, 4),)),
    ("bool_all", lambda x: jnp.all(x, axis=1), (b(3, 4),)),
    ("bool_to_float", lambda x: x.astype(jnp.float32), (b(3, 4),)),
    # complex
    ("complex_add", jnp.add, (c64(3, 4), c64(3, 4))),
    ("complex_mul", jnp.multiply, (c64(3, 4), c64(3, 4))),
    ("complex_abs", jnp.abs, (c64(3, 4),)),
    ("complex_conj", jnp.conj, (c64(3, 4),)),
    ("complex_real_imag", lambda z: (jnp.real(z), jnp.imag(z)), (c64(3, 4),)),
    ("complex_exp", jnp.exp, (c64(3, 4),)),
    ("complex_make", jax.lax.complex, (f32(3, 4), f32(3, 4))),
    ("complex_matmul", jnp.matmul, (c64(3, 4), c64(4, 2))),
    # comparisons and selection
    ("eq", jnp.equal, (i32(3, 4), i32(3, 4))),
    ("ne", jnp.not_equal, (i32(3, 4), i32(3, 4))),
    ("lt", jnp.less, (f32(3, 4), f32(3, 4))),
    ("gt", jnp.greater, (f32(3, 4), f32(3, 4))),
    ("compare_scalar", lambda x: x > 0.5, (f32(3, 4),)),
    ("where", jnp.where, (b(3, 4), f32(3, 4), f32(3, 4))),
    ("where_scalar", lambda x: jnp.where(x > 0, x, 0.0), (f32(3, 4),)),
    ("select_n", jax.lax.select_n, (i32(3, 4, low=0, high=3), f32(3, 4), f32(3, 4), f32(3, 4))),
    ("clamp", jax.lax.clamp, (jnp.float32(-0.5), f32(3, 4), jnp.float32(0.5))),
    ("clip", lambda x: jnp.clip(x, -0.5, 0.5), (f32(3, 4),)),
    # reductions
    ("sum", jnp.sum, (f32(3, 4),)),
    ("sum_axis", lambda x: jnp.sum(x, axis=0), (f32(3, 4),)),
    ("sum_keepdims", lambda x: jnp.sum(x, axis=1, keepdims=True), (f32(3, 4),)),
    ("max_reduce", lambda x: jnp.max(x, axis=1), (f32(3, 4),)),
    ("min_reduce", jnp.min, (f32(3, 4),)),
    ("prod", lambda x: jnp.prod(x, axis=0), (f32(3, 4),)),
    ("mean_var", lambda x: (jnp.mean(x), jnp.var(x, axis=0)), (f32(3, 4),)),
    ("argmax", lambda x: jnp.argmax(x, axis=1), (f32(3, 4),)),
    ("argmin", jnp.argmin, (f32(3, 4),)),
    ("norm", jnp.linalg.norm, (f32(3, 4),)),
    ("cumsum", lambda x: jnp.cumsum(x, axis=1), (f32(3, 4),)),
    ("cumprod", lambda x: jnp.cumprod(x, axis=0), (f32(3, 4),)),
    ("logcumsumexp", lambda x: jax.lax.cumlogsumexp(x, axis=1), (f32(3, 4),)),
    # contractions
    (
        "dot_general",
        lambda x, y: jax.lax.dot_general(x, y, (((1,), (0,)), ((), ()))),
        (f32(3, 4), f32(4, 5)),
    ),
    (
        "dot_general_batch",
        lambda x, y: jax.lax.dot_general(x, y, (((2,), (1,)), ((0,), (0,)))),
        (f32(2, 3, 4), f32(2, 4, 5)),
    ),
    ("matmul", jnp.matmul, (f32(3, 4), f32(4, 5))),
    ("matmul_op", lambda x, y: x @ y, (f32(2, 3, 4), f32(2, 4, 5))),
    ("matvec", jnp.matmul, (f32(3, 4), f32(4))),
    ("int_matmul", jnp.matmul, (i32(3, 4), i32(4, 2))),
    ("einsum", lambda x, y: jnp.einsum("ij,jk->ik", x, y), (f32(3, 4), f32(4, 5))),
    ("einsum_batch", lambda x, y: jnp.einsum("bij,bjk->bki", x, y), (f32(2, 3, 4), f32(2, 4, 5))),
    (
        "conv",
        lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME"),
        (f32(2, 3, 8, 8), f32(4, 3, 3, 3)),
    ),
    (
        "conv_strided_dilated",
        lambda x, w: jax.lax.conv_general_dilated(
            x, w, (2, 1), "VALID", lhs_dilation=(1, 1), rhs_dilation=(1, 2)
        ),
        (f32(1, 2, 9, 9), f32(3, 2, 3, 2)),
    ),
    ("convolve_1d", jnp.convolve, (f32(8), f32(3))),
    # shape manipulation
    ("reshape", lambda x: x.reshape(4, 3), (f32(3, 4),)),
    ("transpose", lambda x: jnp.transpose(x, (2, 0, 1)), (f32(2, 3, 4),)),
    ("squeeze", lambda x: jnp.squeeze(x, axis=1), (f32(3, 1, 4),)),
    ("expand_dims", lambda x: jnp.expand_dims(x, 1), (f32(3, 4),)),
    ("none_index", lambda x: x[:, None], (f32(3, 4),)),
    ("broadcast_to", lambda x: jnp.broadcast_to(x, (2, 3, 4)), (f32(3, 4),)),
    ("concatenate", lambda x, y: jnp.concatenate([x, y], axis=0), (f32(3, 4), f32(2, 4))),
    ("stack", lambda x, y: jnp.stack([x, y]), (f32(3, 4), f32(3, 4))),
    ("split", lambda x: jnp.split(x, 2, axis=1), (f32(3, 4),)),
    ("pad", lambda x: jnp.pad(x, ((1, 2), (0, 1))), (f32(3, 4),)),
    ("pad_lax_negative", lambda x: jax.lax.pad(x, 0.0, ((1, -1, 1), (0, 0, 0))), (f32(3, 4),)),
    ("rev", lambda x: jnp.flip(x, axis=1), (f32(3, 4),)),
    ("roll", lambda x: jnp.roll(x, 1, axis=0), (f32(3, 4),)),
    ("repeat", lambda x: jnp.repeat(x, 2, axis=0), (f32(3, 4),)),
    # indexing
    ("slice", lambda x: x[1:3, ::2], (f32(4, 5),)),
    ("int_index", lambda x: x[2], (f32(4, 5),)),
    (
        "dynamic_slice",
        lambda x, i: jax.lax.dynamic_slice(x, (i, 1), (2, 3)),
        (f32(4, 5), jnp.int32(1)),
    ),
    (
        "dynamic_update_slice",
        lambda x, u, i: jax.lax.dynamic_update_slice(x, u, (i, 0)),
        (f32(4, 5), f32(2, 5), jnp.int32(2)),
    ),
    ("gather", lambda x, idx: x[idx], (f32(4, 5), jnp.array([3, 0, 1], jnp.int32))),
    (
        "gather_2d",
        lambda x, i, j: x[i, j],
        (f32(4, 5), jnp.array([3, 0], jnp.int32), jnp.array([1, 4], jnp.int32)),
    ),
    ("gather_bool_where", lambda x: x[jnp.array([True, False, True, False])].sum(), (f32(4, 5),)),
    (
        "take_along_axis",
        lambda x, i: jnp.take_along_axis(x, i, axis=1),
        (f32(3, 4), i32(3, 2, low=0, high=4)),
    ),
    ("scatter_set", lambda x, v: x.at[1].set(v), (f32(4, 5), f32(5))),
    (
        "scatter_add",
        lambda x, i, v: x.at[i].add(v),
        (f32(4, 5), jnp.array([0, 2, 0], jnp.int32), f32(3, 5)),
    ),
    ("scatter_mul", lambda x: x.at[:, 1].multiply(3.0), (f32(4, 5),)),
    # iota-using code
    ("arange_add", lambda x: x + jnp.arange(x.shape[-1], dtype=x.dtype)[None, :], (f32(3, 4),)),
    ("tril", jnp.tril, (f32(4, 4),)),
    ("eye_matmul", lambda x: jnp.eye(3, dtype=x.dtype) @ x, (f32(3, 4),)),
    ("one_hot", lambda i: jax.nn.one_hot(i, 5), (i32(4, low=0, high=5),)),
    ("diag", jnp.diag, (f32(4, 4),)),
    # sorting
    ("sort", lambda x: jnp.sort(x, axis=-1), (f32(3, 5),)),
    ("argsort", lambda x: jnp.argsort(x, axis=0), (f32(3, 5),)),
    ("lax_sort_multi", lambda k, v: jax.lax.sort((k, v), num_keys=1), (f32(6), i32(6))),
    ("top_k", lambda x: jax.lax.top_k(x, 2), (f32(3, 5),)),
    ("median", jnp.median, (f32(7),)),
    # powers and conversions
    ("integer_pow", lambda x: x**3, (f32(3, 4),)),
    ("pow", jnp.power, (pos(3, 4), f32(3, 4))),
    ("pow_scalar_exponent", lambda x: x**2.5, (pos(3, 4),)),
    ("int_pow", lambda x, y: jax.lax.pow(x, y), (pos(3, 4), i32(3, 4, low=0, high=4))),
    ("astype_int", lambda x: x.astype(jnp.int32), (f32(3, 4),)),
    ("astype_bf16_back", lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), (f32(3, 4),)),
    ("convert_element_type", lambda x: jax.lax.convert_element_type(x, jnp.float32), (i32(3, 4),)),
    ("bitcast", lambda x: jax.lax.bitcast_convert_type(x, jnp.int32), (f32(3, 4),)),
    (
        "reduce_precision",
        lambda x: jax.lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10),
        (f32(3, 4),),
    ),
    ("stop_gradient", jax.lax.stop_gradient, (f32(3, 4),)),
    # linear algebra
    ("cholesky", jnp.linalg.cholesky, (spd(4),)),
    ("qr", jnp.linalg.qr, (f32(5, 3),)),
    ("svd", lambda x: jnp.linalg.svd(x, compute_uv=False), (f32(4, 3),)),
    ("svd_full", lambda x: jnp.linalg.svd(x, full_matrices=False), (f32(4, 3),)),
    ("eigh_values", jnp.linalg.eigvalsh, (sym(4),)),
    ("eigh", jnp.linalg.eigh, (sym(4),)),
    (
        "triangular_solve",
        lambda a, y: jax.lax.linalg.triangular_solve(a, y, left_side=True, lower=True),
        (lower(4), f32(4, 2)),
    ),
    (
        "solve_triangular",
        lambda a, y: jax.scipy.linalg.solve_triangular(a, y, lower=True),
        (lower(4), f32(4, 2)),
    ),
    ("solve", jnp.linalg.solve, (spd(4), f32(4, 2))),
    ("slogdet", jnp.linalg.slogdet, (spd(3),)),
    ("lu", jax.scipy.linalg.lu_factor, (spd(3),)),
    # fft
    ("fft", jnp.fft.fft, (c64(8),)),
    ("rfft", jnp.fft.rfft, (f32(8),)),
    ("irfft", lambda z: jnp.fft.irfft(z, n=8), (c64(5),)),
    # jax.nn and custom_jvp functions
    ("relu", jax.nn.relu, (f32(3, 4),)),
    ("softmax", lambda x: jax.nn.softmax(x, axis=-1), (f32(3, 4),)),
    ("log_softmax", jax.nn.log_softmax, (f32(3, 4),)),
    ("gelu", jax.nn.gelu, (f32(3, 4),)),
    ("silu", jax.nn.silu, (f32(3, 4),)),
    ("softplus", jax.nn.softplus, (f32(3, 4),)),
    ("logsumexp", lambda x: jax.nn.logsumexp(x, axis=1), (f32(3, 4),)),
    ("custom_jvp_unary", my_custom_sin, (f32(3, 4),)),
    ("custom_jvp_binary", my_custom_binary, (f32(3, 4), f32(3, 4))),
    ("custom_jvp_mixed", lambda x: my_custom_binary(x, jnp.ones_like(x)), (f32(3, 4),)),
    # small compositions
    (
        "mlp",
        lambda x, w1, w2: jax.nn.softmax(jax.nn.relu(x @ w1) @ w2),
        (f32(2, 4), f32(4, 8), f32(8, 3)),
    ),
    (
        "layernorm",
        lambda x: (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5),
        (f32(3, 4),),
    ),
]

CASE_IDS = [c[0] for c in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS)

# Tolerances for operations whose result may differ in the last bits when the
# same primitives run through a different code path.
_TOLERANCES = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture
def no_leak_check():
    """The tracer-leak checker (on for every test, see conftest.py) turns off JAX's
    compilation caches and searches the heap after every `quaxify` call, which makes
    a sweep of hundreds of operations take minutes. The sweeps run without it;
    `test_leak_checked` runs a representative subset with it on."""
    with jax.check_tracer_leaks(False):
        yield


def _wrap(cls, args):
    return tuple(cls(a) if isinstance(a, jax.Array) else a for a in args)


def _leaves(tree):
    return jtu.tree_leaves(tree, is_leaf=lambda x: isinstance(x, quaxlike.Value))


@pytest.mark.parametrize("name,fn,args", CASES, ids=CASE_IDS)
def test_plain_arrays(name, fn, args, no_leak_check):
    expected = fn(*args)
    out = quaxlike.quaxify(fn)(*args)
    assert tree_allclose(out, expected)


@pytest.mark.parametrize("name,fn,args", CASES, ids=CASE_IDS)
def test_passthrough(name, fn, args, no_leak_check):
    expected = fn(*args)
    out = quaxlike.quaxify(fn)(*_wrap(PassThrough, args))
    leaves = _leaves(out)
    assert len(leaves) > 0
    for leaf in leaves:
        assert isinstance(leaf, PassThrough), type(leaf)
        assert isinstance(leaf.array, jax.Array)
    assert tree_allclose(materialise_tree(out), expected, **_TOLERANCES)


@pytest.mark.parametrize("name,fn,args", CASES, ids=CASE_IDS)
def test_dense_array_value(name, fn, args, no_leak_check):
    expected = fn(*args)
    out = quaxlike.quaxify(fn)(*_wrap(quaxlike.DenseArrayValue, args))
    for leaf in _leaves(out):
        assert not isinstance(leaf, quaxlike.Value), type(leaf)
        assert isinstance(leaf, jax.Array)
    assert tree_allclose(out, expected, **_TOLERANCES)


# --- transformations ---------------------------------------------------------

_SUBSET = [
    "exp",
    "add",
    "broadcast_add",
    "scalar_mul_left",
    "int_mul",
    "bool_and",
    "complex_mul",
    "where",
    "select_n",
    "sum_axis",
    "argmax",
    "cumsum",
    "dot_general",
    "einsum",
    "conv",
    "reshape",
    "concatenate",
    "pad",
    "rev",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "scatter_add",
    "arange_add",
    "sort",
    "top_k",
    "integer_pow",
    "astype_int",
    "cholesky",
    "solve",
    "rfft",
    "relu",
    "softmax",
    "gelu",
    "logsumexp",
    "custom_jvp_unary",
    "custom_jvp_binary",
    "mlp",
]
SUBSET = [c for c in CASES if c[0] in _SUBSET]
assert len(SUBSET) == len(_SUBSET)


@pytest.mark.parametrize("name,fn,args", SUBSET, ids=[c[0] for c in SUBSET])
def test_jit_outside_quaxify(name, fn, args, no_leak_check):
    expected = fn(*args)
    out = jax.jit(quaxlike.quaxify(fn))(*_wrap(PassThrough, args))
    leaves = _leaves(out)
    assert len(leaves) > 0 and all(isinstance(x, PassThrough) for x in leaves)
    assert tree_allclose(materialise_tree(out), expected, **_TOLERANCES)


@pytest.mark.parametrize("name,fn,args", SUBSET, ids=[c[0] for c in SUBSET])
def test_jit_inside_quaxify(name, fn, args, no_leak_check):
    expected = fn(*args)
    out = quaxlike.quaxify(jax.jit(fn))(*_wrap(PassThrough, args))
    leaves = _leaves(out)
    assert len(leaves) > 0 and all(isinstance(x, PassThrough) for x in leaves)
    assert tree_allclose(materialise_tree(out), expected, **_TOLERANCES)


_VMAP_CASES = [
    ("exp", jnp.exp, (f32(3, 4),)),
    ("add", jnp.add, (f32(3, 4), f32(3, 4))),
    ("mul_scalar", lambda x: 3.0 * x, (f32(3, 4),)),
    ("where", jnp.where, (b(3, 4), f32(3, 4), f32(3, 4))),
    ("sum", jnp.sum, (f32(3, 4),)),
    ("argmax", jnp.argmax, (f32(3, 4),)),
    ("cumsum", jnp.cumsum, (f32(3, 4),)),
    ("matvec", jnp.matmul, (f32(3, 4, 5), f32(3, 5))),
    ("reshape", lambda x: x.reshape(2, 2), (f32(3, 4),)),
    ("concatenate", lambda x, y: jnp.concatenate([x, y]), (f32(3, 4), f32(3, 2))),
    (
        "dynamic_slice",
        lambda x, i: jax.lax.dynamic_slice(x, (i,), (2,)),
        (f32(3, 4), jnp.array([0, 1, 2], jnp.int32)),
    ),
    ("gather", lambda x, i: x[i], (f32(3, 4), jnp.array([0, 3, 1], jnp.int32))),
    ("scatter", lambda x, v: x.at[1].set(v), (f32(3, 4), f32(3))),
    ("sort", jnp.sort, (f32(3, 4),)),
    ("softmax", jax.nn.softmax, (f32(3, 4),)),
    ("relu", jax.nn.relu, (f32(3, 4),)),
    ("custom_jvp", my_custom_sin, (f32(3, 4),)),
    ("cholesky", jnp.linalg.cholesky, (jnp.stack([spd(3), spd(3), spd(3)]),)),
]


@pytest.mark.parametrize("name,fn,args", _VMAP_CASES, ids=[c[0] for c in _VMAP_CASES])
def test_vmap_outside_quaxify(name, fn, args, no_leak_check):
    expected = jax.vmap(fn)(*args)
    out = jax.vmap(quaxlike.quaxify(fn))(*_wrap(PassThrough, args))
    leaves = _leaves(out)
    assert len(leaves) > 0 and all(isinstance(x, PassThrough) for x in leaves)
    assert tree_allclose(materialise_tree(out), expected, **_TOLERANCES)


@pytest.mark.parametrize("name,fn,args", _VMAP_CASES, ids=[c[0] for c in _VMAP_CASES])
def test_vmap_inside_quaxify(name, fn, args, no_leak_check):
    expected = jax.vmap(fn)(*args)
    out = quaxlike.quaxify(jax.vmap(fn))(*_wrap(PassThrough, args))
    leaves = _leaves(out)
    assert len(leaves) > 0 and all(isinstance(x, PassThrough) for x in leaves)
    assert tree_allclose(materialise_tree(out), expected, **_TOLERANCES)



# (id, how to call, case). Run with the tracer-leak checker on (the default).
_LEAK_CHECKED = [
    ("eager-exp", "eager", "exp"),
    ("eager-matmul", "eager", "matmul"),
    ("eager-top_k", "eager", "top_k"),
    ("eager-cholesky", "eager", "cholesky"),
    ("eager-custom_jvp", "eager", "custom_jvp_unary"),
    ("jit-exp", "jit", "exp"),
    ("jit-dot_general", "jit", "dot_general"),
    pytest.param("jit-relu", "jit", "relu"),
    pytest.param("jit-custom_jvp", "jit", "custom_jvp_unary"),
    ("jit_inside-sort", "jit_inside", "sort"),
]
_CASES_BY_NAME = {c[0]: c for c in CASES}


@pytest.mark.parametrize("id_,how,case", _LEAK_CHECKED)
def test_leak_checked(id_, how, case):
    assert jax.config.jax_check_tracer_leaks
    _, fn, args = _CASES_BY_NAME[case]
    expected = fn(*args)
    if how == "eager":
        call = quaxlike.quaxify(fn)
    elif how == "jit":
        call = jax.jit(quaxlike.quaxify(fn))
    else:
        call = quaxlike.quaxify(jax.jit(fn))
    out = call(*_wrap(PassThrough, args))
    assert all(isinstance(x, PassThrough) for x in _leaves(out))
    assert tree_allclose(materialise_tree(out), expected, **_TOLERANCES)


def test_jit_of_vmap_of_quaxify_dense(no_leak_check):
    fn = lambda x, w: jax.nn.relu(x @ w).sum()  # noqa: E731
    x, w = f32(5, 3), f32(3, 2)
    expected = jax.vmap(fn, in_axes=(0, None))(x, w)
    out = jax.jit(jax.vmap(quaxlike.quaxify(fn), in_axes=(0, None)))(
        quaxlike.DenseArrayValue(x), quaxlike.DenseArrayValue(w)
    )
    assert isinstance(out, jax.Array)
    assert tree_allclose(out, expected, **_TOLERANCES)


def test_grad_through_custom_jvp_passthrough():
    x = f32(3, 4)

    def loss(x):
        out = quaxlike.quaxify(lambda v: my_custom_sin(v) * 2.0)(PassThrough(x))
        assert isinstance(out, PassThrough)
        return out.array.sum()

    g = jax.grad(loss)(x)
    assert tree_allclose(g, 2.0 * jnp.cos(x), **_TOLERANCES)


def test_grad_through_relu_dense(no_leak_check):
    x = f32(3, 4)

    def loss(x):
        out = quaxlike.quaxify(lambda v: jax.nn.relu(v) ** 2)(quaxlike.DenseArrayValue(x))
        return out.sum()

    g = jax.grad(loss)(x)
    assert tree_allclose(g, jax.grad(lambda x: (jax.nn.relu(x) ** 2).sum())(x), **_TOLERANCES)


# --- property test -----------------------------------------------------------

_ELEMENTWISE = {
    "add": jnp.add,
    "mul": jnp.multiply,
    "sub": jnp.subtract,
    "max": jnp.maximum,
    "where_gt": lambda x, y: jnp.where(x > y, x, y),
}
_REDUCTIONS = {
    "sum": lambda z, axis: jnp.sum(z, axis=axis),
    "max": lambda z, axis: jnp.max(z, axis=axis),
    "min": lambda z, axis: jnp.min(z, axis=axis),
    "cumsum": lambda z, axis: (
        jnp.cumsum(z, axis=axis if axis is not None else 0) if z.ndim > 0 else z
    ),
}


@st.composite
def _binary_problem(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    # Broadcasting at the same rank (the test config forbids rank promotion).
    x_shape = tuple(d if draw(st.booleans()) else 1 for d in shape)
    y_shape = tuple(d if draw(st.booleans()) else 1 for d in shape)
    dtype = draw(st.sampled_from([np.float32, np.int32]))
    seed = draw(st.integers(0, 2**16))
    binary = draw(st.sampled_from(sorted(_ELEMENTWISE)))
    reduction = draw(st.sampled_from(sorted(_REDUCTIONS)))
    axis = draw(st.one_of(st.none(), st.integers(0, max(ndim - 1, 0)))) if ndim else None
    wrap_x, wrap_y = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
    return x_shape, y_shape, dtype, seed, binary, reduction, axis, wrap_x, wrap_y


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(_binary_problem())
def test_property_elementwise_then_reduce(problem):
    with jax.check_tracer_leaks(False):  # see `no_leak_check`
        _property_body(problem)


def _property_body(problem):
    x_shape, y_shape, dtype, seed, binary, reduction, axis, wrap_x, wrap_y = problem
    rng = np.random.default_rng(seed)
    x = jnp.asarray((rng.integers(-5, 6, x_shape)).astype(dtype))
    y = jnp.asarray((rng.integers(-5, 6, y_shape)).astype(dtype))

    def fn(x, y):
        return _REDUCTIONS[reduction](_ELEMENTWISE[binary](x, y), axis)

    expected = fn(x, y)
    wx = PassThrough(x) if wrap_x else x
    wy = PassThrough(y) if wrap_y else y
    out = quaxlike.quaxify(fn)(wx, wy)
    assert isinstance(out, PassThrough)
    assert tree_allclose(out.array, expected)
    dense = quaxlike.quaxify(fn)(
        quaxlike.DenseArrayValue(x) if wrap_x else x, quaxlike.DenseArrayValue(y) if wrap_y else y
    )
    assert isinstance(dense, jax.Array)
    assert tree_allclose(dense, expected)


# --- misc --------------------------------------------------------------------


def test_values_in_containers_and_kwargs():
    x, y = f32(3, 4), f32(3, 4)

    def fn(pair, *, scale):
        a, b = pair
        return {"s": (a + b) * scale, "d": a - b}

    expected = fn((x, y), scale=jnp.float32(2.0))
    out = quaxlike.quaxify(fn)((PassThrough(x), y), scale=PassThrough(jnp.float32(2.0)))
    assert isinstance(out["s"], PassThrough) and isinstance(out["d"], PassThrough)
    assert tree_allclose(materialise_tree(out), expected)


def test_passthrough_inside_module(no_leak_check):
    class Linear(eqx.Module):
        w: jax.Array
        b: jax.Array

        def __call__(self, x):
            return self.w @ x + self.b

    w, bias, x = f32(3, 4), f32(3), f32(4)
    model = Linear(PassThrough(w), bias)
    out = quaxlike.quaxify(model)(x)
    assert isinstance(out, PassThrough)
    assert tree_allclose(out.array, w @ x + bias)
    # The same through eqx.filter_jit.
    out = eqx.filter_jit(quaxlike.quaxify(model))(x)
    assert isinstance(out, PassThrough)
    assert tree_allclose(out.array, w @ x + bias, **_TOLERANCES)


def test_partial_application_closure():
    x = f32(3, 4)
    wrapped = PassThrough(f32(3, 4))
    out = quaxlike.quaxify(jtu.Partial(jnp.add, wrapped))(x)
    assert isinstance(out, PassThrough)
    assert tree_allclose(out.array, wrapped.array + x)
