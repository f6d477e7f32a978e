"""Every cache and memo (docs/caches.md): none keeps what the user dropped, each
stays at or under its bound, none stores what an older rule set computed, and
errors rewritten on the way out keep the class of the error they replace.

Each test compares results with plain JAX on the dense arrays where there is a
result; the cache tests look at the caches themselves (their sizes and
contents) and at `weakref`s to what the user dropped.
"""

import gc
import re
import sys
import threading
import time
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import randn
from jax import lax
from jaxtyping import ArrayLike

import quaxlike
from quaxlike import _diagnostics, _quaxify, _rules, _staging, _sub_programs, _values
from quaxlike._higher_order import _eager_operators, _jit
from quaxlike.internal import bind_dot_general, cached_rule
from quaxlike.lora import LoraArray
from quaxlike.symbolic.zero import Zero


def _new_type(name: str = "T"):
    """A fresh Value type with no rules: every operation materialises it."""

    class T(quaxlike.ArrayValue):
        array: jax.Array

        def aval(self):
            return jax.typeof(self.array)

        def materialise(self):
            return self.array

    T.__name__ = T.__qualname__ = name
    return T


def _collected(*refs: weakref.ref) -> int:
    """How many of `refs` still name a live object after a full collection."""
    gc.collect()
    return sum(ref() is not None for ref in refs)


def _lora(seed: int = 0, shape=(8, 8)) -> LoraArray:
    return LoraArray(randn(seed, shape), rank=2, key=jr.key(seed))


# --- 1. the `jit` rule's compiled bodies --------------------------------------


def test_jit_bodies_do_not_keep_closed_over_arrays_eagerly():
    lora, x = _lora(), randn(1, (8,))
    refs = []
    for i in range(10):
        big = jnp.full((256, 256), float(i))
        refs.append(weakref.ref(big))
        f = jax.jit(lambda m, v, big=big: m @ v + big[0, :8])
        out = quaxlike.quaxify(f)(lora, x)
        assert np.allclose(out, lora.dense() @ x + i, rtol=1e-5, atol=1e-5)
        del f, big
    assert _collected(*refs) == 0
    assert len(_jit._bodies) <= _jit._bodies.max_size


def test_jit_bodies_do_not_keep_closed_over_arrays_under_jit():
    x = randn(1, (8,))
    refs = []
    for i in range(10):
        big = jnp.full((256, 256), float(i))
        refs.append(weakref.ref(big))
        inner = jax.jit(lambda m, v, big=big: m @ v + big[0, :8])
        outer = jax.jit(quaxlike.quaxify(lambda m, v, inner=inner: inner(m, v)))
        w = randn(i, (8, 8))
        out = outer(quaxlike.DenseArrayValue(w), x)
        assert np.allclose(out, w @ x + i, rtol=1e-5, atol=1e-5)
        del inner, outer, big
    assert _collected(*refs) == 0


def test_jit_bodies_are_reused_while_the_function_lives():
    lora, x = _lora(), randn(1, (8,))
    f = jax.jit(lambda m, v: jnp.sin(m @ v))
    quaxlike.quaxify(f)(lora, x)
    size = len(_jit._bodies)
    for _ in range(3):
        out = quaxlike.quaxify(f)(lora, x)
    assert len(_jit._bodies) == size  # the same body, not one per call
    assert np.allclose(out, jnp.sin(lora.dense() @ x), rtol=1e-5, atol=1e-5)


def test_compiled_calls_are_bounded_and_evict_the_oldest(monkeypatch):
    calls = _staging.CompiledCalls(max_size=4)
    owners = [jnp.zeros(i + 1) for i in range(6)]
    made = []
    split = _staging.split_arrays([jnp.ones(2)])

    def make():
        made.append(_staging.StagedCall(lambda a: a, "identity", split))
        return made[-1]

    for i, owner in enumerate(owners):
        calls.get(("k", i), make, owner=owner)
    assert len(calls) == 4
    assert calls.get(("k", 5), make, owner=owners[5]) is made[5]  # kept
    count = len(made)
    calls.get(("k", 0), make, owner=owners[0])  # evicted: made again
    assert len(made) == count + 1 and len(calls) == 4
    # An owner's calls go with it.
    del owners[5], owner
    gc.collect()
    assert len(calls) == 3 and len(calls._owners) == 3


