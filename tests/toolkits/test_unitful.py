"""`Unitful`: the unit algebra, each family of rules against plain JAX on the
numbers, unit errors, and the type under jit/grad/vmap and inside scan/cond/while.

A dimensioned `Unitful` refuses to materialise, so every test here that passes with
dimensioned quantities also shows that no primitive fell back to the bare numbers.
"""

import copy
import pathlib
import pickle
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_allclose
from jax import lax

import quaxlike
from quaxlike.units import (
    dimensionless,
    hour,
    J,
    K,
    kg,
    km,
    m,
    N,
    s,
    Unit,
    UnitError,
    Unitful,
)


def arr(x, dtype=np.float32):
    """`x` as a `jax.Array`, made without compiling anything. (With the tracer-leak
    checker on, JAX does not cache `jnp.asarray`/`jnp.array`: each call compiles.)"""
    return jax.device_put(np.asarray(x, dtype))


def randn(seed, shape, scale=1.0):
    return arr(scale * np.random.default_rng(seed).standard_normal(shape))


def q(seed, shape, unit, scale=1.0):
    return Unitful(randn(seed, shape, scale), unit)


def _numbers(tree):
    return jax.tree.map(
        lambda x: x.array if isinstance(x, Unitful) else x,
        tree,
        is_leaf=lambda x: isinstance(x, Unitful),
    )


def both(fn, *args, static_argnums=()):
    """`fn` quaxified on `args` and plainly on their numbers, compiled as one
    program (one compilation per test instead of two)."""

    def run(*args):
        return quaxlike.quaxify(fn)(*args), fn(*_numbers(args))

    return jax.jit(run, static_argnums=static_argnums)(*args)


def check(cases, *args, rtol=1e-5, atol=1e-6):
    """Run every `fn` of `cases` (pairs `(fn, expected_unit)`) quaxified on `args`
    and plainly on their numbers, all in one compiled program; compare the numbers
    and the units. An `expected_unit` of None means a plain array."""
    fns = [fn for fn, _ in cases]
    got, expected = both(lambda *a: [fn(*a) for fn in fns], *args)
    for (fn, unit), out, ref in zip(cases, got, expected):
        leaves = jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, Unitful))
        units = [leaf.unit if isinstance(leaf, Unitful) else None for leaf in leaves]
        assert units == [unit] * len(leaves), (fn, [str(u) for u in units], str(unit))
        assert tree_allclose(_numbers(out), ref, rtol=rtol, atol=atol), fn


# --- the unit algebra ------------------------------------------------------------


@pytest.mark.parametrize(
    "unit, text",
    [
        (kg * m / s**2, "kg*m/s^2"),
        (m / s**2, "m/s^2"),
        (1 / s, "1/s"),
        (m ** Fraction(1, 2), "m^(1/2)"),
        ((m * s) ** -1, "1/(m*s)"),
        (m / m, "dimensionless"),
        (km, "1000 m"),
        (km / m, "1000"),
        (K * m**2, "m^2*K"),
    ],
)
def test_unit_printing(unit, text):
    assert str(unit) == text
    assert repr(unit) == f"Unit({text})"


def test_unit_algebra():
    assert N == kg * m / s**2
    assert J == N * m and hash(J) == hash(kg * m**2 / s**2)
    assert (m**2) ** 0.5 == m
    assert (m**3) ** Fraction(1, 3) == m
    assert m / m == dimensionless and (m / m).dimensionless
    assert m != s and m != km and km.same_dimensions(m)
    assert km.si == m
    assert km.factor_to(m) == 1000.0 and m.factor_to(km) == 0.001
    assert hour.factor_to(s) == 3600.0
    # Scales are rounded so that float round-off does not make units differ.
    assert km / m * m == km
    assert (km**2) ** 0.5 == km
    assert m.exponents == {"kg": 0, "m": 1, "s": 0, "A": 0, "K": 0}
    assert {m: 1}[Unit(m=1)] == 1  # hashable, equal by value
    assert copy.deepcopy(N) is N
    assert pickle.loads(pickle.dumps(N)) == N


