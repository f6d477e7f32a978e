"""The semantics of `quaxlike.register` and `quaxlike.quaxify`.

Registrations are global and persist for the whole session, so every test defines
its own Value subclasses and only registers rules that mention them.
"""

import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PassThrough, tree_allclose
from jaxtyping import ArrayLike

import quaxlike


class _Box(quaxlike.ArrayValue):
    """Wraps an array (or another Value). Tests subclass it; no rule is ever
    registered for `_Box` itself."""

    array: Any

    def aval(self):
        if isinstance(self.array, quaxlike.Value):
            return self.array.aval()
        return jax.typeof(self.array)

    def materialise(self):
        return self.array


# JAX's tracer-leak checker (on for every test, see conftest.py) turns off JAX's
# compilation caches, which makes each eager operation recompile. The tests where
# traces nest or end early (jit, grad, nested quaxify, exceptions) keep it; the
# rest of this file runs without it to stay fast.
_LEAK_CHECKED_TESTS = {
    "test_arraylike_matches_jit_tracers",
    "test_arraylike_matches_grad_tracers",
    "test_nested_quaxify_different_types",
    "test_exception_in_rule_does_not_break_next_call",
    "test_exception_in_fn_does_not_break_next_call",
    "test_quaxify_wrapper_is_pytree",
    "test_commutative_swap_for_mul",
}


@pytest.fixture(autouse=True)
def _leak_check_only_where_needed(request):
    if request.node.originalname in _LEAK_CHECKED_TESTS:
        assert jax.config.jax_check_tracer_leaks
        yield
    else:
        with jax.check_tracer_leaks(False):
            yield


def _wrapping_default(cls):
    """A `default` that unwraps values of exactly `cls`, binds, and rewraps in `cls`."""

    def default(primitive, values, params):
        arrays = [
            v.array
            if type(v) is cls
            else quaxlike.internal.materialise_value(v)
            if isinstance(v, quaxlike.Value)
            else v
            for v in values
        ]
        out = primitive.bind(*arrays, **params)
        if primitive.multiple_results:
            return [cls(o) for o in out]
        return cls(out)

    return staticmethod(default)


def _x():
    return jnp.arange(1.0, 7.0, dtype=jnp.float32).reshape(2, 3)


def _has_rule(primitive, rule) -> bool:
    return any(m.implementation is rule for m in quaxlike.rules_for(primitive))


# --- register: what it accepts -----------------------------------------------


def test_register_by_primitive_name_and_list():
    class A(_Box):
        pass

    calls = []

    @quaxlike.register(jax.lax.sin_p)
    def sin_rule(x: A, **params):
        calls.append("sin")
        return A(x.array + 100.0)

    @quaxlike.register("cos")
    def cos_rule(x: A, **params):
        calls.append("cos")
        return A(x.array + 200.0)

    @quaxlike.register([jax.lax.exp_p, "log", (jax.lax.tanh_p, ["abs"])])
    def many_rule(x: A, **params):
        calls.append("many")
        return A(-x.array)

    assert _has_rule(jax.lax.sin_p, sin_rule)
    assert _has_rule(jax.lax.cos_p, cos_rule)
    for p in [jax.lax.exp_p, jax.lax.log_p, jax.lax.tanh_p, jax.lax.abs_p]:
        assert _has_rule(p, many_rule)
    assert not _has_rule(jax.lax.cos_p, sin_rule)

    x = _x()
    a = A(x)
    out = quaxlike.quaxify(jnp.sin)(a)
    assert type(out) is A and tree_allclose(out.array, x + 100.0)
    out = quaxlike.quaxify(jnp.cos)(a)
    assert type(out) is A and tree_allclose(out.array, x + 200.0)
    for fn in [jnp.exp, jnp.log, jnp.tanh, jnp.abs]:
        out = quaxlike.quaxify(fn)(a)
        assert type(out) is A and tree_allclose(out.array, -x)
    assert calls == ["sin", "cos", "many", "many", "many", "many"]


def test_register_names_with_odd_attribute_names():
    # `scatter_add_p` is called "scatter-add": both spellings find it.
    class A(_Box):
        pass

    def rule(x: A, i: ArrayLike, y: ArrayLike, **params):
        return NotImplemented

    quaxlike.register("scatter-add")(rule)
    assert _has_rule(jax.lax.scatter_add_p, rule)


