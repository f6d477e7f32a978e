"""The sparse example type `BCOO`. Every rule is checked against plain JAX on the
dense array, and one use of each against `jax.experimental.sparse` (its BCOO,
through `sparsify`, in the `*_agree_with_jax_sparse` tests). BCOOs here refuse to
materialise (the default), so a rule that fell back to the dense array would fail
its test; `test_matmul_jaxpr_has_no_dense_operand` checks the jaxprs too."""

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_allclose
from jax import lax
from jax.experimental import sparse as jsparse

import quaxlike
from quaxlike.sparse import BCOO


RTOL, ATOL = 1e-5, 1e-5

# The suite runs with JAX's tracer-leak checker on, which turns off JAX's caches
# for eager operations: every eager op compiles again, at a cost of ~0.1 s each.
# So the checks below run under one `jax.jit` each, and test data is built with
# NumPy.


def make_dense(seed, shape, density=0.4):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape) * (rng.random(shape) < density)
    return np.asarray(values, dtype=np.float32)


def sparse_from_numpy(array, pad=2, **kwargs):
    """The BCOO of a NumPy array with `pad` padding slots (at coordinates `shape`),
    built without JAX operations; laid out like `BCOO.fromdense`."""
    indices = np.stack(np.nonzero(array), axis=-1)
    indices = np.concatenate([indices, np.tile(np.asarray(array.shape), (pad, 1))])
    data = np.concatenate([array[np.nonzero(array)], np.zeros(pad, array.dtype)])
    data, indices = put(data), put(indices.astype(np.int32))
    return BCOO(data, indices, array.shape, unique_indices=True, **kwargs)


def make_sparse(seed, shape, pad=2, **kwargs):
    """A BCOO with `pad` padding slots, and the dense array it stands for."""
    array = make_dense(seed, shape)
    return sparse_from_numpy(array, pad, **kwargs), put(array)


def put(array):
    # `jax.device_put` rather than `jnp.asarray`, which compiles a copy each time
    # while the leak checker is on.
    return jax.device_put(array)


def make_halves():
    """[1.0, 0.0] stored as two entries of 0.5 at the same coordinate."""
    data = put(np.array([0.5, 0.5], np.float32))
    return BCOO(data, put(np.array([[0], [0]], np.int32)), (2,))


def dense(x):
    if isinstance(x, (BCOO, jsparse.BCOO)):
        return x.todense()
    return x


def to_jax_sparse(x):
    return jsparse.BCOO((x.data, x.indices), shape=x.shape) if isinstance(x, BCOO) else x


def jit(fn):
    """`jax.jit` with XLA's cheaper CPU optimisation: these programs run once."""
    return jax.jit(fn, compiler_options=_FAST_COMPILE)


_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def check(fns, *args, against_jax_sparse=False, rtol=RTOL, atol=ATOL):
    """`quaxify(fn)` on the arguments equals `fn` on their dense arrays (dtype
    included) and, if asked, `sparsify(fn)` on jax.experimental.sparse BCOOs, for
    `fn` in `fns` (one function or a list). Everything runs in one `jax.jit` (and
    one `quaxify`). Returns the quaxified result(s)."""
    single = callable(fns)
    fns = [fns] if single else list(fns)

    def run(*args):
        got = quaxlike.quaxify(lambda *args: [fn(*args) for fn in fns])(*args)
        expected = [fn(*map(dense, args)) for fn in fns]
        reference = None
        if against_jax_sparse:
            sparse_args = [to_jax_sparse(a) for a in args]
            reference = [dense(jsparse.sparsify(fn)(*sparse_args)) for fn in fns]
        return got, [dense(g) for g in got], expected, reference

    got, got_dense, expected, reference = jit(run)(*args)
    for i, fn in enumerate(fns):
        name = f"function {i}: {getattr(fn, '__name__', fn)}"
        assert tree_allclose(got_dense[i], expected[i], rtol=rtol, atol=atol), name
        if against_jax_sparse:
            assert tree_allclose(reference[i], expected[i], rtol=rtol, atol=atol), name
    return got[0] if single else got


