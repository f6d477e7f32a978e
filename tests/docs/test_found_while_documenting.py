"""Problems found while writing the documentation, reduced to minimal repros
(both fixed; kept as regression tests)."""

import jax
import jax.numpy as jnp
import pytest
from jaxtyping import ArrayLike

import quaxlike


def test_ambiguity_message_suggests_runnable_register_call():
    class A(quaxlike.DenseArrayValue):
        pass

    class B(quaxlike.DenseArrayValue):
        pass

    @quaxlike.register(jax.lax.dot_general_p)
    def dot_general_p_a_any(x: A, y: ArrayLike | quaxlike.ArrayValue, **params):
        return NotImplemented

    @quaxlike.register(jax.lax.dot_general_p)
    def dot_general_p_any_b(x: ArrayLike | quaxlike.ArrayValue, y: B, **params):
        return NotImplemented

    with pytest.raises(quaxlike.AmbiguousRuleError) as info:
        quaxlike.quaxify(jnp.dot)(A(jnp.ones(2)), B(jnp.ones(2)))
    message = str(info.value)
    assert "register(jax.lax.dot_general_p, precedence=1)" in message or (
        "register('dot_general', precedence=1)" in message
    )


def test_program_of_custom_jvp_is_readable():
    report = quaxlike.explain(jax.nn.relu)(quaxlike.DenseArrayValue(jnp.ones(3)))
    program = report.program()
    assert "custom_jvp_call" in program
    assert "Core: memoized" not in program and "Wrapped function:" not in program
