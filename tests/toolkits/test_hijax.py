"""Tests for `quaxlike.experimental.hijax` and `quaxlike.experimental.hijax_units`: values
and derivatives against plain JAX on the bare arrays, units against the unit
algebra, and the probe of JAX's hijax API."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import quaxlike
from quaxlike import _hijax_compat as hc


# Before JAX 0.9.2 the import raises HijaxUnavailableError (an ImportError that
# names the JAX version), and these tests do not apply.
hijax = pytest.importorskip("quaxlike.experimental.hijax", exc_type=ImportError)

from quaxlike.experimental.hijax_units import MAPPED, Unitful, UnitfulArray, unwrap, wrap  # noqa: E402
from quaxlike.units import kilograms, meters, seconds  # noqa: E402


X = jnp.array([1.0, -2.0, 3.5])
Y = jnp.array([0.5, 4.0, -1.0])
M = ((meters, 1),)


def energy(mass, velocity):
    return 0.5 * mass * velocity**2


def test_values_and_units_follow_plain_jax():
    mass = Unitful(X, kilograms)
    velocity = Unitful(Y, {meters: 1, seconds: -1})
    out = quaxlike.quaxify(energy)(mass, velocity)
    assert out.units == ((kilograms, 1), (meters, 2), (seconds, -2))
    np.testing.assert_array_equal(out.array, energy(X, Y))
    jitted = jax.jit(quaxlike.quaxify(energy))(mass, velocity)
    assert jitted.units == out.units
    np.testing.assert_array_equal(jitted.array, energy(X, Y))


def test_the_jaxpr_is_typed_with_units():
    jaxpr = jax.make_jaxpr(quaxlike.quaxify(lambda a: jnp.sum(a * a)))(Unitful(X, meters))
    text = str(jaxpr)
    assert "u[3]{m}" in text and "u[3]{m^2}" in text and "u[]{m^2}" in text


def _loss(q):
    return quaxlike.quaxify(lambda a: jnp.sum(a * a * a))(q).array


def test_gradient_is_plain_gradient_per_unit():
    grad = jax.grad(_loss)(Unitful(X, meters))
    assert grad.units == ((meters, -1),)  # `.array` dropped the m^3: a plain loss
    np.testing.assert_allclose(grad.array, jax.grad(lambda a: jnp.sum(a**3))(X))


def test_gradient_of_a_dimensionless_loss_is_per_metre():
    loss = lambda q: quaxlike.quaxify(lambda a: jnp.sum(a * 2.0))(q).array  # noqa: E731
    grad = jax.grad(loss)(Unitful(X, meters))
    assert grad.units == ((meters, -1),)
    np.testing.assert_allclose(grad.array, 2.0 * jnp.ones_like(X))


def test_tangent_keeps_primal_units_and_matches_plain_jvp():
    f = quaxlike.quaxify(lambda a: a**3 + a * a * a)
    primal, tangent = jax.jvp(f, (Unitful(X, meters),), (Unitful(Y, meters),))
    plain_primal, plain_tangent = jax.jvp(lambda a: a**3 + a * a * a, (X,), (Y,))
    assert primal.units == tangent.units == ((meters, 3),)
    np.testing.assert_allclose(primal.array, plain_primal)
    np.testing.assert_allclose(tangent.array, plain_tangent, rtol=1e-6)


def test_vmap_with_a_mapping_spec_matches_plain_vmap():
    xs = jnp.arange(6.0).reshape(3, 2)
    f = lambda a: jnp.sum(a * a) * a  # noqa: E731
    out = jax.vmap(quaxlike.quaxify(f), in_axes=MAPPED, out_axes=MAPPED, axis_size=3)(
        Unitful(xs, meters)
    )
    assert out.units == ((meters, 3),)
    np.testing.assert_allclose(out.array, jax.vmap(f)(xs))


def test_scan_carries_units():
    step = Unitful(X, meters)

    def body(carry, _):
        return quaxlike.quaxify(lambda a, b: a + b)(carry, step), None

    carry, _ = lax.scan(body, Unitful(Y, meters), None, length=4)
    assert carry.units == M
    np.testing.assert_allclose(carry.array, Y + 4 * X)


def test_mismatched_units_and_unknown_primitives_are_errors():
    with pytest.raises(TypeError, match="units differ"):
        quaxlike.quaxify(lambda a, b: a + b)(Unitful(X, meters), Unitful(X, seconds))
    with pytest.raises(quaxlike.MaterialisationError, match="Refusing to materialise Unitful"):
        quaxlike.quaxify(jnp.sin)(Unitful(X, meters))


def test_hijax_values_cross_quaxify_without_tracers():
    """A hijax value built inside `quaxify`, or passed through it, comes out with
    concrete arrays and the right units."""
    out = quaxlike.quaxify(lambda q, a: (wrap(a * 2.0, meters), q * 1.0))(Unitful(X, meters), Y)
    built, _ = out
    assert isinstance(built, UnitfulArray) and not isinstance(built.array, jax.core.Tracer)
    np.testing.assert_array_equal(built.array, Y * 2.0)
    through = quaxlike.quaxify(lambda q, h: h)(Unitful(X, meters), wrap(Y, seconds))
    assert jax.typeof(through).units == ((seconds, 1),)


def test_register_rules_places_the_value_in_every_position():
    names = {m.implementation.__name__ for m in quaxlike.rules_for(lax.mul_p)}
    assert {"mul_unitful_unitful", "mul_unitful_arraylike", "mul_arraylike_unitful"} <= names
    double = quaxlike.quaxify(lambda a: (2.0 * a, a * 2.0))(Unitful(X, meters))
    for q in double:
        assert q.units == M
        np.testing.assert_array_equal(q.array, 2.0 * X)
    # `mul_p` carries `out_dtype`, which `mul(x, y)` does not take: not passed on.
    assert "out_dtype" not in hijax._wanted_params(lambda x, y: None)


def test_aval_is_an_array_type_so_jax_numpy_accepts_it():
    q = Unitful(X, meters)
    assert type(q.aval()) is jax.core.ShapedArray
    assert quaxlike.quaxify(lambda a: isinstance(a, jax.Array))(q)


def test_multiple_results_primitive_is_refused():
    with pytest.raises(NotImplementedError, match="multiple results"):
        hijax.register_rules(Unitful, {lax.sort_p: lambda q: q})


def test_unwrap_is_the_plain_array():
    np.testing.assert_array_equal(unwrap(wrap(X, meters)), X)


def test_probe_agrees_with_the_installed_jax():
    assert hc.AVAILABLE and not hc.MISSING
    assert hc.hi_type(wrap(X, meters)) is not None
    assert hc.hi_type(X) is None and hc.hi_type(object()) is None


def test_missing_hijax_is_an_import_error_naming_the_jax_version(monkeypatch):
    monkeypatch.setattr(hc, "AVAILABLE", False)
    monkeypatch.setattr(hc, "MISSING", ("MappingSpec",))
    with pytest.raises(ImportError, match=f"jax {jax.__version__} lacks MappingSpec"):
        hc.require_hijax()
    with pytest.raises(quaxlike.JaxCompatibilityError, match="0.9.2 and later"):
        hc.require_hijax()


def test_import_quaxlike_does_not_import_hijax():
    code = "import sys, quaxlike; print('quaxlike.experimental.hijax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