def shapes_in_jaxpr(jaxpr) -> set[tuple[int, ...]]:
    """The shapes of every value any equation (nested jaxprs included) produces."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes.update(tuple(v.aval.shape) for v in eqn.outvars)
        for sub in quaxlike.internal.jaxprs_in_params(eqn.params):
            shapes |= shapes_in_jaxpr(sub)
    return shapes


# --- construction -----------------------------------------------------------------


def test_fromdense_todense_round_trip(getseed):
    array = make_dense(getseed(), (4, 6))
    count = int(np.count_nonzero(array))
    eager = BCOO.fromdense(array)  # eager: nse is the number of nonzeros
    assert eager.nse == count and eager.shape == (4, 6) and eager.dtype == jnp.float32
    assert eager.unique_indices and not eager.allow_materialise

    @jax.jit
    def run(x):
        padded = BCOO.fromdense(x, nse=count + 3)
        reference = jsparse.BCOO.fromdense(x, nse=count + 3)
        return padded, padded.todense(), reference.data, reference.indices

    padded, padded_dense, ref_data, ref_indices = run(array)
    assert padded.nse == count + 3 and tree_allclose(padded_dense, array)
    # Same layout as jax.experimental.sparse: row-major, padding at `shape`.
    assert tree_allclose((padded.data, padded.indices), (ref_data, ref_indices))
    assert tree_allclose((eager.data, eager.indices), (ref_data[:count], ref_indices[:count]))
    # ... and as the NumPy builder the other tests use.
    built = sparse_from_numpy(array, pad=3)
    assert tree_allclose((built.data, built.indices), (padded.data, padded.indices))


def test_fromdense_errors(getseed):
    x = make_dense(getseed(), (3, 4))
    with pytest.raises(ValueError, match="Pass `nse=<an upper bound"):
        jit(BCOO.fromdense)(x)
    with pytest.raises(ValueError, match=r"nonzero entries, so \d+ would be dropped"):
        BCOO.fromdense(x, nse=1)
    with pytest.raises(ValueError, match="at least one dimension"):
        BCOO.fromdense(np.float32(1.0))


def test_constructor_validates():
    with pytest.raises(ValueError, match=r"indices of shape \(3, 1\) for shape \(2, 2\)"):
        BCOO(put(np.ones(3)), put(np.zeros((3, 1), np.int32)), (2, 2))
    with pytest.raises(ValueError, match="integer dtype"):
        BCOO(put(np.ones(1)), put(np.zeros((1, 2))), (2, 2))


def test_duplicates_add_up_and_out_of_bounds_is_padding():
    data = put(np.array([1.0, 2.0, 5.0, 7.0], np.float32))
    # [1, 3] is out of bounds along axis 1 only: `m.sum(1)` must not bring it back.
    indices = put(np.array([[0, 1], [0, 1], [2, 0], [1, 3]], np.int32))
    x = BCOO(data, indices, (3, 2))
    expected = np.array([[0.0, 3.0], [0.0, 0.0], [5.0, 0.0]], np.float32)
    v = put(np.array([1.0, 10.0], np.float32))
    check([lambda m, v: m, lambda m, v: m @ v, lambda m, v: m.sum(1), lambda m, v: m.T @ m], x, v)
    assert tree_allclose(jit(BCOO.todense)(x), expected)


def test_materialise_refuses_by_default(getseed):
    x, array = make_sparse(getseed(), (3, 4))
    with pytest.raises(quaxlike.MaterialisationError, match=r"(?s)`exp`.*BCOO.*todense"):
        jit(quaxlike.quaxify(jnp.exp))(x)
    allowed = sparse_from_numpy(np.asarray(array), allow_materialise=True)
    assert tree_allclose(jit(quaxlike.quaxify(jnp.exp))(allowed), jnp.exp(array))


# --- dot_general --------------------------------------------------------------------

# name: (sparse shape, dense shape, dimension numbers with the sparse operand on
# the left)
_DOT_CASES = {
    "matvec": ((5, 7), (7,), (((1,), (0,)), ((), ()))),
    "matmat": ((5, 7), (7, 3), (((1,), (0,)), ((), ()))),
    "contract_first": ((7, 5), (7, 3), (((0,), (0,)), ((), ()))),
    "vecvec": ((7,), (7,), (((0,), (0,)), ((), ()))),
    "outer": ((4,), (3,), (((), ()), ((), ()))),
    "batched": ((2, 5, 7), (2, 7, 3), (((2,), (1,)), ((0,), (0,)))),
    "two_contracting": ((3, 4, 5), (5, 2, 4), (((1, 2), (2, 0)), ((), ()))),
}


def _swap(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    return (rc, lc), (rb, lb)


def _dot(i, dimension_numbers, sparse_on_left, name):
    """A function of all the cases' operands, computing case `i`."""

    def fn(*operands):
        x, y = operands[2 * i], operands[2 * i + 1]
        if sparse_on_left:
            return lax.dot_general(x, y, dimension_numbers)
        return lax.dot_general(y, x, _swap(dimension_numbers))

    fn.__name__ = f"{name}, sparse on the {'left' if sparse_on_left else 'right'}"
    return fn


