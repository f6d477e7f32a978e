"""Quax's names for the example types, and the behaviour Quax gives them.

`quax.examples.<name>` resolves to `quaxlike.examples.<name>` for code moving
from Quax: `named.Axis`, `named.trace`, `prng.ThreeFry`, `prng.PRNG`, Quax's
batched `sparse.BCOO` layout, `structured_matrices.TridiagonalMatrix` and
`unitful.Dimension`/`kilograms`/`meters`/`seconds`. Every numeric result is
compared with plain JAX on the dense, unnamed or unitless arrays.
"""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randn
from jax import lax

import quaxlike
from quaxlike.examples import named, prng, sparse, structured, structured_matrices, unitful


RTOL, ATOL = 1e-5, 1e-5


def close(a, b, atol=ATOL) -> bool:
    return np.allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=atol)


# --- named: Axis objects ------------------------------------------------------


def test_axis_objects_are_labels_by_identity(getseed):
    foo, bar, foo_again = named.Axis(3), named.Axis(None, name="bar"), named.Axis(3)
    assert foo != foo_again and foo == foo and len({foo, foo_again}) == 2
    assert foo.size == 3 and bar.size is None and "bar" in repr(bar)
    assert copy.deepcopy(foo) is foo and copy.copy(foo) is foo
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(foo)
    x = named.NamedArray(randn(getseed(), (3, 2)), (foo, bar))
    assert x.axes == (foo, bar) and x.position(bar) == 1 and x.axis_size(foo) == 3
    # Quax raises ValueError for repeated axes and wrong sizes: so does this.
    with pytest.raises(ValueError, match="appears more than once"):
        named.NamedArray(randn(getseed(), (3, 3)), (foo, foo))
    with pytest.raises(named.NamedAxisError, match="requires length 3"):
        named.NamedArray(randn(getseed(), (3, 4)), (bar, foo))
    with pytest.raises(TypeError, match="non-negative int or None"):
        named.Axis(-1)


def test_axis_objects_through_rules_match_plain_jax(getseed):
    batch, feature, hidden = named.Axis(None), named.Axis(3), named.Axis(4)
    x_, w_, b_ = randn(getseed(), (2, 3)), randn(getseed(), (3, 4)), randn(getseed(), (4,))
    x = named.NamedArray(x_, (batch, feature))
    w = named.NamedArray(w_, (feature, "hidden"))
    b = named.NamedArray(b_, ("hidden",))

    def layer(x, w, b):
        return jnp.tanh(x @ w + b)

    out = quaxlike.quaxify(layer)(x, w, b)
    assert out.axes == (batch, "hidden")
    assert close(out.array, layer(x_, w_, b_))
    # The by-name helpers take Axis objects wherever they take strings.
    h = named.rename(out, {"hidden": hidden})
    assert h.axes == (batch, hidden)
    assert named.align(h, (hidden, batch)).axes == (hidden, batch)
    assert close(named.align(h, (hidden, batch)).array, h.array.T)
    assert close(named.sum(h, batch).array, h.array.sum(0))
    v = named.NamedArray(randn(getseed(), (4, 3)), (hidden, feature))
    assert named.dot(h, v, hidden).axes == (batch, feature)
    assert close(named.dot(h, v, hidden).array, h.array @ v.array)


def test_contraction_mismatch_is_a_type_error_as_in_quax(getseed):
    foo, bar, qux = named.Axis(3), named.Axis(3), named.Axis(None)
    a = named.NamedArray(randn(getseed(), (3, 3)), (foo, bar))
    b = named.NamedArray(randn(getseed(), (3, 3)), (bar, qux))
    assert quaxlike.quaxify(jnp.matmul)(a, b).axes == (foo, qux)
    for fn in (lambda x, y: x @ y, jnp.matmul):
        with pytest.raises(TypeError, match="^Cannot contract mismatched dimensions") as info:
            quaxlike.quaxify(fn)(b, a)
        assert isinstance(info.value, named.NamedContractionError)
        assert isinstance(info.value, named.NamedAxisError)
    q = named.NamedArray(randn(getseed(), (2, 3, 4)), ("batch", "query", "feature"))
    k = named.NamedArray(randn(getseed(), (2, 5, 4)), ("head", "key", "feature"))
    with pytest.raises(named.NamedContractionError, match="^Cannot batch mismatched dimensions"):
        quaxlike.quaxify(lambda q, k: jnp.einsum("bqf,bkf->bqk", q, k))(q, k)