def test_unit_errors():
    with pytest.raises(TypeError, match="simple fraction"):
        m**0.123456789
    with pytest.raises(TypeError, match="not a bool"):
        Unit(m=True)
    with pytest.raises(ValueError, match="positive finite"):
        Unit(m=1, scale=-1.0)
    with pytest.raises(ValueError, match="dimensions differ"):
        m.factor_to(s)
    with pytest.raises(TypeError):
        2 / m  # only `1 / unit` makes a unit
    # (Under the test suite's runtime type checker, the annotation catches this first.)
    with pytest.raises(TypeError, match="Unit"):
        Unitful(arr(np.ones(3)), "m")  # pyright: ignore


# --- rules, compared with plain JAX on the numbers -------------------------------


# The sweeps below call `lax` directly: every `jnp` function is an inline `jit`,
# which quaxlike runs as a nested `quaxify`, and under the tracer-leak checker each
# of those costs a full garbage collection. `test_jnp_level_physics` covers `jnp`.


def test_same_unit_family(getseed):
    a, b = q(getseed(), (3,), m / s), q(getseed(), (3,), m / s)
    check(
        [
            (lax.add, m / s),
            (lax.sub, m / s),
            (lax.max, m / s),
            (lax.min, m / s),
            (lax.rem, m / s),
            (lax.gt, None),
            (lax.le, None),
            (lax.eq, None),
            (lax.ne, None),
            (lambda x, y: lax.select_n(lax.gt(x, y), y, x), m / s),
            (lambda x, y: lax.concatenate([x, y, x], 0), m / s),
            (lambda x, y: lax.dynamic_update_slice(x, y[:1], (1,)), m / s),
            (lambda x, y: lax.clamp(lax.neg(lax.abs(y)), x, lax.abs(y)), m / s),
            (lambda x, y: lax.pad(x, y[0], [(1, 2, 0)]), m / s),
            (lambda x, y: x.at[1].set(y[0]), m / s),  # scatter
            (lax.atan2, dimensionless),
        ],
        a,
        b,
    )


def test_add_converts_scales(getseed):
    a, b = q(getseed(), (3,), km), q(getseed(), (3,), m)
    sum_km, sum_m, less = jax.jit(
        quaxlike.quaxify(lambda a, b: (a + b, b + a, a < b))  # compared in km
    )(a, b)
    a_np, b_np = np.asarray(a.array), np.asarray(b.array)
    assert sum_km.unit == km and tree_allclose(sum_km.array, np.asarray(a_np + b_np / 1000))
    assert sum_m.unit == m
    assert tree_allclose(sum_m.array, np.asarray(b_np + a_np * 1000), atol=1e-3)
    assert tree_allclose(less, np.asarray(a_np < b_np / 1000))


def test_plain_arrays_are_dimensionless_numbers(getseed):
    ratio = Unitful(randn(getseed(), (3,)), m / m)
    # A dimensionless unit with a scale (km/m) is converted to pure numbers first.
    scaled = Unitful(arr([1.0, 2.0, 3.0]), km / m)
    check(
        [
            (lambda r, x: r + 1.0, dimensionless),
            (lambda r, x: 2.0 - r, dimensionless),
            (lambda r, x: jnp.maximum(r, 0.0), dimensionless),
        ],
        ratio,
        scaled,
    )
    out = jax.jit(quaxlike.quaxify(lambda x: x + 1.0))(scaled)
    assert tree_allclose(out.array, arr([1001.0, 2001.0, 3001.0]))