def test_dot_general(getseed):
    # All cases in one program: compiling is what costs time here.
    operands, fns = [], []
    for i, (name, (sparse_shape, dense_shape, dimension_numbers)) in enumerate(_DOT_CASES.items()):
        operands += [
            make_sparse(getseed(), sparse_shape)[0],
            make_dense(getseed(), dense_shape, 1.0),
        ]
        fns += [_dot(i, dimension_numbers, True, name), _dot(i, dimension_numbers, False, name)]
    outs = check(fns, *operands)
    assert not any(isinstance(out, BCOO) for out in outs)


def test_matmul_operators(getseed):
    x, _ = make_sparse(getseed(), (5, 7))
    v = make_dense(getseed(), (7,), density=1.0)
    w = make_dense(getseed(), (5,), density=1.0)
    fns = [
        lambda m, v, w: m @ v,
        lambda m, v, w: w @ m,
        lambda m, v, w: jnp.dot(m.T, w),
        lambda m, v, w: jnp.einsum("ij,j->i", m, v),
        lambda m, v, w: jnp.einsum("i,ij,j", w, m, v),
    ]
    check(fns, x, v, w)


def test_dot_general_preferred_element_type():
    x = sparse_from_numpy(np.array([[1, 0, 2], [0, 3, 0]], np.int8), pad=1)
    y = np.array([100, 100, 100], np.int8)
    dimension_numbers = (((1,), (0,)), ((), ()))
    fns = [
        lambda m, y: lax.dot_general(m, y, dimension_numbers, preferred_element_type=jnp.int32),
        lambda m, y: lax.dot_general(
            y, m, _swap(dimension_numbers), preferred_element_type=jnp.int32
        ),
    ]
    out, _ = check(fns, x, y)
    assert tree_allclose(out, np.array([300, 300], np.int32))


def test_dot_general_sparse_sparse(getseed):
    x, _ = make_sparse(getseed(), (4, 4))
    y, _ = make_sparse(getseed(), (4, 3))
    z, _ = make_sparse(getseed(), (3, 4))
    u, _ = make_sparse(getseed(), (4,))
    fns = [
        lambda x, y, z, u: x @ y,  # ij,jk
        lambda x, y, z, u: x.T @ y,  # ji,jk
        lambda x, y, z, u: x @ z.T,  # ij,kj
        lambda x, y, z, u: x @ u,
    ]
    outs = check(fns, x, y, z, u)
    assert all(isinstance(out, BCOO) for out in outs)
    assert outs[0].nse == x.nse * y.nse
    # Contracting everything gives a dense scalar.
    assert not isinstance(check(lambda u: jnp.dot(u, u * 2.0), u), BCOO)


# --- elementwise ------------------------------------------------------------------


