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


# Eagerly, diffrax's loop runs op by op through the rules: a minute on two cores.
@pytest.mark.parametrize(
    "jit", [pytest.param(False, marks=pytest.mark.slow), True], ids=["eager", "filter_jit"]
)
def test_gradient_through_the_solve_equals_the_unitless_gradient(jit):
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
    grad = eqx.filter_jit(jax.grad(loss)) if jit else jax.grad(loss)
    np.testing.assert_allclose(grad(4.0), expected, rtol=1e-5)


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


# --- diffrax's default `SaveAt`, and time without units -------------------------
# With only `t1` saved (diffrax's default) the output buffers are written after
# the solver's loop, from the buffers the loop hands back: plain `inf`s there,
# which fit every unit because the loop only copies them (a loop carry that
# enters 0/inf/NaN and that the body gives back so is so after the loop).


def default_saveat(y0, t0, t1, dt0, stiffness):
    """`diffeqsolve` as a new user calls it: a fixed step, nothing else given."""
    return diffrax.diffeqsolve(
        diffrax.ODETerm(_field), diffrax.Tsit5(), t0, t1, dt0, y0, args=stiffness
    ).ys


def _seconds(x):
    return Unitful(jnp.asarray(x), s)


def _state():
    return Unitful(jnp.array(1.0), m), Unitful(jnp.array(0.0), m / s)


def _unitless_default(stiffness=4.0):
    # Times as arrays, as the quantities hold them: the same program.
    numbers = [jnp.asarray(x) for x in (0.0, 3.0, 0.1)]
    return default_saveat((jnp.array(1.0), jnp.array(0.0)), *numbers, stiffness)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
def test_the_default_saveat_equals_the_unitless_solve(jit):
    solve = plain_constants_take_units(quaxlike.quaxify(default_saveat))
    stiffness = Unitful(jnp.array(4.0), s**-2)
    times = map(_seconds, (0.0, 3.0, 0.1))
    positions, velocities = (eqx.filter_jit(solve) if jit else solve)(_state(), *times, stiffness)
    assert positions.unit == m and velocities.unit == m / s
    assert positions.shape == (1,)
    expected_positions, expected_velocities = _unitless_default()
    same = np.testing.assert_array_equal if jit else _close_to_float32
    same(positions.array, expected_positions)
    same(velocities.array, expected_velocities)
    np.testing.assert_allclose(positions.array, np.cos(6.0), atol=1e-4)


def test_the_default_saveat_gradient_equals_the_unitless_gradient():
    solve = plain_constants_take_units(quaxlike.quaxify(default_saveat))

    def loss(stiffness):
        times = map(_seconds, (0.0, 3.0, 0.1))
        positions, velocities = solve(_state(), *times, Unitful(stiffness, s**-2))
        return jnp.sum(positions.array) + jnp.sum(velocities.array)

    def unitless_loss(stiffness):
        positions, velocities = _unitless_default(stiffness)
        return jnp.sum(positions) + jnp.sum(velocities)

    expected = jax.grad(unitless_loss)(4.0)
    np.testing.assert_allclose(eqx.filter_jit(jax.grad(loss))(4.0), expected, rtol=1e-5)


def _rescaled_field(t, y, args):
    # Time is a pure number: one unit of it is `unit_time`, so `dy/dt` is in
    # the unit of `y` (as galax nondimensionalises an orbit's time).
    stiffness, unit_time = args
    position, velocity = y
    return velocity * unit_time, -stiffness * position * unit_time


def dimensionless_time(y0, stiffness, unit_time, solver, throw):
    return diffrax.diffeqsolve(
        diffrax.ODETerm(_rescaled_field),
        solver,
        0.0,
        1.0,
        0.01,
        y0,
        args=(stiffness, unit_time),
        throw=throw,
    ).ys


