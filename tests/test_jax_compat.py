"""The JAX compatibility layer (quaxlike/_jax_compat/): every probe's fallback
is exercised here, on stand-ins shaped like an older or newer JAX, so a
fallback that rots fails a test on any release. (The release matrix in
.ci/run runs the real thing on every minor series from 0.7.2.)"""

import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import randn

import quaxlike
from quaxlike import _jax_compat as jc


def _module(**attributes):
    return types.SimpleNamespace(**attributes)


# --- finding names ----------------------------------------------------------------


def test_first_found_falls_back_to_the_next_module():
    older = _module(set_current_trace="old")
    assert (
        jc._probing._first((_module(), "set_current_trace"), (older, "set_current_trace")) == "old"
    )
    assert jc._probing._first((None, "x"), (_module(x=None), "x")) is None


def test_a_missing_internal_raises_naming_version_range_and_what():
    unavailable = jc._probing._unavailable(
        "jax._src.core.trace_ctx", "running a quaxified function"
    )
    with pytest.raises(jc.JaxCompatibilityError) as info:
        unavailable()
    message = str(info.value)
    for text in ("jax._src.core.trace_ctx", jax.__version__, *jc.TESTED_RANGE):
        assert text in message
    assert isinstance(info.value, quaxlike.QuaxlikeError)


def test_version_comparison():
    assert jc._probing._version_tuple("0.12.0.1") > jc._probing._version_tuple("0.12.0")
    assert jc._probing._version_tuple("0.13.0.dev20270101") > jc._probing._version_tuple(
        jc.TESTED_RANGE[1]
    )
    assert jc._probing._version_tuple("0.7.2") == (0, 7, 2)


# --- the trace API ------------------------------------------------------------------


def test_current_trace_fallbacks_agree_with_jax():
    real = jc._probing._core
    readers = [
        jc.current_trace_reader(real, jc.jex_core),
        # No trace_ctx: `unsafe_get_current_trace`.
        jc.current_trace_reader(
            _module(unsafe_get_current_trace=real.unsafe_get_current_trace), None
        ),
        # Neither: `find_top_trace`.
        jc.current_trace_reader(_module(), _module(find_top_trace=real.find_top_trace)),
    ]
    seen = []

    def inside(x):
        seen.append([read() for read in readers])
        return x

    jax.make_jaxpr(inside)(1.0)
    (traces,) = seen
    assert all(t is traces[0] for t in traces)
    assert all(read() is readers[0]() for read in readers)  # eager, too
    with pytest.raises(jc.JaxCompatibilityError):
        jc.current_trace_reader(_module(), None)()


def test_tracer_initialiser_for_both_signatures():
    class OldTracer:  # jax < 0.10: `__init__(self, trace)`, `aval` the subclass's
        __slots__ = ("_trace", "aval")

        def __init__(self, trace):
            self._trace = trace

    class NewTracer:  # jax >= 0.10: `__init__(self, trace, aval)`
        __slots__ = ("_trace", "aval")

        def __init__(self, trace, aval):
            self._trace, self.aval = trace, aval

    for base in (OldTracer, NewTracer):
        takes_aval = jc._trace_api._init_takes_aval(base)
        assert takes_aval == (base is NewTracer)
        tracer = object.__new__(base)
        jc.tracer_initialiser(base, takes_aval)(tracer, "trace", "aval")
        assert (tracer._trace, tracer.aval) == ("trace", "aval")
    assert "aval" in jc._trace_api._slots_of(NewTracer) and "aval" not in jc._trace_api._slots_of(
        object
    )


def test_binder_for_both_signatures():
    calls = []

    class Old:
        def bind_with_trace(self, trace, args, params):
            calls.append(("old", trace, list(args), params))

    class New:
        def bind_with_trace(self, trace, args, avals, params, /):
            calls.append(("new", trace, list(args), avals, params))

    x = jnp.ones(2)
    jc.binder(Old)(Old(), "t", [x], {"p": 1})
    jc.binder(New)(New(), "t", [x], {"p": 1})
    assert calls[0] == ("old", "t", [x], {"p": 1})
    assert calls[1][:3] == ("new", "t", [x]) and calls[1][3] == [jax.typeof(x)]


