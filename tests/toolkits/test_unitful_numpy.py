"""`Unitful` quantities through ordinary `jax.numpy` code, checked in SI.

Inputs come in mixed units (km, m, minutes, grams); each function runs quaxified,
eagerly and under `jax.jit`, and its result, converted to SI, is compared with the
same `jax.numpy` function on the SI numbers. Then the refusals: real mistakes
(a plain 2.0 added to metres, metres interpolated against seconds) and plain
arrays whose value is not known while tracing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_allclose

import quaxlike
from quaxlike.units import gram, J, km, m, minute, s, UnitError, Unitful


def arr(x):
    return jax.device_put(np.asarray(x, np.float32))


_rng = np.random.default_rng(7)
POSITIONS = arr(_rng.uniform(-2.0, 2.0, (4, 3)))  # km
OTHERS = arr(_rng.uniform(-900.0, 900.0, (4, 3)))  # m
TIMES = arr(np.cumsum(_rng.uniform(0.5, 1.5, 4)))  # minutes, increasing
MASSES = arr(_rng.uniform(100.0, 900.0, 4))  # grams
QUERY = arr(np.asarray(TIMES)[:3] + 0.25)  # minutes, inside the samples


def quantities():
    return (
        Unitful(POSITIONS, km),
        Unitful(OTHERS, m),
        Unitful(TIMES, minute),
        Unitful(MASSES, gram),
        Unitful(QUERY, minute),
    )


def si_numbers():
    """The same inputs as plain SI numbers (m, m, s, kg, s)."""
    return (POSITIONS * 1000.0, OTHERS, TIMES * 60.0, MASSES / 1000.0, QUERY * 60.0)


def _pairwise(r, _o):
    difference = r[:, None, :] - r[None, :, :]
    return jnp.sqrt(jnp.sum(difference**2, axis=-1))


def _velocity(r, t):
    return jnp.diff(r, axis=0) / jnp.diff(t)[:, None]


def _kinetic(r, t, mass):
    v = _velocity(r, t)
    return 0.5 * jnp.sum(mass[1:] * jnp.sum(v**2, axis=1))


# name -> (function of (r, o, t, mass, query), the SI unit of its result)
WORKS = {
    "norm": (lambda r, o, t, mass, tq: jnp.linalg.norm(r, axis=1), m),
    "mean": (lambda r, o, t, mass, tq: jnp.mean(r, axis=0), m),
    "cumsum": (lambda r, o, t, mass, tq: jnp.cumsum(r, axis=0), m),
    "diff": (lambda r, o, t, mass, tq: jnp.diff(r, axis=0), m),
    "trapezoid": (lambda r, o, t, mass, tq: jnp.trapezoid(_velocity(r, t)[:, 0], t[1:]), m),
    "cross": (lambda r, o, t, mass, tq: jnp.cross(r, o), m**2),
    "einsum": (lambda r, o, t, mass, tq: jnp.einsum("ij,ij->i", r, o), m**2),
    "sort": (lambda r, o, t, mass, tq: jnp.sort(r, axis=0), m),
    "max": (lambda r, o, t, mass, tq: jnp.max(r), m),
    "abs": (lambda r, o, t, mass, tq: jnp.abs(r - o), m),
    "matmul": (lambda r, o, t, mass, tq: r @ o.T, m**2),
    "average": (lambda r, o, t, mass, tq: jnp.average(r, axis=0, weights=mass), m),
    "ptp": (lambda r, o, t, mass, tq: jnp.ptp(r, axis=0), m),
    "concatenate": (lambda r, o, t, mass, tq: jnp.concatenate([r, o]), m),
    "pairwise distances": (lambda r, o, t, mass, tq: _pairwise(r, o), m),
    "kinetic energy": (lambda r, o, t, mass, tq: _kinetic(r, t, mass), J),
    "velocity": (lambda r, o, t, mass, tq: _velocity(r, t), m / s),
    # These raised a UnitError before: no rule for `stack` and `tile`, or
    # jax.numpy's own NaN/inf/1 constants beside a quantity.
    "stack": (lambda r, o, t, mass, tq: jnp.stack([r, o]), m),
    "tile": (lambda r, o, t, mass, tq: jnp.tile(r, (2, 1)), m),
    # `lax.unstack` (a primitive from jax 0.10.1; before, slices).
    "unstack": (lambda r, o, t, mass, tq: list(jnp.unstack(r, axis=1)), m),
    "var": (lambda r, o, t, mass, tq: jnp.var(r, axis=0), m**2),
    "std": (lambda r, o, t, mass, tq: jnp.std(r), m),
    "median": (lambda r, o, t, mass, tq: jnp.median(r, axis=0), m),
    "hypot": (lambda r, o, t, mass, tq: jnp.hypot(r, o), m),
    "interp": (lambda r, o, t, mass, tq: jnp.interp(tq, t, r[:, 0]), m),
    "nanmean": (lambda r, o, t, mass, tq: jnp.nanmean(r, axis=1), m),
    "quantile": (lambda r, o, t, mass, tq: jnp.quantile(o, 0.25), m),
    "where nan": (lambda r, o, t, mass, tq: jnp.where(r > o, r, jnp.nan), m),
    "where inf": (lambda r, o, t, mass, tq: jnp.where(r > o, -jnp.inf, o), m),
    "clip at zero": (lambda r, o, t, mass, tq: jnp.clip(r, 0.0, None), m),
    "compare with zero": (lambda r, o, t, mass, tq: r > 0, None),
    "all": (lambda r, o, t, mass, tq: (jnp.all(r), jnp.any(r > o), r.astype(bool)), None),
    # Rules added for what the type x jax.numpy table found.
    "power with a known exponent": (lambda r, o, t, mass, tq: jnp.power(jnp.abs(r), 1.5), m**1.5),
    "sqrt as a power": (lambda r, o, t, mass, tq: jnp.abs(o) ** 0.5, m**0.5),
    "convolve": (lambda r, o, t, mass, tq: jnp.convolve(r[:, 0], o[:, 1]), m**2),
    "partition": (lambda r, o, t, mass, tq: jnp.partition(r, 1, axis=0), m),
    "nan_to_num": (lambda r, o, t, mass, tq: jnp.nan_to_num(jnp.where(r > 0, r, jnp.nan)), m),
    "copysign": (lambda r, o, t, mass, tq: jnp.copysign(r, t[:, None] - t[1]), m),
    "ldexp": (lambda r, o, t, mass, tq: jnp.ldexp(r, jnp.arange(3)), m),
    "signbit": (lambda r, o, t, mass, tq: jnp.signbit(r), None),
    "eigvalsh": (lambda r, o, t, mass, tq: jnp.linalg.eigvalsh(r[:3] @ r[:3].T), m**2),
    "svdvals": (lambda r, o, t, mass, tq: jnp.linalg.svdvals(o), m),
    "qr": (lambda r, o, t, mass, tq: jnp.abs(jnp.linalg.qr(r[:3])[1]), m),
    "cholesky": (lambda r, o, t, mass, tq: jnp.linalg.cholesky(_spd(r)), m),
    "det": (lambda r, o, t, mass, tq: jnp.linalg.det(_spd(r)), m**6),
    "inv": (lambda r, o, t, mass, tq: jnp.linalg.inv(_spd(r)), m**-2),
    "solve": (lambda r, o, t, mass, tq: jnp.linalg.solve(_spd(r), o[:3, 0]), 1 / m),
    "lstsq": (lambda r, o, t, mass, tq: jnp.linalg.lstsq(_spd(r), o[:3, 0])[0], 1 / m),
    "isclose with a quantity atol": (
        lambda r, o, t, mass, tq: jnp.isclose(r, r + o * 1e-9, atol=jnp.abs(o[0, 0]) * 1e-3),
        None,
    ),
}


# From jax 0.11 `jnp.searchsorted` binds a high-level primitive that JAX lowers
# where it is traced, so the whole-function rule never sees the call (see the
# unitful README): the lowered search runs primitive by primitive, its NaN and
# 0 fills known while tracing, and works too.
_SEARCHSORTED_IS_HIGH_LEVEL = "SearchSorted" in str(
    jax.make_jaxpr(jnp.searchsorted)(jnp.ones(3), jnp.ones(2))
)
_SEARCHES = {
    "searchsorted": (lambda r, o, t, mass, tq: jnp.searchsorted(t, tq), None),
    "digitize": (lambda r, o, t, mass, tq: jnp.digitize(tq, t), None),
}
WORKS.update(_SEARCHES)


@pytest.mark.skipif(not _SEARCHSORTED_IS_HIGH_LEVEL, reason="the whole-function rule runs")
@pytest.mark.parametrize("name", list(_SEARCHES))
def test_searchsorted_as_a_high_level_primitive_runs_eagerly(name):
    # Lowered where it is traced, primitive by primitive: plain indices, equal
    # to the search on the numbers in SI.
    fn, _ = _SEARCHES[name]
    _check(name, quaxlike.quaxify(fn)(*quantities()), fn(*si_numbers()))


def _spd(r):
    """A symmetric positive definite 3x3 matrix in m^2 (made from `r`)."""
    return r[:3] @ r[:3].T + jnp.eye(3) * r[0, 0] ** 2


def _to_si(tree):
    return jax.tree.map(
        lambda x: x.to(x.unit.si) if isinstance(x, Unitful) else x,
        tree,
        is_leaf=lambda x: isinstance(x, Unitful),
    )


def _check(name, got, expected):
    fn, unit = WORKS[name]
    leaves = jax.tree.leaves(_to_si(got), is_leaf=lambda x: isinstance(x, Unitful))
    units = [leaf.unit if isinstance(leaf, Unitful) else None for leaf in leaves]
    assert units == [unit] * len(leaves), (name, [str(u) for u in units])
    numbers = [leaf.array if isinstance(leaf, Unitful) else leaf for leaf in leaves]
    assert tree_allclose(numbers, jax.tree.leaves(expected), rtol=2e-5, atol=1e-3), name


def test_jax_numpy_functions_in_si_under_jit():
    fns = [fn for fn, _ in WORKS.values()]
    got = jax.jit(quaxlike.quaxify(lambda *a: [fn(*a) for fn in fns]))(*quantities())
    expected = jax.jit(lambda *a: [fn(*a) for fn in fns])(*si_numbers())
    for name, out, ref in zip(WORKS, got, expected):
        _check(name, out, ref)


@pytest.mark.parametrize("name", ["stack", "var", "median", "hypot", "interp", "where nan"])
def test_jax_numpy_functions_in_si_eagerly(name):
    fn, _ = WORKS[name]
    _check(name, quaxlike.quaxify(fn)(*quantities()), fn(*si_numbers()))


def test_tracking_constants_adds_no_constants_to_the_program():
    # The NaN fill of `jnp.median` is checked at trace time; the program still
    # builds it with `broadcast_in_dim`, not as a constant array.
    x = Unitful(jnp.ones(1000), m)
    jaxpr = jax.make_jaxpr(quaxlike.quaxify(jnp.median))(x)
    assert not jaxpr.consts
    assert "broadcast_in_dim" in str(jaxpr)


# --- refusals ----------------------------------------------------------------------


def _refuses(fn, *args, match):
    with pytest.raises(UnitError, match=match):
        jax.jit(quaxlike.quaxify(fn))(*args)


def test_real_mistakes_are_refused():
    r, o, t, _, tq = quantities()
    _refuses(lambda r: r + 2.0, r, match=r"`add` got a plain array .* quantity in 1000 m")
    _refuses(lambda r: jnp.where(r > 0, r, 1.0), r, match="`select_n` got a plain array")
    _refuses(
        lambda r, t: jnp.hypot(r[:, 0], t), r, t, match=r"`jnp.hypot` needs .* in 1000 m .* in 60 s"
    )
    _refuses(
        lambda r, t: jnp.interp(r[:, 0], t, r[:, 1]), r, t, match=r"`jnp.interp` needs .* in 60 s"
    )
    # (`stack` is a primitive from jax 0.10.1; before, a `concatenate`.)
    _refuses(lambda r, t: jnp.stack([r[:, 0], t]), r, t, match="`(stack|concatenate)` needs")
    _refuses(lambda r: jnp.var(jnp.exp(r)), r, match="`exp` needs a dimensionless argument")


def test_a_traced_plain_array_is_refused_even_if_zero():
    # Under `jax.jit` a plain argument could hold anything: no exemption.
    r = quantities()[0]
    _refuses(
        lambda r, zeros: r + zeros,
        r,
        jnp.zeros(3),
        match=r"`add` got a plain array .*not known while tracing",
    )


def test_interp_with_other_arguments_goes_primitive_by_primitive():
    # `left=` changes the traced program: not recognised as the plain
    # `jnp.interp`, so the primitive rules see its epsilon comparison.
    r, _, t, _, tq = quantities()
    _refuses(
        lambda tq, t, r: jnp.interp(tq, t, r[:, 0], left=r[0, 0]),
        tq,
        t,
        r,
        match="got a plain array",
    )


def test_a_user_function_named_hypot_is_not_jnp_hypot():
    @jax.jit
    def hypot(a, b):
        return a + b

    r, o = quantities()[:2]
    out = quaxlike.quaxify(hypot)(r, o)
    assert out.unit == km
    assert tree_allclose(out.array, r.array + o.array / 1000.0)


def test_user_jit_keeps_its_boundary_with_a_traced_plain_argument():
    # A `jax.jit` inside the quaxified function whose plain arguments are all
    # traced: kept as a `jit` of the program, with the quantity crossing it.
    r = quantities()[0]

    def f(r, scale):
        return jax.jit(lambda r, scale: jnp.sum(r * scale, axis=0))(r, scale)

    jaxpr = jax.make_jaxpr(quaxlike.quaxify(f))(r, jnp.ones(3))
    assert [e.primitive.name for e in jaxpr.eqns] == ["jit"]
    out = jax.jit(quaxlike.quaxify(f))(r, arr([1.0, 2.0, 3.0]))
    assert out.unit == km
    assert tree_allclose(out.array, jnp.sum(r.array * arr([1.0, 2.0, 3.0]), axis=0))
