"""Every row of the conformance table (`_table.CASES`) run through `quaxlike.quaxify`
and compared with plain JAX: values, shapes, dtypes and weak types.

- `test_plain`: no Value involved (quaxify calls the function as it is).
- `test_values_all`: a pass-through Value (`Tracked`, a `PassThrough`) in every
    array position; outputs must come back as Values.
- `test_values_each_position`: a Value in one array position at a time.
- `test_dense_value`: `DenseArrayValue` in every position (the materialising
    fallback).
- `test_jit`, `test_grad`, `test_vmap`: those transforms applied outside `quaxify`;
    `test_jit_inside`, `test_vmap_inside`: `jit` and `vmap` inside it.

The eager runs are cheap, so the first three cover every row. The others cover the
deterministic sample `_table.SAMPLE` by default and the whole table with
`--run-slow`. All of them run with JAX's tracer-leak checker off (it disables
JAX's caches and makes the sweep take many minutes); `test_leak_checked` runs a
subset with it on. Then: functions with data-dependent output shapes, and minimal
reproductions of the core bugs the table found (`_known_bugs.py`).
"""

import functools as ft

import jax
import jax.numpy as jnp
import pytest
from _inputs import Case
from _table import (
    assert_same,
    batch,
    CASES,
    CASES_BY_NAME,
    is_real_float,
    is_value,
    run_with_values,
    SAMPLE,
    scalarise,
    split_static,
    Tracked,
    value_leaves,
    wrap,
)
from jax.sharding import NamedSharding

import quaxlike


_VALUE_MODES = (
    "values",
    "position",
    "dense",
    "jit",
    "grad",
    "vmap",
    "jit_inside",
    "vmap_inside",
    "leak",
)


def _marks(c: Case, mode: str, *, sampled: bool) -> list:
    marks = []
    if sampled and c.name not in SAMPLE:
        marks.append(pytest.mark.slow)
    reason = c.xfail.get(mode) or (c.xfail.get("values") if mode in _VALUE_MODES else None)
    if reason is not None:
        marks.append(pytest.mark.xfail(reason=reason, strict=True))
    if c.loose_promotion:
        marks.append(pytest.mark.loose_promotion)
    return marks


def _rows(mode: str, *, sampled: bool, when=lambda c: True) -> list:
    return [
        pytest.param(c, id=c.name, marks=_marks(c, mode, sampled=sampled)) for c in CASES if when(c)
    ]


@pytest.fixture(autouse=True)
def no_leak_check(request):
    """The sweep runs with the tracer-leak checker off (see the module docstring);
    `test_leak_checked` keeps it on."""
    if request.function.__name__ == "test_leak_checked":
        yield
        return
    with jax.check_tracer_leaks(False):
        yield


@ft.cache
def _expected(name: str):
    c = CASES_BY_NAME[name]
    return c.call(c.fn, c.args)


def _check_all_values(c: Case, out):
    """With a Value in every position, the outputs come back as `Tracked` Values
    (unless the row says the core legitimately materialises)."""
    plain = [x for x in jax.tree.leaves(out, is_leaf=is_value) if not is_value(x)]
    if c.all_values:
        assert not plain, f"{c.name}: outputs {plain} did not come back as Values"
    assert all(type(x) is Tracked for x in value_leaves(out))


# --- eager --------------------------------------------------------------------------


@pytest.mark.parametrize("c", _rows("plain", sampled=False))
def test_plain(c: Case):
    out = c.call(quaxlike.quaxify(c.fn), c.args)
    assert not value_leaves(out)
    assert_same(out, _expected(c.name), tol=c.tol, compare=c.compare, where=c.name)


@pytest.mark.parametrize("c", _rows("values", sampled=False))
def test_values_all(c: Case):
    out = run_with_values(c)
    _check_all_values(c, out)
    assert_same(out, _expected(c.name), tol=c.tol, compare=c.compare, where=c.name)


def _positions():
    params = []
    for c in CASES:
        positions = c.array_positions()
        if len(positions) < 2:
            continue  # the same run as test_values_all
        for i in positions:
            marks = _marks(c, "position", sampled=False)
            params.append(pytest.param(c, i, id=f"{c.name}-{i}", marks=marks))
    return params


@pytest.mark.parametrize("c,position", _positions())
def test_values_each_position(c: Case, position: int):
    out = c.call(quaxlike.quaxify(c.fn), wrap(c.args, [position]))
    assert all(type(x) is Tracked for x in value_leaves(out))
    assert_same(out, _expected(c.name), tol=c.tol, compare=c.compare, where=f"{c.name}[{position}]")


@pytest.mark.parametrize("c", _rows("dense", sampled=True))
def test_dense_value(c: Case):
    dense = wrap(c.args, c.array_positions(), cls=quaxlike.DenseArrayValue)
    out = c.call(quaxlike.quaxify(c.fn), dense)
    # It materialises wherever a primitive touches it; only a row that returns
    # its input as it is (or passes it through a sharding annotation) gets one back.
    assert all(type(x) is quaxlike.DenseArrayValue for x in value_leaves(out))
    assert_same(out, _expected(c.name), tol=c.tol, compare=c.compare, where=c.name)