def test_add_sub_dense_give_dense(getseed):
    x, _ = make_sparse(getseed(), (3, 4))
    y = make_dense(getseed(), (3, 4), density=1.0)
    fns = [
        jnp.add,
        lambda a, b: b + a,
        lambda a, b: a + 2.0,
        lambda a, b: a + b[:, :1],  # a column, broadcast along the rows
        jnp.subtract,
        lambda a, b: b - a,
    ]
    outs = check(fns, x, y)
    assert not any(isinstance(out, BCOO) for out in outs)
    # A dense operand that broadcasts the sparse one goes to the default: refused.
    row, _ = make_sparse(getseed(), (1, 4))
    with pytest.raises(quaxlike.MaterialisationError, match="`add`"):
        jit(quaxlike.quaxify(jnp.add))(row, y)


def test_add_sub_sparse(getseed):
    x, array = make_sparse(getseed(), (3, 4))
    y, _ = make_sparse(getseed(), (3, 4))
    fns = [
        lambda x, y: x + y,  # different patterns: entries concatenated
        lambda x, y: x - y,
        lambda x, y: x + x,  # the same `indices`: data added
        lambda x, y: (x * 2.0) - x,
    ]
    outs = check(fns, x, y)
    assert [out.nse for out in outs] == [x.nse + y.nse, x.nse + y.nse, x.nse, x.nse]

    # Equal indices in separate arrays: compared when concrete (here closed over
    # by the jitted function), concatenated when traced. Both are right.
    def add(data, indices, other_data):
        same = BCOO(other_data, x.indices, x.shape)
        sum_ = quaxlike.quaxify(jnp.add)(BCOO(data, indices, x.shape), same)
        return sum_, sum_.todense()

    doubled = put(2 * np.asarray(x.data))
    concrete, concrete_dense = jit(lambda d, o: add(d, x.indices, o))(x.data, doubled)
    traced, traced_dense = jit(add)(x.data, x.indices, doubled)
    assert concrete.nse == x.nse and traced.nse == 2 * x.nse
    assert tree_allclose((concrete_dense, traced_dense), (3 * np.asarray(array),) * 2)


def test_mul_div_dense_stay_sparse(getseed):
    x, _ = make_sparse(getseed(), (3, 4))
    y = make_dense(getseed(), (3, 4), density=1.0)
    row = make_dense(getseed(), (4,), density=1.0)
    fns = [
        lambda a, b, r: a * b,
        lambda a, b, r: b * a,
        lambda a, b, r: a * 3.0,
        lambda a, b, r: 3.0 * a,
        lambda a, b, r: a / 4.0,
        lambda a, b, r: a * r,  # `r` broadcasts along the rows
        lambda a, b, r: a / (b**2 + 1.0),
    ]
    outs = check(fns, x, y, row * 6 + [False])
    assert all(isinstance(out, BCOO) and out.nse == x.nse for out in outs)
    assert all(out.unique_indices for out in outs)


def test_mul_sparse(getseed):
    x, array = make_sparse(getseed(), (3, 4))
    y, _ = make_sparse(getseed(), (3, 4))
    # Equal indices in another array: under `jit` the two cannot be compared, so
    # `x + same` stores every coordinate twice.
    same = sparse_from_numpy(-2.0 * np.asarray(array))

    def square(s):
        return s * s

    fns = [
        lambda x, y, same: x * (x * 2.0),  # the same pattern
        lambda x, y, same: x * y,  # matched coordinates
        lambda x, y, same: (x + y) * x,  # repeated coordinates on the left...
        lambda x, y, same: y * (x + y),  # ... on the right
        lambda x, y, same: square(x + same),  # ... on both sides of the same pattern
    ]
    outs = check(fns, x, y, same)
    assert [out.nse for out in outs] == [x.nse, x.nse, x.nse + y.nse, y.nse, 2 * x.nse]
    assert [out.unique_indices for out in outs] == [True, True, False, True, False]