def test_allow_materialise_as_quax_and_propagated(getseed):
    x_ = randn(getseed(), (2, 3))
    merge = quaxlike.quaxify(lambda a: jnp.reshape(a, (6,)))  # no rule: merges axes
    # Default here: an operation with no rule gives the plain array.
    assert close(merge(named.NamedArray(x_, ("a", "b"))), x_.reshape(6))
    refusing = named.NamedArray(x_, ("a", "b"), allow_materialise=False)
    with pytest.raises(quaxlike.MaterialisationError, match="allow_materialise=False"):
        merge(refusing)
    # A rule's result refuses if any NamedArray operand did.
    doubled = quaxlike.quaxify(lambda a, b: a + b)(refusing, named.NamedArray(x_, ("a", "b")))
    assert doubled.allow_materialise is False and close(doubled.array, 2 * x_)
    with pytest.raises(quaxlike.MaterialisationError):
        merge(doubled)
    allowed = doubled.enable_materialise()
    assert allowed.allow_materialise and close(merge(allowed), 2 * x_.reshape(6))
    assert named.rename(refusing, {"a": "c"}).allow_materialise is False


def test_trace_by_name_matches_jnp_trace(getseed):
    a, b, c = named.Axis(None), named.Axis(None), named.Axis(None)
    x_ = randn(getseed(), (3, 2, 4))
    x = named.NamedArray(x_, (a, b, c))
    for offset, dtype in [(0, None), (1, None), (-2, jnp.float16)]:
        out = named.trace(x, axis1=a, axis2=c, offset=offset, dtype=dtype)
        expected = jnp.trace(x_, offset=offset, axis1=0, axis2=2, dtype=dtype)
        assert out.axes == (b,) and out.array.dtype == expected.dtype
        assert close(out.array, expected, atol=1e-2)
    # Reversed axes trace the transposed diagonal, as jnp.trace does.
    assert close(named.trace(x, axis1=c, axis2=a, offset=1).array, jnp.trace(x_, 1, 2, 0))
    square = named.NamedArray(randn(getseed(), (3, 3)), ("i", "j"))
    assert close(named.trace(square, axis1="i", axis2="j"), jnp.trace(square.array))
    with pytest.raises(named.NamedAxisError, match="two different axes"):
        named.trace(x, axis1=a, axis2=a)
    with pytest.raises(named.NamedAxisError, match="no axis named"):
        named.trace(x, axis1=a, axis2=named.Axis(None))


# --- prng: ThreeFry and PRNG ------------------------------------------------------


def test_threefry_draws_what_jax_random_draws():
    key = prng.ThreeFry(3)
    plain = jax.random.key(3, impl="threefry2x32")
    assert isinstance(key, prng.PRNG) and isinstance(key, prng.PRNGKeyValue)
    assert jnp.array_equal(prng.uniform(key, (4,)), jax.random.uniform(plain, (4,)))
    assert jnp.array_equal(prng.normal(key, (2,)), jax.random.normal(plain, (2,)))
    bits = key.random_bits(16, (3,))
    assert jnp.array_equal(bits, jax.random.bits(plain, (3,), dtype=jnp.uint16))
    # Splitting: an array of keys that unpacks into ThreeFry keys.
    new_key, subkey = prng.split(key)
    plain_new, plain_sub = jax.random.split(plain)
    assert type(new_key) is prng.ThreeFry and type(subkey) is prng.ThreeFry
    assert jnp.array_equal(prng.normal(subkey, (2,)), jax.random.normal(plain_sub, (2,)))
    listed = key.split(3)
    assert len(listed) == 3 and all(type(k) is prng.ThreeFry for k in listed)
    assert jnp.array_equal(
        prng.uniform(listed[2]), jax.random.uniform(jax.random.split(plain, 3)[2])
    )
    with pytest.raises(TypeError, match="single PRNG key"):
        iter(key).__next__()


