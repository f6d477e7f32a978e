"""Values known while tracing (`quaxlike.internal.known_value`,
`is_scale_invariant`): noted for a type that asks (`Value.tracks_known_values`),
through `jit` bodies, loop bodies and custom derivatives, and never for a type
that does not ask."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import quaxlike
from quaxlike.internal import is_known, is_scale_invariant, known_value


class _Asking(quaxlike.ArrayValue):
    """Stands for its array; its `add` rule writes down what it knows of the
    plain operand."""

    array: jax.Array
    tracks_known_values: ClassVar[bool] = True

    def aval(self):
        return jax.core.ShapedArray(self.array.shape, self.array.dtype)

    def materialise(self):
        return self.array


class _NotAsking(_Asking):
    tracks_known_values: ClassVar[bool] = False


_seen: list = []


def _note(x, y):
    value = known_value(y)
    _seen.append((None if value is None else value.tolist(), is_scale_invariant(y)))
    return type(x)(x.array + y)


@quaxlike.register(lax.add_p)
def _add_asking(x: _Asking, y: jax.Array) -> _Asking:
    return _note(x, y)


@pytest.fixture(autouse=True)
def _fresh():
    _seen.clear()
    yield
    _seen.clear()


def _run(fn, *args, value_type=_Asking):
    out = jax.jit(quaxlike.quaxify(fn))(value_type(jnp.ones(3)), *args)
    assert _seen, "the rule did not run"
    return out


def test_a_constant_made_under_jit_is_known():
    _run(lambda v: v + jnp.zeros(3) * 2.0 + 1.0)
    assert _seen == [([0.0, 0.0, 0.0], True), (1.0, False)]


def test_a_traced_argument_is_unknown():
    out = _run(lambda v, c: v + c, jnp.full(3, 2.0))
    assert _seen == [(None, False)]
    np.testing.assert_array_equal(out.array, 3.0)


def test_inf_times_an_unknown_is_scale_invariant_but_not_known():
    # `jnp.full(n, direction * jnp.inf)`, as diffrax fills its output times.
    _run(lambda v, c: v + jnp.full(3, jnp.where(c > 0, 1.0, -1.0) * jnp.inf), jnp.array(1.0))
    assert _seen == [(None, True)]


def test_an_unknown_times_a_finite_constant_is_not_scale_invariant():
    _run(lambda v, c: v + c * 2.0, jnp.zeros(3))
    assert _seen == [(None, False)]


def test_zeros_made_in_a_loop_body_are_known_and_the_carry_is_not():
    def fn(v):
        def body(i, carry):
            return carry + jnp.zeros(3) + i.astype(jnp.float32)

        return lax.fori_loop(0, 2, body, v)

    _run(fn)
    known_zeros = [seen for seen in _seen if seen == ([0.0, 0.0, 0.0], True)]
    unknown = [seen for seen in _seen if seen[0] is None]
    assert known_zeros and unknown
    assert all(invariant is False for _, invariant in unknown)


def test_knowledge_crosses_a_custom_vjp():
    @jax.custom_vjp
    def f(v, c):
        return v + c

    f.defvjp(lambda v, c: (f(v, c), None), lambda _, ct: (ct, ct))

    _run(lambda v: f(v, jnp.zeros(3)))
    assert _seen == [([0.0, 0.0, 0.0], True)]


def test_knowledge_crosses_a_custom_jvp():
    @jax.custom_jvp
    def f(v, c):
        return v + c

    f.defjvp(lambda primals, tangents: (f(*primals), tangents[0] + tangents[1]))

    _run(lambda v: f(v, jnp.full(3, jnp.nan)))
    assert len(_seen) == 1 and _seen[0][1] is True and np.isnan(_seen[0][0]).all()


def test_a_type_that_does_not_ask_pays_nothing():
    _run(lambda v: v + jnp.zeros(3), value_type=_NotAsking)
    assert _seen == [(None, False)]


def test_the_result_of_an_effect_is_not_known():
    def fn(v):
        c = jax.experimental.io_callback(
            lambda: np.zeros(3, np.float32), jax.ShapeDtypeStruct((3,), jnp.float32)
        )
        return v + c

    _run(fn)
    assert _seen == [(None, False)]


def test_the_program_is_unchanged():
    def fn(v, c):
        return v + jnp.zeros(3) * c

    asking = jax.make_jaxpr(quaxlike.quaxify(fn))(_Asking(jnp.ones(3)), 2.0)
    not_asking = jax.make_jaxpr(quaxlike.quaxify(fn))(_NotAsking(jnp.ones(3)), 2.0)
    assert str(asking) == str(not_asking)


def test_outside_quaxify_nothing_is_known():
    @jax.jit
    def fn(c):
        zeros = jnp.zeros(3) * c
        assert not is_known(zeros) and known_value(zeros) is None
        return zeros

    fn(1.0)
    assert eqx.is_array(fn(1.0))


# --- after loops, branches and custom derivatives -------------------------------
# A loop or `cond` over plain arrays only reaches the trace as one operation
# (its body read as a jaxpr); one that also carries a Value runs its body
# through quaxlike's rule. Both ways are tested: `with_value` puts `v` in the
# loop's carry or the branches' operands.


def _while(body, carry, v=None):
    # A `while` (bounds traced under `jit`), as diffrax's solver loop is; with
    # `v`, the Value rides along in the carry.
    def step(c):
        i, w, *rest = c
        return (i + 1, w, *body(*rest))

    i, w, *out = lax.while_loop(lambda c: c[0] < 3, step, (0, v, *carry))
    return out


_WITH_VALUE = pytest.mark.parametrize("with_value", [False, True], ids=["plain", "value"])


@_WITH_VALUE
def test_a_carry_the_loop_only_copies_stays_invariant_after_it(with_value):
    def fn(v, n):
        carry = (jnp.full(3, jnp.inf), 0.0 * n)
        buffer, count = _while(
            lambda b, c: (jnp.copy(b), c + 1.0), carry, v if with_value else None
        )
        return v + buffer + count

    _run(fn, jnp.array(1.0))
    # `count` entered as 0 too, but the body changes it.
    assert _seen == [(None, True), (None, False)]


@_WITH_VALUE
def test_a_carry_that_depends_on_a_changed_carry_is_not_invariant_after_the_loop(with_value):
    # Assuming both carries stay 0 shows `y + x` to be 0; `x` is not, so `y` is
    # not either: 0, 0, 1, 3 after three steps. (A decision kept from the
    # first assumption would call it 0.)
    def fn(v, n):
        carry = (0.0 * n, 0.0 * n)
        x, y = _while(lambda x, y: (x + 1.0, y + x), carry, v if with_value else None)
        return v + y

    out = _run(fn, jnp.array(1.0))
    assert _seen == [(None, False)]
    np.testing.assert_array_equal(out.array, 4.0)


@_WITH_VALUE
def test_a_scan_carry_written_only_with_nan_stays_invariant(with_value):
    def fn(v, n):
        def body(carry, i):
            buffer, w = carry
            return (buffer.at[i].set(jnp.nan * n), w), buffer[i]

        (buffer, _), read = lax.scan(
            body, (jnp.zeros(3) * n, v if with_value else None), jnp.arange(3)
        )
        return v + buffer + read

    _run(fn, jnp.array(1.0))
    assert _seen == [(None, True), (None, True)]


@_WITH_VALUE
def test_a_nested_loop_keeps_its_carry_invariant(with_value):
    def fn(v, n):
        w = v if with_value else None

        def inner(b):
            return _while(lambda b: (b * 2.0,), (b,), w)

        (buffer,) = _while(inner, (jnp.zeros(3) * n,), w)
        return v + buffer

    _run(fn, jnp.array(1.0))
    assert _seen == [(None, True)]


@_WITH_VALUE
@pytest.mark.parametrize("other, invariant", [(jnp.nan, True), (1.0, False)])
def test_a_cond_output_is_invariant_where_every_branch_gives_so(other, invariant, with_value):
    def fn(v, p):
        w = v if with_value else jnp.ones(3)
        out, _ = lax.cond(
            p > 0,
            lambda w: (jnp.full(3, jnp.inf) * p, w),
            lambda w: (jnp.full(3, other) + 0 * p, w),
            w,
        )
        return v + out

    _run(fn, jnp.array(1.0))
    assert _seen == [(None, invariant)]


def test_knowledge_comes_back_out_of_a_custom_vjp():
    @jax.custom_vjp
    def f(v):
        return v, jnp.zeros(3) * 2.0

    f.defvjp(lambda v: (f(v), None), lambda _, ct: (ct[0],))

    def fn(v):
        same, zeros = f(v)
        return same + zeros

    _run(fn)
    assert _seen == [([0.0, 0.0, 0.0], True)]


def test_loops_and_branches_leave_the_program_unchanged():
    def fn(v, c):
        (buffer,) = _while(lambda b: (jnp.copy(b),), (jnp.full(3, jnp.inf),), v)
        out = lax.cond(c > 0, lambda: buffer, lambda: buffer * c)
        return v + out

    asking = jax.make_jaxpr(quaxlike.quaxify(fn))(_Asking(jnp.ones(3)), 2.0)
    not_asking = jax.make_jaxpr(quaxlike.quaxify(fn))(_NotAsking(jnp.ones(3)), 2.0)
    assert str(asking) == str(not_asking)
