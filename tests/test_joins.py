"""Where a plain array meets a Value (a loop carry, a `cond` output, a `select_n`
with a scalar predicate): the Value's type holds the plain array
(`Value.holding_plain`) instead of the Value being materialised. Each result and
derivative is compared with the same function on the dense arrays.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import randn
from jax import lax

import quaxlike
from quaxlike.lora import LoraArray
from quaxlike.quantized import quantize_int8


N = 4


def _lora(seed=0, **kwargs):
    return LoraArray(randn(seed, (N, N)), rank=2, key=jr.key(seed), **kwargs)


def _dense(value):
    return value.dense() if isinstance(value, LoraArray) else value


def _trained(lora: LoraArray) -> LoraArray:
    """`lora` with a nonzero `B`, so that both factors have gradients."""
    return LoraArray.from_factors(lora.w, lora.a, randn(7, lora.b.shape))


def _cond_plain_or_value(pick_value, plain, value, x):
    out = lax.cond(pick_value, lambda: value, lambda: plain)
    return jnp.sum(jnp.tanh(out @ x))


def _while_from_plain(value, start, x):
    # The carry enters as the plain `start` and the body puts the Value in it.
    def body(carry):
        i, m, acc = carry
        return i + 1, value, acc + jnp.sum(m @ x)

    return lax.while_loop(lambda c: c[0] < 3, body, (0, start, 0.0))[2]


def _scan_from_plain(value, start, x):
    def body(carry, _):
        m, acc = carry
        return (value, acc + jnp.sum(jnp.sin(m @ x))), None

    return lax.scan(body, (start, 0.0), None, length=3)[0][1]


def _select(pick_value, plain, value, x):
    return jnp.sum((lax.select(pick_value, value, plain) @ x) ** 2)


@pytest.mark.parametrize("pick_value", [False, True])
@pytest.mark.parametrize("fn", [_cond_plain_or_value, _select])
def test_branches_of_a_plain_array_and_a_lora_keep_it_structured(fn, pick_value):
    lora, plain, x = _trained(_lora()), randn(1, (N, N)), randn(2, (N,))
    expected = fn(pick_value, plain, lora.dense(), x)
    run = quaxlike.quaxify(fn)
    np.testing.assert_allclose(run(pick_value, plain, lora, x), expected, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(run)(pick_value, plain, lora, x), expected, rtol=1e-6)
    assert not quaxlike.explain(fn)(pick_value, plain, lora, x).materialised


@pytest.mark.parametrize("pick_value", [False, True])
@pytest.mark.parametrize("fn", [_cond_plain_or_value, _select])
def test_gradients_through_the_join_of_a_frozen_lora(fn, pick_value):
    # The plain array, held in a frozen LoRA's `W`, keeps its derivative (the
    # joined form is thawed, with the Value's own `W` behind `stop_gradient`);
    # the factors keep theirs; the frozen `W` gets none.
    lora, plain, x = _trained(_lora()), randn(1, (N, N)), randn(2, (N,))

    def dense_loss(plain, w, a, b):
        return fn(pick_value, plain, lax.stop_gradient(w) + a @ b, x)

    def loss(plain, w, a, b):
        value = LoraArray.from_factors(w, a, b)
        return quaxlike.quaxify(fn)(pick_value, plain, value, x)

    args = (plain, lora.w, lora.a, lora.b)
    expected = jax.grad(dense_loss, argnums=(0, 1, 2, 3))(*args)
    got = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    tangents = tuple(randn(10 + i, np.shape(a)) for i, a in enumerate(args))
    _, expected_t = jax.jvp(dense_loss, args, tangents)
    _, got_t = jax.jvp(loss, args, tangents)
    np.testing.assert_allclose(got_t, expected_t, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(expected[0 if not pick_value else 2]))) > 0


@pytest.mark.parametrize("fn", [_while_from_plain, _scan_from_plain])
def test_a_loop_carry_that_starts_plain_keeps_the_body_s_lora(fn):
    lora, x = _trained(_lora()), randn(2, (N,))
    start = jnp.zeros((N, N))
    expected = fn(lora.dense(), start, x)
    run = quaxlike.quaxify(fn)
    np.testing.assert_allclose(run(lora, start, x), expected, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(run)(lora, start, x), expected, rtol=1e-6)
    assert not quaxlike.explain(fn)(lora, start, x).materialised
    if fn is _scan_from_plain:  # reverse mode through `scan`; `while` has none
        start = randn(3, (N, N))  # the carry's first value is used: its gradient counts

        def dense_loss(start, a, b):
            return fn(lax.stop_gradient(lora.w) + a @ b, start, x)

        def loss(start, a, b):
            return quaxlike.quaxify(fn)(LoraArray.from_factors(lora.w, a, b), start, x)

        expected = jax.grad(dense_loss, argnums=(0, 1, 2))(start, lora.a, lora.b)
        got = jax.grad(loss, argnums=(0, 1, 2))(start, lora.a, lora.b)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_a_type_that_cannot_hold_the_array_is_materialised_as_before():
    # A quantised matrix cannot hold an arbitrary plain array: materialised where
    # it may be, refused where it may not.
    w, plain, x = randn(0, (N, N)), randn(1, (N, N)), randn(2, (N,))
    allowed = quantize_int8(w, allow_materialise=True)
    expected = _cond_plain_or_value(True, plain, allowed.materialise(), x)
    run = quaxlike.quaxify(_cond_plain_or_value)
    np.testing.assert_allclose(run(True, plain, allowed, x), expected, rtol=1e-6)
    assert quaxlike.explain(_cond_plain_or_value)(True, plain, allowed, x).materialised
    with pytest.raises(quaxlike.MaterialisationError, match="output 0"):
        run(True, plain, quantize_int8(w), x)


def test_an_elementwise_select_mixes_the_cases_and_is_not_joined():
    lora, plain = _lora(allow_materialise=True), randn(1, (N, N))
    mask = randn(4, (N, N)) > 0
    fn = lambda m, p, v: lax.select(m, v, p)  # noqa: E731
    got = quaxlike.quaxify(fn)(mask, plain, lora)
    np.testing.assert_allclose(got, fn(mask, plain, lora.dense()), rtol=1e-6)


def test_a_holding_plain_of_another_structure_is_an_error_naming_the_type():
    class Bad(LoraArray):
        def holding_plain(self, array):
            return LoraArray.from_factors(array, jnp.zeros((N, 3)), jnp.zeros((3, N)))

    lora = _lora()
    bad = Bad.from_factors(lora.w, lora.a, lora.b)
    with pytest.raises(quaxlike.QuaxlikeError, match=r"Bad\.holding_plain .*output 0 of `cond`"):
        quaxlike.quaxify(_cond_plain_or_value)(True, randn(1, (N, N)), bad, randn(2, (N,)))


def _latest(x, start):
    # The carry starts as `start` and the body replaces it (as a solver's state
    # that starts as zeros is overwritten by its first step).
    def body(carry):
        i, _ = carry
        return i + 1, x * i

    return lax.while_loop(lambda c: c[0] < 3, body, (0, start))[1]


def test_a_quantity_holds_a_plain_zero_it_meets_in_a_loop():
    # A plain 0 fits every unit: the carry that starts as `jnp.zeros` is a
    # quantity in metres from the start. Its value must be known while tracing
    # (eagerly, or computed inside a `jit` from constants).
    from quaxlike.units import m, Unitful

    x = Unitful(randn(0, (3,)), m)
    out = quaxlike.quaxify(lambda x: _latest(x, jnp.zeros(3)))(x)
    assert isinstance(out, Unitful) and out.unit == m
    np.testing.assert_allclose(out.array, 2 * x.array, rtol=1e-6)
    # Inside a `jit` of Unitful's the zero is known too (and the table of known
    # values keeps none of the loop body's tracers alive: the leak checker is on).
    out = quaxlike.quaxify(eqx.filter_jit(lambda x: _latest(x, jnp.zeros(3))))(x)
    assert isinstance(out, Unitful) and out.unit == m
    np.testing.assert_allclose(out.array, 2 * x.array, rtol=1e-6)


def test_a_quantity_does_not_hold_a_plain_array_of_unknown_value():
    # A plain start whose value is not known (an argument) is a dimensionless
    # number of any value: it cannot become metres, and the loop refuses.
    from quaxlike.units import m, Unitful

    x = Unitful(randn(0, (3,)), m)
    with pytest.raises(quaxlike.CarryMaterialisationError, match="carry 1"):
        jax.jit(quaxlike.quaxify(_latest))(x, jnp.ones(3))


def _decaying_sum(x, start):
    # `acc * 0.5 + x`: inside the body the plain carry's value is unknown, so a
    # quantity refuses it as a plain number; it holds metres from the start.
    return lax.fori_loop(0, 3, lambda i, acc: acc * 0.5 + x, start)


@pytest.mark.parametrize("jitted", [False, True])
def test_a_plain_carry_takes_the_unit_the_loop_body_gives_it(jitted):
    from quaxlike.units import m, Unitful

    x = Unitful(randn(0, (3,)), m)
    fn = lambda x: _decaying_sum(x, jnp.zeros(3))  # noqa: E731
    fn = eqx.filter_jit(fn) if jitted else fn
    out = quaxlike.quaxify(fn)(x)
    assert isinstance(out, Unitful) and out.unit == m
    np.testing.assert_allclose(out.array, _decaying_sum(x.array, jnp.zeros(3)), rtol=1e-6)

    def loss(array, f):
        return (f(array) ** 2).sum()

    quaxified = lambda a: quaxlike.quaxify(fn)(Unitful(a, m)).array  # noqa: E731
    dense = lambda a: _decaying_sum(a, jnp.zeros(3))  # noqa: E731
    np.testing.assert_allclose(
        jax.grad(loss)(x.array, quaxified), jax.grad(loss)(x.array, dense), rtol=1e-6
    )
    tangent = jnp.arange(3.0)
    np.testing.assert_allclose(
        jax.jvp(quaxified, (x.array,), (tangent,))[1],
        jax.jvp(dense, (x.array,), (tangent,))[1],
        rtol=1e-6,
    )


def test_a_stand_in_never_leaves_the_loop():
    # The counter starts as a plain zero too, and the body gives it no unit: it
    # stays a plain array, while the sum becomes metres.
    from quaxlike.units import m, Unitful

    x = Unitful(randn(0, (3,)), m)

    def f(x):
        body = lambda i, c: (c[0] * 0.5 + x, c[1] + 1.0)  # noqa: E731
        return lax.fori_loop(0, 3, body, (jnp.zeros(3), jnp.zeros(())))

    total, count = quaxlike.quaxify(f)(x)
    assert isinstance(total, Unitful) and total.unit == m
    assert not isinstance(count, quaxlike.Value)
    np.testing.assert_allclose(count, 3.0)


def test_a_plain_carry_of_unknown_value_is_still_refused_inside_the_body():
    # Under an outer `jit` the plain start is not known to be 0: it is not
    # given a unit, and the body's own error is raised.
    from quaxlike.units import m, UnitError, Unitful

    x = Unitful(randn(0, (3,)), m)
    with pytest.raises(UnitError, match="`add` got a plain array"):
        jax.jit(quaxlike.quaxify(_decaying_sum))(x, jnp.zeros(3))


@pytest.mark.parametrize("jitted", [False, True])
def test_a_carry_whose_unit_follows_from_another_found_one(jitted):
    # `total` takes metres x seconds only once `acc` is known to be in metres:
    # found in a second round. The body computes something before it meets the
    # plain carry (`y`), so the first tries fail half-way through the body's
    # trace: with JAX's leak checker on (as in every test here), nothing of
    # those traces may stay alive.
    from quaxlike.units import m, s

    def f(x, t):
        def body(i, carry):
            acc, total = carry
            y = jnp.sin(jnp.arange(3.0)) * x
            return acc * 0.5 + y, total + acc * t

        return lax.fori_loop(0, 3, body, (jnp.zeros(3), jnp.zeros(3)))

    _same_as_unitless(f, jitted, units=(m, m * s))


@pytest.mark.parametrize("jitted", [False, True])
def test_a_stand_in_meeting_a_unit_in_a_nested_loop_takes_it(jitted):
    # The outer carry `rate` starts as a plain zero: while its unit is worked out
    # it stands in, and the inner loop's carry `rate * t` starts in that unit
    # still unknown and leaves the inner body in metres. There it takes metres
    # (rather than being materialised), so the outer body finishes and `rate`
    # is found to be in m/s.
    from quaxlike.units import m, s

    def f(x, t):
        def outer(i, carry):
            y, rate = carry
            step = lax.fori_loop(0, 2, lambda j, a: a * 0.5 + x, rate * t)
            return y + step, step / t

        return lax.fori_loop(0, 3, outer, (x, jnp.zeros(3)))

    _same_as_unitless(f, jitted, units=(m, m / s))


def _same_as_unitless(f, jitted, units):
    """`quaxify(f)` on `x` in metres and `t` in seconds (under `eqx.filter_jit` if
    `jitted`) gives quantities in `units` whose numbers are `f` of the bare
    numbers."""
    from quaxlike.units import m, s, Unitful

    x, t = Unitful(randn(0, (3,)), m), Unitful(jnp.array(2.0), s)
    outs = quaxlike.quaxify(eqx.filter_jit(f) if jitted else f)(x, t)
    for out, unit, expected in zip(outs, units, f(x.array, t.array), strict=True):
        assert out.unit == unit
        np.testing.assert_allclose(out.array, expected, rtol=1e-6)
