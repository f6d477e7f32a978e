"""Tests for `quaxlike.interval`: every bound is checked against plain JAX
evaluated at points inside the input brackets (soundness), at the endpoints where
the bound is exact, and eager against `jit`."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import quaxlike
from quaxlike.interval import Interval, MONOTONE


LO = jnp.array([-2.0, -1.0, 0.5, 1.0, -3.0])
HI = jnp.array([-1.0, 2.0, 1.5, 4.0, 3.0])


def _samples(lo, hi, n=41):
    """`n` points spread over each bracket, endpoints included: shape (n, *lo.shape)."""
    t = jnp.linspace(0.0, 1.0, n).reshape((n,) + (1,) * lo.ndim)
    return lo + t * (hi - lo)


def _assert_sound(f, *intervals):
    """`quaxify(f)` on the intervals brackets plain `f` at every sampled point."""
    out = quaxlike.quaxify(f)(*intervals)
    grids = [_samples(x.lo, x.hi, 9) for x in intervals]
    for points in itertools.product(*[range(9)] * len(intervals)):
        plain = f(*[g[i] for g, i in zip(grids, points, strict=True)])
        assert bool(jnp.all(out.lo <= plain + 1e-5)), (plain, out.lo)
        assert bool(jnp.all(plain - 1e-5 <= out.hi)), (plain, out.hi)
    return out


UNARY = {
    "neg": lambda a: -a,
    "square": lambda a: a**2,
    "cube": lambda a: a**3,
    "fourth": lambda a: a**4,
    "abs": jnp.abs,
    "exp": jnp.exp,
    "atan": jnp.arctan,
    "tanh": jnp.tanh,
    "scale_neg": lambda a: -3.0 * a,
    "affine": lambda a: 2.0 - 0.5 * a,
    "poly": lambda a: a**3 - 2.0 * a + 1.0,
    "divide_by_constant": lambda a: a / jnp.array([2.0, -4.0, 1.0, -1.0, 3.0]),
    "cumsum": jnp.cumsum,
    "sum": jnp.sum,
    "max": jnp.max,
    "clip": lambda a: jnp.clip(a, -0.5, 0.5),
    "maximum": lambda a: jnp.maximum(a, 0.0),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_bounds_are_sound_and_match_jit(name):
    f = UNARY[name]
    x = Interval(LO, HI)
    out = _assert_sound(f, x)
    jitted = jax.jit(quaxlike.quaxify(f))(x)
    assert jnp.allclose(jitted.lo, out.lo) and jnp.allclose(jitted.hi, out.hi)


@pytest.mark.parametrize(
    "f",
    [lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a * b, lambda a, b: jnp.minimum(a, b)],
    ids=["add", "sub", "mul", "minimum"],
)
def test_binary_bounds_are_sound(f):
    x = Interval(LO, HI)
    y = Interval(jnp.array([0.5, -2.0, -1.0, 2.0, -0.5]), jnp.array([1.0, -1.0, 3.0, 2.5, 0.5]))
    _assert_sound(f, x, y)


def test_monotone_and_rule_bounds_are_exact_at_the_endpoints():
    """Where the extremes lie at endpoints the bracket is the exact range."""
    x = Interval(LO, HI)
    out = quaxlike.quaxify(jnp.exp)(x)
    assert jnp.array_equal(out.lo, jnp.exp(LO)) and jnp.array_equal(out.hi, jnp.exp(HI))
    out = quaxlike.quaxify(lambda a: a**2)(x)
    grid = _samples(LO, HI, 2001) ** 2
    assert jnp.allclose(out.lo, grid.min(axis=0), atol=1e-5)
    assert jnp.allclose(out.hi, grid.max(axis=0))


def test_division_by_an_interval_containing_zero_is_unbounded():
    x = Interval(jnp.array([1.0, 1.0]), jnp.array([2.0, 2.0]))
    y = Interval(jnp.array([-1.0, 0.5]), jnp.array([1.0, 4.0]))
    out = quaxlike.quaxify(lambda a, b: a / b)(x, y)
    assert out.lo[0] == -jnp.inf and out.hi[0] == jnp.inf
    assert jnp.allclose(out.lo[1], 0.25) and jnp.allclose(out.hi[1], 4.0)


def test_non_monotone_primitive_is_refused_naming_it():
    with pytest.raises(ValueError, match="no rule for `cos`.*Register a rule"):
        quaxlike.quaxify(jnp.cos)(Interval(LO, HI))


def test_comparisons_are_refused():
    """A comparison of brackets has no single boolean answer."""
    with pytest.raises(ValueError, match="no rule for `lt`"):
        quaxlike.quaxify(lambda a: a < 0.0)(Interval(LO, HI))


def test_conversion_to_bool_is_refused_and_between_floats_allowed():
    x = Interval(LO, HI)
    with pytest.raises(ValueError, match="not monotone"):
        quaxlike.quaxify(lambda a: a.astype(bool))(x)
    out = quaxlike.quaxify(lambda a: a.astype(jnp.float16))(x)
    assert out.lo.dtype == jnp.float16
    assert jnp.array_equal(out.lo, LO.astype(jnp.float16))


def test_materialise_and_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="Refusing to materialise an Interval"):
        Interval(LO, HI).materialise()
    with pytest.raises(ValueError, match="same shape"):
        Interval(jnp.zeros(2), jnp.zeros(3))


def test_every_rule_names_interval():
    """No rule may match plain arrays alone: it would capture ordinary arithmetic."""
    plain = jnp.asarray(1.0)
    primitives = {lax.neg_p, lax.sub_p, lax.mul_p, lax.div_p, lax.abs_p, lax.integer_pow_p}
    checked = 0
    for primitive in primitives | set(MONOTONE):
        for method in quaxlike.rules_for(primitive):
            if not method.implementation.__module__.startswith("quaxlike.interval"):
                continue
            checked += 1
            assert not method.signature.match((plain,) * len(method.signature.types))
    assert checked >= 9


def test_interval_does_not_leak_into_plain_arithmetic():
    """A quaxified function without Intervals computes exactly as plain JAX."""
    a, b = jnp.array([1.0, 2.0]), jnp.array([3.0, 5.0])
    f = lambda x, y: (x - y) * y / x  # noqa: E731
    assert np.array_equal(quaxlike.quaxify(f)(a, b), f(a, b))


def test_vmap_and_grad_of_bounds():
    """`vmap` maps over brackets; the bounds are differentiable functions."""
    x = Interval(jnp.stack([LO, LO - 1]), jnp.stack([HI, HI + 1]))
    out = jax.vmap(quaxlike.quaxify(lambda a: a**2))(x)
    for i in range(2):
        row = quaxlike.quaxify(lambda a: a**2)(Interval(x.lo[i], x.hi[i]))
        assert jnp.array_equal(out.lo[i], row.lo) and jnp.array_equal(out.hi[i], row.hi)

    width = lambda hi: quaxlike.quaxify(lambda a: jnp.sum(3.0 * a))(Interval(LO, hi)).width  # noqa: E731
    assert jnp.allclose(jax.grad(width)(HI), 3.0 * jnp.ones_like(HI))