def test_neg_transpose(getseed):
    x, _ = make_sparse(getseed(), (2, 3, 4))
    outs = check([jnp.negative, lambda a: jnp.transpose(a, (2, 0, 1)), lambda a: a.mT], x)
    assert all(isinstance(out, BCOO) and out.unique_indices for out in outs)
    assert outs[1].shape == (4, 2, 3) and outs[2].shape == (2, 4, 3)


def test_reduce_sum(getseed):
    x, _ = make_sparse(getseed(), (2, 3, 4))
    all_axes = [None, (0,), (1,), (0, 2), (2, 1, 0)]
    outs = check([lambda a, axes=axes: jnp.sum(a, axis=axes) for axes in all_axes], x)
    assert [isinstance(out, BCOO) for out in outs] == [False, True, True, True, False]


def test_convert_element_type(getseed):
    x, _ = make_sparse(getseed(), (3, 4))
    outs = check([lambda a: a.astype(jnp.float16), lambda a: a.astype(jnp.int32)], x)
    assert [out.dtype for out in outs] == [jnp.float16, jnp.int32]
    assert all(isinstance(out, BCOO) for out in outs)
    # Repeated coordinates: converting each entry to an integer is not converting
    # their sum (0.5 + 0.5 -> 1, but 0 + 0 -> 0), so that falls back (and refuses).
    halves = make_halves()
    check(lambda a: a.astype(jnp.float16), halves)
    with pytest.raises(quaxlike.MaterialisationError, match="convert_element_type"):
        jit(quaxlike.quaxify(lambda a: a.astype(jnp.int32)))(halves)
    allowed = BCOO(halves.data, halves.indices, (2,), allow_materialise=True)
    to_int = jit(quaxlike.quaxify(lambda a: a.astype(jnp.int32)))(allowed)
    assert tree_allclose(to_int, np.array([1, 0], np.int32))


def test_zero_preserving_elementwise(getseed):
    x, _ = make_sparse(getseed(), (3, 4))
    fns = [jnp.abs, jnp.sign, jnp.sin, jnp.tanh, jnp.expm1, jnp.square, lambda a: a**3]
    fns += [lambda a: jnp.sqrt(jnp.abs(a)), lambda a: jnp.log1p(jnp.abs(a))]
    outs = check(fns, x)
    assert all(isinstance(out, BCOO) for out in outs)
    # With repeated coordinates f(a) + f(b) != f(a + b): these fall back.
    halves = make_halves()
    with pytest.raises(quaxlike.MaterialisationError, match="square"):
        jit(quaxlike.quaxify(jnp.square))(halves)


# --- against jax.experimental.sparse ------------------------------------------------
# One function per rule, through `sparsify` on jax.experimental.sparse BCOOs built
# from the same data and indices (padding included). Operations it does not
# support (sparse - dense, broadcasting, most elementwise functions) are checked
# against plain JAX only, above.


def test_products_agree_with_jax_sparse(getseed):
    x, _ = make_sparse(getseed(), (5, 7))
    other, _ = make_sparse(getseed(), (7, 4))
    y = make_dense(getseed(), (7, 3), 1.0)
    w = make_dense(getseed(), (3, 5), 1.0)
    v = make_dense(getseed(), (7,), 1.0)
    fns = [
        lambda x, other, y, w, v: x @ v,
        lambda x, other, y, w, v: x @ y,
        lambda x, other, y, w, v: w @ x,
        lambda x, other, y, w, v: x.T @ w.T,
        lambda x, other, y, w, v: x @ other,
        lambda x, other, y, w, v: other.T @ x.T,
    ]
    check(fns, x, other, y, w, v, against_jax_sparse=True)


