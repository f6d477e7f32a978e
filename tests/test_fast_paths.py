"""The interpreter's fast paths (see quaxlike/_higher_order/_jit.py and _sub_programs.py).

- Sub-programs of `jit(inline=True)` functions (most of `jax.numpy`) are evaluated
  in the trace itself.
- When every operation on a Value inside such a sub-program would only
  materialise it, later calls materialise the Values once, at the call, and hand
  the call whole to the parent trace.

Each test compares against plain JAX on the materialised arrays, and checks the
path taken through what it changes: how many times a Value is materialised.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randn

import quaxlike


def _counting_type():
    """A fresh Value type (so rules registered for it stay local to one test)
    that counts its materialisations and has no rules of its own."""

    class Counted(quaxlike.ArrayValue):
        array: jax.Array
        count = [0]

        def aval(self):
            return quaxlike.internal.ShapedArray(self.array.shape, self.array.dtype)

        def materialise(self):
            type(self).count[0] += 1
            return self.array

    return Counted


@jax.jit
def _unused(x):
    return x


def _inline_jit(fn):
    # A jit that JAX inlines where it is traced, as jax.numpy's are (on any
    # release: `inline=True` before jax 0.11, `jax.Inline.JAX_EARLY` from 0.11).
    return jax.jit(fn, inline=quaxlike._jax_compat.JIT_INLINE_AT_TRACE)


def _trace(fn, *args):
    return jax.make_jaxpr(quaxlike.quaxify(fn, check=False))(*args)


def test_only_materialised_sub_program_goes_whole_to_the_parent():
    counted = _counting_type()
    body = _inline_jit(lambda a, b: jnp.sin(a) * jnp.cos(a) + b)
    a, b = randn(0, (3,)), randn(1, (3,))
    plain = jax.make_jaxpr(body)(a, b)
    counts = []
    for _ in range(3):
        counted.count[0] = 0
        jaxpr = _trace(body, counted(a), b)
        counts.append(counted.count[0])
        assert np.allclose(jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, a, b)[0], body(a, b))
    # First call: inlined, `a` materialised at each of its two uses. Then once,
    # at the call, and the traced program is JAX's own.
    assert counts == [2, 1, 1]
    assert [e.primitive for e in jaxpr.eqns] == [e.primitive for e in plain.eqns]


def test_the_eager_result_is_plain_jax_s():
    counted = _counting_type()
    body = _inline_jit(lambda a: jnp.exp(a) - a)
    a = randn(2, (4,))
    for _ in range(2):
        out = jax.jit(quaxlike.quaxify(body, check=False))(counted(a))
        assert np.allclose(out, body(a))


def test_a_value_returned_unchanged_stays_a_value():
    counted = _counting_type()
    body = _inline_jit(lambda a, b: (a, jnp.sin(a) + b))
    a, b = randn(3, (2,)), randn(4, (2,))
    for _ in range(3):
        passed, total = jax.jit(quaxlike.quaxify(body, check=False))(counted(a), b)
        assert isinstance(passed, counted)
        assert np.allclose(total, jnp.sin(a) + b)


def test_materialise_that_computes_runs_under_the_parent_trace():
    # `materialise()` here is a JAX computation on the Value's (traced) array:
    # it must be staged into the enclosing program, not run eagerly.
    class Scaled(quaxlike.ArrayValue):
        array: jax.Array
        factor: float = eqx.field(static=True)

        def aval(self):
            return quaxlike.internal.ShapedArray(self.array.shape, self.array.dtype)

        def materialise(self):
            return self.factor * self.array

    body = _inline_jit(lambda a: jnp.sin(a) + 1.0)
    a = randn(9, (3,))
    fn = jax.jit(quaxlike.quaxify(body, check=False))
    for factor in (2.0, 3.0, 3.0):  # the last call takes the materialise-at-call path
        assert np.allclose(fn(Scaled(a, factor)), jnp.sin(factor * a) + 1.0)


def test_an_unread_value_is_never_materialised():
    class Refusing(quaxlike.ArrayValue):
        def aval(self):
            return quaxlike.internal.ShapedArray((2,), jnp.float32)

        def materialise(self):
            raise RuntimeError("Refusing never materialises")

    counted = _counting_type()
    body = _inline_jit(lambda r, a: jnp.sin(a))
    a = randn(5, (2,))
    for _ in range(3):
        jaxpr = _trace(body, Refusing(), counted(a))
        assert np.allclose(jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, a)[0], jnp.sin(a))


def test_a_rule_registered_later_is_used():
    counted = _counting_type()
    body = _inline_jit(lambda a: jnp.sin(a) + 1.0)
    a = randn(6, (3,))
    for _ in range(2):
        _trace(body, counted(a))

    @quaxlike.register(jax.lax.sin_p)
    def _(x: counted, **params):
        return jnp.cos(x.array)

    counted.count[0] = 0
    jaxpr = _trace(body, counted(a))
    assert counted.count[0] == 0
    assert np.allclose(jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, a)[0], jnp.cos(a) + 1.0)


def test_a_rule_registered_while_the_trace_runs_is_used_from_then_on():
    # The trace remembers, per call-like primitive and argument kinds, which
    # rule applies and whether the call only materialises; registering a rule
    # mid-trace must make it forget.
    counted = _counting_type()
    body = _inline_jit(lambda a: jnp.sin(a) + 1.0)
    a = randn(10, (3,))

    def register_cos_for_sin():
        @quaxlike.register(jax.lax.sin_p)
        def _(x: counted, **params):
            return jnp.cos(x.array)

    def fn(v):
        before = [body(v) for _ in range(2)]  # the second takes the cached path
        register_cos_for_sin()
        after = body(v)
        return before, after

    jaxpr = _trace(fn, counted(a))
    (before_1, before_2), after = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(((0, 0), 0)),
        jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, a),
    )
    assert np.allclose(before_1, jnp.sin(a) + 1.0)
    assert np.allclose(before_2, jnp.sin(a) + 1.0)
    assert np.allclose(after, jnp.cos(a) + 1.0)


def test_a_materialise_that_breaks_its_promise_is_caught_on_the_fast_path():
    class Liar(quaxlike.ArrayValue):
        array: jax.Array

        def aval(self):
            return quaxlike.internal.ShapedArray((3,), jnp.float32)

        def materialise(self):
            return self.array  # whatever shape it holds, whatever `aval` says

    body = _inline_jit(lambda a: jnp.sin(a))
    honest = Liar(randn(11, (3,)))
    for _ in range(2):  # judged once: the call only materialises
        _trace(body, honest)
    liar = Liar(randn(12, (2,)))
    with pytest.raises(quaxlike.QuaxlikeError, match="Liar"):
        _trace(body, liar)  # the materialise-at-call path checks it too


def test_a_sub_program_with_a_rule_inside_is_inlined():
    from helpers import PassThrough

    counted = _counting_type()
    body = _inline_jit(lambda a, p: jnp.sin(a) + p)
    a, p = randn(7, (3,)), randn(8, (3,))
    for _ in range(3):
        out = quaxlike.quaxify(body, check=False)(counted(a), PassThrough(p))
        assert isinstance(out, PassThrough)
        assert np.allclose(out.array, jnp.sin(a) + p)


def test_warnings_still_name_the_inner_primitive():
    counted = _counting_type()
    body = _inline_jit(lambda a: jnp.tanh(a))
    a = randn(9, (3,))
    for _ in range(2):
        _trace(body, counted(a))
    with quaxlike.materialise_policy("warn"):
        with pytest.warns(UserWarning, match="tanh"):
            _trace(body, counted(a))


@pytest.mark.parametrize("transform", ["grad", "vmap", "jit"])
def test_under_transforms(transform):
    counted = _counting_type()
    body = _inline_jit(lambda a: jnp.sum(jnp.sin(a) ** 2))
    a = randn(10, (4,))

    def run():
        f = quaxlike.quaxify(lambda v: body(v), check=False)
        if transform == "grad":
            return jax.grad(lambda x: f(counted(x)))(a), jax.grad(body)(a)
        if transform == "vmap":
            return jax.vmap(lambda x: f(counted(x)))(a[:, None]), jax.vmap(body)(a[:, None])
        return jax.jit(lambda x: f(counted(x)))(a), body(a)

    for _ in range(3):
        got, want = run()
        assert np.allclose(got, want, rtol=1e-5)


def test_inlining_keeps_name_scopes():
    from helpers import PassThrough

    def scoped(a):
        with jax.named_scope("outer"):
            b = jnp.sin(a)
            with jax.named_scope("inner"):
                return b * 2.0

    body = _inline_jit(scoped)
    a = randn(11, (3,))
    plain = jax.make_jaxpr(body)(a)
    for _ in range(2):
        jaxpr = _trace(body, PassThrough(a))
        assert [str(e.source_info.name_stack) for e in jaxpr.eqns] == [
            str(e.source_info.name_stack) for e in plain.eqns
        ]


def test_constant_operands_beside_the_value():
    # NumPy arrays and Python scalars passed to a jitted function next to a
    # Value reach the call as they are; the call still goes to the parent.
    counted = _counting_type()
    body = _inline_jit(lambda a, b, c: a * b + c)
    a = randn(11, (3,))
    b = np.arange(3.0, dtype=np.float32)
    for _ in range(3):
        jaxpr = _trace(lambda a: body(a, b, 2.0), counted(a))
        out = jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, a)[0]
        assert np.allclose(out, a * b + 2.0)


def test_eager_calls_run_as_one_compiled_call(monkeypatch):
    # Eagerly, a `jax.numpy` call whose Values only materialise runs through a
    # compiled call made once per sub-program, as plain JAX runs it on arrays:
    # `jit`'s own implementation (the Python path) is never called, and the
    # results are bitwise plain JAX's.
    jit_p = quaxlike._jax_compat.jit_p
    bound, impl = [], jit_p.impl
    monkeypatch.setattr(jit_p, "impl", lambda *a, **p: bound.append(p["name"]) or impl(*a, **p))
    x, y = randn(5, (4,)), randn(6, (4, 4))
    f = lambda a, b: jnp.tanh(jnp.sin(a) @ b) - jnp.sum(b, axis=0)  # noqa: E731
    quaxified = quaxlike.quaxify(f)
    for _ in range(2):
        out = quaxified(quaxlike.DenseArrayValue(x), quaxlike.DenseArrayValue(y))
        np.testing.assert_array_equal(out, f(x, y), strict=True)
    assert bound == []
    # A `jit` that asks for more than `keep_unused` (an output sharding, here)
    # is bound as it is, to the same result.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    g = jax.jit(jnp.cos, out_shardings=device)
    out = quaxlike.quaxify(g)(quaxlike.DenseArrayValue(x))
    assert bound == ["cos"]
    np.testing.assert_array_equal(out, g(x), strict=True)
    assert out.sharding == g(x).sharding


def test_compiled_calls_follow_each_calls_params(monkeypatch):
    # What is decided for one sub-program's params is remembered by their
    # identity: params that differ (an output sharding here) are never taken
    # for the last ones, in either order.
    from quaxlike._sub_programs import run_compiled

    jit_p = quaxlike._jax_compat.jit_p
    bound, impl = [], jit_p.impl
    monkeypatch.setattr(jit_p, "impl", lambda *a, **p: bound.append(p["name"]) or impl(*a, **p))
    x = randn(7, (4,))
    (eqn,) = jax.make_jaxpr(lambda a: jax.jit(jnp.sin)(a))(x).jaxpr.eqns
    plain = dict(eqn.params)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sharded = {**plain, "out_shardings": (device,)}
    for params, binds in [(plain, False), (sharded, True), (plain, False), (sharded, True)]:
        before = len(bound)
        (out,) = run_compiled([x], params)
        assert (len(bound) > before) is binds
        np.testing.assert_array_equal(out, jnp.sin(x), strict=True)


@pytest.mark.parametrize(
    "args, split",
    [
        ((), True),
        ((1.0,), True),
        ((True, 2, 3.0, 1j), True),
        ((np.arange(3.0),), True),
        ((jnp.arange(3.0),), True),
        ((np.float32(2.0),), False),  # a NumPy scalar: not one of the leaf types
        (((1.0,),), False),  # a container
        ((None,), False),  # an empty PyTree, no leaf
    ],
    ids=["none", "float", "python-numbers", "numpy", "array", "numpy-scalar", "tuple", "None"],
)
def test_the_flat_split_of_a_call_is_what_flattening_finds(args, split):
    # `_flat_call` stands in for `tree_flatten((fn, args, {}), is_leaf=is_value)`
    # where every argument is a leaf, and declines elsewhere.
    from quaxlike._quaxify import _flat_call
    from quaxlike._values import is_value

    def fn(*a):
        return a

    value = quaxlike.DenseArrayValue(jnp.ones(3))
    for call_args in (args, (value, *args), (*args, value)):
        flat = _flat_call(fn, call_args)
        if not split:
            assert flat is None
            continue
        assert flat is not None
        leaves, treedef = flat
        expected_leaves, expected_treedef = jax.tree_util.tree_flatten(
            (fn, call_args, {}), is_leaf=is_value
        )
        assert treedef == expected_treedef
        assert len(leaves) == len(expected_leaves)
        assert all(a is b for a, b in zip(leaves, expected_leaves))


def test_a_single_result_and_a_tuple_of_results_come_back_as_plain_jax_s():
    value = quaxlike.DenseArrayValue(jnp.arange(4.0))
    single = quaxlike.quaxify(lambda x, y: x * y)(value, 2.0)
    pair = quaxlike.quaxify(lambda x, y: (x * y, y))(value, 2.0)
    expected = jnp.arange(4.0) * 2.0
    assert type(single) is type(expected)
    np.testing.assert_array_equal(single, expected)
    assert type(pair) is tuple and pair[1] == 2.0
    np.testing.assert_array_equal(pair[0], expected)