def test_threefry_in_jit_scan_and_where_matches_plain_jax():
    def walk(key, split, normal):
        def body(carry, _):
            total, key = carry
            key, subkey = split(key)
            total = total + normal(subkey)
            return (total, key), total

        return lax.scan(body, (jnp.float32(0.0), key), length=4)[1]

    ours = jax.jit(lambda k: walk(k, prng.split, prng.normal))(prng.ThreeFry(0))
    plain = jax.jit(lambda k: walk(k, jax.random.split, jax.random.normal))(jax.random.key(0))
    assert jnp.array_equal(ours, plain)

    where = jax.jit(quaxlike.quaxify(lambda p, a, b: jnp.where(p, a, b)))
    k0, k1 = prng.ThreeFry(0), prng.ThreeFry(1)
    assert k0 != k1
    picked = where(jnp.array(False), k0, k1)
    assert type(picked) is prng.ThreeFry and picked == k1 and where(jnp.array(True), k0, k1) == k0


def test_threefry_refuses_arithmetic_and_custom_generators():
    key = prng.ThreeFry(0)
    with pytest.raises(TypeError):
        key + 1  # pyright: ignore[reportOperatorIssue]
    with pytest.raises(TypeError):
        jax.jit(lambda k: k + 1)(key)
    # Inside quaxify JAX itself refuses arithmetic on the typed key; a primitive
    # that gets past it meets the Value's refusal.
    with pytest.raises(TypeError, match="add does not accept dtypes key<fry>"):
        quaxlike.quaxify(lambda k: k + 1)(key)
    with pytest.raises(prng.KeyArithmeticError, match="`reduce_max` was applied to a PRNG key"):
        quaxlike.quaxify(lambda k: lax.reduce_max_p.bind(k, axes=()))(key)
    with pytest.raises(TypeError, match="overrides `random_bits`"):

        class MyGenerator(prng.PRNG):  # pyright: ignore[reportUnusedClass]
            def random_bits(self, bit_width, shape):
                return jnp.zeros(shape, jnp.uint32)

    with pytest.raises(ValueError, match="bit_width must be"):
        key.random_bits(12, (2,))


def test_prngkeyvalue_unpacks_like_a_key_array():
    keys = prng.split(prng.PRNGKeyValue(jax.random.PRNGKey(0)), 3)  # raw keys
    plain = jax.random.split(jax.random.PRNGKey(0), 3)
    unpacked = list(keys)
    assert len(unpacked) == 3 and all(k.raw for k in unpacked)
    for ours, theirs in zip(unpacked, plain):
        assert jnp.array_equal(prng.uniform(ours, (2,)), jax.random.uniform(theirs, (2,)))


# --- sparse: Quax's batched BCOO ------------------------------------------------------


def dense_of(x: sparse.BCOO) -> np.ndarray:
    """The dense array a BCOO stands for, entry by entry in NumPy (not `todense`)."""
    out = np.zeros(x.shape, np.float64)
    data, indices, n_batch = np.asarray(x.data), np.asarray(x.indices), x.n_batch
    for b in np.ndindex(*x.shape[:n_batch]):
        for k in range(x.nse):
            c = tuple(indices[b + (k,)])
            if all(0 <= ci < size for ci, size in zip(c, x.shape[n_batch:])):
                out[b + c] += data[b + (k,)]
    return out


def batched(seed, batch, shape, nse) -> sparse.BCOO:
    """A batched BCOO with repeated coordinates and out-of-bounds padding."""
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((*batch, nse)).astype(np.float32)
    indices = np.stack([rng.integers(0, n + 1, (*batch, nse)) for n in shape], -1)
    return sparse.BCOO(data, indices.astype(np.int32), (*batch, *shape))