# --- transforms outside quaxify -----------------------------------------------------


@pytest.mark.parametrize("c", _rows("jit", sampled=True, when=lambda c: c.jit))
def test_jit(c: Case):
    fn, arrays = split_static(c)
    out = c.call(jax.jit(quaxlike.quaxify(fn)), tuple(Tracked(a) for a in arrays))
    _check_all_values(c, out)
    assert_same(out, _expected(c.name), tol=c.tol, compare=c.compare, where=c.name)


def _grad_rows():
    def eligible(c):
        float32 = [a for a in c.args if is_real_float(a) and a.dtype == jnp.float32]
        return c.grad and c.axis_name is None and bool(float32)

    return _rows("grad", sampled=True, when=eligible)


@pytest.mark.parametrize("c", _grad_rows())
def test_grad(c: Case):
    fn, arrays = split_static(c)
    argnums = tuple(i for i, a in enumerate(arrays) if is_real_float(a) and a.dtype == jnp.float32)
    if not any(map(is_real_float, jax.tree.leaves(jax.eval_shape(fn, *arrays)))):
        pytest.skip("no real floating output to differentiate")

    def plain_loss(*xs):
        return scalarise(fn(*xs))

    def value_loss(*xs):
        out = quaxlike.quaxify(fn)(*(Tracked(x) for x in xs))
        if c.all_values:
            assert value_leaves(out), "the output lost its Values"
        return scalarise(out)

    expected = jax.grad(plain_loss, argnums=argnums)(*arrays)
    got = jax.grad(value_loss, argnums=argnums)(*arrays)
    tol = c.tol or {"rtol": 1e-4, "atol": 1e-5}
    assert_same(got, expected, tol=tol, where=f"grad of {c.name}")


@pytest.mark.parametrize(
    "c", _rows("vmap", sampled=True, when=lambda c: c.vmap and c.axis_name is None)
)
def test_vmap(c: Case):
    fn, arrays = split_static(c)
    batched = tuple(batch(a) for a in arrays)
    expected = jax.vmap(fn)(*batched)
    out = jax.vmap(quaxlike.quaxify(fn))(*(Tracked(a) for a in batched))
    _check_all_values(c, out)
    assert_same(out, expected, tol=c.tol, compare=c.compare, where=f"vmap of {c.name}")


# --- transforms inside quaxify -----------------------------------------------------


@pytest.mark.parametrize("c", _rows("jit_inside", sampled=True, when=lambda c: c.jit))
def test_jit_inside(c: Case):
    fn, arrays = split_static(c)
    out = c.call(quaxlike.quaxify(jax.jit(fn)), tuple(Tracked(a) for a in arrays))
    _check_all_values(c, out)
    assert_same(out, _expected(c.name), tol=c.tol, compare=c.compare, where=c.name)


@pytest.mark.parametrize(
    "c", _rows("vmap_inside", sampled=True, when=lambda c: c.vmap and c.axis_name is None)
)
def test_vmap_inside(c: Case):
    fn, arrays = split_static(c)
    batched = tuple(batch(a) for a in arrays)
    out = quaxlike.quaxify(jax.vmap(fn))(*(Tracked(a) for a in batched))
    _check_all_values(c, out)
    expected = jax.vmap(fn)(*batched)
    assert_same(out, expected, tol=c.tol, compare=c.compare, where=f"vmap of {c.name}")


# --- with the tracer-leak checker on ------------------------------------------------

# (row, how). Each costs about a second: the checker disables JAX's caches.
_LEAK_CHECKED = [
    ("top_k", "eager"), ("random_bits", "eager"), ("scan", "eager"),
    ("custom_jvp_call", "eager"), ("psum", "eager"), ("cond", "jit"),
    ("custom_vjp_call", "jit"), ("shard_map", "jit"),
]  # fmt: skip


@pytest.mark.parametrize(
    "c,how",
    [
        pytest.param(
            CASES_BY_NAME[n],
            how,
            id=f"{n}-{how}",
            marks=_marks(CASES_BY_NAME[n], "leak", sampled=False),
        )
        for n, how in _LEAK_CHECKED
    ],
)
def test_leak_checked(c: Case, how: str):
    assert jax.config.jax_check_tracer_leaks
    fn, arrays = split_static(c)
    call = quaxlike.quaxify(fn) if how == "eager" else jax.jit(quaxlike.quaxify(fn))
    out = c.call(call, tuple(Tracked(a) for a in arrays))
    _check_all_values(c, out)
    assert_same(out, _expected(c.name), tol=c.tol, compare=c.compare, where=c.name)


# --- data-dependent output shapes -----------------------------------------------------