def test_quaxify_runs_with_the_fallbacks_of_speed_shortcuts(monkeypatch):
    # Equation contexts not interned (jax < 0.10.2) and concrete arrays without
    # a readable aval: every equation's context is entered, keys use typeof.
    monkeypatch.setattr(jc._trace_api, "_EQN_CONTEXTS_INTERNED", False)
    monkeypatch.setattr(jc._trace_api, "_ARRAY_CARRIES_AVAL", False)
    assert jc.current_eqn_context() is None
    x = randn(0, (3,))
    value = quaxlike.DenseArrayValue(x)
    for f in (jnp.sin, lambda v: jnp.sum(v * 2.0)):
        np.testing.assert_array_equal(quaxlike.quaxify(f)(value), f(x))
        np.testing.assert_array_equal(jax.jit(quaxlike.quaxify(f))(value), jax.jit(f)(x))
    assert jc.aval_key(x) == jax.typeof(x)


def test_register_tracer_class_without_jax_s_table(monkeypatch):
    monkeypatch.setattr(jc._trace_api, "_aval_mappings", None)
    monkeypatch.setattr(jc._probing, "_disabled", [])

    class Stray(jc.Tracer):
        pass

    jc.register_tracer_class(Stray)
    assert jc.disabled_shortcuts() == ["jax.typeof's lookup for QuaxTracer"]


# --- concreteness, typed scalars ------------------------------------------------------


def test_concreteness_fallback_asks_the_tracer(monkeypatch):
    # Without `core.to_concrete_value`, the tracer's own method is asked.
    fallback = jc.concreteness_reader(_module())
    assert jc.TRACERS_ANSWER_CONCRETENESS
    x = jnp.array([0.0, 1.0, 0.0])
    seen = []

    def inside(a):
        seen.append((fallback(a), jc.to_concrete_value(a)))
        return a

    quaxlike.quaxify(inside)(quaxlike.DenseArrayValue(x))
    jax.jit(quaxlike.quaxify(inside))(quaxlike.DenseArrayValue(x))
    (eager_fallback, eager_real), (jit_fallback, jit_real) = seen
    np.testing.assert_array_equal(eager_fallback, x)
    np.testing.assert_array_equal(eager_real, x)
    assert jit_fallback is None and jit_real is None
    assert fallback(x) is x and fallback(2.0) == 2.0
    # Routed through the fallback, eager concreteness still works.
    monkeypatch.setattr(jc, "to_concrete_value", fallback)
    out = quaxlike.quaxify(jnp.trim_zeros)(quaxlike.DenseArrayValue(x))
    np.testing.assert_array_equal(out, jnp.trim_zeros(x))


def test_typed_scalar_types_in_both_layouts():
    class TypedInt(int):
        pass

    class LiteralFloat(float):
        pass

    newer = _module(typed_scalar_types={TypedInt}, literal_scalar_types=None)
    older = _module(literal_scalar_types={LiteralFloat})
    assert jc.typed_scalar_types_of(newer) == (TypedInt,)
    assert jc.typed_scalar_types_of(older) == (LiteralFloat,)
    assert jc.typed_scalar_types_of(_module()) == () == jc.typed_scalar_types_of(None)


def test_custom_call_primal_jaxpr():
    jaxpr = jax.make_jaxpr(jax.nn.relu)(1.0)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is jc.custom_jvp_call_p]
    primal = jc.custom_call_primal_jaxpr(eqn.params)
    assert isinstance(primal, jc.ClosedJaxpr)
    assert jc.eval_jaxpr(primal.jaxpr, primal.consts, -2.0) == [0.0]
    # The trace hook's params hold functions, not a jaxpr.
    assert jc.custom_call_primal_jaxpr({"fun": jax.nn.relu}) is None