# --- 2. the eager operators' verdicts --------------------------------------------


def test_eager_operator_verdicts_are_bounded(monkeypatch):
    monkeypatch.setattr(_eager_operators, "_MAX_VERDICTS", 8)
    _eager_operators._applies.clear()
    f = quaxlike.quaxify(lambda a, b: a * b)
    for n in range(1, 21):
        z = Zero((n,), np.dtype("float32"))
        out = f(z, np.ones(n, np.float32))
        assert np.array_equal(out.materialise() if isinstance(out, Zero) else out, np.zeros(n))
        assert len(_eager_operators._applies) <= 8
    T = _new_type()
    t, u = T(jnp.arange(3.0)), T(jnp.ones(3))
    g = quaxlike.quaxify(lambda a, b: a + b)
    g(t, u)
    (first,) = [k for k in _eager_operators._applies if k[0] == "__add__"]
    for n in range(1, 13):  # other keys, while `first` is used now and then
        f(Zero((n + 100,), np.dtype("float32")), np.ones(n + 100, np.float32))
        if n % 3 == 0:
            assert np.array_equal(g(t, u), jnp.arange(3.0) + 1)
    assert first in _eager_operators._applies  # one used since the last sweep is kept


def test_a_failed_trace_records_no_verdict_for_every_int():
    T = _new_type()
    t = T(jnp.arange(3, dtype=jnp.int32))
    _eager_operators._applies.clear()
    with pytest.raises((OverflowError, TypeError)):
        quaxlike.quaxify(lambda a: a * 2**70)(t)
    assert not any(k[0] == "__mul__" for k in _eager_operators._applies)
    out = quaxlike.quaxify(lambda a: a * 3)(t)
    assert np.array_equal(out, jnp.arange(3, dtype=jnp.int32) * 3)
    verdicts = [v[0] for k, v in _eager_operators._applies.items() if k[0] == "__mul__"]
    assert verdicts == [True]  # the shortcut applies to a small int


# --- 3. `register` against dispatch ----------------------------------------------


def _sin_rule_for(T, marker: float):
    @quaxlike.register(lax.sin_p)
    def sin_p_t(x: T, **params):  # pyright: ignore[reportInvalidTypeForm]
        return jnp.full(x.array.shape, marker, x.array.dtype)

    return sin_p_t


def test_a_plan_computed_before_a_register_is_not_stored(monkeypatch):
    T = _new_type()
    make_plan = _rules._make_plan
    registered = []

    def make_plan_then_register(primitive, values):
        plan = make_plan(primitive, values)
        if primitive is lax.sin_p and not registered:
            registered.append(_sin_rule_for(T, 7.0))  # lands while the plan is made
        return plan

    monkeypatch.setattr(_rules, "_make_plan", make_plan_then_register)
    t = T(jnp.zeros(3))
    first = quaxlike.quaxify(lax.sin)(t)
    assert np.array_equal(first, jnp.zeros(3))  # the rule came too late for this call
    assert registered and np.array_equal(quaxlike.quaxify(lax.sin)(t), jnp.full(3, 7.0))


def test_a_verdict_computed_before_a_register_is_not_stored(monkeypatch):
    T = _new_type()
    applies_to = _eager_operators._applies_to
    registered = []

    def applies_to_then_register(*args):
        verdict = applies_to(*args)
        if not registered:

            @quaxlike.register(lax.mul_p)
            def mul_p_t(x: T, y: jax.Array, **params):  # pyright: ignore[reportInvalidTypeForm]
                return jnp.full(x.array.shape, 5.0)

            registered.append(mul_p_t)
        return verdict

    monkeypatch.setattr(_eager_operators, "_applies_to", applies_to_then_register)
    _eager_operators._applies.clear()
    t = T(jnp.ones(3))
    quaxlike.quaxify(lambda a: a * jnp.ones(3))(t)
    assert not _eager_operators._applies  # computed from the older rules: dropped
    assert np.array_equal(quaxlike.quaxify(lambda a: a * jnp.ones(3))(t), jnp.full(3, 5.0))


