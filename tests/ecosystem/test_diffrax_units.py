"""A harmonic oscillator with units, solved by diffrax on `Unitful` values (the
way galax integrates orbits): Tsit5, an adaptive `PIDController`, output at given
times. Each solve is checked against the same solve on the numbers alone, and
its derivative against the unitless derivative.

diffrax's step-size controller holds plain numbers that mean "in the unit of
whatever this meets" (`atol`, added to `rtol * |y|` for a position and a
velocity alike; the first step's safeguards): the documented rule for them is
`plain_constants_take_units` (see the unitful README), and without it the
solve refuses, naming that rule."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quaxlike
from quaxlike.units import km, m, plain_constants_take_units, s, UnitError, Unitful


TIMES = np.linspace(0.0, 3.0, 5)


def _field(t, y, stiffness):
    position, velocity = y
    return velocity, -stiffness * position


def oscillator(y0, t0, t1, ts, stiffness, atol=1e-6):
    """Positions and velocities at `ts` of `x'' = -stiffness * x`."""
    return diffrax.diffeqsolve(
        diffrax.ODETerm(_field),
        diffrax.Tsit5(),
        t0,
        t1,
        dt0=None,
        y0=y0,
        args=stiffness,
        saveat=diffrax.SaveAt(ts=ts),
        stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=atol),
    ).ys


def _with_units(stiffness=4.0, position_unit=m, velocity_unit=m / s):
    y0 = (Unitful(jnp.array(1.0), position_unit), Unitful(jnp.array(0.0), velocity_unit))
    times = (Unitful(jnp.array(0.0), s), Unitful(jnp.array(3.0), s), Unitful(jnp.asarray(TIMES), s))
    return y0, *times, Unitful(jnp.array(stiffness), s**-2)


def _close_to_float32(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def _unitless(stiffness=4.0):
    return oscillator((1.0, 0.0), 0.0, 3.0, jnp.asarray(TIMES), stiffness)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
def test_oscillator_in_metres_and_seconds_equals_the_unitless_solve(jit):
    solve = plain_constants_take_units(quaxlike.quaxify(oscillator))
    positions, velocities = (eqx.filter_jit(solve) if jit else solve)(*_with_units())
    assert positions.unit == m and velocities.unit == m / s
    expected_positions, expected_velocities = _unitless()
    # The same numbers: the solver reads every plain constant as the unitless
    # solve does, so it takes the same steps. Under `filter_jit` it is the same
    # program, bit for bit; eagerly `Unitful` runs `jax.numpy`'s equations one
    # by one, which may round the last bits differently (1e-6 of 1 on jax 0.12).
    same = np.testing.assert_array_equal if jit else _close_to_float32
    same(positions.array, expected_positions)
    same(velocities.array, expected_velocities)
    np.testing.assert_allclose(positions.array, np.cos(2 * TIMES), atol=1e-4)


def test_oscillator_with_a_position_in_km_converts_where_units_meet():
    solve = eqx.filter_jit(plain_constants_take_units(quaxlike.quaxify(oscillator)))
    positions, velocities = solve(*_with_units(position_unit=km))
    # The velocity's `v * dt` (in m) is added to a position in km: converted.
    assert positions.unit == km and velocities.unit == m / s
    np.testing.assert_allclose(positions.array, np.cos(2 * TIMES), atol=1e-4)
    np.testing.assert_allclose(velocities.array, -2000 * np.sin(2 * TIMES), rtol=1e-4, atol=0.2)


def test_oscillator_with_plain_time_and_a_state_in_metres():
    # Time as plain numbers (dimensionless), the state in metres: `y' = (v, -k x)`
    # with `v` in m as well (per unit time).
    solve = eqx.filter_jit(plain_constants_take_units(quaxlike.quaxify(oscillator)))
    y0 = (Unitful(jnp.array(1.0), m), Unitful(jnp.array(0.0), m))
    positions, velocities = solve(y0, 0.0, 3.0, jnp.asarray(TIMES), 4.0)
    assert positions.unit == m and velocities.unit == m
    expected_positions, expected_velocities = _unitless()
    np.testing.assert_array_equal(positions.array, expected_positions)
    np.testing.assert_array_equal(velocities.array, expected_velocities)


def test_gradient_through_the_solve_equals_the_unitless_gradient():
    # diffrax's default adjoint checkpoints its loop in a `custom_vjp`, whose
    # backward pass runs under `jax.grad`, after the forward call has returned:
    # it reads the plain constants as the forward pass did, and its cotangents
    # are per unit of what they belong to.
    solve = plain_constants_take_units(quaxlike.quaxify(oscillator))
    y0, t0, t1, ts, _ = _with_units()

    def loss(stiffness):
        positions, _ = solve(y0, t0, t1, ts, Unitful(stiffness, s**-2))
        return jnp.sum(positions.array)

    def unitless_loss(stiffness):
        return jnp.sum(_unitless(stiffness)[0])

    expected = jax.grad(unitless_loss)(4.0)
    np.testing.assert_allclose(jax.grad(loss)(4.0), expected, rtol=1e-5)
    np.testing.assert_allclose(eqx.filter_jit(jax.grad(loss))(4.0), expected, rtol=1e-5)


def test_without_the_rule_a_plain_tolerance_is_refused_naming_it():
    solve = eqx.filter_jit(quaxlike.quaxify(oscillator))
    with pytest.raises(UnitError, match="plain_constants_take_units"):
        solve(*_with_units())


def test_a_tolerance_not_known_while_tracing_is_still_refused():
    # Under `filter_jit` an array argument is traced: it could be anything, so
    # the rule does not read it in any unit.
    solve = eqx.filter_jit(plain_constants_take_units(quaxlike.quaxify(oscillator)))
    with pytest.raises(UnitError, match="`add` got a plain array.*not known while tracing"):
        solve(*_with_units(), jnp.array(1e-6))


def test_a_tolerance_given_in_a_unit_must_fit_every_part_of_the_state():
    # `atol` in metres fits the position but not the velocity: refused, with
    # the units named, rule or no rule.
    solve = eqx.filter_jit(plain_constants_take_units(quaxlike.quaxify(oscillator)))
    with pytest.raises(UnitError, match=r"in m .* in m/s|in m/s .* in m"):
        solve(*_with_units(), Unitful(jnp.array(1e-6), m))