# --- params that changed between releases -------------------------------------------


def test_jit_inline_param_both_forms():
    assert jc.jit_inlines_at_trace(True) and not jc.jit_inlines_at_trace(False)
    assert not jc.jit_inlines_at_trace("something new")
    if jc._primitives._Inline is not None:  # jax >= 0.11: an enum
        assert jc.jit_inlines_at_trace(jc._primitives._Inline.JAX_EARLY)
        others = [m for m in jc._primitives._Inline if m is not jc._primitives._Inline.JAX_EARLY]
        assert others and not any(map(jc.jit_inlines_at_trace, others))


def test_jax_numpy_functions_are_seen_as_inlined():
    seen = []

    # Bound under a trace that keeps `jit` equations: the inline param of a
    # `jax.numpy` function is one that inlines at trace time, on any release.
    class Recording(quaxlike.DenseArrayValue):
        pass

    @quaxlike.register(jc.jit_p)
    def jit_p_recording(*args: Recording | jax.Array | float, jaxpr, **params):
        seen.append(jc.jit_inlines_at_trace(params.get("inline", False)))
        return NotImplemented

    quaxlike.quaxify(jnp.sin)(Recording(randn(1, (2,))))
    assert seen == [True]


def _jit_params(f, *args) -> dict:
    (eqn,) = jax.make_jaxpr(f)(*args).jaxpr.eqns
    assert eqn.primitive is jc.jit_p
    return dict(eqn.params)


def test_jit_needs_only_keep_unused():
    # What `jax.numpy` functions bind eagerly: nothing beyond keep_unused.
    x = randn(2, (4,))
    plain = _jit_params(lambda a: jax.jit(jnp.sin)(a), x)
    assert jc.jit_needs_only_keep_unused(plain)
    assert jc.jit_needs_only_keep_unused(
        _jit_params(lambda a: jax.jit(jnp.sin, keep_unused=True)(a), x)
    )
    # Donation, an explicit sharding or compiler options: bound as they are.
    donating = _jit_params(lambda a: jax.jit(jnp.sin, donate_argnums=0)(a), x)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sharded = _jit_params(lambda a: jax.jit(jnp.sin, out_shardings=device)(a), x)
    for params in (donating, sharded, {**plain, "compiler_options_kvs": (("a", 1),)}):
        assert not jc.jit_needs_only_keep_unused(params)
    # A param this layer does not know (a newer JAX), or one gone: bound as it is.
    assert not jc.jit_needs_only_keep_unused({**plain, "something_new": None})
    assert not jc.jit_needs_only_keep_unused({k: v for k, v in plain.items() if k != "ctx_mesh"})


def test_eager_calls_are_bound_without_unspecified_value(monkeypatch):
    # The fallback where this JAX has no `UnspecifiedValue`: every eager call
    # is bound through `jit_p` as it is, with the same results.
    x = randn(3, (5,))
    plain = _jit_params(lambda a: jax.jit(jnp.sin)(a), x)
    monkeypatch.setattr(jc._primitives, "_UnspecifiedValue", None)
    assert not jc.jit_needs_only_keep_unused(plain)
    f = lambda a: jnp.sum(jnp.exp(a) * 2.0)  # noqa: E731
    np.testing.assert_array_equal(quaxlike.quaxify(f)(quaxlike.DenseArrayValue(x)), f(x))


def test_scan_layout_both_forms():
    assert jc.scan_layout({"num_consts": 2, "num_carry": 1}) == (2, 1)

    class FlatTrees:
        def unpack(self):
            return [None] * 3, [None], [None] * 4

    assert jc.scan_layout({"ft_in": FlatTrees()}) == (3, 1)
    with pytest.raises(jc.JaxCompatibilityError, match="scan"):
        jc.scan_layout({})
    # And the real one, on this release.
    jaxpr = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda c, x: (c + x, c * x), c, xs))
    (eqn,) = jaxpr(1.0, jnp.ones(3)).eqns
    assert jc.scan_layout(eqn.params) == (0, 1)