def test_register_returns_rule_unchanged():
    class A(_Box):
        pass

    def rule(x: A, **params):
        return x

    assert quaxlike.register(jax.lax.sin_p)(rule) is rule
    assert quaxlike.register("cos", precedence=3)(rule) is rule
    assert quaxlike.register([jax.lax.exp_p, "log"])(rule) is rule


def test_unknown_primitive_name():
    with pytest.raises(quaxlike.QuaxlikeError, match="no_such_primitive_xyz"):
        quaxlike.register("no_such_primitive_xyz")
    with pytest.raises(quaxlike.QuaxlikeError, match="definitely_not_a_prim"):
        quaxlike.register(["sin", "definitely_not_a_prim"])


@pytest.mark.parametrize(
    "bad",
    [42, jnp.sin, None, "sin_p ", object()],
    ids=["int", "jnp.sin", "None", "name-with-space", "object"],
)
def test_register_non_primitive(bad):
    with pytest.raises(quaxlike.QuaxlikeError):
        quaxlike.register(bad)


def test_register_non_callable():
    # Under the test suite's runtime type checking (pyproject addopts), the
    # annotation `rule: Callable` catches this first, as a TypeError.
    with pytest.raises((quaxlike.QuaxlikeError, TypeError), match="must decorate a function|rule"):
        quaxlike.register(jax.lax.sin_p)(3)


