"""Bad input gets an error that names the type, the primitive and the way out."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from jax import lax
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import ShapedArray
from quaxlike.lora import LoraArray
from quaxlike.symbolic.zero import Zero


def test_refusing_type_names_primitive_types_and_rule_to_write():
    lora = LoraArray(jnp.ones((3, 3)), rank=1, key=jr.key(0))
    with pytest.raises(quaxlike.MaterialisationError) as info:
        quaxlike.quaxify(jnp.sin)(lora)
    message = str(info.value)
    assert "`sin`" in message and "LoraArray" in message
    assert '@quaxlike.register("sin")' in message and "x0: LoraArray" in message
    assert "allow_materialise=True" in message  # the type's own explanation is kept


def test_refusing_type_error_lists_all_argument_types():
    lora = LoraArray(jnp.ones((3, 3)), rank=1, key=jr.key(0))
    with pytest.raises(
        quaxlike.MaterialisationError, match=r"argument types \(LoraArray, ArrayImpl\)"
    ):
        quaxlike.quaxify(lax.atan2)(lora, jnp.ones((3, 3)))


def test_a_refusal_is_no_value_error_that_jax_code_catches():
    # `jnp.array_equiv` answers False where comparing raises a ValueError (shapes
    # that do not broadcast); a refusal to materialise must reach the caller,
    # not become that answer.
    lora = LoraArray(jnp.ones((3, 3)), rank=1, key=jr.key(0))
    with pytest.raises(quaxlike.MaterialisationError, match="`eq`") as info:
        quaxlike.quaxify(jnp.array_equiv)(lora, jnp.ones((3, 3)))
    assert not isinstance(info.value, ValueError)


def test_aval_returning_non_aval():
    class BadAval(quaxlike.ArrayValue):
        x: jax.Array

        def aval(self):
            return (3,)

        def materialise(self):
            return self.x

    with pytest.raises(quaxlike.QuaxlikeError, match=r"BadAval.aval\(\)` returned a tuple"):
        quaxlike.quaxify(jnp.sin)(BadAval(jnp.ones(3)))


def test_materialise_with_wrong_shape():
    class WrongShape(quaxlike.ArrayValue):
        x: jax.Array

        def aval(self):
            return ShapedArray((3,), jnp.float32)

        def materialise(self):
            return jnp.ones((4,))

    with pytest.raises(
        quaxlike.QuaxlikeError, match=r"returned an array of type float32\[4\].*says float32\[3\]"
    ):
        quaxlike.quaxify(jnp.sin)(WrongShape(jnp.ones(3)))


def test_value_not_selected_by_filter_spec():
    zero = Zero((3,), jnp.float32)
    only_second = (False, (False, True), False)
    with pytest.raises(quaxlike.QuaxlikeError, match="no `quaxify` has lifted.*filter_spec"):
        quaxlike.quaxify(lambda a, b: lax.mul(a, b), filter_spec=only_second)(zero, jnp.ones(3))


@pytest.mark.parametrize(
    "fn",
    [lambda a, b: lax.mul(a, b), lambda a, b: a * b, lambda a, b: b * a],
    ids=["primitive", "operator", "reflected-operator"],
)
def test_value_not_lifted_is_a_type_error_as_jax_raises(fn):
    # Outside any `quaxify`, JAX (or Python, for an operator) raises a TypeError
    # for the Value, and Quax passes it on: quaxlike's rewritten error is one too.
    zero = Zero((3,), jnp.float32)
    with pytest.raises(TypeError):
        fn(zero, jnp.ones(3))
    only_second = (False, (False, True), False)
    with pytest.raises(quaxlike.ValueNotLiftedError, match="no `quaxify` has lifted") as info:
        quaxlike.quaxify(fn, filter_spec=only_second)(zero, jnp.ones(3))
    assert isinstance(info.value, TypeError) and isinstance(info.value, quaxlike.QuaxlikeError)
    assert "Zero" in str(info.value)


def test_rule_returning_non_array():
    class Odd(quaxlike.ArrayValue):
        x: jax.Array

        def aval(self):
            return jax.typeof(self.x)

        def materialise(self):
            return self.x

    @quaxlike.register(lax.cos_p)
    def cos_p_odd(x: Odd, **params):
        return "not an array"

    with pytest.raises(quaxlike.QuaxlikeError, match="cos_p_odd.*`cos`.*str"):
        quaxlike.quaxify(lax.cos)(Odd(jnp.ones(2)))


def test_rule_exception_does_not_break_next_call():
    class Flaky(quaxlike.ArrayValue):
        x: jax.Array
        fail: bool = eqx.field(static=True)

        def aval(self):
            return jax.typeof(self.x)

        def materialise(self):
            return self.x

    @quaxlike.register(lax.exp_p)
    def exp_p_flaky(x: Flaky, **params):
        if x.fail:
            raise ValueError("rule failed")
        return Flaky(lax.exp(x.x), False)

    with pytest.raises(ValueError, match="rule failed"):
        quaxlike.quaxify(jnp.exp)(Flaky(jnp.ones(2), True))
    out = quaxlike.quaxify(jnp.exp)(Flaky(jnp.ones(2), False))
    assert jnp.allclose(out.x, jnp.exp(jnp.ones(2)))
    # And under jit, where the failed trace must not leave state behind either.
    out = jax.jit(quaxlike.quaxify(jnp.exp))(Flaky(jnp.zeros(2), False))
    assert jnp.allclose(out.x, 1.0)


def test_quaxify_without_values_is_the_function_itself():
    calls = []

    def f(x):
        calls.append(x)
        return jnp.nonzero(x)  # data-dependent shape: only works eagerly

    x = jnp.array([0.0, 1.0, 0.0, 2.0])
    (out,) = quaxlike.quaxify(f)(x)
    assert out.tolist() == [1, 3]
    assert calls[0] is x


def test_add_rule_handles_zero_on_either_side():
    # sanity check used by the error tests' neighbours: commutative swap works
    x = jnp.arange(3.0)

    @quaxlike.quaxify
    def f(z, x):
        return x + z, z + x

    a, b = f(Zero((3,), jnp.float32), x)
    assert jnp.array_equal(a, x) and jnp.array_equal(b, x)


def test_register_rejects_unknown_name():
    with pytest.raises(quaxlike.QuaxlikeError, match="no primitive called 'not_a_primitive'"):
        quaxlike.register("not_a_primitive")


def test_arraylike_rule_annotation_accepted():
    # ArrayLike | Value unions are accepted annotations (no error at registration).
    class Tag(quaxlike.ArrayValue):
        x: jax.Array

        def aval(self):
            return jax.typeof(self.x)

        def materialise(self):
            return self.x

    @quaxlike.register(lax.atan2_p)
    def atan2_p_tag_any(x: Tag, y: ArrayLike | quaxlike.ArrayValue, **params):
        return Tag(
            lax.atan2(
                x.x, quaxlike.internal.materialise_value(y) if isinstance(y, quaxlike.Value) else y
            )
        )

    out = quaxlike.quaxify(lax.atan2)(Tag(jnp.ones(2)), jnp.ones(2))
    assert isinstance(out, Tag) and jnp.allclose(out.x, jnp.pi / 4)


@pytest.mark.parametrize("under_jit", [False, True], ids=["eager", "jit"])
def test_a_tracer_leaked_by_the_test_is_found_by_the_leak_checker(under_jit):
    # The suite freezes every object older than a test out of the garbage
    # collector while the test runs (tests/conftest.py), which the leak checker's
    # search relies on: a tracer leaked by the test itself must still be found.
    assert jax.config.jax_check_tracer_leaks  # on for the core's tests
    leaked = []

    def keep_the_tracer(x):
        leaked.append(x)
        return x + 1

    f = quaxlike.quaxify(keep_the_tracer)
    with pytest.raises(Exception, match="[Ll]eaked"):
        (jax.jit(f) if under_jit else f)(quaxlike.DenseArrayValue(jnp.ones(3)))