_DATA_DEPENDENT = {
    "nonzero": jnp.nonzero,
    "flatnonzero": jnp.flatnonzero,
    "argwhere": jnp.argwhere,
    "where-one-argument": jnp.where,
    "unique": jnp.unique,
    "unique_counts": jnp.unique_counts,
    "compress": lambda x: jnp.compress(x > 0.5, x),
    "boolean-mask": lambda x: x[x > 0.5],
    "setdiff1d": lambda x: jnp.setdiff1d(x, jnp.array([1.0], jnp.float32)),
}
_DATA = jnp.array([0.0, 1.0, 0.0, 2.0, 3.0, 1.0], jnp.float32)


@pytest.mark.parametrize("fn", _DATA_DEPENDENT.values(), ids=_DATA_DEPENDENT.keys())
def test_data_dependent_shape_without_values(fn):
    # No Value among the arguments: quaxify calls the function as it is, eagerly.
    expected = fn(_DATA)
    assert_same(quaxlike.quaxify(fn)(_DATA), expected)
    # A Value elsewhere in the call does not make the plain argument abstract.
    both = quaxlike.quaxify(lambda v, x: (v * 2.0, fn(x)))
    value_out, out = both(Tracked(jnp.float32(1.5)), _DATA)
    assert type(value_out) is Tracked
    assert_same(out, expected)


@pytest.mark.parametrize("fn", _DATA_DEPENDENT.values(), ids=_DATA_DEPENDENT.keys())
def test_data_dependent_shape_of_a_value_needs_size(fn):
    # As under `jax.jit`: a Value is abstract inside quaxify, so a data-dependent
    # shape needs `size=` (the `*-size` rows of the table).
    errors = (jax.errors.ConcretizationTypeError, jax.errors.NonConcreteBooleanIndexError)
    with pytest.raises(errors):
        quaxlike.quaxify(fn)(Tracked(_DATA))


# --- core bugs found by the table, reduced to a minimal example -----------------------


@jax.custom_jvp
def _plain_primal_value_tangent(x):
    return x * 0.0 + jnp.ones_like(x)


@_plain_primal_value_tangent.defjvp
def _plain_primal_value_tangent_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # The primal output does not depend on `x` (a plain array under quaxify); the
    # tangent output does (a Value).
    return jnp.ones_like(x), 3.0 * t


def test_core_custom_jvp_mismatch_under_grad():
    x = jnp.array([1.0, 2.0], jnp.float32)

    def loss(x):
        out = quaxlike.quaxify(_plain_primal_value_tangent)(Tracked(x))
        return (out.array if isinstance(out, Tracked) else out).sum()

    expected = jax.grad(lambda x: _plain_primal_value_tangent(x).sum())(x)
    assert_same(jax.grad(loss)(x), expected)


def test_slogdet_grad():
    # slogdet's jvp rule calls slogdet itself and builds the sign's tangent with
    # `zeros_like`: a plain tangent for a pass-through Value's output. The
    # custom_jvp rule once differentiated the rule's own primal computation for
    # that, which recursed without end (RecursionError).
    x = jnp.array([[4.0, 1.0, 0.5], [1.0, 3.0, 0.2], [0.5, 0.2, 2.0]], jnp.float32)

    def loss(x):
        _, logdet = quaxlike.quaxify(jnp.linalg.slogdet)(Tracked(x))
        return logdet.array if isinstance(logdet, Tracked) else logdet

    expected = jax.grad(lambda x: jnp.linalg.slogdet(x)[1])(x)
    assert_same(jax.grad(loss)(x), expected, tol={"rtol": 1e-5, "atol": 1e-6})


def _new_ref_read_twice(x):
    ref = jax.new_ref(x)
    return ref[...] * 2.0


def test_core_default_returning_a_ref():
    x = jnp.ones((3, 4), jnp.float32)
    out = quaxlike.quaxify(_new_ref_read_twice)(quaxlike.DenseArrayValue(x))
    assert_same(out, _new_ref_read_twice(x))


def test_core_sharding_constraint_unconstrained():
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec(jax.sharding.PartitionSpec.UNCONSTRAINED, None)
    fn = ft.partial(jax.lax.with_sharding_constraint, shardings=NamedSharding(mesh, spec))
    x = jnp.ones((3, 4), jnp.float32)
    assert_same(quaxlike.quaxify(fn)(Tracked(x)), fn(x))


def _halve_until(x, n):
    return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 0.5), (0, x))[1]


def test_core_vmap_of_while_inside_quaxify():
    xs, ns = jnp.ones((2, 3), jnp.float32), jnp.array([1, 3], jnp.int32)
    out = quaxlike.quaxify(jax.vmap(_halve_until))(Tracked(xs), ns)
    assert_same(out, jax.vmap(_halve_until)(xs, ns))


def test_core_nested_vmap_of_while_inside_quaxify():
    # Two levels of per-element predicates; elements stop at different steps.
    xs = jnp.arange(24, dtype=jnp.float32).reshape(2, 3, 4)
    ns = jnp.array([[0, 1, 4], [2, 5, 3]], jnp.int32)
    fn = jax.vmap(jax.vmap(_halve_until))
    assert_same(quaxlike.quaxify(fn)(Tracked(xs), ns), fn(xs, ns))