def test_elementwise_agrees_with_jax_sparse(getseed):
    x, _ = make_sparse(getseed(), (5, 7))
    z, _ = make_sparse(getseed(), (5, 7))
    d = make_dense(getseed(), (5, 7), 1.0)
    fns = [
        lambda x, z, d: x + d,
        lambda x, z, d: x + z,
        lambda x, z, d: x + x,
        lambda x, z, d: x - z,
        lambda x, z, d: x * d,
        lambda x, z, d: x * 2.0,
        lambda x, z, d: x / 4.0,
        lambda x, z, d: x * z,
        lambda x, z, d: (x + z) * x,
        lambda x, z, d: -x,
        lambda x, z, d: x.T,
        lambda x, z, d: x.sum(),
        lambda x, z, d: x.sum(0),
        lambda x, z, d: (x + z).sum(1),
        lambda x, z, d: x.astype(jnp.float16),
        lambda x, z, d: x.astype(jnp.int32),
        lambda x, z, d: jnp.abs(x),
        lambda x, z, d: jnp.sin(x),
    ]
    check(fns, x, z, d, against_jax_sparse=True)


# --- no densification --------------------------------------------------------------


def test_matmul_jaxpr_has_no_dense_operand(getseed):
    x, _ = make_sparse(getseed(), (5, 7))
    right = make_dense(getseed(), (7, 3), density=1.0)
    left = make_dense(getseed(), (3, 5), density=1.0)

    @quaxlike.quaxify
    def products(m, right, left):
        return jnp.sum(jnp.tanh(m @ right)) + jnp.sum(jnp.sin(left @ m))

    def loss(data, indices, right, left):
        return products(BCOO(data, indices, x.shape), right, left)

    for fn in [loss, jax.grad(loss, argnums=(0, 2, 3))]:
        shapes = shapes_in_jaxpr(jax.make_jaxpr(fn)(x.data, x.indices, right, left).jaxpr)
        assert (5, 7) not in shapes and (7, 5) not in shapes, shapes
    # The check can fail: a densifying version does produce the (5, 7) array.
    densified = jax.make_jaxpr(lambda m, r: m.todense() @ r)(x, right).jaxpr
    assert (5, 7) in shapes_in_jaxpr(densified)


# --- transformations ----------------------------------------------------------------


def f(m, v):
    return jnp.tanh(m @ v) * 2.0 + jnp.sum(m * 0.5, axis=1)


def test_jit_outside(getseed):
    x, array = make_sparse(getseed(), (5, 7))
    v = make_dense(getseed(), (7,), density=1.0)
    assert tree_allclose(jit(quaxlike.quaxify(f))(x, v), jit(f)(array, v), rtol=RTOL)
    out = jit(quaxlike.quaxify(lambda m: -(m * 2.0).T))(x)
    assert isinstance(out, BCOO) and out.shape == (7, 5)
    assert tree_allclose(jit(BCOO.todense)(out), -2.0 * np.asarray(array).T)


def test_grad_wrt_data_and_dense(getseed):
    x, array = make_sparse(getseed(), (5, 7))
    v = make_dense(getseed(), (7,), density=1.0)

    def loss(data, v):
        return jnp.sum(quaxlike.quaxify(f)(BCOO(data, x.indices, x.shape), v) ** 2)

    def dense_loss(array, v):
        return jnp.sum(f(array, v) ** 2)

    def value_loss(m, v):
        return jnp.sum(quaxlike.quaxify(f)(m, v) ** 2)

    @jax.jit
    def run(x, v):
        grads = jax.grad(loss, argnums=(0, 1))(x.data, v)
        dense_grads = jax.grad(dense_loss, argnums=(0, 1))(x.todense(), v)
        value_grads = eqx.filter_grad(value_loss)(x, v)
        # d loss / d data[i] is the dense gradient at entry i (zero for padding).
        coordinates = tuple(x.indices.T)
        at_entries = dense_grads[0].at[coordinates].get(mode="fill", fill_value=0)
        return grads, dense_grads, value_grads, at_entries

    grads, dense_grads, value_grads, at_entries = run(x, v)
    assert tree_allclose(grads, (at_entries, dense_grads[1]), rtol=1e-4, atol=1e-5)
    # Through eqx.filter_grad on the BCOO itself: a BCOO of gradients.
    assert isinstance(value_grads, BCOO) and value_grads.indices is None
    assert tree_allclose(value_grads.data, at_entries, rtol=1e-4, atol=1e-5)