def test_batched_bcoo_layout_and_validation(getseed):
    x = batched(getseed(), (2,), (3, 4), 5)
    assert x.n_batch == 1 and x.nse == 5 and x.shape == (2, 3, 4)
    assert close(x.todense(), dense_of(x))
    assert (
        not x.allow_materialise and sparse.BCOO(x.data, x.indices, x.shape, True).allow_materialise
    )
    assert close(x.enable_materialise().materialise(), dense_of(x))
    with pytest.raises(RuntimeError, match="Refusing to materialise"):
        x.materialise()
    with pytest.raises(ValueError, match=r"`data` must have shape \(\*batch, nse\)"):
        sparse.BCOO(x.data, x.indices, (3, 3, 4))  # batch of shape does not match data
    with pytest.raises(ValueError, match=r"indices of shape \(2, 5, 1\)"):
        sparse.BCOO(x.data, x.indices[..., :1], x.shape)
    unflat = sparse.BCOO(x.data.reshape(-1), np.zeros((10, 3), np.int32), (2, 3, 4))
    assert unflat.n_batch == 0


ELEMENTWISE = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "rsub": lambda a, b: b - a,
    "mul": lambda a, b: a * b,
    "rmul": lambda a, b: b * a,
}


@pytest.mark.parametrize("op", sorted(ELEMENTWISE))
def test_batched_bcoo_with_dense_matches_dense(op, getseed):
    fn = ELEMENTWISE[op]
    x = batched(getseed(), (2,), (3, 4), 5)
    d = randn(getseed(), (2, 3, 4))
    for other in (d, d[0], d[:, :1], d[None]):
        out = quaxlike.quaxify(fn)(x, other)
        expected = fn(dense_of(x), np.asarray(other))
        if op in ("mul", "rmul"):  # stays sparse
            assert isinstance(out, sparse.BCOO)
            out = dense_of(out)
        assert close(out, expected), (op, np.shape(other))


def test_batched_bcoo_product_with_dense_keeps_layout(getseed):
    # As in Quax: `x * y` is a BCOO with x's indices and the layout it was built in.
    x = batched(getseed(), (2,), (5, 1, 4), 4)
    for y in (jnp.float32(3.0), randn(getseed(), (5, 1, 4)), randn(getseed(), (2, 5, 1, 4))):
        out = quaxlike.quaxify(lambda a, b: a * b)(x, y)
        assert isinstance(out, sparse.BCOO) and out.n_batch == 1
        assert jnp.array_equal(out.indices, x.indices)
        assert close(dense_of(out), dense_of(x) * np.asarray(y))


def test_batched_bcoo_sums_and_structure_match_dense(getseed):
    x = batched(getseed(), (2,), (3, 4), 5)
    y = batched(getseed(), (3, 2), (3, 4), 2)
    flat = batched(getseed(), (), (2, 3, 4), 4)
    pairs = [(x, x, "add"), (x, y, "add"), (flat, y, "add"), (y, x, "sub"), (x, flat, "sub")]
    pairs += [(x, x, "mul"), (y, x, "mul"), (x, flat, "mul")]
    for a, b, op in pairs:
        fn = ELEMENTWISE[op]
        out = quaxlike.quaxify(fn)(a, b)
        assert isinstance(out, sparse.BCOO)
        assert close(dense_of(out), fn(dense_of(a), dense_of(b))), (op, a.shape, b.shape)
    # Same batch dimensions, different patterns: concatenated per batch element.
    z = quaxlike.quaxify(lambda a, b: a + b)(x, batched(getseed(), (2,), (3, 4), 3))
    assert z.n_batch == 1 and z.nse == 8
    v, m = randn(getseed(), (4,)), randn(getseed(), (4, 2))
    X = dense_of(x)
    cases = [
        (lambda a: a @ v, X @ v),
        (lambda a: a @ m, X @ m),
        (lambda a: jnp.ones(3) @ a, np.ones(3) @ X),
        (lambda a: jnp.einsum("bij,bj->bi", a, randn(0, (2, 4))), None),
        (lambda a: a.transpose(0, 2, 1), X.transpose(0, 2, 1)),
        (lambda a: a.sum(), X.sum()),
        (lambda a: a.sum(1), X.sum(1)),
        (lambda a: -a, -X),
        (lambda a: jnp.broadcast_to(a, (3, 2, 3, 4)), np.broadcast_to(X, (3, 2, 3, 4))),
    ]
    for fn, expected in cases:
        if expected is None:
            expected = np.einsum("bij,bj->bi", X, np.asarray(randn(0, (2, 4))))
        out = quaxlike.quaxify(fn)(x)
        assert close(dense_of(out) if isinstance(out, sparse.BCOO) else out, expected, atol=1e-4)
    s = batched(getseed(), (1,), (1, 4), 3)
    for dims in ((0,), (1,), (0, 1)):
        out = quaxlike.quaxify(lambda a: jnp.squeeze(a, dims))(s)
        assert isinstance(out, sparse.BCOO)
        assert close(dense_of(out), dense_of(s).squeeze(dims))
    jitted = jax.jit(quaxlike.quaxify(lambda a, b: a * b + a))(x, randn(getseed(), (2, 3, 4)))
    assert isinstance(jitted, sparse.BCOO)


