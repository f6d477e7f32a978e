"""The structured matrices `Identity`, `ScaledIdentity`, `Diagonal`, `TriDiagonal`.

Every result is compared with plain JAX on the dense matrices, built here
independently of `materialise()`. Where a result should stay structured, its
type is checked too; `test_*_jaxpr_has_no_dense_matrix` checks that products and
solves never form an `(n, n)` array."""

import functools as ft
import itertools as it

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randn, tree_allclose
from jax import lax

import quaxlike
from quaxlike.structured import (
    Diagonal,
    Identity,
    ScaledIdentity,
    solve,
    StructuredMatrix,
    TriDiagonal,
)


RTOL, ATOL = 1e-4, 1e-5
N = 5
KINDS = ["identity", "scaled", "diagonal", "tridiagonal"]


def numpy_randn(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def make(kind: str, seed: int, n: int = N, batch=()):
    """A structured matrix; its diagonal is kept away from zero so it is
    well conditioned without pivoting. Built from NumPy (no JAX operation runs:
    eager operations each compile a program, which would dominate the time)."""
    if kind == "identity":
        return Identity(n)
    if kind == "scaled":
        return ScaledIdentity(jnp.asarray(1.5 + np.abs(numpy_randn(seed, batch))), n)
    diag = jnp.asarray(3.0 + np.abs(numpy_randn(seed, (*batch, n))))
    if kind == "diagonal":
        return Diagonal(diag)
    return TriDiagonal(randn(seed + 1, (*batch, n - 1)), diag, randn(seed + 2, (*batch, n - 1)))


def make_all(getseed, **kwargs):
    """One matrix of each kind, in the order of KINDS."""
    return [make(kind, getseed(), **kwargs) for kind in KINDS]


def dense(a):
    """The dense matrix a structured one stands for, built with jnp.diag (not
    with `materialise`); anything else unchanged."""
    if isinstance(a, Identity):
        return jnp.eye(a.n, dtype=a.dtype)
    if isinstance(a, ScaledIdentity):
        return a.scale * jnp.eye(a.n, dtype=a.dtype)
    if isinstance(a, Diagonal):
        return jnp.diag(a.diag)
    if isinstance(a, TriDiagonal):
        return jnp.diag(a.diag) + jnp.diag(a.lower, -1) + jnp.diag(a.upper, 1)
    return a


def is_value(x) -> bool:
    return isinstance(x, quaxlike.Value)


def check(fn, *args, rtol=RTOL, atol=ATOL, expect=None, materialises=False):
    """`quaxify(fn)` on the arguments equals `fn` on their dense matrices (dtypes
    included), both in one `jax.jit`-compiled program; `expect` is the type of the
    result, or a tuple of types for a tuple of results. Unless `materialises`, no
    structured matrix may fall back to its dense array. Tests put many expressions
    in one `fn`: one compilation is much cheaper than running them op by op."""

    def both(*args):
        out = quaxlike.quaxify(fn)(*args)
        return out, jax.tree.map(dense, out, is_leaf=is_value), fn(*map(dense, args))

    with quaxlike.materialise_policy("allow" if materialises else "error"):
        got, got_dense, expected = jax.jit(both)(*args)
    assert tree_allclose(got_dense, expected, rtol=rtol, atol=atol)
    if expect is not None:
        types = [type(x) for x in jax.tree.leaves(got, is_leaf=is_value)]
        expect = list(expect) if isinstance(expect, tuple) else [expect]
        assert len(types) == len(expect)
        for t, e in zip(types, expect):
            assert issubclass(t, e), (t, e)
    return got


def shapes_in_jaxpr(jaxpr) -> set[tuple[int, ...]]:
    """The shapes of every value any equation (nested jaxprs included) produces."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes.update(tuple(v.aval.shape) for v in eqn.outvars)
        for sub in quaxlike.internal.jaxprs_in_params(eqn.params):
            shapes |= shapes_in_jaxpr(sub)
    return shapes


# --- construction ------------------------------------------------------------


def test_materialise_aval_and_bands(getseed):
    mats = make_all(getseed)
    for a in mats:
        assert isinstance(a, StructuredMatrix)
        assert a.shape == (N, N) and a.dtype == jnp.float32 and a.n == N

    @jax.jit
    def bands(mats):
        got = [(a.materialise(), a.diagonal(), a.lower_band(), a.upper_band()) for a in mats]
        got += [a.transpose().materialise() for a in mats]
        dense_mats = [dense(a) for a in mats]
        expected = [(m, jnp.diag(m), jnp.diag(m, -1), jnp.diag(m, 1)) for m in dense_mats]
        return got, expected + [m.T for m in dense_mats]

    got, expected = bands(mats)
    assert tree_allclose(got, expected)


def test_batched_materialise(getseed):
    t = make("tridiagonal", getseed(), batch=(3,))
    s = make("scaled", getseed(), batch=(2,))
    assert t.shape == (3, N, N) and s.shape == (2, N, N)

    @jax.jit
    def materialise(t, s):
        got = t.materialise(), s.materialise()
        expected = jax.vmap(lambda t: dense(t))(t), s.scale[:, None, None] * jnp.eye(N)
        return got, expected

    got, expected = materialise(t, s)
    assert tree_allclose(got, expected)


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"lower` and `upper` must have shape \(4,\)"):
        TriDiagonal(np.ones(3), np.ones(5), np.ones(4))
    with pytest.raises(ValueError, match="at least 1"):
        Identity(0)
    with pytest.raises(ValueError, match=r"Diagonal: `diag` must have shape \(n,\)"):
        Diagonal(np.float32(1.0))
    mixed = TriDiagonal(np.ones(2, np.int32), np.ones(3, np.float32), np.ones(2, np.float32))
    assert mixed.dtype == jnp.float32 and mixed.lower.dtype == jnp.float32


# --- products ----------------------------------------------------------------


def products_with_dense(a, x):
    return (
        a @ x[:, 0],
        a @ x,
        x[:, 0] @ a,
        x.T @ a,
        a.T @ x,
        x.T @ a.T,
        jnp.einsum("ji,jk->ik", a, x),  # contracts the rows of a
        jnp.einsum("ij,kj->ik", a, x.T),  # contracts the last axis of x.T
    )


def test_products_with_dense(getseed):
    x = randn(getseed(), (N, 3))
    fn = lambda x, *mats: [products_with_dense(a, x) for a in mats]  # noqa: E731
    check(fn, x, *make_all(getseed), expect=(jax.Array,) * 8 * len(KINDS))


# The type of `a @ b` for each pair of kinds (first: a, second: b).
PRODUCT_TYPES = {
    ("identity", "identity"): Identity,
    ("identity", "scaled"): ScaledIdentity,
    ("scaled", "scaled"): ScaledIdentity,
    ("scaled", "diagonal"): Diagonal,
    ("diagonal", "identity"): Diagonal,
    ("diagonal", "diagonal"): Diagonal,
    ("diagonal", "tridiagonal"): TriDiagonal,
    ("tridiagonal", "diagonal"): TriDiagonal,
    ("tridiagonal", "scaled"): TriDiagonal,
    ("tridiagonal", "tridiagonal"): jax.Array,  # pentadiagonal: dense
}


def test_products_of_structured(getseed):
    def products(*matrices):
        pairs = zip(matrices[::2], matrices[1::2])
        return [(a @ b, a.T @ b.T, jnp.einsum("ji,jk->ik", a, b)) for a, b in pairs]

    matrices = [make(kind, getseed()) for pair in PRODUCT_TYPES for kind in pair]
    got = check(products, *matrices)
    for (ab, at_bt, _), expect in zip(got, PRODUCT_TYPES.values()):
        assert isinstance(ab, expect) and isinstance(at_bt, expect), (type(ab), expect)


# --- elementwise -------------------------------------------------------------


def test_sums_stay_structured(getseed):
    i, s, d, t = (make(kind, getseed()) for kind in KINDS)
    x = randn(getseed(), (N, N))

    def sums(i, s, d, t, x):
        return (i + i, s - i, d + s, i - d, t + d, i - t, t + t, t + x)

    expect = (ScaledIdentity, ScaledIdentity, Diagonal, Diagonal)
    expect += (TriDiagonal, TriDiagonal, TriDiagonal, jax.Array)  # + dense is dense
    check(sums, i, s, d, t, x, expect=expect, materialises=True)  # t + x


def unary_ops(a):
    return (
        2.5 * a,
        a * jnp.float32(-0.5),
        a / 4.0,
        -a,
        a.T,
        lax.stop_gradient(a),
        a.astype(jnp.bfloat16).astype(jnp.float32),
        jnp.sum(a, axis=0),
        jnp.sum(a, axis=1),
        jnp.sum(a),
    )


def test_scaling_negation_transpose_sums(getseed):
    mats = make_all(getseed)
    expect = ()
    for a in mats:
        scaled = ScaledIdentity if isinstance(a, Identity) else type(a)
        expect += (scaled,) * 4 + (type(a),) * 3 + (jax.Array,) * 3
    fn = lambda *mats: [unary_ops(a) for a in mats]  # noqa: E731
    check(fn, *mats, expect=expect, rtol=1e-2)  # rtol: the bfloat16 round trip


def test_tridiagonal_transpose_swaps_bands(getseed):
    t = make("tridiagonal", getseed())
    out = quaxlike.quaxify(lambda a: a.T)(t)
    assert isinstance(out, TriDiagonal)
    assert tree_allclose((out.lower, out.diag, out.upper), (t.upper, t.diag, t.lower))


def test_hadamard_products(getseed):
    i, s, d, t = (make(kind, getseed()) for kind in KINDS)
    x = randn(getseed(), (N, N))

    def products(i, s, d, t, x):
        # Multiplying by a dense array only reads the structured bands of it; a
        # row x[0] and a column x[:, :1] are broadcast.
        return (i * i, s * i, i * d, t * s, t * t, t * x, x * d, t * x[0], i * x[:, :1])

    expect = (Identity, ScaledIdentity, Diagonal, Diagonal, TriDiagonal, TriDiagonal)
    expect += (Diagonal, TriDiagonal, Diagonal)
    check(products, i, s, d, t, x, expect=expect)


def test_no_rule_materialises(getseed):
    # exp(0) = 1 off the bands: there is no rule, and the dense result is right.
    t, d = make("tridiagonal", getseed()), make("diagonal", getseed())
    fn = lambda t, d: (jnp.exp(t), 1.0 / d)  # noqa: E731
    check(fn, t, d, expect=(jax.Array, jax.Array), materialises=True)
    with pytest.raises(quaxlike.MaterialisationError, match="TriDiagonal"):
        check(fn, t, d)  # so the other tests, which forbid it, can fail


# --- solves ------------------------------------------------------------------


def test_solve_function(getseed):
    mats = make_all(getseed)
    b = numpy_randn(getseed(), (N, 2))

    def solves(solve, b, *mats):
        return [(solve(a, b), solve(a, b[:, 0])) for a in mats]

    got = jax.jit(ft.partial(solves, solve))(b, *mats)
    expected = jax.jit(lambda b, *mats: solves(jnp.linalg.solve, b, *map(dense, mats)))(b, *mats)
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match=r"must have shape \(5,\) or \(5, k\)"):
        solve(mats[-1], jnp.asarray(b.T))


def test_solve_function_falls_back(getseed):
    # Anything that is not a structured matrix goes to jnp.linalg.solve: a dense
    # matrix, and a batch of structured ones.
    a = jnp.asarray(4.0 * np.eye(N, dtype=np.float32) + 0.1 * numpy_randn(getseed(), (N, N)))
    batch = make("diagonal", getseed(), batch=(2,))
    b = randn(getseed(), (N,))

    @jax.jit
    def solves(a, batch, b):
        got = solve(a, b), solve(batch, b)
        return got, (jnp.linalg.solve(a, b), jnp.linalg.solve(jax.vmap(dense)(batch), b))

    got, expected = solves(a, batch, b)
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_solve_function_transforms(getseed):
    t = make("tridiagonal", getseed())
    batch = make("tridiagonal", getseed(), batch=(3,))
    b = randn(getseed(), (N,))

    def loss(lower, diag, upper, b, how):
        a = TriDiagonal(lower, diag, upper)
        x = solve(a, b) if how == "structured" else jnp.linalg.solve(dense(a), b)
        return jnp.sum(jnp.sin(x))

    @ft.partial(jax.jit, static_argnums=3)
    def run(t, batch, b, how):
        grad = jax.grad(loss, argnums=(0, 1, 2, 3))(t.lower, t.diag, t.upper, b, how)
        if how == "structured":
            return grad, jax.vmap(solve, in_axes=(0, None))(batch, b)
        return grad, jnp.linalg.solve(jax.vmap(dense)(batch), b)

    got = run(t, batch, b, "structured")
    expected = run(t, batch, b, "dense")
    assert tree_allclose(got, expected, rtol=1e-3, atol=1e-4)


def test_linalg_solve_inside_quaxify(getseed):
    b = randn(getseed(), (N, 2))

    def solves(b, i, s, d, t):
        # A vector right-hand side for `d`. Inside quaxify, `solve` sees the
        # structured matrix as an array and calls jnp.linalg.solve.
        return (
            jnp.linalg.solve(i, b),
            jnp.linalg.solve(s, b),
            jnp.linalg.solve(d, b[:, 0]),
            solve(t, b),
        )

    check(solves, b, *make_all(getseed))


def test_linalg_solve_gradients(getseed):
    # Through custom_linear_solve's derivative rules, rebuilt around our rules.
    n = 7  # distinct from every other size in these programs
    t = make("tridiagonal", getseed(), n=n)
    b = randn(getseed(), (n,))

    def loss(lower, diag, upper, b, structured):
        a = TriDiagonal(lower, diag, upper)
        a = a if structured else dense(a)
        return quaxlike.quaxify(lambda a, b: jnp.sum(jnp.linalg.solve(a, b) ** 2))(a, b)

    args = (t.lower, t.diag, t.upper, b)
    tangents = tuple(randn(getseed(), x.shape) for x in args)

    @ft.partial(jax.jit, static_argnums=2)
    def grad_and_jvp(args, tangents, structured):
        def f(*xs):
            return loss(*xs, structured)

        return jax.grad(f, argnums=(0, 1, 2, 3))(*args), jax.jvp(f, args, tangents)

    # Traced once: the program is checked for (n, n) arrays, then compiled and run.
    traced = grad_and_jvp.trace(args, tangents, True)
    assert (n, n) not in shapes_in_jaxpr(traced.jaxpr.jaxpr)
    got = traced.lower().compile()(args, tangents)
    expected = grad_and_jvp(args, tangents, False)
    assert tree_allclose(got, expected, rtol=1e-3, atol=1e-4)


def test_lu_of_tridiagonal_is_packed_tridiagonal(getseed):
    t = make("tridiagonal", getseed())

    @jax.jit
    def factors(t):
        lu, pivots, permutation = quaxlike.quaxify(lax.linalg.lu)(t)
        packed = dense(lu)
        lower = jnp.tril(packed, -1) + jnp.eye(N)
        return lu, (pivots, permutation, lower @ jnp.triu(packed)), dense(t)

    lu, (pivots, permutation, product), expected = factors(t)
    assert isinstance(lu, TriDiagonal)
    assert tree_allclose((pivots, permutation), (np.arange(N, dtype=np.int32),) * 2)
    assert tree_allclose(product, expected, rtol=RTOL, atol=ATOL)


def test_triangular_solve_reads_one_triangle(getseed):
    b = randn(getseed(), (N, 2))

    def solves(b, *mats):
        out = []
        for a in mats:
            for left_side, lower, transpose_a, unit_diagonal in it.product((True, False), repeat=4):
                flags = dict(lower=lower, transpose_a=transpose_a, unit_diagonal=unit_diagonal)
                rhs = b if left_side else b.T
                out.append(lax.linalg.triangular_solve(a, rhs, left_side=left_side, **flags))
        return out

    check(solves, b, make("diagonal", getseed()), make("tridiagonal", getseed()))


# --- nothing dense -----------------------------------------------------------


def test_products_and_solves_jaxpr_has_no_dense_matrix(getseed):
    n = 7  # distinct from every other size in these programs
    x = randn(getseed(), (n, 3))
    mats = make_all(getseed, n=n)

    def program(x, *mats):
        out = []
        for a in mats:
            out += [a @ x, x.T @ a.T, a @ (a.T @ x[:, 0]), jnp.sum(a, 0)]
        # (Solves with the identities are covered by test_linalg_solve_inside_quaxify.)
        return out, [jnp.linalg.solve(a, x) for a in mats[2:]]

    jaxpr = jax.make_jaxpr(quaxlike.quaxify(program))(x, *mats)
    assert (n, n) not in shapes_in_jaxpr(jaxpr.jaxpr)
    # (The gradients of solves are checked in test_linalg_solve_gradients.)
    # The check can fail: without a rule the matrix is materialised.
    jaxpr = jax.make_jaxpr(quaxlike.quaxify(lambda a: jnp.exp(a)))(mats[-1])
    assert (n, n) in shapes_in_jaxpr(jaxpr.jaxpr)


# --- transformations ---------------------------------------------------------


def f(a, x):
    return jnp.tanh(a @ x) + (a.T @ x) * 0.5


def test_jit_outside(getseed):
    t = make("tridiagonal", getseed())
    d = make("diagonal", getseed())
    x = randn(getseed(), (N, 2))
    check(f, t, x)
    # A Value out of the jit-compiled function.
    scaled = jax.jit(quaxlike.quaxify(lambda t, d: t @ d + t))(t, d)
    assert isinstance(scaled, TriDiagonal)
    expected = jax.jit(lambda t, d: dense(t) @ dense(d) + dense(t))(t, d)
    assert tree_allclose(jax.jit(dense)(scaled), expected, rtol=RTOL)


def test_grad_outside(getseed):
    mats = make_all(getseed)[1:]  # the Identity has no leaves
    x = randn(getseed(), (N, 2))
    leaves, treedef = jax.tree.flatten(mats)

    def loss(x, *mats):
        return sum(jnp.sum(f(a, x) ** 2) for a in mats)

    def loss_of_leaves(x, leaves):
        return loss(x, *map(dense, jax.tree.unflatten(treedef, leaves)))

    grads = jax.jit(jax.grad(quaxlike.quaxify(loss), argnums=(0, 1, 2, 3)))(x, *mats)
    assert [type(g) for g in grads[1:]] == [type(a) for a in mats]
    expected = jax.jit(jax.grad(loss_of_leaves, argnums=(0, 1)))(x, leaves)
    assert tree_allclose((grads[0], jax.tree.leaves(grads[1:])), expected, rtol=RTOL, atol=ATOL)


def test_vmap_outside_over_values(getseed):
    d = make("diagonal", getseed(), batch=(4,))
    t = make("tridiagonal", getseed(), batch=(4,))
    xs = randn(getseed(), (4, N))

    def g(d, t, x):
        return (f(d, x), f(t, x), jnp.linalg.solve(t, x)), d @ d.T, t @ t.T

    @jax.jit
    def run(d, t, xs):
        got = jax.vmap(quaxlike.quaxify(g))(d, t, xs)
        return got, got[1].materialise(), jax.vmap(g)(jax.vmap(dense)(d), jax.vmap(dense)(t), xs)

    got, squares, expected = run(d, t, xs)
    # D @ D.T stays a (batch of) Diagonal; T @ T.T is dense.
    assert isinstance(got[1], Diagonal) and not isinstance(got[2], quaxlike.Value)
    assert tree_allclose((got[0], squares, got[2]), expected, rtol=RTOL, atol=ATOL)


def test_vmap_outside_over_inputs(getseed):
    i = make("identity", getseed())
    s = make("scaled", getseed())
    xs = randn(getseed(), (3, N))

    @jax.jit
    def run(i, s, xs):
        got = jax.vmap(quaxlike.quaxify(lambda a, b, x: (a + b) @ x), in_axes=(None, None, 0))(
            i, s, xs
        )
        return got, xs @ (dense(i) + dense(s)).T

    got, expected = run(i, s, xs)
    assert tree_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_scan_cond_while_inside(getseed):
    d = make("diagonal", getseed())
    t = make("tridiagonal", getseed())
    x = randn(getseed(), (N,))

    def power(a, x):  # `a` is a constant of the loop body
        def body(v, _):
            w = a @ v
            return w / jnp.linalg.norm(w), jnp.sum(w)

        return lax.scan(body, x, length=4)

    def diagonal_power(d):  # the carry stays a Diagonal
        return lax.scan(lambda m, _: (m @ d, None), d, length=3)[0]

    def branches(p, a, x):
        def branch(p):
            return lax.cond(p, lambda: a @ x, lambda: a.T @ (a.T @ x))

        return branch(p), branch(~p)

    def loop(a, x):
        def body(carry):
            i, v = carry
            return i + 1, a.T @ v * 0.5

        return lax.while_loop(lambda c: c[0] < 3, body, (jnp.int32(0), x))

    def program(p, d, t, x):
        return diagonal_power(d), power(t, x), branches(p, t, x), loop(t, x)

    got = check(program, jnp.asarray(True), d, t, x)
    assert isinstance(got[0], Diagonal)
    jaxpr = jax.make_jaxpr(quaxlike.quaxify(loop))(t, x)
    assert (N, N) not in shapes_in_jaxpr(jaxpr.jaxpr)


def test_transforms_inside_quaxify(getseed):
    t = make("tridiagonal", getseed())
    xs = randn(getseed(), (3, N))

    def program(t, xs):
        grad = jax.grad(lambda v: jnp.sum(jnp.sin(t @ v)))(xs[0])
        return grad, jax.vmap(lambda v: t.T @ v)(xs)

    check(program, t, xs)