def test_a_sub_program_verdict_computed_before_a_register_is_not_stored(monkeypatch):
    T = _new_type()
    only_materialises = _jit.only_materialises
    registered = []

    def judge_then_register(*args):
        verdict = only_materialises(*args)
        if not registered:
            registered.append(_sin_rule_for(T, 3.0))
        return verdict

    monkeypatch.setattr(_jit, "only_materialises", judge_then_register)
    t = T(jnp.zeros(3))
    f = quaxlike.quaxify(jnp.sin)  # a `jit` that JAX inlines, run eagerly
    f(t)
    assert registered
    assert np.array_equal(f(t), jnp.full(3, 3.0))


def test_a_compiled_body_made_before_a_register_is_not_stored(monkeypatch):
    T = _new_type()

    @quaxlike.register(lax.mul_p)
    def mul_p_t(x: T, y: ArrayLike, **params):  # pyright: ignore[reportInvalidTypeForm]
        return T(x.array * y)  # a rule: the call is not only materialising

    registered = []
    get = _jit._bodies.get

    def get_registering_in_make(key, make, owner=None):
        def make_then_register():
            call = make()
            if not registered:
                registered.append(_sin_rule_for(T, 4.0))
            return call

        return get(key, make_then_register, owner)

    monkeypatch.setattr(_jit._bodies, "get", get_registering_in_make)
    f = jax.jit(lambda a: jnp.sin(a * 2.0))
    t = T(jnp.zeros(3))
    first = quaxlike.quaxify(f)(t)  # traced after the register: on the new rules
    assert np.array_equal(first, jnp.full(3, 4.0))
    assert registered and len(_jit._bodies) == 0  # but made before it: not stored
    monkeypatch.undo()
    assert np.array_equal(quaxlike.quaxify(f)(t), jnp.full(3, 4.0))


def test_a_cached_rule_program_made_before_a_register_is_not_stored():
    class Scaled(quaxlike.ArrayValue):
        array: jax.Array
        scale: float = eqx.field(static=True)

        def aval(self):
            return jax.typeof(self.array)

        def materialise(self):
            return self.scale * self.array

    T = _new_type()
    registered = []

    @quaxlike.register(lax.dot_general_p)
    @cached_rule
    def dot_general_p_scaled(x: Scaled, y: jax.Array, *, dimension_numbers, **params):
        if not registered:  # runs while the program is traced (after it is stored)
            registered.append(_sin_rule_for(T, 1.0))
        return x.scale * bind_dot_general(x.array, y, dimension_numbers, params)

    w, v = randn(0, (3, 2)), randn(1, (2,))
    f = jax.jit(quaxlike.quaxify(lambda a, b: a @ b))
    assert np.allclose(f(Scaled(w, 2.0), v), 2 * (w @ v), rtol=1e-5)
    assert registered
    # The register emptied the rule's cache: nothing made before it is left.
    assert len(dot_general_p_scaled.compiled_calls) == 0  # pyright: ignore[reportFunctionMemberAccess]
    assert np.allclose(f(Scaled(w, 3.0), v), 3 * (w @ v), rtol=1e-5)
    assert len(dot_general_p_scaled.compiled_calls) == 1  # pyright: ignore[reportFunctionMemberAccess]


def test_register_is_atomic_with_threads_dispatching():
    """One thread dispatches `sin` on a fresh type in a loop while the main
    thread registers that type's rule; afterwards every call uses the rule.
    (Outside pytest, before the generation check, about one trial in eight
    kept a stale plan; `test_a_plan_computed_before_a_register_is_not_stored`
    provokes that order every time.)"""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for trial in range(6):
            T = _new_type(f"T{trial}")
            stop = threading.Event()
            errors: list = []
            calls = [
                lambda: quaxlike.quaxify(lax.sin)(T(jnp.zeros(2))),
                lambda: quaxlike.quaxify(jnp.sin)(T(jnp.zeros(2))),
                lambda: quaxlike.quaxify(lambda a: jnp.sin(a) * 1.0)(T(jnp.zeros(2))),
            ]

            def dispatch(call=calls[trial % 3]):
                try:
                    for _ in range(100):
                        if stop.is_set():
                            break
                        call()
                except Exception as error:  # reported below
                    errors.append(error)

            thread = threading.Thread(target=dispatch)
            thread.start()
            time.sleep(0.0005)
            _sin_rule_for(T, 9.0)
            stop.set()
            thread.join(timeout=60)
            assert not thread.is_alive() and not errors
            for call in calls:
                assert np.array_equal(call(), jnp.full(2, 9.0)), trial
    finally:
        sys.setswitchinterval(previous)


