"""Eager mode (a quaxified function called outside any transformation) behaves
as Quax and JAX users expect: rules receive concrete arrays, and results are
bitwise those of running each rule as it is reached. Compiling a `jax.numpy`
function applied to Values as one call is an opt-in (`Value.compile_eagerly`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randn
from jaxtyping import ArrayLike

import quaxlike


class Powered(quaxlike.ArrayValue):
    """`array` raised to a static integer power, as a units library tracks the
    power of a unit: the rule for `pow` must read the exponent's value."""

    array: jax.Array
    power: int = eqx.field(static=True)

    def aval(self):
        return jax.typeof(self.array)

    def materialise(self):
        return self.array


@quaxlike.register(jax.lax.pow_p)
def pow_p_powered_any(x: Powered, y: ArrayLike, **params):
    return Powered(x.array**y, x.power * int(y))


@quaxlike.register(jax.lax.integer_pow_p)
def integer_pow_p_powered(x: Powered, *, y, **params):
    return Powered(x.array**y, x.power * y)


class Length(quaxlike.ArrayValue):
    """A length with a unit: kilometres (`per_km == 1`) or metres (1000)."""

    array: jax.Array
    per_km: float = eqx.field(static=True)

    def aval(self):
        return jax.typeof(self.array)

    def materialise(self):
        raise ValueError("a Length has no dense form without a unit")


@quaxlike.register(jax.lax.sub_p)
def sub_p_length_length(x: Length, y: Length, **params):
    # Convert `y` to `x`'s unit, then subtract: two operations.
    return Length(x.array - y.array * (x.per_km / y.per_km), x.per_km)


def test_a_rule_reads_a_concrete_exponent():
    x = Powered(jnp.array([1.0, 2.0]), 1)
    out = quaxlike.quaxify(jnp.power)(x, 3.0)
    assert isinstance(out, Powered) and out.power == 3
    np.testing.assert_array_equal(out.array, jnp.array([1.0, 2.0]) ** 3.0)
    out = quaxlike.quaxify(lambda v: v**2)(x)  # `integer_pow`, a param
    assert out.power == 2


def test_rules_see_concrete_arrays_for_every_argument():
    seen = []

    class Seen(quaxlike.DenseArrayValue):
        pass

    @quaxlike.register(jax.lax.mul_p)
    def mul_p_seen_any(x: Seen, y: ArrayLike, **params):
        seen.append((type(x.array), type(y)))
        return Seen(x.array * y)

    x = randn(0, (3,))
    out = quaxlike.quaxify(lambda v, w: jnp.multiply(v, jnp.sin(w)))(Seen(x), x)
    np.testing.assert_array_equal(out.array, x * jnp.sin(x))
    assert seen and all(not issubclass(t, jax.core.Tracer) for pair in seen for t in pair)


def test_results_are_those_of_the_rules_run_op_by_op():
    km, metres = Length(jnp.array(1.0), 1.0), Length(jnp.array(500.0), 1000.0)
    out = quaxlike.quaxify(jnp.subtract)(km, metres)
    # What the rule computes when its two operations run one after the other.
    factor = jnp.float32(1.0 / 1000.0)
    expected = jnp.array(1.0) - jnp.array(500.0) * factor
    assert out.per_km == 1.0
    np.testing.assert_array_equal(out.array, expected)
    assert float(out.array) == 0.5


def test_dense_sub_programs_equal_plain_jax_bitwise():
    x, y = randn(1, (4, 3)), randn(2, (3,))
    dense = quaxlike.DenseArrayValue
    cases = [
        (jnp.sin, (x,)),
        (jnp.mean, (x,)),
        (lambda a, b: jnp.tanh(a @ b) * 2.0 + 1.0, (x, y)),
        (jax.nn.softmax, (x,)),
        (lambda a: jnp.where(a > 0, a, 0.0), (x,)),
    ]
    for fn, args in cases:
        out = quaxlike.quaxify(fn)(*map(dense, args))
        expected = fn(*args)
        assert jax.typeof(out) == jax.typeof(expected)
        np.testing.assert_array_equal(out, expected)


def test_compile_eagerly_opt_in():
    seen = []

    class Fast(quaxlike.DenseArrayValue):
        compile_eagerly = True

    @quaxlike.register(jax.lax.sin_p)
    def sin_p_fast(x: Fast, **params):
        seen.append(isinstance(x.array, jax.core.Tracer))
        return Fast(jax.lax.sin(x.array))

    x = randn(3, (3,))
    for _ in range(2):
        out = quaxlike.quaxify(lambda v: jnp.sin(v) * 2.0)(Fast(x))
        np.testing.assert_allclose(out, jnp.sin(x) * 2.0, rtol=1e-6)
    # Compiled once (the rule saw a tracer), then reused without running it.
    assert seen == [True]


def test_inside_jit_rules_see_tracers_as_jax_users_expect():
    seen = []

    class Seen(quaxlike.DenseArrayValue):
        pass

    @quaxlike.register(jax.lax.cos_p)
    def cos_p_seen(x: Seen, **params):
        seen.append(isinstance(x.array, jax.core.Tracer))
        return Seen(jax.lax.cos(x.array))

    x = randn(4, (3,))
    quaxlike.quaxify(jnp.cos)(Seen(x))
    jax.jit(quaxlike.quaxify(jnp.cos))(Seen(x))
    assert seen == [False, True]


def test_refusing_types_are_named_with_the_operation_eagerly():
    with pytest.raises(quaxlike.MaterialisationError, match=r"(?s)`exp`.*Length"):
        quaxlike.quaxify(jnp.exp)(Length(jnp.ones(2), 1.0))