def test_custom_vjp_cotangents_both_forms():
    assert jc.custom_vjp_cotangents([1, None], with_logs=False) == [1, None]
    assert jc.custom_vjp_cotangents(([1, None], None), with_logs=True) == [1, None]


def test_varying_axes_both_forms():
    old = _module(vma=frozenset({"x"}))
    new = _module(mat=_module(varying=frozenset({"x", "y"})))
    assert jc.varying_axes(old) == {"x"}
    assert jc.varying_axes(new) == {"x", "y"}
    assert jc.varying_axes(_module()) == frozenset()


def test_shard_map_body_old_protocol():
    class WrappedFun:  # jax <= 0.8: a one-shot function returning a flat list
        def call_wrapped(self, *args):
            return [a * 2 for a in args]

    outs, specs, rebuild = jc.shard_map_body_outputs(
        WrappedFun(), [1, 2], {"out_specs_thunk": lambda: ("a", "b")}, flat_tree=False
    )
    assert (outs, specs, rebuild([5, 6])) == ([2, 4], ("a", "b"), [5, 6])
    assert jc.map_shard_map_result([1, 2], lambda v: v + 1) == [2, 3]


def test_stand_in_primitives_are_inert():
    stand_in = jc._primitives._stand_in_primitive("gone")
    assert isinstance(stand_in, jc.Primitive) and stand_in.name == "quaxlike_missing_gone"
    assert jc.lax_primitive_by_name("quaxlike_missing_gone") is None


# --- a JAX newer than the tested range ----------------------------------------------