def test_threads_calling_and_registering_get_plain_jax_results():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    lora, x = _lora(), randn(1, (8,))
    dense = lora.dense()
    wanted = {
        "eager": jnp.tanh(dense @ x),
        "jit": jnp.tanh(dense @ x),
        "grad": jax.grad(lambda w: jnp.sum(jnp.tanh(w @ x)))(dense),
    }
    runs = {
        "eager": lambda: quaxlike.quaxify(lambda w: jnp.tanh(w @ x))(lora),
        "jit": lambda: jax.jit(quaxlike.quaxify(lambda w: jnp.tanh(w @ x)))(lora),
        "grad": lambda: jax.grad(lambda w: jnp.sum(jnp.tanh(w @ x)))(dense),
    }
    failures: list = []

    def work(name):
        try:
            for _ in range(4):
                out = runs[name]()
                if not np.allclose(out, wanted[name], rtol=1e-5, atol=1e-5):
                    failures.append(name)
        except Exception as error:
            failures.append(error)

    try:
        threads = [threading.Thread(target=work, args=(name,)) for name in runs]
        for thread in threads:
            thread.start()
        for i in range(4):  # rules for types nobody here uses: every cache is emptied
            _sin_rule_for(_new_type(f"Unused{i}"), 0.0)
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads) and not failures
    finally:
        sys.setswitchinterval(previous)


# --- 4. errors keep their class ---------------------------------------------------


def test_a_value_where_jax_needs_a_concrete_value_is_a_type_error_as_under_jit():
    T = _new_type("Count")
    with pytest.raises(TypeError):
        jax.jit(lambda n: jnp.zeros(n))(jnp.int32(3))
    message = re.escape("A Count (int32[]) was used where JAX needs a concrete value")
    with pytest.raises(TypeError, match=message) as info:
        quaxlike.quaxify(lambda n: jnp.zeros(n))(T(jnp.int32(3)))
    assert isinstance(info.value, quaxlike.QuaxlikeError)
    assert isinstance(info.value.__cause__, TypeError)


def test_a_rewritten_error_is_an_instance_of_the_class_it_replaces():
    replaced = jax.errors.ConcretizationTypeError.__new__(jax.errors.ConcretizationTypeError)
    error = _diagnostics.keeping_class(_diagnostics.ValueNotConcreteError, replaced, "message")
    assert isinstance(error, jax.errors.ConcretizationTypeError)
    assert isinstance(error, TypeError) and isinstance(error, quaxlike.QuaxlikeError)
    assert str(error) == "message"
    again = _diagnostics.keeping_class(_diagnostics.ValueNotConcreteError, replaced, "other")
    assert type(again) is type(error)  # one class per pair, not one per error


def test_a_users_own_type_error_is_not_relabelled():
    T = _new_type()
    raised = []

    def f(x):
        raised.append(TypeError(f"unsupported operand {x}"))
        raise raised[0]

    with pytest.raises(TypeError) as info:
        quaxlike.quaxify(f)(T(jnp.ones(2)))
    assert info.value is raised[0]
    assert not isinstance(info.value, quaxlike.QuaxlikeError)


def test_an_unlifted_value_error_keeps_its_class():
    zero = Zero((3,), np.dtype("float32"))
    with pytest.raises(TypeError) as info:
        quaxlike.quaxify(lax.mul, filter_spec=(False, (False, True), False))(zero, jnp.ones(3))
    assert isinstance(info.value, quaxlike.ValueNotLiftedError)
    assert isinstance(info.value, type(info.value.__cause__))


def test_a_refusal_to_materialise_is_a_materialisation_error_chained_from_it():
    # The one deliberate exception (docs/migration/from-quax.md): a refusal
    # reaching JAX's `jnp.array_equiv` as a `ValueError` would be caught there
    # and answered `False`.
    class Refuses(quaxlike.ArrayValue):
        array: jax.Array

        def aval(self):
            return jax.typeof(self.array)

        def materialise(self):
            raise ValueError("no dense form")

    with pytest.raises(quaxlike.MaterialisationError) as info:
        quaxlike.quaxify(jnp.exp)(Refuses(jnp.ones(2)))
    assert isinstance(info.value, RuntimeError) and not isinstance(info.value, ValueError)
    assert isinstance(info.value.__cause__, ValueError)


