"""`NamedArray`: names ride along with the axes and are checked.

Values are compared with plain JAX on the arrays (computed positionally, which
is what the names must not change), and the result's axis names are checked
separately. Programs run under `jax.jit`, with many expressions per program:
each eager operation would compile a program of its own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randn, tree_allclose
from jax import lax

import quaxlike
from quaxlike import named
from quaxlike.named import NamedArray, NamedAxisError


RTOL, ATOL = 1e-5, 1e-6
B, F, H = 2, 3, 4


def make(seed, axes, shape) -> NamedArray:
    return NamedArray(randn(seed, shape), axes)


def is_named(x) -> bool:
    return isinstance(x, NamedArray)


def plain(x):
    return x.array if is_named(x) else x


def axes_of(tree) -> list:
    """The axis names of each result (None for a plain array)."""
    return [x.axes if is_named(x) else None for x in jax.tree.leaves(tree, is_leaf=is_named)]


def check(fn, *args, axes=None, expected_fn=None, rtol=RTOL, atol=ATOL):
    """`quaxify(fn)` on the arguments equals `expected_fn` (by default `fn`) on
    their plain arrays, dtypes included, both in one `jax.jit`-compiled program;
    `axes` lists the names each result should carry (None: a plain array)."""

    expected_fn = fn if expected_fn is None else expected_fn

    def both(*args):
        out = quaxlike.quaxify(fn)(*args)
        plain_out = jax.tree.map(plain, out, is_leaf=is_named)
        return out, plain_out, expected_fn(*map(plain, args))

    got, got_plain, expected = jax.jit(both)(*args)
    assert tree_allclose(got_plain, expected, rtol=rtol, atol=atol)
    if axes is not None:
        assert axes_of(got) == list(axes)
    return got


@pytest.fixture
def x(getseed):
    return make(getseed(), ("batch", "feature"), (B, F))


@pytest.fixture
def w(getseed):
    return make(getseed(), ("feature", "hidden"), (F, H))


# --- construction ------------------------------------------------------------


def test_construction(x):
    assert x.shape == (B, F) and x.dtype == jnp.float32 and x.axes == ("batch", "feature")
    assert x.position("feature") == 1 and x.axis_size("feature") == F
    assert NamedArray(np.ones((2, 2)), [None, "a"]).axes == (None, "a")


def test_construction_errors(x):
    with pytest.raises(
        NamedAxisError, match=r"got 1 axis names \('a',\) for an array of shape \(2, 3\)"
    ):
        NamedArray(np.ones((2, 3)), ("a",))
    with pytest.raises(NamedAxisError, match="'a' appears more than once"):
        NamedArray(np.ones((2, 3)), ("a", "a"))
    with pytest.raises(
        NamedAxisError, match="must be strings, `Axis` objects or None; got 0 of type int"
    ):
        NamedArray(np.ones((2, 3)), ("a", 0))
    with pytest.raises(
        NamedAxisError, match=r"no axis named 'hidden'; the axes are \('batch', 'feature'\)"
    ):
        x.position("hidden")


def test_stacked_by_vmap_explains(getseed):
    stacked = jax.vmap(lambda a: NamedArray(a, ("batch", "feature")))(randn(getseed(), (5, B, F)))
    assert stacked.array.shape == (5, B, F)
    with pytest.raises(NamedAxisError, match="stacked"):
        quaxlike.quaxify(jnp.sin)(stacked)


# --- elementwise -------------------------------------------------------------


def test_elementwise_keeps_names(x, getseed):
    y = make(getseed(), ("batch", "feature"), (B, F))
    dense = randn(getseed(), (B, F))

    def fn(x, y, dense):
        return (
            jnp.tanh(x) * 2.0 + 1.0,
            x - y,
            x * dense,
            dense / (1.0 + y**2),
            jnp.where(x > 0, x, 0.0),
            jnp.maximum(x, y),
            x > y,
            jax.nn.relu(x),
            lax.stop_gradient(x).astype(jnp.bfloat16),
        )

    check(fn, x, y, dense, axes=[("batch", "feature")] * 9, rtol=1e-2)


def test_broadcasting_fills_unnamed_axes(x, getseed):
    bias = make(getseed(), ("feature",), (F,))
    scale = make(getseed(), ("batch",), (B,))
    unnamed = NamedArray(randn(getseed(), (B, F)), (None, "feature"))

    def fn(x, bias, scale, unnamed):
        return x + bias, x * scale[:, None], unnamed + bias, unnamed * x, 2.0 * bias

    axes = [("batch", "feature"), ("batch", "feature"), (None, "feature"), ("batch", "feature")]
    check(fn, x, bias, scale, unnamed, axes=axes + [("feature",)])


def test_same_names_in_another_order_are_aligned(getseed):
    a = make(getseed(), ("row", "col"), (3, 3))
    b = make(getseed(), ("col", "row"), (3, 3))
    c = make(getseed(), ("col", "row"), (3, 2))

    def fn(a, b):
        return a + b, b * a, jnp.maximum(a, b)

    def expected(a, b):  # the second operand is transposed to the first's order
        return a + b.T, b * a.T, jnp.maximum(a, b.T)

    check(fn, a, b, axes=[("row", "col"), ("col", "row"), ("row", "col")], expected_fn=expected)
    # Through lax (which does not check shapes first) even different sizes line up.
    check(lambda c, d: lax.sub(d, c), c, make(getseed(), ("row", "col"), (2, 3)),
          expected_fn=lambda c, d: d - c.T, axes=[("row", "col")])  # fmt: skip


def test_mismatched_names_raise(x, getseed):
    square = make(getseed(), ("batch", "feature"), (B, B))
    other = make(getseed(), ("batch", "hidden"), (B, B))
    per_batch = make(getseed(), ("batch",), (B,))
    run = quaxlike.quaxify(lambda a, b: a * b)
    with pytest.raises(
        NamedAxisError,
        match=r"`mul`: cannot combine NamedArrays with axes \('batch', 'feature'\) and "
        r"\('batch', 'hidden'\): position 1 is 'feature' in one and 'hidden' in the other",
    ) as info:
        run(square, other)
    assert "rename(y, {'hidden': 'feature'})" in str(info.value)
    # NumPy broadcasting lines a vector up with the last axis, here the wrong one.
    with pytest.raises(NamedAxisError, match=r"position 1 is 'feature' in one and 'batch'") as info:
        run(square, per_batch)
    assert "v[:, None]" in str(info.value)
    flipped = NamedArray(square.array, (None, "batch"))
    with pytest.raises(NamedAxisError, match="'batch' is at position 0 in one and 1 in the other"):
        quaxlike.quaxify(lambda a, b: a + b)(NamedArray(square.array, ("batch", None)), flipped)


# --- reductions and structure ------------------------------------------------


def test_reductions_keep_the_other_names(x):
    def fn(x):
        return (
            jnp.sum(x, axis=0),
            jnp.max(x, axis=1),
            jnp.argmax(x, axis=1),
            jnp.mean(x, axis=0, keepdims=True),
            jnp.cumsum(x, axis=1),
            jax.nn.softmax(x, axis=-1),
            jnp.sum(x),
        )

    axes = [("feature",), ("batch",), ("batch",), (None, "feature"), ("batch", "feature")]
    check(fn, x, axes=axes + [("batch", "feature"), None])


def test_structural_operations_move_names(x):
    def fn(x):
        return (
            x.T,
            x[None],
            x[:, None],
            x[1:],
            x[0],
            jnp.reshape(x, (B, 1, F)),
            jnp.squeeze(jnp.reshape(x, (B, 1, F)), axis=1),
            jnp.reshape(x, (B * F,)),  # merges axes: no rule, no names
            jnp.concatenate([x, x], axis=0),
            jnp.flip(x, axis=1),
            jnp.pad(x, ((0, 1), (0, 0))),
            lax.dynamic_slice(x, (jnp.int32(0), jnp.int32(1)), (B, 2)),
        )

    names = ("batch", "feature")
    axes = [("feature", "batch"), (None, *names), ("batch", None, "feature"), names, ("feature",)]
    axes += [("batch", None, "feature"), names, None, names, names, names, names]
    check(fn, x, axes=axes)


# --- dot_general -------------------------------------------------------------


def test_dot_general_carries_names(x, w, getseed):
    weight = randn(getseed(), (F, H))
    v = make(getseed(), ("feature",), (F,))
    q = make(getseed(), ("batch", "query", "feature"), (B, 2, F))
    k = make(getseed(), ("batch", "key", "feature"), (B, 5, F))

    def fn(x, w, weight, v, q, k):
        return (
            x @ w,
            x @ weight,  # a plain operand has unnamed axes
            weight.T @ x.T,
            x @ v,
            jnp.einsum("bqf,bkf->bqk", q, k),
            jnp.tensordot(x, w, axes=1),
        )

    axes = [("batch", "hidden"), ("batch", None), (None, "batch"), ("batch",)]
    check(fn, x, w, weight, v, q, k, axes=axes + [("batch", "query", "key"), ("batch", "hidden")])


def test_dot_general_mismatch_raises(getseed):
    x = make(getseed(), ("batch", "feature"), (B, F))
    w = make(getseed(), ("hidden", "feature"), (F, F))
    run = quaxlike.quaxify(lambda a, b: a @ b)
    with pytest.raises(
        NamedAxisError,
        match=r"contracts axis 'feature' \(position 1 of the left operand, axes \('batch', "
        r"'feature'\)\) with axis 'hidden' \(position 0 of the right operand",
    ) as info:
        run(x, w)
    assert "dot(x, w, 'feature')" in str(info.value)
    assert "align(w, ('feature', 'hidden'))" in str(info.value)
    y = make(getseed(), ("feature", "batch"), (F, B))
    with pytest.raises(NamedAxisError, match="the result would have two axes named 'batch'"):
        run(x, y)
    q = make(getseed(), ("batch", "query", "feature"), (B, 2, F))
    k = make(getseed(), ("head", "key", "feature"), (B, 5, F))
    with pytest.raises(NamedAxisError, match="batch axes must have the same name"):
        quaxlike.quaxify(lambda q, k: jnp.einsum("bqf,bkf->bqk", q, k))(q, k)


def _bind_dot_general(dimension_numbers):
    """A function binding `dot_general_p` directly with `dimension_numbers`,
    which `lax.dot_general` would reject before any rule saw them (the other
    params are those JAX gives a valid product)."""
    square = jnp.ones((3, 3))
    jaxpr = jax.make_jaxpr(lambda a, b: a @ b)(square, square)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive is lax.dot_general_p]
    params = {**eqn.params, "dimension_numbers": dimension_numbers}
    return lambda a, b: lax.dot_general_p.bind(a, b, **params)


def test_dot_general_unpaired_axes_is_a_value_error(getseed):
    # Two contracted axes on the left against one on the right: Quax's rule
    # raises a ValueError (JAX's own check, without names, a TypeError).
    x, y = make(getseed(), ("a", "b"), (3, 3)), make(getseed(), ("a", "b"), (3, 3))
    f = _bind_dot_general((((0, 1), (0,)), ((), ())))
    with pytest.raises(TypeError):
        f(plain(x), plain(y))
    with pytest.raises(ValueError, match=r"pair \(0, 1\) of the left operand with \(0,\)"):
        quaxlike.quaxify(f)(x, y)


def test_dot_general_axis_out_of_range_is_jax_type_error(getseed):
    # No name to check at axis 5 of a matrix: JAX's own TypeError, as in Quax
    # (and as for the plain arrays), not an IndexError from reading the names.
    x, y = make(getseed(), ("a", "b"), (3, 3)), make(getseed(), ("a", "b"), (3, 3))
    f = _bind_dot_general((((5,), (0,)), ((), ())))
    with pytest.raises(TypeError) as plain_error:
        f(plain(x), plain(y))
    with pytest.raises(TypeError) as error:
        quaxlike.quaxify(f)(x, y)
    assert str(error.value) == str(plain_error.value)


def test_full_contraction_of_two_named_arrays_is_named(getseed):
    # As in Quax: contracting every axis of two NamedArrays gives a NamedArray
    # with no axes (not a plain scalar); with a plain operand, a plain scalar.
    x, y = make(getseed(), ("a", "b"), (3, 4)), make(getseed(), ("a", "b"), (3, 4))
    full = lambda a, b: jnp.tensordot(a, b, axes=([0, 1], [0, 1]))  # noqa: E731
    for run in (quaxlike.quaxify(full), jax.jit(quaxlike.quaxify(full))):
        out = run(x, y)
        assert isinstance(out, NamedArray) and out.axes == ()
        assert tree_allclose(out.array, full(plain(x), plain(y)), rtol=RTOL, atol=ATOL)
    v = make(getseed(), ("a",), (3,))
    out = quaxlike.quaxify(lambda a, b: a @ b)(v, v)
    assert isinstance(out, NamedArray) and out.axes == ()
    out = quaxlike.quaxify(lambda a, b: a @ b)(v, plain(v))
    assert not isinstance(out, NamedArray)
    assert tree_allclose(out, plain(v) @ plain(v), rtol=RTOL, atol=ATOL)


# --- helpers by name ---------------------------------------------------------


def test_helpers(x, w, getseed):
    w_t = make(getseed(), ("hidden", "feature"), (H, F))
    q = make(getseed(), ("batch", "query", "feature"), (B, 2, F))
    k = make(getseed(), ("key", "feature", "batch"), (5, F, B))
    y = make(getseed(), ("feature", "batch"), (F, B))

    @jax.jit
    def run(x, w, w_t, q, k, y):
        return (
            named.dot(x, w_t, "feature"),  # contracts wherever the axis is
            named.dot(q, k, "feature"),  # "batch" is shared: a batch axis
            named.dot(x, y, ("batch", "feature")),  # no names left: a plain array
            named.sum(x, "batch"),
            named.sum(q, ("batch", "feature")),
            named.align(k, ("batch", "key", "feature")),
            named.rename(w, {"hidden": "out"}),
        )

    got = run(x, w, w_t, q, k, y)
    xa, wa, wta, qa, ka, ya = map(plain, (x, w, w_t, q, k, y))
    expected = (
        xa @ wta.T,
        jnp.einsum("bqf,kfb->bqk", qa, ka),
        jnp.sum(xa * ya.T),
        xa.sum(0),
        qa.sum((0, 2)),
        ka.transpose(2, 0, 1),
        wa,
    )
    assert tree_allclose([plain(g) for g in got], list(expected), rtol=1e-5, atol=1e-5)
    assert axes_of(got) == [
        ("batch", "hidden"),
        ("batch", "query", "key"),
        None,
        ("feature",),
        ("query",),
        ("batch", "key", "feature"),
        ("feature", "out"),
    ]


def test_helper_errors(x, w, getseed):
    with pytest.raises(NamedAxisError, match="`sum` takes NamedArrays; got ArrayImpl for `x`"):
        named.sum(x.array, "batch")
    with pytest.raises(NamedAxisError, match="Inside a quaxified function"):
        quaxlike.quaxify(lambda x: named.sum(x, "batch"))(x)
    with pytest.raises(NamedAxisError, match="`sum`: there is no axis named 'time'"):
        named.sum(x, "time")
    with pytest.raises(NamedAxisError, match="`rename`: there is no axis named 'time'"):
        named.rename(x, {"time": "t"})
    with pytest.raises(NamedAxisError, match=r"must list each name of the array's axes"):
        named.align(x, ("batch",))
    other = make(getseed(), ("batch", "feature"), (B + 1, F))
    with pytest.raises(NamedAxisError, match="axis 'batch' has length 2 in the left operand and 3"):
        named.dot(x, other, "feature")


# --- transformations ---------------------------------------------------------


def mlp(x, w, bias):
    return jax.nn.softmax(jnp.tanh(x @ w + bias), axis=-1)


def loss(x, w, bias):
    return jnp.sum(mlp(x, w, bias) ** 2)


@pytest.fixture
def bias(getseed):
    return make(getseed(), ("hidden",), (H,))


def test_jit_outside(x, w, bias):
    out = check(mlp, x, w, bias, axes=[("batch", "hidden")])
    assert is_named(out)


def test_grad_outside(x, w, bias):
    @jax.jit
    def grads(x, w, bias):
        got = jax.grad(quaxlike.quaxify(loss), argnums=(0, 1, 2))(x, w, bias)
        return got, jax.grad(loss, argnums=(0, 1, 2))(*map(plain, (x, w, bias)))

    got, expected = grads(x, w, bias)
    assert axes_of(got) == [x.axes, w.axes, bias.axes]
    assert tree_allclose([g.array for g in got], list(expected), rtol=1e-5, atol=1e-6)


def test_vmap_outside(w, bias, getseed):
    xs = jax.vmap(lambda a: NamedArray(a, ("batch", "feature")))(randn(getseed(), (5, B, F)))
    inputs = randn(getseed(), (5, B, F))

    @jax.jit
    def run(xs, inputs, w, bias):
        over_values = jax.vmap(quaxlike.quaxify(mlp), in_axes=(0, None, None))(xs, w, bias)
        make_x = lambda a: NamedArray(a, ("batch", "feature"))  # noqa: E731
        over_inputs = jax.vmap(lambda a: quaxlike.quaxify(mlp)(make_x(a), w, bias))(inputs)
        reference = jax.vmap(mlp, in_axes=(0, None, None))
        return (
            over_values,
            over_inputs,
            reference(xs.array, w.array, bias.array),
            reference(inputs, w.array, bias.array),
        )

    over_values, over_inputs, expected_values, expected_inputs = run(xs, inputs, w, bias)
    assert over_values.axes == over_inputs.axes == ("batch", "hidden")
    assert tree_allclose((over_values.array, over_inputs.array), (expected_values, expected_inputs))


def test_scan_cond_while_inside(x, w, bias):
    def program(p, x, w, bias):
        def body(h, _):  # `w` and `bias` are constants of the loop body
            h = jnp.tanh(h @ w + bias) @ w.T
            return h, jnp.sum(h)

        scanned, sums = lax.scan(body, x, length=3)
        branched = lax.cond(p, lambda: x * 2.0, lambda: -x)
        looped = lax.fori_loop(0, jnp.int32(3), lambda i, h: h * 0.5 + x, x)
        return scanned, sums, branched, looped

    names = ("batch", "feature")
    check(program, jnp.asarray(True), x, w, bias, axes=[names, None, names, names])


def test_mismatch_inside_scan_body_raises(x, getseed):
    other = make(getseed(), ("batch", "hidden"), (B, F))

    def program(x, other):
        return lax.scan(lambda h, _: (h + other, None), x, length=2)[0]

    with pytest.raises(NamedAxisError, match="position 1 is 'feature' in one and 'hidden'"):
        quaxlike.quaxify(program)(x, other)


def test_transforms_inside_quaxify(x, w, bias):
    def program(x, w, bias):
        grad = jax.grad(lambda x: loss(x, w, bias))(x)
        return grad, jax.vmap(lambda row: jnp.tanh(row @ w))(x)

    # vmap's batching rules apply each operation to the whole NamedArray, so the
    # mapped axis keeps its name.
    check(program, x, w, bias, axes=[("batch", "feature"), ("batch", "hidden")])