def test_unit_algebra_rules(getseed):
    x, y = q(getseed(), (3,), m), q(getseed(), (3,), s)
    mat = q(getseed(), (2, 3), kg)
    plain = randn(getseed(), (3,))

    def matmul(a, b):
        return lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())))

    check(
        [
            (lambda x, y, mat, p: lax.mul(x, y), m * s),
            (lambda x, y, mat, p: lax.div(x, y), m / s),
            (lambda x, y, mat, p: lax.mul(x, p), m),
            (lambda x, y, mat, p: lax.mul(p, x), m),
            (lambda x, y, mat, p: lax.div(p, y), 1 / s),
            (lambda x, y, mat, p: matmul(mat, x), kg * m),
            (lambda x, y, mat, p: matmul(mat, p), kg),
            (lambda x, y, mat, p: lax.integer_pow(x, 3), m**3),
            (lambda x, y, mat, p: lax.integer_pow(x, -1), 1 / m),
            (lambda x, y, mat, p: lax.square(x), m**2),
            (lambda x, y, mat, p: lax.sqrt(lax.abs(x)), m**0.5),
            (lambda x, y, mat, p: lax.cbrt(x), m ** Fraction(1, 3)),
            (lambda x, y, mat, p: lax.rsqrt(lax.abs(x)), m**-0.5),
            (lambda x, y, mat, p: lax.sqrt(lax.square(x)), m),
            (lambda x, y, mat, p: lax.reduce_prod_p.bind(x, axes=(0,)), m**3),
            (lambda x, y, mat, p: lax.reduce_prod_p.bind(mat, axes=(0,)), kg**2),
        ],
        x,
        y,
        mat,
        plain,
    )


def test_unit_keeping_rules(getseed):
    x = q(getseed(), (2, 3), m)
    keeps = [
        lax.neg,
        lax.abs,
        lax.floor,
        lambda x: lax.round(x),
        lambda x: lax.reduce_sum_p.bind(x, axes=(0, 1)),
        lambda x: lax.reduce_max_p.bind(x, axes=(1,)),
        lambda x: lax.reduce_min_p.bind(x, axes=(0,)),
        lambda x: lax.cumsum(x, axis=1),
        lambda x: lax.cummax(x, axis=0),
        lambda x: x.T,
        lambda x: x.reshape(3, 2),
        lambda x: x[1],
        lambda x: x[:, 1:],
        lambda x: lax.rev(x, (0,)),
        lambda x: lax.broadcast_in_dim(x, (4, 2, 3), (1, 2)),
        lambda x: lax.convert_element_type(x, jnp.float16),
        lambda x: lax.dynamic_slice_in_dim(x, 1, 2, axis=1),
        lambda x: lax.sort(x, dimension=1),
        lax.stop_gradient,
        lambda x: lax.split(x, (1, 2), axis=1),  # several results
    ]
    plain = [
        lax.sign,
        lax.is_finite,
        lambda x: lax.argmax(x, 1, jnp.int32),
        # `argsort`: `sort` carrying indices along; only the keys have a unit.
        lambda x: lax.sort((x, lax.broadcasted_iota(jnp.int32, (2, 3), 1)), num_keys=1)[1],
    ]
    check([(fn, m) for fn in keeps] + [(fn, None) for fn in plain], x)


def test_dimensionless_only_rules(getseed):
    x, length = q(getseed(), (3,), m), Unitful(arr(2.0), km)
    ratio = Unitful(arr(np.abs(np.asarray(randn(getseed(), (3,)))) + 0.5), dimensionless)
    fns = [np.exp, np.sin, np.tanh, np.log1p, np.arctan, np.sqrt]
    lax_fns = [lax.exp, lax.sin, lax.tanh, lax.log1p, lax.atan, lambda r: lax.pow(r, 0.5)]

    def f(x, length, ratio):
        # x / length is in m/km: converted to a pure number before `fn`.
        r = lax.div(lax.abs(x), length)
        return [fn(r) for fn in lax_fns], lax.pow(2.0, ratio)

    outs, power = jax.jit(quaxlike.quaxify(f))(x, length, ratio)
    for fn, out in zip(fns, outs):
        assert out.unit == dimensionless
        assert tree_allclose(out.array, np.asarray(fn(np.abs(x.array) / 2000.0)))
    assert power.unit == dimensionless
    assert tree_allclose(power.array, np.asarray(2.0 ** np.asarray(ratio.array)))