# --- nothing kept that the user dropped -------------------------------------------


def _model_step(mode: str, fn, w, x, quaxified: bool = True):
    f = quaxlike.quaxify(fn) if quaxified else fn
    if mode == "eager":
        return f(w, x)
    if mode == "jit":
        return jax.jit(f)(w, x)
    if mode == "grad":
        return jax.grad(lambda w: jnp.sum(f(w, x)))(w)
    if mode == "vmap":
        return jax.vmap(f, in_axes=(None, 0))(w, jnp.stack([x, x]))
    if mode == "scan":
        return lax.scan(lambda c, _: (f(w, c), None), x, None, length=2)[0]
    if mode == "explain":
        return quaxlike.explain(fn)(w, x) if quaxified else f(w, x)
    if mode == "checked":
        return quaxlike.quaxify(fn, check=True)(w, x) if quaxified else f(w, x)
    raise AssertionError(mode)


def _kept_after_dropping(mode: str, quaxified: bool) -> int:
    """How many of the arrays, Values and functions of three model steps are still
    alive after the user dropped them: with a `LoraArray` through `quaxify`, or
    with its dense array through plain JAX (`quaxified=False`)."""
    refs = []
    for i in range(3):
        big = jnp.full((128, 8), float(i))
        w = _lora(i) if quaxified else randn(i, (8, 8))
        x = randn(i + 10, (8,))

        def fn(w, x, big=big):
            inner = jax.jit(lambda m, v: jnp.tanh(m @ v) + big[0])
            return inner(w, x) + jnp.sin(x) * 2

        closure = jax.jit(fn)
        out = _model_step(mode, closure, w, x, quaxified)
        refs += [weakref.ref(o) for o in (big, w, x, fn, closure)]
        del big, w, x, fn, closure, out
    return _collected(*refs)


@pytest.mark.parametrize("mode", ["eager", "jit", "grad", "vmap", "scan", "explain", "checked"])
def test_nothing_is_kept_after_the_user_drops_it(mode):
    # What plain JAX keeps is JAX's (jax 0.12's `scan` keeps the constants its
    # inner `jit`s closed over); quaxlike adds nothing to it. Before 0.12 plain
    # JAX keeps none of them in any mode, so this asserts 0 there.
    kept_by_plain_jax = _kept_after_dropping(mode, quaxified=False)
    assert _kept_after_dropping(mode, quaxified=True) <= kept_by_plain_jax
    if mode != "scan":
        assert kept_by_plain_jax == 0


# --- the other memos ----------------------------------------------------------------


def test_type_memos_hold_one_entry_per_type():
    T = _new_type()
    quaxlike.quaxify(jnp.sin)(T(jnp.ones(2)))
    before = len(_values._is_value_type)
    for n in range(2, 6):  # other shapes and values of the same types: no growth
        quaxlike.quaxify(jnp.sin)(T(jnp.ones(n)))
    assert _values._is_value_type[T] is True
    assert len(_values._is_value_type) == before
    _staging.split_arrays([T(jnp.ones(2)), jnp.ones(2), 1.0, "a string"])
    known = _staging._array_types[eqx.is_array]
    assert set(known) >= {float, str}
    assert all(type(v) is bool for v in known.values())
    assert len(_sub_programs._concrete_example) <= 1


def test_flat_call_structures_are_one_per_number_of_arguments():
    T = _new_type()
    for n in range(1, 4):
        quaxlike.quaxify(lambda *a: a[0] + 1)(*[T(jnp.ones(2))] * n)
    assert set(_quaxify._flat_structures) >= {1, 2, 3}
    assert all(k < 64 for k in _quaxify._flat_structures)


def test_sub_program_stores_go_with_their_jaxpr():
    T = _new_type()
    t = T(jnp.ones(3))
    f = jax.jit(lambda a: jnp.cos(a) + 1)
    out = quaxlike.quaxify(f)(t)
    assert np.allclose(out, jnp.cos(jnp.ones(3)) + 1)
    jaxpr = jax.make_jaxpr(f)(jnp.ones(3)).eqns[0].params["jaxpr"]
    ref = weakref.ref(jaxpr)
    assert id(jaxpr) in _sub_programs.verdicts or id(jaxpr) in _sub_programs._compiled_calls
    del f, jaxpr
    assert _collected(ref) == 0
    alive = {k for k, (r, _) in _sub_programs.verdicts.items() if r() is not None}
    assert alive == set(_sub_programs.verdicts)