_SOLVERS = {
    "Euler": (diffrax.Euler(), False),
    "Tsit5": (diffrax.Tsit5(), False),
    "Tsit5-throw": (diffrax.Tsit5(), True),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
@pytest.mark.parametrize("solver", list(_SOLVERS))
def test_dimensionless_time_with_units_in_the_state_equals_the_unitless_solve(solver, jit):
    solver, throw = _SOLVERS[solver]

    def solve(y0, stiffness, unit_time):
        return dimensionless_time(y0, stiffness, unit_time, solver, throw)

    with_units = plain_constants_take_units(quaxlike.quaxify(solve))
    with_units = eqx.filter_jit(with_units) if jit else with_units
    positions, velocities = with_units(_state(), Unitful(jnp.array(4.0), s**-2), _seconds(1.0))
    assert positions.unit == m and velocities.unit == m / s
    expected_positions, expected_velocities = solve(
        (jnp.array(1.0), jnp.array(0.0)), jnp.array(4.0), jnp.array(1.0)
    )
    same = np.testing.assert_array_equal if jit else _close_to_float32
    same(positions.array, expected_positions)
    same(velocities.array, expected_velocities)


@pytest.mark.parametrize(
    "solver, jit", [("Euler", False), ("Tsit5", True)], ids=["Euler-eager", "Tsit5-filter_jit"]
)
def test_dimensionless_time_gradient_equals_the_unitless_gradient(solver, jit):
    solver, throw = _SOLVERS[solver]

    def loss(stiffness):
        y0 = _state()
        args = Unitful(stiffness, s**-2), _seconds(1.0)
        solve = quaxlike.quaxify(dimensionless_time)
        positions, _ = plain_constants_take_units(solve)(y0, *args, solver, throw)
        return jnp.sum(positions.array)

    def unitless_loss(stiffness):
        y0 = (jnp.array(1.0), jnp.array(0.0))
        positions, _ = dimensionless_time(y0, stiffness, jnp.array(1.0), solver, throw)
        return jnp.sum(positions)

    expected = jax.grad(unitless_loss)(jnp.array(4.0))
    grad = eqx.filter_jit(jax.grad(loss)) if jit else jax.grad(loss)
    np.testing.assert_allclose(grad(jnp.array(4.0)), expected, rtol=1e-5)


_SAVEATS = {
    "t0-and-t1": diffrax.SaveAt(t0=True, t1=True),
    "steps": diffrax.SaveAt(steps=True),
    "dense": diffrax.SaveAt(dense=True),
}


def saved(y0, t0, t1, dt0, stiffness, saveat):
    solution = diffrax.diffeqsolve(
        diffrax.ODETerm(_field),
        diffrax.Tsit5(),
        t0,
        t1,
        dt0,
        y0,
        args=stiffness,
        saveat=saveat,
        max_steps=16,
    )
    if saveat.dense:  # the interpolation, read after the solve
        return solution.evaluate(0.5 * t1), solution.evaluate(0.75 * t1)
    return solution.ts, solution.ys


@pytest.mark.parametrize("saveat", list(_SAVEATS))
def test_other_saveats_equal_the_unitless_solve(saveat):
    saveat = _SAVEATS[saveat]

    def solve(y0, t0, t1, dt0, stiffness):
        return saved(y0, t0, t1, dt0, stiffness, saveat)

    with_units = eqx.filter_jit(plain_constants_take_units(quaxlike.quaxify(solve)))
    times = map(_seconds, (0.0, 1.0, 0.1))
    out = with_units(_state(), *times, Unitful(jnp.array(4.0), s**-2))
    numbers = [jnp.asarray(x) for x in (0.0, 1.0, 0.1, 4.0)]
    expected = solve((jnp.array(1.0), jnp.array(0.0)), *numbers)
    if saveat.dense:
        units = ((m, m / s), (m, m / s))
    else:
        units = (s, (m, m / s))
    is_quantity = lambda x: isinstance(x, Unitful)  # noqa: E731
    assert jax.tree.map(lambda q: q.unit, out, is_leaf=is_quantity) == units
    arrays = jax.tree.map(lambda q: q.array, out, is_leaf=is_quantity)
    # Unfilled places hold inf in both.
    jax.tree.map(np.testing.assert_array_equal, arrays, expected)
