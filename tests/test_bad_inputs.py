"""The catalogue of bad inputs: each mistake a user can make, and the error that
must teach them the way out (naming the type, the primitive, and what to do).

Some of these are also exercised next to the feature they belong to; here they
are together, one test each, so the catalogue can be read in one place.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import PassThrough, randn, tree_allclose
from jax import lax

import quaxlike
from quaxlike.internal import ShapedArray


class Plain(quaxlike.ArrayValue):
    array: jax.Array

    def aval(self):
        return jax.typeof(self.array)

    def materialise(self):
        return self.array


def _x(shape=(3,)):
    return randn(0, shape)


def test_01_wrong_filter_spec_structure():
    f = quaxlike.quaxify(lambda a, b: a + b, filter_spec=(True, (True, True, True), {}))
    with pytest.raises(
        quaxlike.QuaxlikeError, match=r"(?s)filter_spec.*does not match.*PyTree prefix"
    ):
        f(Plain(_x()), _x())


def test_02_aval_returning_a_non_aval():
    class BadAval(Plain):
        def aval(self):
            return (3,)

    with pytest.raises(
        quaxlike.QuaxlikeError, match=r"`.*BadAval.aval\(\)` returned a tuple.*ShapedArray"
    ):
        quaxlike.quaxify(jnp.sin)(BadAval(_x()))


def test_03_materialise_returning_the_wrong_shape():
    class Truncating(Plain):
        def materialise(self):
            return self.array[:2]

    with pytest.raises(
        quaxlike.QuaxlikeError,
        match=r"(?s)Truncating.materialise\(\)`.*`exp`.*float32\[2\].*float32\[3\]",
    ):
        quaxlike.quaxify(lax.exp)(Truncating(_x()))


def test_04_rule_returning_a_list_for_a_single_output_primitive():
    class Listy(Plain):
        pass

    @quaxlike.register(lax.cos_p)
    def cos_p_listy(x: Listy, **params):
        return [jnp.cos(x.array)]

    with pytest.raises(
        quaxlike.QuaxlikeError, match=r"(?s)cos_p_listy.*`cos`.*list.*single output"
    ):
        quaxlike.quaxify(lax.cos)(Listy(_x()))


@pytest.mark.parametrize("bad", [jnp.sin, 3, None])
def test_05_registering_a_non_primitive(bad):
    with pytest.raises(quaxlike.QuaxlikeError, match=r"takes a JAX primitive.*jax.lax.mul_p"):
        quaxlike.register(bad)


def test_06_unknown_primitive_name():
    with pytest.raises(quaxlike.QuaxlikeError, match=r"no primitive called 'mull'.*such as:"):
        quaxlike.register("mull")


def test_07_rule_with_unannotated_positional_argument():
    # Accepted (plum treats it as matching anything); checked mode warns. (A
    # primitive of the test's own: a rule matching anything would take over a
    # real primitive for the rest of the session.)
    private_p = jax.extend.core.Primitive("quaxlike_test_bare")
    token = quaxlike._instrument.checking.set(True)
    try:
        with pytest.warns(
            UserWarning,
            match=r"(?s)rule `.*bare_rule` registered for `quaxlike_test_bare`.*argument `x`.*annotation",
        ):

            @quaxlike.register(private_p)
            def bare_rule(x, **params):
                return NotImplemented

    finally:
        quaxlike._instrument.checking.reset(token)


def test_08_ambiguous_rules():
    class Left(Plain):
        pass

    class Right(Plain):
        pass

    @quaxlike.register(lax.atan2_p)
    def atan2_p_left_any(x: Left, y: Plain, **params):
        return lax.atan2(x.array, y.array)

    @quaxlike.register(lax.atan2_p)
    def atan2_p_any_right(x: Plain, y: Right, **params):
        return lax.atan2(x.array, y.array)

    with pytest.raises(quaxlike.AmbiguousRuleError) as info:
        quaxlike.quaxify(lax.atan2)(Left(_x()), Right(_x()))
    message = str(info.value)
    for needle in (
        "`atan2`",
        "Left",
        "Right",
        "atan2_p_left_any",
        "atan2_p_any_right",
        "precedence",
        "filter_spec",
    ):
        assert needle in message


def test_09_conflicting_defaults():
    class Loud(Plain):
        @staticmethod
        def default(primitive, values, params):
            raise AssertionError("not reached")

    class Proud(Plain):
        @staticmethod
        def default(primitive, values, params):
            raise AssertionError("not reached")

    with pytest.raises(quaxlike.QuaxlikeError, match=r"(?s)`max`.*Loud.*Proud.*Register a rule"):
        quaxlike.quaxify(lax.max)(Loud(_x()), Proud(_x()))


def test_10_value_created_inside_quaxify_and_returned():
    # Comes back as a Value; built from a lifted Value, it holds that Value.
    def f(v):
        return PassThrough(v * 2.0), Plain(jnp.ones(3))

    wrapped, plain = quaxlike.quaxify(f)(PassThrough(_x()))
    assert isinstance(wrapped, PassThrough) and isinstance(wrapped.array, PassThrough)
    assert tree_allclose(wrapped.array.array, _x() * 2.0)
    assert isinstance(plain, Plain) and tree_allclose(plain.array, jnp.ones(3))


def test_11_loop_carry_changing_type():
    # A carry that enters dense and comes out as a Value (mixed with one closed
    # over) is materialised and the loop retraced: the right numbers, densely.
    x = _x()
    out = quaxlike.quaxify(lambda v: lax.fori_loop(0, 3, lambda i, c: c + v, jnp.zeros(3)))(
        PassThrough(x)
    )
    assert not isinstance(out, quaxlike.Value) and tree_allclose(out, 3 * x, rtol=1e-6)
    # A change no materialisation can reconcile is reported with both types.
    with pytest.raises(TypeError, match=r"(?s)carry.*float32\[3\].*float16\[3\]"):
        quaxlike.quaxify(
            lambda v: lax.fori_loop(0, 3, lambda i, c: (c + v).astype(jnp.float16), v)
        )(PassThrough(x))


def test_12_value_where_jax_needs_a_concrete_value():
    with pytest.raises(
        quaxlike.QuaxlikeError,
        match=r"(?s)A Plain \(int32\[\]\) was used where JAX needs a concrete value.*plain Python number",
    ):
        quaxlike.quaxify(lambda n: jnp.zeros(n))(Plain(jnp.int32(3)))


def test_13_rule_returning_mismatched_shapes_in_checked_mode():
    class Stretchy(Plain):
        pass

    @quaxlike.register(lax.tanh_p)
    def tanh_p_stretchy(x: Stretchy, **params):
        return jnp.tanh(jnp.concatenate([x.array, x.array]))

    with pytest.raises(
        quaxlike.QuaxlikeError,
        match=r"(?s)tanh_p_stretchy.*test_bad_inputs.py:\d+.*`tanh`.*expected: float32\[3\].*got:      float32\[6\]",
    ):
        quaxlike.quaxify(lax.tanh, check=True)(Stretchy(_x()))


def test_14_exception_inside_a_rule_then_the_next_call_works():
    class Flaky(Plain):
        pass

    calls = []

    @quaxlike.register(lax.log1p_p)
    def log1p_p_flaky(x: Flaky, **params):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first call fails")
        return lax.log1p(x.array)

    f = quaxlike.quaxify(lax.log1p)
    with pytest.raises(RuntimeError, match="first call fails"):
        f(Flaky(jnp.abs(_x())))
    assert tree_allclose(f(Flaky(jnp.abs(_x()))), jnp.log1p(jnp.abs(_x())))
    assert tree_allclose(jax.jit(f)(Flaky(jnp.abs(_x()))), jnp.log1p(jnp.abs(_x())))


def test_15_no_value_at_all_works_and_costs_nothing():
    def f(a, b):
        return jnp.sin(a) @ b

    a, b = _x((2, 3)), _x((3,))
    wrapped = quaxlike.quaxify(f)
    assert tree_allclose(wrapped(a, b), f(a, b))
    # The same program, equation for equation.
    assert str(jax.make_jaxpr(wrapped)(a, b)) == str(jax.make_jaxpr(f)(a, b))
    # And the function itself is called: no trace is created.
    seen = []
    quaxlike.quaxify(lambda x: seen.append(type(x)) or x)(a)
    assert seen == [type(a)]


def test_16_value_not_selected_by_filter_spec():
    f = quaxlike.quaxify(lambda a, b: a * b, filter_spec=(False, (True, False), False))
    with pytest.raises(
        quaxlike.QuaxlikeError, match=r"(?s)`operator \*` received a Plain.*filter_spec"
    ):
        f(_x(), Plain(_x()))


def test_17_rule_returning_a_non_array():
    class Wordy(Plain):
        pass

    @quaxlike.register(lax.floor_p)
    def floor_p_wordy(x: Wordy, **params):
        return "floor"

    with pytest.raises(
        quaxlike.QuaxlikeError, match=r"floor_p_wordy.*`floor`.*str.*neither an array"
    ):
        quaxlike.quaxify(lax.floor)(Wordy(_x()))


def test_18_refusing_type_without_a_rule():
    class Precious(Plain):
        def materialise(self):
            raise RuntimeError("Precious never becomes dense")

    with pytest.raises(quaxlike.MaterialisationError) as info:
        quaxlike.quaxify(lax.expm1)(Precious(_x()))
    message = str(info.value)
    assert "`expm1`" in message and "Precious never becomes dense" in message
    assert "def expm1_p_precious(x0: " in message


def test_19_materialise_policy_error():
    with quaxlike.materialise_policy("error"):
        with pytest.raises(
            quaxlike.MaterialisationError, match=r"(?s)`exp`.*Plain.*materialise_policy"
        ):
            quaxlike.quaxify(lax.exp)(Plain(_x()))


def test_20_aval_disagreeing_with_value_shape_used_in_a_rule():
    # aval() is what user code sees; ShapedArray is re-exported for type authors.
    class Scalarish(Plain):
        def aval(self):
            return ShapedArray((), self.array.dtype)

    with pytest.raises(
        quaxlike.QuaxlikeError, match=r"Scalarish.materialise\(\)`.*float32\[3\].*float32\[\]"
    ):
        quaxlike.quaxify(lax.exp)(Scalarish(_x()))