# --- structured_matrices: TridiagonalMatrix --------------------------------------------


def tridiagonal(seed, batch=(), n=4, **kwargs):
    lower, main, upper = (randn(seed + i, (*batch, n + (i == 1) - 1)) for i in range(3))
    return structured_matrices.TridiagonalMatrix(lower, main + 4.0, upper, **kwargs)


def dense_tridiagonal(a) -> np.ndarray:
    """Built from the diagonals directly (not with `materialise`)."""
    lower, main, upper = (np.asarray(v) for v in (a.lower_diag, a.main_diag, a.upper_diag))
    n = main.shape[-1]
    out = np.zeros((*main.shape[:-1], n, n), main.dtype)
    i = np.arange(n)
    out[..., i, i] = main
    out[..., i[1:], i[:-1]] = lower
    out[..., i[:-1], i[1:]] = upper
    return out


def test_tridiagonal_matrix_products_match_dense(getseed):
    a = tridiagonal(getseed())
    A = dense_tridiagonal(a)
    assert isinstance(a, structured.TriDiagonal) and not a.allow_materialise
    assert close(a.enable_materialise().materialise(), A)
    v, m = randn(getseed(), (4,)), randn(getseed(), (4, 3))
    for fn in (
        lambda a, v, m: a @ v,
        lambda a, v, m: v @ a,
        lambda a, v, m: a.T @ m,
        lambda a, v, m: (2.0 * a) @ m,
        lambda a, v, m: jnp.linalg.solve(a, v),
    ):
        out = quaxlike.quaxify(fn)(a, v, m)
        assert close(out, fn(A, np.asarray(v), np.asarray(m)), atol=1e-4)
        assert not quaxlike.explain(fn)(a, v, m).materialised
    # Integer diagonals times a float vector, as in Quax's test.
    ints = structured_matrices.TridiagonalMatrix(jnp.arange(3), jnp.arange(4), jnp.arange(3) + 5)
    assert close(quaxlike.quaxify(lambda a, v: a @ v)(ints, v), dense_tridiagonal(ints) @ v)


def test_tridiagonal_matrix_batched_products_match_dense(getseed):
    a = tridiagonal(getseed(), batch=(2, 3))
    A = dense_tridiagonal(a)
    y, yb = randn(getseed(), (2, 4, 5)), randn(getseed(), (3, 2, 4))
    for spec, other in [
        ("bcij,bjk->bcik", y),
        ("bcij,cbj->bci", yb),
        ("bcij,cbi->bcj", yb),
        ("bcij,jk->bcik", y[0]),
        ("cbj,bcij->cbi", yb),
    ]:
        args = (a, other) if spec.startswith("bcij") else (other, a)

        def fn(p, q, spec=spec):
            return jnp.einsum(spec, p, q)

        expected = np.einsum(spec, *(A if v is a else np.asarray(v) for v in args))
        assert close(quaxlike.quaxify(fn)(*args), expected, atol=1e-4), spec
        assert not quaxlike.explain(fn)(*args).materialised, spec
    # Our other structured types get the batched products too.
    d = structured.Diagonal(randn(getseed(), (2, 4)))
    out = quaxlike.quaxify(lambda d, y: d @ y)(d, y)
    assert close(out, np.asarray(d.diag)[:, :, None] * np.asarray(y))


