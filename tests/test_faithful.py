"""quaxify on `DenseArrayValue`s is plain JAX (issue 25, items 1-4 and 6): calls
that need a concrete value work eagerly and raise JAX's own error under `jit`;
a `jit` returning a constant works; a sub-program whose Values only
materialise is compiled as plain JAX compiles it (bitwise, even with a custom
derivative inside); a Value whose `aval()` binds a primitive works under `jit`;
JAX's typed scalars convert to `jax.Array` through plum, as in Quax."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import plum
import pytest
from jax import lax

import quaxlike
from quaxlike import _jax_compat as jc, DenseArrayValue as D


# These run user-style code and compare it with plain JAX under the same promotion.
pytestmark = pytest.mark.loose_promotion

X = jnp.array([0.0, 0.0, 1.0, 2.0, 0.0])


def _dense(tree):
    return jax.tree_util.tree_map(
        lambda v: quaxlike.internal.materialise_value(v) if isinstance(v, quaxlike.Value) else v,
        tree,
        is_leaf=lambda v: isinstance(v, quaxlike.Value),
    )


def _assert_bitwise(got, want):
    got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g.reshape(-1).view(np.uint8), w.reshape(-1).view(np.uint8))


def _through_quaxlike(fn, *args):
    return _dense(quaxlike.quaxify(fn)(*[D(a) for a in args]))


# --- 1. eager concreteness ------------------------------------------------------

NEEDS_A_VALUE = {
    "trim_zeros": (jnp.trim_zeros, (X,)),
    "item": (lambda a: a.item(), (jnp.array(3.0),)),
    "bool": (lambda a: a * 2 if a[2] > 0 else a, (X,)),
    "bincount": (jnp.bincount, (jnp.array([0, 1, 1, 3]),)),
    "unique": (jnp.unique, (X,)),
    "boolean_mask": (lambda a, m: a[m], (X, X > 0)),
    "empty_boolean_mask": (lambda a, m: a[m], (jnp.zeros((0,)), jnp.zeros((0,), bool))),
    "polymul": (
        lambda a, b: jnp.polymul(a, b, trim_leading_zeros=True),
        (jnp.array([0.0, 1.0, 2.0]), jnp.array([3.0, 4.0, 5.0])),
    ),
    "polydiv": (
        lambda a, b: jnp.polydiv(a, b, trim_leading_zeros=True),
        (jnp.array([1.0, 2.0, 3.0]), jnp.array([0.0, 1.0, 1.0])),
    ),
    "ravel_multi_index": (
        lambda i, j: jnp.ravel_multi_index((i, j), (3, 4)),
        (jnp.array([0, 1, 2]), jnp.array([1, 2, 3])),
    ),
    "slice_bounds": (lambda a, n: a[n : n + 2], (X, jnp.array(1))),
}


@pytest.mark.parametrize("name", sorted(NEEDS_A_VALUE))
def test_calls_that_need_a_value_run_eagerly_as_plain_jax(name):
    fn, args = NEEDS_A_VALUE[name]
    _assert_bitwise(_through_quaxlike(fn, *args), fn(*args))


@pytest.mark.parametrize("name", sorted(set(NEEDS_A_VALUE) - {"slice_bounds"}))
def test_under_jit_they_raise_jax_s_own_error(name):
    fn, args = NEEDS_A_VALUE[name]
    with pytest.raises(Exception) as plain:
        jax.jit(fn)(*args)
    with pytest.raises(type(plain.value)):
        jax.jit(quaxlike.quaxify(fn))(*[D(a) for a in args])


def test_concrete_inside_grad_as_jax_s_own_tracers():
    # JAX's JVP tracer answers with its primal; a QuaxTracer inside `grad` does too.
    def plain(x):
        return x * x.item()

    def through(x):
        return quaxlike.quaxify(lambda a: a * a.item())(D(x))

    assert jax.grad(through)(3.0) == jax.grad(plain)(3.0)


def test_nested_quaxify_is_concrete():
    fn = quaxlike.quaxify(quaxlike.quaxify(jnp.trim_zeros))
    _assert_bitwise(_dense(fn(D(X))), jnp.trim_zeros(X))


class Scaled(quaxlike.ArrayValue):
    """`factor * array`: materialising computes."""

    array: jax.Array
    factor: float = eqx.field(static=True)

    def aval(self):
        return jax.typeof(self.array)

    def materialise(self):
        return self.factor * self.array


class ConcreteScaled(Scaled):
    concrete_eagerly = True


class Refusing(quaxlike.ArrayValue):
    array: jax.Array
    concrete_eagerly = True

    def aval(self):
        return jax.typeof(self.array)

    def materialise(self):
        raise ValueError("Refusing has no dense form")


def test_a_type_answers_only_when_it_opts_in():
    with pytest.raises(jax.errors.ConcretizationTypeError):
        quaxlike.quaxify(jnp.trim_zeros)(Scaled(X, 2.0))
    out = quaxlike.quaxify(jnp.trim_zeros)(ConcreteScaled(X, 2.0))
    _assert_bitwise(out, jnp.trim_zeros(2.0 * X))


def test_a_type_that_refuses_to_materialise_stays_abstract():
    with pytest.raises(jax.errors.ConcretizationTypeError):
        quaxlike.quaxify(jnp.trim_zeros)(Refusing(X))
    with pytest.raises(jax.errors.TracerArrayConversionError):
        quaxlike.quaxify(np.asarray)(Refusing(X))


def test_the_materialise_policy_is_respected():
    with quaxlike.materialise_policy("error"):
        with pytest.raises(jax.errors.ConcretizationTypeError):
            quaxlike.quaxify(jnp.trim_zeros)(ConcreteScaled(X, 2.0))
        # `DenseArrayValue` is dense by purpose (`warn_on_materialise = False`).
        _assert_bitwise(_through_quaxlike(jnp.trim_zeros, X), jnp.trim_zeros(X))


def test_an_ordinary_operation_keeps_a_value_that_does_not_opt_in():
    # dtype promotion asks every operand whether it is concrete; answering
    # would make the Value dense there (see quaxlike/_concrete.py).
    value = Scaled(X, 2.0)
    assert quaxlike.quaxify(jnp.asarray)(value) is value
    assert quaxlike.quaxify(lambda a: a.astype(jnp.float32))(value) is value


# --- 2. literals in a sub-program's outputs ---------------------------------------


RETURNS_A_CONSTANT = {
    "jit_constant": (jax.jit(lambda x: (x * 2, 1.0)), (X,)),
    "average_returned": (lambda a: jnp.average(a, returned=True), (X,)),
    "polyfit_full": (lambda a, b: jnp.polyfit(a, b, 1, full=True), (X, jnp.arange(5.0))),
    "empty_cov": (jnp.cov, (jnp.ones((0,)),)),
    "resize": (lambda a: jnp.resize(a, (3, 4)), (X,)),
}


@pytest.mark.parametrize("name", sorted(RETURNS_A_CONSTANT))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_sub_program_returning_a_literal(name, jit):
    fn, args = RETURNS_A_CONSTANT[name]
    through = quaxlike.quaxify(fn)
    if jit:
        fn, through = jax.jit(fn), jax.jit(through)
    with jax.check_tracer_leaks(False):  # `polyfit` and `cov` warn plainly too
        with np.errstate(all="ignore"):
            want = fn(*args)
            got = _dense(through(*[D(a) for a in args]))
    _assert_bitwise(got, want)


# --- 3. sub-programs compiled as plain JAX compiles them -----------------------------


def test_a_custom_jvp_inside_a_jit_is_compiled_as_plain():
    a = jnp.linspace(-30.0, 30.0, 1001, dtype=jnp.float32)
    b = jnp.linspace(10.0, -20.0, 1001, dtype=jnp.float32)
    _assert_bitwise(_through_quaxlike(jnp.logaddexp2, a, b), jnp.logaddexp2(a, b))


def test_a_custom_vjp_inside_a_jit_is_compiled_as_plain():
    @jax.custom_vjp
    def f(x, y):
        return jnp.logaddexp2(x, y)  # a custom_jvp inside the custom_vjp

    f.defvjp(lambda x, y: (f(x, y), None), lambda _, g: (g / 2, g / 2))

    # Inlined where traced, as `jax.numpy`'s functions are.
    @ft.partial(jax.jit, inline=True)
    def g(x, y):
        return f(x, y) * 2

    a = jnp.linspace(-30.0, 30.0, 1001, dtype=jnp.float32)
    b = jnp.linspace(10.0, -20.0, 1001, dtype=jnp.float32)
    _assert_bitwise(_through_quaxlike(g, a, b), g(a, b))


class Tagged(quaxlike.ArrayValue):
    array: jax.Array

    def aval(self):
        return jax.typeof(self.array)

    def materialise(self):
        return self.array


_max_calls = []


@quaxlike.register(lax.max_p)
def max_p_tagged(x: Tagged, y: Tagged, **params):
    _max_calls.append(x)
    return Tagged(lax.max_p.bind(x.array, y.array, **params))


def test_a_rule_inside_a_custom_jvp_still_runs_eagerly():
    # A Value meeting a rule inside the custom_jvp's primal: not compiled whole.
    _max_calls.clear()
    a, b = jnp.arange(3.0), jnp.arange(3.0)[::-1]
    out = quaxlike.quaxify(lambda x, y: jnp.logaddexp2(x, y))(Tagged(a), Tagged(b))
    assert _max_calls
    np.testing.assert_allclose(_dense(out), jnp.logaddexp2(a, b), rtol=1e-6)


# --- 4. an aval() that binds a primitive ----------------------------------------------


class StopGradArray(quaxlike.ArrayValue):
    array: jax.Array

    def materialise(self):
        return self.array

    def aval(self):
        return jax.typeof(lax.stop_gradient(self.array))


@quaxlike.register(lax.mul_p)
def mul_p_stopgrad(x: StopGradArray, y: StopGradArray, /, **params):
    return StopGradArray(lax.mul_p.bind(x.array, y.array, **params))


@pytest.mark.parametrize("transform", ["eager", "jit", "vmap", "grad"])
def test_an_aval_that_binds_a_primitive(transform):
    square = quaxlike.quaxify(lambda a: a * a)
    x = jnp.arange(3.0)
    if transform == "eager":
        out = square(StopGradArray(x)).array
    elif transform == "jit":
        out = jax.jit(square)(StopGradArray(x)).array
    elif transform == "vmap":
        out = jax.vmap(square)(StopGradArray(jnp.stack([x, x + 1]))).array
        x = jnp.stack([x, x + 1])
    else:
        out = jax.grad(lambda v: square(StopGradArray(v)).array.sum())(x)
        np.testing.assert_array_equal(out, 2 * x)
        return
    np.testing.assert_array_equal(out, x * x)


# --- 6. plum and JAX's typed scalars ----------------------------------------------------


@pytest.mark.parametrize("typed", jc.TYPED_SCALAR_TYPES, ids=lambda t: t.__name__)
def test_typed_scalars_convert_to_jax_array(typed):
    base = next(b for b in (int, float, complex) if issubclass(typed, b))
    value, dtype = {int: (5, np.int32), float: (-2.5, np.float32), complex: (3j, np.complex64)}[
        base
    ]
    out = plum.convert(typed(value, np.dtype(dtype)), jax.Array)
    assert isinstance(out, jax.Array) and out.dtype == dtype and out.shape == ()
    assert out.item() == value


def test_typed_scalars_exist_on_every_release_tested():
    assert {t.__name__.replace("Literal", "Typed") for t in jc.TYPED_SCALAR_TYPES} == {
        "TypedInt",
        "TypedFloat",
        "TypedComplex",
    }


def test_jax_array_is_faithful_for_plum():
    assert jax.Array.__faithful__ is True  # pyright: ignore[reportAttributeAccessIssue]
    dispatcher = plum.Dispatcher()

    @dispatcher
    def f(x: jax.Array) -> str:
        return "array"

    @dispatcher
    def f(x: object) -> str:  # noqa: F811
        return "object"

    assert f(jnp.ones(2)) == "array" and f(1.0) == "object"
    assert len(f._cache) > 0  # plum caches resolution: every annotation is faithful
    seen = []
    jax.jit(lambda x: seen.append(f(x)) or x)(jnp.ones(2))
    assert seen == ["array"]  # a tracer is still a `jax.Array`