def test_jnp_level_physics(getseed):
    """Ordinary `jnp` code: nested and inline `jit`s, `where`, `clip`, `norm`."""
    positions = q(getseed(), (4, 3), m)
    masses = Unitful(arr(np.abs(np.asarray(randn(getseed(), (4,)))) + 1.0), kg)
    box = Unitful(arr(1.0), m)

    def f(x, mass, box):
        centre = jnp.sum(mass[:, None] * x, axis=0) / jnp.sum(mass)
        distance = jnp.linalg.norm(x - centre, axis=1)
        inside = jnp.where(distance < box, distance, box)
        return centre, jnp.clip(x, -box, box), jnp.mean(inside**2), jnp.argsort(distance)

    got, expected = both(f, positions, masses, box)
    assert [getattr(g, "unit", None) for g in got] == [m, m, m**2, None]
    assert tree_allclose(_numbers(got), expected)


def test_constant_zeros_have_every_unit(getseed):
    x = q(getseed(), (4,), m / s)

    def f(x):
        return (
            lax.gt(x, 0.0),  # a Python zero, as written
            jax.nn.relu(x),  # `max` with a NumPy zero inside JAX
            jax.grad(lambda y: jnp.sum(jnp.abs(y)))(x),  # `ge(x, 0)` in abs's derivative
        )

    (positive, relu, sign), expected = both(f, x)
    assert tree_allclose((positive, relu.array, sign), expected)
    assert relu.unit == m / s
    # A zero whose value is known while tracing fits every unit, wherever it was
    # written; a traced plain array could be anything, and is refused.
    got = jax.jit(quaxlike.quaxify(lambda x: (x > 0, jnp.maximum(x, 0.0))))(x)
    assert tree_allclose(got[0], x.array > 0) and got[1].unit == m / s
    with pytest.raises(UnitError, match="`gt` got a plain array.*not known while tracing"):
        jax.jit(quaxlike.quaxify(lambda x, zero: x > zero))(x, jnp.zeros(4))


def test_the_float_next_to_zero_fits_every_unit():
    # Equinox's `nextafter`/`prevbefore` (diffrax steps just past a time with
    # them) flush the denormal next to 0 to the smallest normal number, beside a
    # time in seconds: that number stands for 0, not for an amount in some unit.
    import equinox.internal as eqxi

    t = Unitful(jnp.array([0.0, 1.5, -2.0], jnp.float32), s)
    for fn in (eqxi.nextafter, eqxi.prevbefore):
        got = jax.jit(quaxlike.quaxify(fn))(t)
        assert got.unit == s
        np.testing.assert_array_equal(got.array, fn(t.array))
    tiny = float(jnp.finfo(jnp.float32).tiny)
    assert quaxlike.quaxify(lambda t: jnp.where(t > 0, t, -tiny))(t).unit == s
    # Any other plain number beside a time in seconds is still refused.
    with pytest.raises(UnitError, match="`select_n` got a plain array"):
        quaxlike.quaxify(lambda t: jnp.where(t > 0, t, 2 * tiny))(t)


def test_grad_inside_through_where(getseed):
    # The transpose of `select_n` fills the other branch's cotangent with zeros
    # made inside the transposed `jnp.where`: values known while tracing, which
    # fit every unit.
    x, cap = q(getseed(), (3,), m), Unitful(arr(0.5), m)

    def f(x, cap):
        return jnp.sum(jnp.where(x > cap, cap, x) ** 2)

    inside = jax.jit(quaxlike.quaxify(jax.grad(f)))(x, cap)
    outside = jax.jit(jax.grad(lambda a: quaxlike.quaxify(f)(Unitful(a, m), cap).array))(x.array)
    x_np = np.asarray(x.array)
    expected = np.asarray(np.where(x_np > 0.5, 0.0, 2 * x_np), np.float32)
    assert inside.unit == m
    assert tree_allclose(inside.array, expected) and tree_allclose(outside, expected)