def test_import_on_an_unknown_newer_jax():
    # A JAX that calls itself 0.99, whose public re-exports of the trace API and
    # of some primitives moved away (their `jax._src` homes stay, as JAX itself
    # uses them): `import quaxlike` still works, says it is beyond the tested
    # range, and quaxify runs on the fallbacks.
    script = textwrap.dedent(
        """
        import jax, jax.extend.core, jax.numpy as jnp
        jax.__version__ = "0.99.0"
        core = jax.extend.core
        for module, name in [
            (core, "set_current_trace"), (core, "take_current_trace"),
            (core, "jaxpr_as_fun"), (core.primitives, "jit_p"),
            (core.primitives, "remat_p"), (jax, "Inline"),
        ]:
            if hasattr(module, name):
                delattr(module, name)
        import quaxlike
        from quaxlike import _jax_compat as jc
        assert jc.beyond_tested_range()
        assert jc.jit_p.name == "jit" and jc.remat_p.name == "remat2"
        x = jnp.arange(3.0)
        value = quaxlike.DenseArrayValue(x)
        out = quaxlike.quaxify(lambda v: jnp.sin(v) * 2.0 + 1.0)(value)
        assert (out == jnp.sin(x) * 2.0 + 1.0).all()
        out = jax.jit(quaxlike.quaxify(lambda v: jax.checkpoint(jnp.cos)(v)))(value)
        assert jnp.allclose(out, jnp.cos(x))
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_jit_options_identify_the_params_but_the_jaxpr():
    x = randn(4, (3,))
    plain = _jit_params(lambda a: jax.jit(jnp.sin)(a), x)
    options = jc.jit_options(plain)
    assert options is not None and len(options) == len(plain) - 1
    assert not any(o is plain["jaxpr"] for o in options)
    assert set(map(id, options)) <= {id(v) for k, v in plain.items() if k != "jaxpr"}
    # A param this layer does not know, or one gone: nothing to remember by.
    assert jc.jit_options({**plain, "something_new": None}) is None
    assert jc.jit_options({k: v for k, v in plain.items() if k != "ctx_mesh"}) is None
    renamed = {("ctx_meshes" if k == "ctx_mesh" else k): v for k, v in plain.items()}
    assert jc.jit_options(renamed) is None


def test_without_mesh_tells_an_explicitly_sharded_aval():
    assert jc.without_mesh(jax.typeof(jnp.ones(3)))
    assert jc.without_mesh(jax.ShapeDtypeStruct((2,), jnp.float32))
    axis_type = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    if axis_type is None:
        pytest.skip("this JAX has no explicit mesh axes")
    mesh = jax.make_mesh((1,), ("x",), axis_types=(axis_type,))
    sharded = jax.device_put(jnp.ones(4), jax.sharding.NamedSharding(mesh, jax.P("x")))
    # Asked twice: the first answer is not remembered for another mesh.
    for _ in range(2):
        assert jc.without_mesh(jax.typeof(jnp.ones(3)))
        assert not jc.without_mesh(jax.typeof(sharded))


# --- Equinox's own primitives -------------------------------------------------------


def test_filter_primitive_rules_found_and_their_fallback(monkeypatch):
    import lineax._solve

    from quaxlike._jax_compat import _equinox

    rules = jc.filter_primitive_rules(lineax._solve.linear_solve_p)
    assert rules is not None and all(callable(r) for r in rules)
    assert jc.filter_primitive_rules(jax.lax.add_p) is None
    # An Equinox that keeps its registries elsewhere: no rules (the default).
    monkeypatch.setattr(_equinox, "FILTER_PRIMITIVES_FOUND", False)
    assert jc.filter_primitive_rules(lineax._solve.linear_solve_p) is None


def _toy_filter_primitive(name):
    """A filter primitive doubling a PyTree's arrays, made the way lineax makes its own."""
    import equinox.internal as eqxi

    def double(tree):
        return jax.tree_util.tree_map(lambda x: 2 * x, tree)

    def jvp(primals, tangents, **params):
        return jax.tree_util.tree_map(lambda t: 2 * t, (primals, tangents))

    return eqxi.create_vprim(
        name,
        eqxi.filter_primitive_def(double),
        eqxi.filter_primitive_def(lambda tree: tree),
        eqxi.filter_primitive_jvp(lambda p, t: (double(p), double(t))),
        None,
    )


def test_filter_primitives_with_and_without_their_rules(monkeypatch):
    import equinox.internal as eqxi

    from quaxlike._jax_compat import _equinox
    from quaxlike.structured import TriDiagonal

    a = TriDiagonal(jnp.full(3, 0.5), jnp.full(4, 3.0), jnp.full(3, 0.5))
    found = _toy_filter_primitive("quaxlike_test_double")
    out = quaxlike.quaxify(lambda x: eqxi.filter_primitive_bind(found, x))(a)
    assert isinstance(out, TriDiagonal)
    np.testing.assert_allclose(out.materialise(), 2 * a.materialise())
    # An Equinox that keeps its registries elsewhere: no rules, the default.
    monkeypatch.setattr(_equinox, "FILTER_PRIMITIVES_FOUND", False)
    missing = _toy_filter_primitive("quaxlike_test_double_unprobed")
    report = quaxlike.explain(lambda x: eqxi.filter_primitive_bind(missing, x))(a)
    assert [r.primitive for r in report.materialised] == ["quaxlike_test_double_unprobed"]


def test_callback_host_function_and_its_fallback():
    def f(x):
        return jax.pure_callback(np.sin, jax.ShapeDtypeStruct((2,), jnp.float32), x)

    (eqn,) = jax.make_jaxpr(f)(jnp.ones(2, jnp.float32)).jaxpr.eqns
    host = jc.callback_host_function(eqn)
    assert host is not None
    np.testing.assert_allclose(host(np.ones(2, np.float32))[0], np.sin(1.0), rtol=1e-6)
    (add,) = jax.make_jaxpr(lambda x: x + 1)(1.0).jaxpr.eqns
    assert jc.callback_host_function(add) is None
    # A release whose callback equations keep the host function elsewhere.
    moved = types.SimpleNamespace(primitive=eqn.primitive, params={})
    assert jc.callback_host_function(moved) is None
