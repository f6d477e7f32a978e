"""`quaxlike.internal.cached_rule`: a rule traced once per argument types and
params, whose recorded program JAX reuses.

Each test counts how many times the rule's Python ran (which says whether the
cached program was used) and compares results with plain JAX on the
materialised arrays.
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randn

import quaxlike
from quaxlike.internal import bind_dot_general, cached_rule


def _scaled_type(*, cache=True):
    """A fresh Value type standing for `scale * array` (`scale` a static field),
    with a counting `dot_general` rule (cached or not) that emits two equations."""

    class Scaled(quaxlike.ArrayValue):
        array: jax.Array
        scale: float = eqx.field(static=True)
        runs = [0]

        def aval(self):
            return quaxlike.internal.ShapedArray(self.array.shape, self.array.dtype)

        def materialise(self):
            return self.scale * self.array

    def rule(x: Scaled, y: jax.Array, *, dimension_numbers, **params):
        Scaled.runs[0] += 1
        product = bind_dot_general(x.array, y, dimension_numbers, params)
        return x.scale * product

    quaxlike.register(jax.lax.dot_general_p)(cached_rule(rule) if cache else rule)
    return Scaled


def _matvec(w, v):
    return w @ v


def _trace(*args):
    # A fresh function each time: JAX caches what it traced per function.
    return jax.make_jaxpr(quaxlike.quaxify(lambda w, v: _matvec(w, v)))(*args)


def test_the_rule_runs_once_per_argument_types_and_statics():
    scaled = _scaled_type()
    w, v = randn(0, (3, 2)), randn(1, (2,))
    for scale in (2.0, 2.0, 3.0, 3.0):
        out = _trace(scaled(w, scale), v)
        assert np.allclose(jax.core.eval_jaxpr(out.jaxpr, out.consts, w, v)[0], scale * (w @ v))
    assert scaled.runs[0] == 2  # once per value of the static `scale`
    # Other avals: traced again.
    w3, v3 = randn(2, (4, 5)), randn(3, (5,))
    assert np.allclose(quaxlike.quaxify(_matvec)(scaled(w3, 2.0), v3), 2.0 * (w3 @ v3))
    assert scaled.runs[0] == 3


def test_the_program_is_the_one_the_rule_emits():
    w, v = randn(4, (3, 2)), randn(5, (2,))
    programs = []
    for cache in (False, True):
        scaled = _scaled_type(cache=cache)
        for _ in range(2):  # the second call reuses the cached program
            jaxpr = _trace(scaled(w, 1.5), v)
        programs.append(str(jaxpr))
    assert programs[0] == programs[1]


def test_eager_jit_grad_and_vmap_agree_with_plain_jax():
    scaled = _scaled_type()
    w, v = randn(6, (3, 2)), randn(7, (2,))
    f = quaxlike.quaxify(_matvec)
    expected = 0.5 * (w @ v)
    for _ in range(2):
        assert np.allclose(f(scaled(w, 0.5), v), expected)
        assert np.allclose(jax.jit(f)(scaled(w, 0.5), v), expected)
    grad = jax.grad(lambda w, v: f(scaled(w, 0.5), v).sum(), argnums=(0, 1))(w, v)
    plain = jax.grad(lambda w, v: (0.5 * (w @ v)).sum(), argnums=(0, 1))(w, v)
    assert all(np.allclose(g, p) for g, p in zip(grad, plain))
    vs = randn(8, (5, 2))
    batched = jax.vmap(lambda v: f(scaled(w, 0.5), v))(vs)
    assert np.allclose(batched, 0.5 * vs @ w.T)


def test_the_output_structure_follows_the_argument_types():
    # A rule whose result is a Value with a static field read from the shape.
    class Shaped(quaxlike.ArrayValue):
        array: jax.Array
        rows: int = eqx.field(static=True)

        def aval(self):
            return quaxlike.internal.ShapedArray(self.array.shape, self.array.dtype)

        def materialise(self):
            return self.array

    @quaxlike.register(jax.lax.neg_p)
    @cached_rule
    def _(x: Shaped):
        return Shaped(-x.array, x.array.shape[0])

    for rows in (2, 3, 2):
        # Traced afresh each time, so the rule's cached program is asked for
        # by avals (2, then 3, then 2 again).
        f = jax.jit(quaxlike.quaxify(lambda x: jnp.negative(x)))
        out = f(Shaped(jnp.ones((rows, 1)), 0))
        assert isinstance(out, Shaped) and out.rows == rows
        assert np.array_equal(out.array, -np.ones((rows, 1)))


def test_reporting_policies_and_explain_run_the_rule_each_time():
    scaled = _scaled_type()
    w, v = randn(9, (3, 2)), randn(10, (2,))
    _trace(scaled(w, 2.0), v)
    _trace(scaled(w, 2.0), v)
    assert scaled.runs[0] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with quaxlike.materialise_policy("warn"):
            _trace(scaled(w, 2.0), v)
    assert scaled.runs[0] == 2
    report = quaxlike.explain(_matvec)(scaled(w, 2.0), v)
    assert scaled.runs[0] == 3
    assert any("rule" in r.handler for r in report.records[0].children)


def test_unhashable_params_run_the_rule_directly():
    runs = []

    @cached_rule
    def double(x: quaxlike.DenseArrayValue, *, options):
        runs.append(1)
        return 2 * x.array

    x = quaxlike.DenseArrayValue(jnp.arange(3.0))
    for _ in range(2):
        assert np.array_equal(double(x, options=["a list"]), 2 * np.arange(3.0))
        assert np.array_equal(double(x, options=("a tuple",)), 2 * np.arange(3.0))
    assert len(runs) == 3  # the list twice, the tuple once


@pytest.mark.parametrize("check", [False, True])
def test_a_rule_registered_later_is_seen(check):
    # The cached program of a rule that redispatches through `quaxify` depends
    # on the rules registered then. (A fresh subclass, so the rule registered
    # for it below stays local to this test.)
    class Inner(quaxlike.DenseArrayValue):
        pass

    class Outer(quaxlike.ArrayValue):
        inner: Inner

        def aval(self):
            return self.inner.aval()

        def materialise(self):
            return self.inner.array

    @quaxlike.register(jax.lax.sin_p)
    @cached_rule
    def _(x: Outer, **params):
        return quaxlike.quaxify(jnp.cos)(x.inner)

    f = quaxlike.quaxify(jnp.sin, check=check)
    x = Outer(Inner(jnp.arange(3.0)))
    assert np.allclose(f(x), np.cos(np.arange(3.0)))

    @quaxlike.register(jax.lax.cos_p)
    def _(x: Inner, **params):
        return jnp.full(x.array.shape, 7.0, x.array.dtype)

    assert np.allclose(f(x), 7.0)