def test_tridiagonal_matrix_keeps_its_settings_and_refuses(getseed):
    a = tridiagonal(getseed())
    A = dense_tridiagonal(a)
    for fn in (lambda a: 2 * a, lambda a: -a, lambda a: a.T, lambda a: a.astype(jnp.float16)):
        out = quaxlike.quaxify(fn)(a)
        assert type(out) is structured_matrices.TridiagonalMatrix
        assert out.allow_materialise is False
        assert close(dense_tridiagonal(out), fn(A), atol=1e-2)
    mixed = quaxlike.quaxify(lambda a, d: a + d)(a, structured.Diagonal(jnp.ones(4)))
    assert type(mixed) is structured.TriDiagonal and close(mixed.materialise(), A + np.eye(4))
    both = quaxlike.quaxify(lambda a, b: a - b)(a, a.enable_materialise())
    assert close(both.materialise(), np.zeros((4, 4)))
    with pytest.raises(quaxlike.MaterialisationError, match="allow_materialise=False"):
        quaxlike.quaxify(jnp.exp)(a)
    assert close(quaxlike.quaxify(jnp.exp)(a.enable_materialise()), np.exp(A), atol=1e-4)


# --- unitful: Dimension, kilograms, meters, seconds --------------------------------------


def test_dimensions_are_base_units():
    assert unitful.meters == unitful.m and unitful.kilograms == unitful.kg
    assert unitful.seconds == unitful.s and unitful.Dimension("K") == unitful.K
    assert repr(unitful.meters) == "m" and {unitful.meters: 1} == {unitful.m: 1}
    with pytest.raises(ValueError, match="SI base dimensions"):
        unitful.Dimension("mol")
    newton = unitful.as_unit({unitful.kilograms: 1, unitful.meters: 1, unitful.seconds: -2})
    assert newton == unitful.N
    for unit in (unitful.N, unitful.km / unitful.hour, unitful.m**0.5, unitful.dimensionless):
        assert unitful.as_unit(unitful.units_of(unit)) == unit
    assert unitful.units_of(unitful.m / unitful.s) == {unitful.meters: 1, unitful.seconds: -1}
    with pytest.raises(TypeError, match="dimensions to powers"):
        unitful.as_unit("m")  # pyright: ignore[reportArgumentType]


def test_quax_style_quantities_compute_as_plain_jax(getseed):
    a_, b_ = randn(getseed(), (3,)), randn(getseed(), (3,))
    a = unitful.Unitful(a_, unitful.meters)
    b = unitful.Unitful(b_, unitful.meters)
    out = quaxlike.quaxify(lambda a, b: (a + b) * a)(a, b)
    assert out.unit == unitful.as_unit({unitful.meters: 2})
    assert close(out.array, (a_ + b_) * a_)
    with pytest.raises(unitful.UnitError):
        quaxlike.quaxify(lambda a, t: a + t)(a, unitful.Unitful(b_, unitful.seconds))


def test_quax_unitful_constructor_and_units():
    x = unitful.Unitful(jnp.ones(2), {unitful.meters: 1})
    assert x.unit == unitful.m
    assert x.units == {unitful.meters: 1}
    speed = unitful.Unitful(jnp.ones(2), {unitful.meters: 1, unitful.seconds: -1})
    assert speed.unit == unitful.m / unitful.s
    assert speed.units == {unitful.meters: 1, unitful.seconds: -1}