def test_unannotated_positional_argument_matches_anything():
    # As in plum (and so Quax): an unannotated positional argument matches an
    # argument of any type. Checked mode points it out.
    class A(_Box):
        pass

    def mul_p_a_anything(x: A, y, **params):
        return A(x.array * 10 * (y.array if isinstance(y, A) else y))

    token = quaxlike._instrument.checking.set(True)
    try:
        with pytest.warns(UserWarning, match=r"(?s)mul_p_a_anything.*`mul`.*`y` with no type"):
            quaxlike.register(jax.lax.mul_p)(mul_p_a_anything)
    finally:
        quaxlike._instrument.checking.reset(token)
    assert _has_rule(jax.lax.mul_p, mul_p_a_anything)
    x = _x()
    for other in (jnp.full(x.shape, 2.0), A(jnp.full(x.shape, 2.0))):
        out = quaxlike.quaxify(lambda a, b: a * b)(A(x), other)
        assert isinstance(out, A)
        assert jnp.array_equal(out.array, x * 20.0)

    # Without checked mode, nothing is said. (A primitive of this test's own: a
    # rule that matches anything would take over `mul` for the whole session.)
    private_p = jax.extend.core.Primitive("quaxlike_test_unannotated")

    def varargs_rule(*args, **params):
        return NotImplemented

    token = quaxlike._instrument.checking.set(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            quaxlike.register(private_p)(varargs_rule)
    finally:
        quaxlike._instrument.checking.reset(token)
    assert _has_rule(private_p, varargs_rule)

    # Unannotated keyword-only params are not dispatched on: no warning.
    def ok_rule(x: A, y: A, *, extra=None, **params):
        return NotImplemented

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quaxlike.register(jax.lax.mul_p)(ok_rule) is ok_rule


def test_rule_receives_params_as_keywords():
    class A(_Box):
        pass

    seen = {}

    @quaxlike.register(jax.lax.reduce_sum_p)
    def rule(x: A, **params):
        seen.update(params)
        return A(jax.lax.reduce_sum_p.bind(x.array, **params))

    out = quaxlike.quaxify(lambda v: jnp.sum(v, axis=1))(A(_x()))
    assert type(out) is A and tree_allclose(out.array, _x().sum(axis=1))
    assert tuple(seen["axes"]) == (1,)


# --- rule selection ----------------------------------------------------------


def test_not_implemented_falls_through_to_next_rule_then_default():
    class Base(_Box):
        pass

    class Sub(Base):
        pass

    calls = []

    @quaxlike.register(jax.lax.sin_p)
    def sub_rule(x: Sub, **params):
        calls.append("sub")
        return NotImplemented

    @quaxlike.register(jax.lax.sin_p)
    def base_rule(x: Base, **params):
        calls.append("base")
        return Base(x.array * 0 + 7.0) if x.array.shape == (2, 3) else NotImplemented

    x = _x()
    out = quaxlike.quaxify(jnp.sin)(Sub(x))
    assert calls == ["sub", "base"]
    assert type(out) is Base and tree_allclose(out.array, jnp.full((2, 3), 7.0))

    # Both hand over: the default materialises and binds.
    calls.clear()
    y = jnp.arange(4.0, dtype=jnp.float32)
    out = quaxlike.quaxify(jnp.sin)(Sub(y))
    assert calls == ["sub", "base"]
    assert type(out) is not Sub and isinstance(out, jax.Array)
    assert tree_allclose(out, jnp.sin(y))


def test_not_implemented_falls_to_overridden_default():
    class A(_Box):
        pass

    A.default = _wrapping_default(A)
    calls = []

    @quaxlike.register(jax.lax.cos_p)
    def rule(x: A, **params):
        calls.append("rule")
        return NotImplemented

    out = quaxlike.quaxify(jnp.cos)(A(_x()))
    assert calls == ["rule"]
    assert type(out) is A and tree_allclose(out.array, jnp.cos(_x()))


def test_more_specific_rule_wins():
    class A(_Box):
        pass

    class B(_Box):
        pass

    @quaxlike.register(jax.lax.sub_p)
    def general(x: A, y: A | B | ArrayLike, **params):
        return A(x.array * 0 + 1.0)

    @quaxlike.register(jax.lax.sub_p)
    def specific(x: A, y: B, **params):
        return A(x.array * 0 + 2.0)

    x = _x()
    f = quaxlike.quaxify(jnp.subtract)
    assert tree_allclose(f(A(x), B(x)).array, jnp.full((2, 3), 2.0))
    assert tree_allclose(f(A(x), A(x)).array, jnp.full((2, 3), 1.0))
    assert tree_allclose(f(A(x), x).array, jnp.full((2, 3), 1.0))


def test_precedence_breaks_ties():
    class A(_Box):
        pass

    class B(_Box):
        pass

    @quaxlike.register(jax.lax.sub_p)
    def left(x: A, y: A | B, **params):
        return A(x.array * 0 + 1.0)

    @quaxlike.register(jax.lax.sub_p, precedence=1)
    def right(x: A | B, y: A, **params):
        return A(x.array * 0 + 2.0)

    x = _x()
    out = quaxlike.quaxify(jnp.subtract)(A(x), A(x))
    assert tree_allclose(out.array, jnp.full((2, 3), 2.0))
    # Where only one matches, precedence plays no part.
    assert tree_allclose(quaxlike.quaxify(jnp.subtract)(A(x), B(x)).array, jnp.full((2, 3), 1.0))
    assert tree_allclose(quaxlike.quaxify(jnp.subtract)(B(x), A(x)).array, jnp.full((2, 3), 2.0))


def test_ambiguous_rules():
    class AmbA(_Box):
        pass

    class AmbB(_Box):
        pass

    @quaxlike.register(jax.lax.sub_p)
    def ambiguous_left_rule(x: AmbA, y: AmbA | AmbB, **params):
        return x

    @quaxlike.register(jax.lax.sub_p)
    def ambiguous_right_rule(x: AmbA | AmbB, y: AmbA, **params):
        return x

    x = _x()
    with pytest.raises(quaxlike.AmbiguousRuleError) as info:
        quaxlike.quaxify(jnp.subtract)(AmbA(x), AmbA(x))
    error = info.value
    assert isinstance(error, quaxlike.QuaxlikeError) and isinstance(error, LookupError)
    message = str(error)
    assert "sub" in message
    assert "AmbA" in message
    assert "ambiguous_left_rule" in message and "ambiguous_right_rule" in message
    assert "quaxify" in message and "filter_spec" in message
    assert "precedence" in message
    # Unambiguous combinations still work, and so does the failing one again
    # (the error is raised every time, not cached into something else).
    assert type(quaxlike.quaxify(jnp.subtract)(AmbA(x), AmbB(x))) is AmbA
    with pytest.raises(quaxlike.AmbiguousRuleError):
        quaxlike.quaxify(jnp.subtract)(AmbA(x), AmbA(x))

    # A rule for exactly this combination resolves it.
    @quaxlike.register(jax.lax.sub_p)
    def exact(x: AmbA, y: AmbA, **params):
        return AmbA(x.array * 0 + 5.0)

    out = quaxlike.quaxify(jnp.subtract)(AmbA(x), AmbA(x))
    assert tree_allclose(out.array, jnp.full((2, 3), 5.0))


# --- commutative primitives ----------------------------------------------------


def test_commutative_swap_for_mul():
    class M(_Box):
        pass

    seen = []

    @quaxlike.register(jax.lax.mul_p)
    def mul_rule(x: M, y: ArrayLike, **params):
        seen.append((type(x), type(y)))
        return M(x.array * y)

    x = _x()
    for fn in [lambda v: 2.0 * v, lambda v: v * 2.0, lambda v: jnp.multiply(jnp.float32(2), v)]:
        seen.clear()
        out = quaxlike.quaxify(fn)(M(x))
        assert type(out) is M
        assert tree_allclose(out.array, 2.0 * x)
        assert len(seen) == 1 and seen[0][0] is M  # the rule always gets M first

    # The primitive directly, in both orders.
    out = quaxlike.quaxify(jax.lax.mul_p.bind)(jnp.float32(3.0), M(x))
    assert type(out) is M and tree_allclose(out.array, 3.0 * x)


@pytest.mark.parametrize(
    "primitive,fn",
    [
        (jax.lax.add_p, jnp.add),
        (jax.lax.max_p, jnp.maximum),
        (jax.lax.min_p, jnp.minimum),
    ],
)
def test_commutative_swap_other_primitives(primitive, fn):
    class M(_Box):
        pass

    @quaxlike.register(primitive)
    def rule(x: M, y: ArrayLike, **params):
        return M(primitive.bind(x.array, y, **params))

    x, y = _x(), jnp.full((2, 3), 3.0, jnp.float32)
    for args, expected in [((M(x), y), fn(x, y)), ((y, M(x)), fn(y, x))]:
        out = quaxlike.quaxify(fn)(*args)
        assert type(out) is M and tree_allclose(out.array, expected)


def test_no_swap_for_sub():
    class M(_Box):
        pass

    calls = []

    @quaxlike.register(jax.lax.sub_p)
    def sub_rule(x: M, y: ArrayLike, **params):
        calls.append("rule")
        return M(x.array - y)

    x = _x()
    out = quaxlike.quaxify(lambda v: v - 2.0)(M(x))
    assert calls == ["rule"] and type(out) is M and tree_allclose(out.array, x - 2.0)
    calls.clear()
    out = quaxlike.quaxify(lambda v: 2.0 - v)(M(x))
    assert calls == []  # not swapped: the default materialised instead
    assert isinstance(out, jax.Array) and tree_allclose(out, 2.0 - x)


# --- defaults --------------------------------------------------------------------


def test_overridden_default_is_used():
    class D(_Box):
        pass

    class Plain(_Box):
        pass

    calls = []
    wrap = _wrapping_default(D).__func__

    def default(primitive, values, params):
        calls.append((primitive.name, tuple(type(v) for v in values)))
        return wrap(primitive, values, params)

    D.default = staticmethod(default)

    x = _x()
    out = quaxlike.quaxify(jnp.sin)(D(x))
    assert type(out) is D and tree_allclose(out.array, jnp.sin(x))
    assert calls == [("sin", (D,))]

    # With a Value type that does not override `default`, D's is the only one.
    calls.clear()
    out = quaxlike.quaxify(jnp.add)(D(x), Plain(x))
    assert calls == [("add", (D, Plain))]
    assert type(out) is D and tree_allclose(out.array, 2 * x)


def test_subclass_inherits_default_without_conflict():
    class D(_Box):
        pass

    D.default = _wrapping_default(D)

    class DSub(D):
        pass

    x = _x()
    # DSub's default is D's (same function): no conflict between D and DSub.
    out = quaxlike.quaxify(lambda a, b: a * b)(D(x), DSub(jnp.ones((2, 3), jnp.float32)))
    assert type(out) is D


def test_conflicting_defaults_raise():
    class D1(_Box):
        pass

    class D2(_Box):
        pass

    D1.default = _wrapping_default(D1)
    D2.default = _wrapping_default(D2)

    x = _x()
    with pytest.raises(quaxlike.QuaxlikeError, match="overrides `Value.default`") as info:
        quaxlike.quaxify(jnp.add)(D1(x), D2(x))
    message = str(info.value)
    assert "D1" in message and "D2" in message and "add" in message

    # Each on its own is fine.
    assert type(quaxlike.quaxify(jnp.add)(D1(x), x)) is D1
    assert type(quaxlike.quaxify(jnp.add)(x, D2(x))) is D2

    # A rule for the combination resolves the conflict.
    @quaxlike.register(jax.lax.add_p)
    def add_d1_d2(a: D1, b: D2, **params):
        return D1(a.array + b.array)

    out = quaxlike.quaxify(jnp.add)(D1(x), D2(x))
    assert type(out) is D1 and tree_allclose(out.array, 2 * x)


# --- the dispatch cache ---------------------------------------------------------


def test_cache_invalidated_by_later_register():
    class Base(_Box):
        pass

    class Sub(Base):
        pass

    @quaxlike.register(jax.lax.sin_p)
    def base_rule(x: Base, **params):
        return Base(x.array * 0 + 1.0)

    x = _x()
    f = quaxlike.quaxify(jnp.sin)
    out = f(Sub(x))
    assert type(out) is Base and tree_allclose(out.array, jnp.ones((2, 3)))
    out = f(Sub(x))  # cached now
    assert tree_allclose(out.array, jnp.ones((2, 3)))

    @quaxlike.register(jax.lax.sin_p)
    def sub_rule(x: Sub, **params):
        return Sub(x.array * 0 + 2.0)

    out = f(Sub(x))
    assert type(out) is Sub and tree_allclose(out.array, jnp.full((2, 3), 2.0))
    # The Base entry is unaffected.
    out = f(Base(x))
    assert type(out) is Base and tree_allclose(out.array, jnp.ones((2, 3)))


def test_cache_invalidated_by_register_under_jit():
    class A(_Box):
        pass

    A.default = _wrapping_default(A)
    f = jax.jit(quaxlike.quaxify(jnp.cos))
    x = _x()
    assert tree_allclose(f(A(x)).array, jnp.cos(x))

    @quaxlike.register(jax.lax.cos_p)
    def rule(x: A, **params):
        return A(x.array * 0 - 1.0)

    # A fresh trace (new function) sees the new rule.
    out = jax.jit(quaxlike.quaxify(lambda v: jnp.cos(v)))(A(x))
    assert tree_allclose(out.array, jnp.full((2, 3), -1.0))


# --- ArrayLike matches every kind of array -------------------------------------------


def _arraylike_setup():
    class M(_Box):
        pass

    seen = []

    @quaxlike.register(jax.lax.mul_p)
    def rule(x: M, y: ArrayLike, **params):
        # Record facts, not `y` itself: keeping a tracer would leak it.
        seen.append(isinstance(y, jax.core.Tracer))
        return M(x.array * y)

    return M, seen


@pytest.mark.parametrize(
    "other",
    [
        2.0,
        2,
        True,
        np.float32(2.0),
        np.int32(2),
        np.full((2, 3), 2.0, np.float32),
        jnp.float32(2.0),
    ],
    ids=["float", "int", "bool", "np.float32", "np.int32", "np.ndarray", "jax.Array"],
)
@pytest.mark.loose_promotion  # NumPy scalars and bools beside float32, on purpose
def test_arraylike_matches_eager_inputs(other):
    M, seen = _arraylike_setup()
    x = _x()
    out = quaxlike.quaxify(jax.lax.mul_p.bind)(M(x), other)
    assert seen == [False], "the ArrayLike rule was not used"
    assert type(out) is M
    assert tree_allclose(out.array, x * jnp.asarray(other, jnp.float32))
    # Swapped (mul is commutative).
    seen.clear()
    out = quaxlike.quaxify(jax.lax.mul_p.bind)(other, M(x))
    assert seen == [False] and type(out) is M


def test_arraylike_matches_jit_tracers():
    M, seen = _arraylike_setup()
    x, y = _x(), jnp.full((2, 3), 3.0, jnp.float32)

    @jax.jit
    def f(m, y):
        return quaxlike.quaxify(jax.lax.mul_p.bind)(m, y)

    out = f(M(x), y)
    assert seen == [True]
    assert type(out) is M and tree_allclose(out.array, x * y)


def test_arraylike_matches_grad_tracers():
    M, seen = _arraylike_setup()
    x, y = _x(), jnp.full((2, 3), 3.0, jnp.float32)

    def loss(y):
        out = quaxlike.quaxify(lambda m, y: m * y)(M(x), y)
        assert type(out) is M
        return out.array.sum()

    g = jax.grad(loss)(y)
    assert seen == [True]
    assert tree_allclose(g, x)
    # And through jit and grad together.
    seen.clear()
    g = jax.jit(jax.grad(loss))(y)
    assert seen == [True] and tree_allclose(g, x)


def test_quaxify_primitive_bind():
    x, y = _x(), jnp.full((2, 3), 3.0, jnp.float32)
    out = quaxlike.quaxify(jax.lax.mul_p.bind)(PassThrough(x), y)
    assert type(out) is PassThrough and tree_allclose(out.array, x * y)
    out = quaxlike.quaxify(jax.lax.mul_p.bind)(quaxlike.DenseArrayValue(x), y)
    assert isinstance(out, jax.Array) and tree_allclose(out, x * y)
    out = quaxlike.quaxify(jax.lax.mul_p.bind)(x, y)
    assert tree_allclose(out, x * y)


# --- quaxify -----------------------------------------------------------------------


def test_quaxify_without_values_is_identity():
    x = jnp.array([0.0, 1.0, 0.0, 2.0])
    # Only works eagerly: a traced call would fail for want of `size=`.
    (idx,) = quaxlike.quaxify(jnp.nonzero)(x)
    assert tree_allclose(idx, jnp.array([1, 3], dtype=idx.dtype))

    sentinel = object()
    assert quaxlike.quaxify(lambda: sentinel)() is sentinel
    assert quaxlike.quaxify(lambda a: a)(x) is x
    assert quaxlike.quaxify(lambda a, *, k: (a, k))(1, k="s") == (1, "s")
    # Output type is not converted (no jnp.asarray of Python objects).
    assert quaxlike.quaxify(lambda: [1, "two"])() == [1, "two"]

    # A Value that filter_spec does not select also passes through untouched.
    v = PassThrough(x)
    assert quaxlike.quaxify(lambda a: a, filter_spec=False)(v) is v


def test_quaxify_with_values_returns_non_array_outputs():
    x = _x()
    out = quaxlike.quaxify(lambda a: (a.shape, "tag", a + 1.0))(PassThrough(x))
    assert out[0] == (2, 3) and out[1] == "tag" and type(out[2]) is PassThrough


@pytest.mark.parametrize(
    "filter_spec",
    [(True, True), (False, (True, True), False), [True, True, True], {"a": True}],
    ids=["short", "too-many-args", "list", "dict"],
)
def test_filter_spec_mismatch(filter_spec):
    f = quaxlike.quaxify(lambda a: a + 1.0, filter_spec=filter_spec)
    with pytest.raises(quaxlike.QuaxlikeError, match="filter_spec"):
        f(PassThrough(_x()))


def test_filter_spec_selects_arguments():
    x = _x()
    seen = []

    def fn(a, b):
        seen.append((type(a).__name__, type(b).__name__))
        return a + b

    out = quaxlike.quaxify(fn, filter_spec=(False, (True, False), False))(PassThrough(x), x)
    assert type(out) is PassThrough and tree_allclose(out.array, 2 * x)
    assert seen[0][0] != "PassThrough"  # it was a tracer inside


def test_a_predicate_filter_spec_lifts_only_the_values_it_selects():
    x = _x()
    seen = []

    def fn(a, b):
        seen.append((type(a), type(b)))
        return a, b

    chosen, other = PassThrough(x), PassThrough(2 * x)
    out_a, out_b = quaxlike.quaxify(fn, filter_spec=lambda v: v is chosen)(chosen, other)
    assert seen[0][0] is not PassThrough and seen[0][1] is PassThrough
    assert type(out_a) is PassThrough and out_b.array is other.array
    # A callable with leaves of its own is a prefix of filters, as in
    # `eqx.partition`: an int among them is refused.
    partial = jax.tree_util.Partial(lambda k, v: True, 3)
    with pytest.raises(quaxlike.QuaxlikeError, match="filter_spec"):
        quaxlike.quaxify(fn, filter_spec=partial)(chosen, other)


def test_nested_quaxify_different_types():
    class D1(_Box):
        pass

    class D2(_Box):
        pass

    D1.default = _wrapping_default(D1)
    D2.default = _wrapping_default(D2)

    def is_d1(v):
        return isinstance(v, D1)

    def is_d2(v):
        return isinstance(v, D2)

    x = _x()
    y = jnp.full((2, 3), 10.0, jnp.float32)

    def fn(a, b):
        return a * 2.0 + b

    # Together in one trace the two defaults conflict.
    with pytest.raises(quaxlike.QuaxlikeError, match="overrides `Value.default`"):
        quaxlike.quaxify(fn)(D1(x), D2(y))

    # The inner quaxify dispatches first: its type ends up outermost.
    inner_d1 = quaxlike.quaxify(quaxlike.quaxify(fn, filter_spec=is_d1), filter_spec=is_d2)
    out = inner_d1(D1(x), D2(y))
    assert type(out) is D1 and type(out.array) is D2
    assert tree_allclose(out.array.array, x * 2.0 + y)

    inner_d2 = quaxlike.quaxify(quaxlike.quaxify(fn, filter_spec=is_d2), filter_spec=is_d1)
    out = inner_d2(D1(x), D2(y))
    assert type(out) is D2 and type(out.array) is D1
    assert tree_allclose(out.array.array, x * 2.0 + y)

    # Also under jit.
    out = jax.jit(inner_d1)(D1(x), D2(y))
    assert type(out) is D1 and type(out.array) is D2
    assert tree_allclose(out.array.array, x * 2.0 + y)


def test_nested_quaxify_same_type_twice():
    x = _x()
    out = quaxlike.quaxify(quaxlike.quaxify(lambda a: jnp.sin(a) + 1.0))(PassThrough(x))
    assert type(out) is PassThrough and tree_allclose(out.array, jnp.sin(x) + 1.0)


# --- what rules may return ----------------------------------------------------------


def test_rule_returning_list_for_single_output():
    class A(_Box):
        pass

    @quaxlike.register(jax.lax.sin_p)
    def list_returning_rule(x: A, **params):
        return [x]

    with pytest.raises(quaxlike.QuaxlikeError, match="single output") as info:
        quaxlike.quaxify(jnp.sin)(A(_x()))
    assert "list_returning_rule" in str(info.value) and "sin" in str(info.value)


def test_rule_returning_single_for_multiple_outputs():
    class A(_Box):
        pass

    @quaxlike.register(jax.lax.sort_p)
    def single_returning_rule(*xs: A, **params):
        return xs[0]

    with pytest.raises(quaxlike.QuaxlikeError, match="multiple outputs"):
        quaxlike.quaxify(lambda v: jax.lax.sort(v))(A(jnp.array([3.0, 1.0, 2.0])))


def test_rule_returning_non_array():
    class A(_Box):
        pass

    @quaxlike.register(jax.lax.sin_p)
    def string_rule(x: A, **params):
        return "not an array"

    with pytest.raises(quaxlike.QuaxlikeError, match="neither an array nor"):
        quaxlike.quaxify(jnp.sin)(A(_x()))


def test_rule_returning_arrays_and_python_scalars():
    class A(_Box):
        pass

    @quaxlike.register(jax.lax.reduce_max_p)
    def rule(x: A, **params):
        return jax.lax.reduce_max_p.bind(x.array, **params)

    out = quaxlike.quaxify(jnp.max)(A(_x()))
    assert isinstance(out, jax.Array) and tree_allclose(out, _x().max())


def test_rule_returning_another_value_type():
    class A(_Box):
        pass

    class B(_Box):
        pass

    calls = []

    @quaxlike.register(jax.lax.sin_p)
    def sin_a(x: A, **params):
        calls.append("sin_a")
        return B(jnp.sin(x.array))

    @quaxlike.register(jax.lax.cos_p)
    def cos_b(x: B, **params):
        calls.append("cos_b")
        return A(jnp.cos(x.array))

    x = _x()
    out = quaxlike.quaxify(lambda v: jnp.cos(jnp.sin(v)))(A(x))
    assert calls == ["sin_a", "cos_b"]
    assert type(out) is A and tree_allclose(out.array, jnp.cos(jnp.sin(x)))
    out = quaxlike.quaxify(jnp.sin)(A(x))
    assert type(out) is B


def test_values_nested_inside_values():
    class Inner(_Box):
        pass

    class Outer(_Box):
        pass

    x = _x()
    nested = Outer(Inner(x))
    assert nested.shape == (2, 3) and nested.dtype == jnp.float32

    # No rule: the default materialises through both layers.
    out = quaxlike.quaxify(jnp.sin)(nested)
    assert isinstance(out, jax.Array) and tree_allclose(out, jnp.sin(x))

    # A rule may return a nested Value; it comes back as it is.
    @quaxlike.register(jax.lax.exp_p)
    def exp_outer(v: Outer, **params):
        return Outer(Inner(jnp.exp(quaxlike.internal.materialise_value(v))))

    out = quaxlike.quaxify(lambda v: jnp.exp(v) + 1.0)(nested)
    assert isinstance(out, jax.Array) and tree_allclose(out, jnp.exp(x) + 1.0)
    out = quaxlike.quaxify(jnp.exp)(nested)
    assert type(out) is Outer and type(out.array) is Inner
    assert tree_allclose(out.array.array, jnp.exp(x))


# --- quaxify as a wrapper -----------------------------------------------------------


def test_quaxify_preserves_metadata():
    def my_function(a, b):
        """My docstring."""
        return a + b

    wrapped = quaxlike.quaxify(my_function)
    assert wrapped.__name__ == "my_function"
    assert wrapped.__doc__ == "My docstring."
    assert wrapped.__wrapped__ is my_function
    assert wrapped.__qualname__ == my_function.__qualname__


def test_quaxify_as_method():
    class Scale:
        def __init__(self, factor):
            self.factor = factor

        @quaxlike.quaxify
        def apply(self, x):
            """Scale x."""
            return x * self.factor

    x = _x()
    s = Scale(3.0)
    out = s.apply(PassThrough(x))
    assert type(out) is PassThrough and tree_allclose(out.array, 3.0 * x)
    assert tree_allclose(s.apply(x), 3.0 * x)
    assert Scale.apply.__name__ == "apply" and Scale.apply.__doc__ == "Scale x."

    class Model(eqx.Module):
        w: Any

        @quaxlike.quaxify
        def __call__(self, x):
            return self.w @ x

    w = PassThrough(jnp.ones((4, 3), jnp.float32))
    out = Model(w)(x.T)
    assert type(out) is PassThrough and tree_allclose(out.array, jnp.ones((4, 3)) @ x.T)
    # A plain weight with a PassThrough input.
    out = Model(jnp.ones((4, 3), jnp.float32))(PassThrough(x.T))
    assert type(out) is PassThrough


def test_quaxify_wrapper_is_pytree():
    class Linear(eqx.Module):
        w: Any

        def __call__(self, x):
            return self.w @ x

    w = jnp.ones((4, 3), jnp.float32)
    wrapped = quaxlike.quaxify(Linear(PassThrough(w)))
    leaves = jax.tree_util.tree_leaves(wrapped)
    assert len(leaves) == 1 and leaves[0] is w
    assert isinstance(wrapped, eqx.Module)

    x = _x()[0]
    out = eqx.filter_jit(wrapped)(x)
    assert type(out) is PassThrough and tree_allclose(out.array, w @ x)
    # tree_map over the wrapper reaches the Value's array.
    doubled = jax.tree_util.tree_map(lambda a: 2 * a, wrapped)
    out = eqx.filter_jit(doubled)(x)
    assert tree_allclose(out.array, 2 * w @ x)
    # And as an argument to a jitted function.
    out = eqx.filter_jit(lambda f, x: f(x))(wrapped, x)
    assert tree_allclose(out.array, w @ x)


def test_exception_in_rule_does_not_break_next_call():
    class A(_Box):
        pass

    state = {"fail": True}

    @quaxlike.register(jax.lax.sin_p)
    def flaky(x: A, **params):
        if state["fail"]:
            raise ValueError("boom from flaky rule")
        return A(jnp.sin(x.array))

    x = _x()
    f = quaxlike.quaxify(lambda v: jnp.sin(v) * 2.0)  # A has no mul rule: materialised
    with pytest.raises(ValueError, match="boom from flaky rule"):
        f(A(x))
    # Plain JAX still runs eagerly (the trace context was restored).
    y = jnp.sin(x)
    assert not isinstance(y, jax.core.Tracer)
    state["fail"] = False
    out = f(A(x))
    assert isinstance(out, jax.Array) and tree_allclose(out, jnp.sin(x) * 2.0)
    assert type(quaxlike.quaxify(jnp.sin)(A(x))) is A
    # And under jit.
    state["fail"] = True
    with pytest.raises(ValueError, match="boom"):
        jax.jit(f)(A(x))
    state["fail"] = False
    out = jax.jit(f)(A(x))
    assert isinstance(out, jax.Array) and tree_allclose(out, jnp.sin(x) * 2.0)


def test_exception_in_fn_does_not_break_next_call():
    def fn(v):
        v = v + 1.0
        raise RuntimeError("inside fn")

    with pytest.raises(RuntimeError, match="inside fn"):
        quaxlike.quaxify(fn)(PassThrough(_x()))
    out = quaxlike.quaxify(lambda v: v + 1.0)(PassThrough(_x()))
    assert type(out) is PassThrough and tree_allclose(out.array, _x() + 1.0)