def test_vmap_over_dense_operand(getseed):
    x, array = make_sparse(getseed(), (5, 7))
    vs = make_dense(getseed(), (4, 7), density=1.0)
    ws = make_dense(getseed(), (4, 2, 5), density=1.0)

    @jax.jit
    def run(x, vs, ws):
        return (
            jax.vmap(quaxlike.quaxify(f), in_axes=(None, 0))(x, vs),
            jax.vmap(quaxlike.quaxify(lambda m, w: w @ m), in_axes=(None, 0))(x, ws),
        )

    expected = jit(lambda a, vs, ws: (jax.vmap(f, in_axes=(None, 0))(a, vs), ws @ a))(array, vs, ws)
    assert tree_allclose(run(x, vs, ws), expected, rtol=RTOL)


def test_vmap_over_batch_of_sparse(getseed):
    arrays = make_dense(getseed(), (3, 5, 7))
    nse = int(max(np.count_nonzero(a) for a in arrays)) + 1
    v = make_dense(getseed(), (7,), density=1.0)

    @jax.jit
    def run(arrays, v):
        xs = jax.vmap(lambda a: BCOO.fromdense(a, nse=nse))(arrays)
        out = jax.vmap(quaxlike.quaxify(f), in_axes=(0, None))(xs, v)
        scaled = jax.vmap(quaxlike.quaxify(lambda m: m * 3.0))(xs)
        return xs, out, scaled, jax.vmap(BCOO.todense)(scaled)

    xs, out, scaled, scaled_dense = run(arrays, v)
    assert xs.data.shape == (3, nse) and isinstance(scaled, BCOO)
    expected = jit(jax.vmap(f, in_axes=(0, None)))(arrays, v)
    assert tree_allclose((out, scaled_dense), (expected, 3.0 * arrays), rtol=RTOL)


def test_scan_inside(getseed):
    x, array = make_sparse(getseed(), (5, 5))
    v = make_dense(getseed(), (5,), density=1.0)

    def iterate(m, v):
        # `m` is a constant of the body; `m * 0.5 ** i` is a BCOO carry.
        def body(carry, _):
            vec, mat = carry
            return (jnp.tanh(m @ vec + mat @ vec), mat * 0.5), jnp.sum(vec)

        (vec, mat), sums = lax.scan(body, (v, m), length=3)
        return vec, mat, sums

    @jax.jit
    def run(x, v):
        vec, mat, sums = quaxlike.quaxify(iterate)(x, v)
        return mat, (vec, mat.todense(), sums)

    mat, got = run(x, v)
    assert isinstance(mat, BCOO) and mat.nse == x.nse
    assert tree_allclose(got, jit(iterate)(array, v), rtol=RTOL)


def test_cond_inside(getseed):
    x, array = make_sparse(getseed(), (5, 7))
    v = make_dense(getseed(), (7,), density=1.0)

    def choose(m, v, flag):
        vec = lax.cond(flag, lambda m: m @ v, lambda m: jnp.sin(m @ v), m)
        mat = lax.cond(flag, lambda m: m * 2.0, lambda m: -m, m)
        return vec, mat

    @jax.jit
    def run(x, v, flag):
        vec, mat = quaxlike.quaxify(choose)(x, v, flag)
        return mat, (vec, mat.todense())

    for flag in [True, False]:
        mat, got = run(x, v, flag)
        assert isinstance(mat, BCOO)
        assert tree_allclose(got, jit(choose)(array, v, flag), rtol=RTOL)


def test_while_inside(getseed):
    x, array = make_sparse(getseed(), (5, 5))
    v = make_dense(getseed(), (5,), density=1.0)

    def power(m, v):
        def body(state):
            i, vec = state
            vec = m @ vec + vec
            return i + 1, vec / jnp.linalg.norm(vec)

        return lax.while_loop(lambda s: s[0] < 4, body, (0, v))[1]

    got = jit(quaxlike.quaxify(power))(x, v)
    assert tree_allclose(got, jit(power)(array, v), rtol=1e-4, atol=1e-5)