def test_grad_through_relu_under_jit(getseed):
    # `relu`'s derivative selects between the tangent and `lax.full_like(g, 0)`:
    # zeros made by the differentiation itself, outside any `jit` body. Under
    # `jax.jit` they are traced, and known while tracing because a `Unitful`
    # asks quaxlike to note constants (`Value.tracks_known_values`).
    x, cap = q(getseed(), (3,), m), Unitful(arr(0.5), m)

    def f(x, cap):
        return jnp.sum(jax.nn.relu(x) * cap)

    def outside(a):
        return quaxlike.quaxify(f)(Unitful(a, m), cap).array

    expected = np.asarray(0.5 * (x.array > 0), np.float32)
    inside = jax.jit(quaxlike.quaxify(jax.grad(f)))(x, cap)
    assert inside.unit == m and tree_allclose(inside.array, expected)
    assert tree_allclose(jax.jit(jax.grad(outside))(x.array), expected)
    assert tree_allclose(jax.grad(outside)(x.array), expected)
    assert tree_allclose(quaxlike.quaxify(jax.grad(f))(x, cap).array, expected)


def test_unknown_plain_value_still_refused_under_jit(getseed):
    # A plain array computed from a traced argument is not known: it could be
    # anything, so it is refused beside metres, eagerly known or not.
    x = q(getseed(), (3,), m)

    def f(x, c):
        return jnp.where(c > 0, x, c)

    with pytest.raises(UnitError, match="`select_n` got a plain array.*not known while tracing"):
        jax.jit(quaxlike.quaxify(f))(x, jnp.zeros(3))


# --- errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda x, t: x + t, r"`add` needs .* in m .* in s"),
        (lambda x, t: x - t, r"`sub` needs .* in m .* in s"),
        (lambda x, t: jnp.maximum(x, t), r"`max` needs .* in m .* in s"),
        (lambda x, t: x < t, r"`lt` needs .* in m .* in s"),
        (lambda x, t: jnp.where(True, x, t), r"`select_n` needs .* in s .* in m"),
        (lambda x, t: jnp.concatenate([x, t]), r"`concatenate` needs"),
        (lambda x, t: x + 1.0, r"`add` got a plain array .* quantity in m"),
        (lambda x, t: x > 1, r"`gt` got a plain array .* quantity in m"),
        (lambda x, t: jnp.exp(x), r"`exp` needs a dimensionless argument, .* in m"),
        (lambda x, t: jnp.sin(x * t), r"`sin` needs a dimensionless argument, .* in m\*s"),
        (lambda x, t: x ** (t / t), r"`pow` with a quantity in m"),
        (lambda x, t: lax.bessel_i0e(x), r"`bessel_i0e` has no unit rule.*in m"),
    ],
)
def test_unit_errors_name_units_and_primitive(getseed, fn, match):
    x, t = q(getseed(), (3,), m), q(getseed(), (3,), s)
    with pytest.raises(UnitError, match=match):
        jax.jit(quaxlike.quaxify(fn))(x, t)


def test_materialise_only_when_dimensionless():
    with pytest.raises(UnitError, match="silently drop its unit"):
        Unitful(arr(np.ones(2)), m).materialise()
    ratio = Unitful(arr([1.0, 2.0]), km / m)

    def f(r):
        # A primitive with no rule runs on dimensionless numbers (scale 1), and
        # floating-point results stay quantities.
        return r.materialise(), quaxlike.quaxify(lambda r: lax.bessel_i0e(r / 1000.0))(r)

    dense, values = jax.jit(f)(ratio)
    assert tree_allclose(dense, arr([1000.0, 2000.0]))
    assert values.unit == dimensionless
    assert tree_allclose(values.array, jax.scipy.special.i0e(arr([1.0, 2.0])))


def test_to():
    x = Unitful(arr([1.5, 2.0]), km)
    in_m, in_hours, ints = jax.jit(lambda x, t, i: (x.to(m), t.to(hour), i.to(m)))(
        x, Unitful(arr(7200.0), s), Unitful(arr([1, 2], np.int32), km)
    )
    assert in_m.unit == m and tree_allclose(in_m.array, arr([1500.0, 2000.0]))
    assert in_hours.unit == hour and tree_allclose(in_hours.array, arr(2.0))
    assert tree_allclose(ints.array, arr([1000, 2000], np.int32))
    with pytest.raises(UnitError, match="dimensions differ"):
        x.to(s)
    with pytest.raises(UnitError, match="not a whole number"):
        Unitful(arr([1, 2], np.int32), m).to(km)