def test_without_mesh_remembers_one_mesh():
    from quaxlike._jax_compat import _trace_api

    assert _trace_api.without_mesh(jax.typeof(jnp.ones(2)))
    assert len(_trace_api._empty_mesh) == 1


def test_the_unit_product_memo_is_bounded(monkeypatch):
    from quaxlike.units import _unit

    # The memo is the module's; earlier tests may have filled it with these very
    # products (which then never reach the bound), so this test starts it empty.
    monkeypatch.setattr(_unit, "_MAX_PRODUCTS", 8)
    monkeypatch.setattr(_unit, "_products", {})
    metre = _unit.Unit(m=1)
    unit = metre
    sizes = []
    for n in range(2, 22):
        unit = unit * metre
        assert unit == _unit.Unit(m=n)
        sizes.append(len(_unit._products))
    assert max(sizes) == 8 and all(size <= 8 for size in sizes)
    assert sizes[-1] < 8  # cleared on reaching the bound, then filled again


def test_the_rule_lock_is_reentrant_for_a_register_inside_a_subscriber():
    seen = []

    def subscriber():
        seen.append(_rules.rules_generation())

    _rules.on_rules_changed(subscriber)
    try:
        generation = _rules.rules_generation()
        _sin_rule_for(_new_type(), 0.0)
        assert seen == [generation + 1]
        stale: dict = {}
        _rules.store_if_current(stale, "k", 1, generation)
        assert stale == {}
        _rules.store_if_current(stale, "k", 1, _rules.rules_generation())
        assert stale == {"k": 1}
    finally:
        _rules._subscribers.remove(subscriber)


def test_unitful_stores_go_with_their_jaxpr():
    from quaxlike.units import _functions, Unit, Unitful

    refs = []
    # Unitful's own rules keep tracers in a context variable while a `jit` is
    # traced, which JAX's leak checker reports: its tests (tests/toolkits) run
    # without the checker, and so does this one.
    with jax.check_tracer_leaks(False):
        _unitful_calls(refs, Unit, Unitful)
    assert _collected(*refs) == 0
    assert all(len(d) <= 2 for d in _functions._jitted_bodies.values())


def _unitful_calls(refs, Unit, Unitful):
    for i in range(3):
        big = jnp.full((64, 3), float(i))
        refs.append(weakref.ref(big))
        f = jax.jit(lambda q, big=big: q * 2 + q * big[0])
        out = quaxlike.quaxify(f)(Unitful(jnp.arange(3.0), Unit(m=1)))
        assert isinstance(out, Unitful) and out.unit == Unit(m=1)
        assert np.allclose(out.array, jnp.arange(3.0) * (2 + i))


def test_prng_key_data_is_one_per_implementation():
    from quaxlike.prng import _value

    for _ in range(3):
        struct = _value.key_data_struct(jax.random.key(0).dtype)
    assert struct.shape == jax.random.key_data(jax.random.key(0)).shape
    assert _value.key_data_struct.cache_info().currsize <= len(("threefry", "rbg", "unsafe_rbg"))


def test_equinox_and_derivative_stores():
    # The companions of Equinox's filter primitives and the primitives asked
    # for rules are held weakly, one entry per live primitive; the derivative
    # maps of a Value are `eqx.filter_jit`s (JAX's own bounded cache).
    from quaxlike import _rules
    from quaxlike._higher_order import _equinox, _leaf_derivatives
    from quaxlike.lora import LoraArray

    assert isinstance(_equinox._companions, weakref.WeakKeyDictionary)
    assert isinstance(_rules._asked_providers, weakref.WeakSet)
    for jitted in (_leaf_derivatives._pushforward, _leaf_derivatives._pullback):
        assert isinstance(jitted, type(eqx.filter_jit(lambda x: x)))
    # A dense cotangent pulled back twice for one structure: one compiled map.
    lora = LoraArray(jnp.ones((3, 4)), rank=2, key=jr.key(0))
    for _ in range(2):
        cts = _leaf_derivatives.leaf_cotangents(lora, jnp.ones((3, 4)), None)
    assert [ct.shape for ct in cts if ct is not None] == [(3, 4), (3, 2), (2, 4)]