# --- transforms and control flow -------------------------------------------------


def kinetic_energy(mass, velocity):
    return 0.5 * mass * jnp.sum(velocity**2)


def kinetic_energy_np(mass, velocity):
    return 0.5 * np.asarray(mass) * np.sum(np.asarray(velocity) ** 2, axis=-1)


def test_jit_compiles_once_per_unit(getseed):
    mass, v = q(getseed(), (), kg), q(getseed(), (3,), m / s)
    traces = []

    def f(mass, v):
        traces.append(None)
        return kinetic_energy(mass, v)

    fn = jax.jit(quaxlike.quaxify(f))
    out = fn(mass, v)
    assert out.unit == J
    assert tree_allclose(out.array, np.asarray(kinetic_energy_np(mass.array, v.array)))
    fn(mass, Unitful(v.array * 2, m / s))
    assert len(traces) == 1
    out = fn(mass, Unitful(v.array, km / s))  # a new unit is a new static structure
    assert len(traces) == 2 and out.unit == kg * km**2 / s**2


def test_grad_outside_quaxify(getseed):
    mass, v = q(getseed(), (), kg), randn(getseed(), (3,))

    def loss(speed):
        return quaxlike.quaxify(kinetic_energy)(mass, Unitful(speed, m / s)).array

    grad = jax.jit(jax.grad(loss))(v)
    assert tree_allclose(grad, np.asarray(np.asarray(mass.array) * np.asarray(v)))


def test_grad_inside_quaxify_gives_momentum_units(getseed):
    mass, v = q(getseed(), (), kg), q(getseed(), (3,), m / s)
    momentum = jax.jit(quaxlike.quaxify(jax.grad(kinetic_energy, argnums=1)))(mass, v)
    assert momentum.unit == kg * m / s
    assert tree_allclose(momentum.array, np.asarray(np.asarray(mass.array) * v.array))


def test_vmap_over_a_batch_of_quantities(getseed):
    v = q(getseed(), (5, 3), m / s)
    mass = q(getseed(), (), kg)
    out = jax.jit(jax.vmap(quaxlike.quaxify(kinetic_energy), in_axes=(None, 0)))(mass, v)
    assert out.unit == J and out.shape == (5,)
    assert tree_allclose(out.array, np.asarray(kinetic_energy_np(mass.array, v.array)))


def euler(x, v, a, dt, steps):
    def step(carry, _):
        x, v = carry
        v = v + a * dt
        x = x + v * dt
        return (x, v), x

    return lax.scan(step, (x, v), length=steps)


def test_scan_with_unitful_carry(getseed):
    x, v = q(getseed(), (2,), m), q(getseed(), (2,), m / s)
    a, dt = Unitful(arr([0.0, -9.8]), m / s**2), Unitful(arr(0.1), s)
    ((x_out, v_out), xs), expected = both(euler, x, v, a, dt, 5, static_argnums=4)
    assert (x_out.unit, v_out.unit, xs.unit) == (m, m / s, m)
    assert tree_allclose(((x_out.array, v_out.array), xs.array), expected)


def test_scan_carry_changing_unit_is_refused(getseed):
    x = q(getseed(), (2,), m)

    def f(x):
        return lax.scan(lambda c, _: (c * c, None), x, length=2)

    # The carry turns from m into m^2: the core materialises it to retry, which a
    # dimensioned quantity refuses; the error names `scan` and the way out.
    with pytest.raises(
        quaxlike.MaterialisationError, match=r"(?s)`scan`.*carry.*silently drop its unit"
    ):
        jax.jit(quaxlike.quaxify(f))(x)


def _squares_in_while(x):
    return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * c[1]), (0, x))[1]


def _squares_in_fori(x):
    return lax.fori_loop(0, 3, lambda i, c: c * c, x)


def _squares_in_scan(x):
    return lax.scan(lambda c, _: (c * c, None), x, length=2)[0]


@pytest.mark.parametrize(
    "fn", [_squares_in_while, _squares_in_fori, _squares_in_scan], ids=["while", "fori", "scan"]
)
def test_loop_carry_changing_unit_is_the_type_error_quax_raises(fn, getseed):
    # Quax raises a TypeError saying the carry changed structure, eagerly and
    # under jit; so does quaxlike, with a MaterialisationError that says why the
    # quantity could not be carried as plain numbers either.
    x = q(getseed(), (2,), m)
    for run in (quaxlike.quaxify(fn), jax.jit(quaxlike.quaxify(fn))):
        with pytest.raises(TypeError, match="carry changed structure") as info:
            run(x)
        assert isinstance(info.value, quaxlike.MaterialisationError)
        assert "(unit=m)" in str(info.value) and "(unit=m^2)" in str(info.value)


@pytest.mark.parametrize(
    "loop",
    [
        lambda body: (
            lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, body(c[1])), (0, x))[
                1
            ]
        ),
        lambda body: lambda x: lax.fori_loop(0, 3, lambda i, c: body(c), x),
        lambda body: lambda x: lax.scan(lambda c, _: (body(c), None), x, length=2)[0],
    ],
    ids=["while", "fori", "scan"],
)
def test_loop_carry_keeping_its_unit_runs(loop, getseed):
    x = q(getseed(), (2,), m)
    out, expected = both(loop(lambda c: c + c), x)
    assert out.unit == m and tree_allclose(out.array, expected)


def test_cond_and_while(getseed):
    x, limit = q(getseed(), (), m), Unitful(arr(5.0), m)
    step = Unitful(arr(0.7), m)

    def f(x, limit, step):
        y = lax.cond(x > limit, lambda x: x - step, lambda x: x + 2.0 * step, x)
        return lax.while_loop(lambda y: jnp.abs(y) < limit, lambda y: y * 1.5 + step, y)

    out, expected = both(f, x, limit, step)
    assert out.unit == m and tree_allclose(out.array, expected)

    def bad(x, t):
        return lax.cond(x > 0 * x, lambda: x, lambda: t)

    # Branches in m and in s: the core materialises to reconcile them, and a
    # dimensioned quantity refuses; the error names `cond`.
    with pytest.raises(quaxlike.MaterialisationError, match=r"(?s)`cond`.*silently drop its unit"):
        jax.jit(quaxlike.quaxify(bad))(x, Unitful(arr(1.0), s))


def test_fori_loop(getseed):
    x = q(getseed(), (3,), N)

    def f(x):
        return lax.fori_loop(0, 3, lambda i, c: c + x / 3.0, jnp.zeros(3) * x)

    out = jax.jit(quaxlike.quaxify(f))(x)
    assert out.unit == N and tree_allclose(out.array, x.array)


def _save_after_the_loop(x, n, step):
    # A solver's pattern (diffrax's default `SaveAt`): an `inf` buffer goes
    # through the loop beside the state, which `step` updates, and is written
    # with the state after it (`n` traced: a `while`).
    def body(carry):
        i, state, buffer, count = carry
        return i + 1, state * 0.5, jnp.copy(buffer), step(count)

    carry = (0, x, jnp.full((2, 3), jnp.inf), jnp.zeros(3))
    _, state, buffer, count = lax.while_loop(lambda c: c[0] < n, body, carry)
    return buffer.at[1].set(state), count


def test_a_buffer_the_loop_only_copies_takes_the_unit_written_after_it(getseed):
    x = q(getseed(), (3,), m)
    saved, _ = jax.jit(quaxlike.quaxify(lambda x, n: _save_after_the_loop(x, n, jnp.copy)))(x, 2)
    assert saved.unit == m
    np.testing.assert_array_equal(saved.array[0], np.inf)
    np.testing.assert_allclose(saved.array[1], x.array / 4)


def test_a_carry_the_loop_changes_is_still_a_plain_number_after_it(getseed):
    # `count` starts at 0, but the body adds 1: not 0 after the loop, so it
    # is refused beside metres, as any plain number is.
    def f(x, n):
        saved, count = _save_after_the_loop(x, n, lambda c: c + 1.0)
        return saved[1] + count

    with pytest.raises(UnitError, match="`add` got a plain array.*not known while tracing"):
        jax.jit(quaxlike.quaxify(f))(q(getseed(), (3,), m), 2)


def test_readme_example(capsys):
    """The README's example runs as written."""
    readme = pathlib.Path(quaxlike.__file__).parent / "units" / "README.md"
    (code,) = re.findall(r"## Example\n\n```python\n(.*?)```", readme.read_text(), re.S)
    exec(compile(code, str(readme), "exec"), {})
    printed = capsys.readouterr().out
    assert "25.0 kg*m^2/s^2" in printed and "kg*m/s" in printed
    assert "m m/s (10,)" in printed and "`add` needs its arguments" in printed


def test_mismatched_units_are_a_value_error_as_in_quax():
    # Quax's unitful example raises ValueError for mismatched units; so does
    # UnitError (Quax main's test_select_n_requires_matching_units).
    pred = jnp.array([True, False])
    length = Unitful(jnp.array([2.0, 3.0]), m)
    time = Unitful(jnp.array([4.0, 5.0]), s)
    with pytest.raises(ValueError, match="units") as caught:
        quaxlike.quaxify(jnp.where)(pred, length, time)
    assert isinstance(caught.value, UnitError)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_unit_error_inside_a_cond_branch_is_raised_as_it_is(jit):
    # The cond rule retries with dense outputs when JAX rejects branches whose
    # output types differ (a TypeError or ValueError); a UnitError from inside a
    # branch is the user's error, raised unchanged, not taken for that rejection.
    def f(pred, a, b):
        return jax.lax.cond(pred, lambda: a + b, lambda: a)

    f = quaxlike.quaxify(f)
    with pytest.raises(UnitError, match="`add` needs its arguments in compatible units"):
        (jax.jit(f) if jit else f)(
            jnp.array(True), Unitful(jnp.ones(2), m), Unitful(jnp.ones(2), s)
        )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_cond_branches_that_disagree_report_the_refusal_as_a_value_error(jit):
    # One branch returns a quantity, the other a plain array: the cond rule tries
    # to materialise the quantity and Unitful refuses. Quax main raises the
    # type's ValueError naming the refusal (its test_cond_mismatched_branches_
    # reports_refusal); ours is a BranchMaterialisationError (a ValueError and a
    # MaterialisationError) naming the output, whose cause is the UnitError.
    def f(x, pred):
        return jax.lax.cond(pred, lambda: x, lambda: jnp.ones(3))

    f = quaxlike.quaxify(f)
    with pytest.raises(ValueError, match="Refusing to materialise a Unitful") as caught:
        (jax.jit(f) if jit else f)(Unitful(jnp.arange(3.0), m), jnp.array(True))
    assert isinstance(caught.value, quaxlike.BranchMaterialisationError)
    assert isinstance(caught.value, quaxlike.MaterialisationError)
    assert "output 0" in str(caught.value)
    assert isinstance(caught.value.__cause__, UnitError)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_cond_branch_of_known_zeros_takes_the_other_branch_unit(jit):
    # Zeros made in a branch are known while tracing, and 0 fits every unit:
    # the branch is held as a quantity in the other branch's unit (as a loop
    # carry that starts as `jnp.zeros` is), not refused.
    def f(x, pred):
        return jax.lax.cond(pred, lambda: x, lambda: jnp.zeros(3))

    f = quaxlike.quaxify(f)
    for pred, expected in ((True, np.arange(3.0)), (False, np.zeros(3))):
        out = (jax.jit(f) if jit else f)(Unitful(jnp.arange(3.0), m), jnp.array(pred))
        assert out.unit == m and tree_allclose(out.array, jnp.asarray(expected, jnp.float32))
