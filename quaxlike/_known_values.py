"""Plain values whose numbers are known while tracing, for rules that ask.

Under `jax.jit` most plain arrays are tracers, but many are constants in
disguise: `jnp.zeros(n)` made inside a loop's body, a `jnp.inf` handed through
a `custom_vjp`, `0.5 * dt` with a literal `dt`. A rule may need such a number
to decide what to do (a unit type lets 0, inf and NaN stand beside any
quantity; an exponent must be known to give `x ** y` a unit). This module
keeps, while a type asks for it, how to compute each such value:

- A table is open while a Value of a type with `Value.tracks_known_values` is
  lifted (`opening_for`, called by `quaxify`); a nested `quaxify` uses the
  enclosing table, so that what is known outside a body stays known in it.
  Nothing is tracked outside one, so types that never ask pay nothing.
- `remember(primitive, inputs, params, outputs)` is called by `QuaxTrace` for
  every operation on plain arrays only (step 1 of `_trace.py`, which hands it
  to the parent trace): where every input is known, it records how to compute
  the outputs' values from the inputs' (`_Computed`; nothing, if the operation
  turns out to have an effect); where some are not, how to tell whether the
  outputs are scale-invariant (`_MaybeInvariant`). Nothing is computed or
  checked until a rule asks, so an operation costs a lookup per input.
- `sharing_knowledge(inner, outer)` carries what is known across a boundary
  where JAX hands a function fresh tracers for the same values: a custom
  derivative's function (`custom_jvp`, `custom_vjp`) gets new tracers for its
  arguments.
- `known_value(x)` computes the value when a rule asks, at compile time
  (`jax.ensure_compile_time_eval`); nothing is computed otherwise, and the
  program is unchanged.
- `is_scale_invariant(x)`: whether `x` is 0, +-inf or NaN in every element,
  the values that multiplying by any positive number leaves as they are (a
  unit type lets them stand beside any quantity). Known where `x`'s value is,
  and also where it follows from the operation alone, whatever the unknown
  inputs: `direction * jnp.inf` is +-inf or NaN for any `direction`, and
  `jnp.full(n, direction * jnp.inf)` a buffer of them (`_INVARIANT_IF`); also
  through the bodies of `jit`s, `cond`s and loops (`_invariant_through_body`:
  a loop's carry that enters invariant and that its body keeps so, as a
  solver's output buffer that its loop copies). Where a rule runs a loop's or
  a `cond`'s body on Values, `_known_values_across` does the same.

The table holds each traced value weakly: an entry goes when its value does,
so it never keeps a tracer of a finished trace (a loop body, a branch) alive,
and its computations hold no tracer.
"""

import contextvars
import functools as ft
import weakref
from collections.abc import Callable
from typing import Any, cast

import jax
import numpy as np

from . import _jax_compat as jc


class _Computed:
    """A value known while tracing: how to compute it (`None` if it turns out to
    have an effect), holding no tracer."""

    __slots__ = ("compute",)

    def __init__(self, compute: Callable[[], Any]):
        self.compute = compute


class _MaybeInvariant:
    """A value not known, which the operations that made it may show to be 0,
    inf or NaN everywhere: `decide()` works it out when a rule asks."""

    __slots__ = ("decide",)

    def __init__(self, decide: Callable[[], bool]):
        self.decide = decide


_Knowledge = _Computed | _MaybeInvariant

# Whether a value is scale-invariant may rest on an assumption about a loop's
# carries, made while the loop's fixed point is sought
# (`_known_values_across.LoopCarries`): each
# try at it is a pass, and a decision made during a pass is kept in that
# pass's memo only (the innermost, where a nested loop's are sought within
# another's), never for good. (A value's computation never rests on one.)
_passes: list[dict] = []


def _decision(decide: Callable[[], Any]) -> Callable[[], Any]:
    """`decide`, cached: for good outside a pass, for the pass within one."""
    cache: list = []

    def cached() -> Any:
        if _passes:
            memo = _passes[-1]
            if cached not in memo:
                memo[cached] = decide()
            return memo[cached]
        if not cache:
            cache.append(decide())
        return cache[0]

    return cached


# id(traced plain value) -> (a weak reference to the value, what is known of it).
# The reference tells whether the id is still that value's.
_known: contextvars.ContextVar[dict[int, tuple[weakref.ref, _Knowledge]] | None] = (
    contextvars.ContextVar("quaxlike_known_values", default=None)
)


def tracking() -> bool:
    """Whether a table of known values is open."""
    return _known.get() is not None


def opening_for(leaves) -> contextvars.Token | None:
    """Open a table, where none is, when a Value among `leaves` (about to be
    lifted) is of a type with `Value.tracks_known_values`; the token that
    `closing` takes, or `None` where nothing was opened."""
    if _known.get() is not None:
        return None
    if not any(getattr(type(x), "tracks_known_values", False) for x in leaves):
        return None
    return _known.set({})


def closing(token: contextvars.Token | None) -> None:
    """Close the table `opening_for` opened, if it did."""
    if token is not None:
        _known.reset(token)


def _entry(x: Any) -> tuple[weakref.ref, _Knowledge] | None:
    known = _known.get()
    entry = None if known is None else known.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    return entry


def is_known(x: Any) -> bool:
    """Whether the plain operand `x`'s value is known while tracing.

    It is when `x` is not a tracer (a Python or NumPy number, a literal, a
    concrete array), or when it was computed from known values only while a
    Value of a type with `Value.tracks_known_values` was lifted.

    **Arguments:**

    - `x`: a plain operand (an array, a tracer or a number), never a Value.

    **Returns:**

    `True` if `known_value(x)` would give its value (unless computing it turns
    out to have an effect, such as a callback: then it gives `None`).

    !!! example

        ```python
        from quaxlike.units import m, Unitful
        from quaxlike.internal import is_known

        seen = []

        def f(x, c):
            seen.append((is_known(jnp.ones(3) * 2.0), is_known(c * 2.0)))
            return x

        jax.jit(quaxlike.quaxify(f))(Unitful(jnp.ones(3), m), 2.0)
        assert seen == [(True, False)]
        ```
    """
    if not isinstance(x, jc.Tracer):
        return True
    entry = _entry(x)
    return entry is not None and isinstance(entry[1], _Computed)


def known_value(x: Any) -> np.ndarray | None:
    """The value of the plain operand `x` if it is known while tracing.

    **Arguments:**

    - `x`: a plain operand (an array, a tracer or a number), never a Value.

    **Returns:**

    Its value as a NumPy array, or `None` if it is not known.

    !!! example

        ```python
        from quaxlike.units import m, Unitful
        from quaxlike.internal import known_value

        seen = []

        def f(x, c):
            zeros = jnp.zeros(3)  # traced under `jax.jit`, yet a constant
            seen.append((known_value(zeros), known_value(c)))
            return x + zeros  # 0 fits every unit

        out = jax.jit(quaxlike.quaxify(f))(Unitful(jnp.ones(3), m), 2.0)
        assert out.unit == m and (seen[0][0] == 0).all() and seen[0][1] is None
        ```
    """
    if not isinstance(x, jc.Tracer):
        try:
            return np.asarray(x)
        except Exception:  # an object NumPy cannot read: unknown
            return None
    entry = _entry(x)
    if entry is None or not isinstance(entry[1], _Computed):
        return None
    value = entry[1].compute()
    return None if value is None else np.asarray(value)


def is_scale_invariant(x: Any) -> bool:
    """Whether the plain operand `x` is known to be 0, +-inf or NaN in every
    element (what multiplying by a positive number leaves unchanged).

    **Arguments:**

    - `x`: a plain operand (an array, a tracer or a number), never a Value.

    **Returns:**

    `True` where its value is known and is so, or where the operations that
    made it give such values whatever their unknown inputs; else `False`.

    !!! example

        ```python
        from quaxlike.units import m, Unitful
        from quaxlike.internal import is_scale_invariant, known_value

        seen = []

        def f(x, c):
            direction = jnp.where(c > 0, 1.0, -1.0)  # not known under `jax.jit`
            infinities = jnp.full(3, direction * jnp.inf)
            seen.append((known_value(infinities), is_scale_invariant(infinities)))
            return jnp.minimum(x, infinities)  # +-inf fits every unit

        out = jax.jit(quaxlike.quaxify(f))(Unitful(jnp.ones(3), m), 1.0)
        assert out.unit == m and seen == [(None, True)]
        ```
    """
    if isinstance(x, jc.Tracer) and (entry := _entry(x)) is not None:
        if isinstance(entry[1], _MaybeInvariant):
            return entry[1].decide()
    return _invariant_value(known_value(x))


def _invariant_value(value: np.ndarray | None) -> bool:
    if value is None or value.dtype == object:
        return False
    if np.issubdtype(value.dtype, np.inexact):
        return bool(np.all((value == 0) | np.isinf(value) | np.isnan(value)))
    return bool(np.all(value == 0))


def _knowledge(x: Any) -> _Knowledge | None:
    """What is known of `x`, holding no tracer; `None` if nothing."""
    if not isinstance(x, jc.Tracer):
        return _Computed(lambda: x)
    entry = _entry(x)
    return None if entry is None else entry[1]


def _invariant_of(knowledge: _Knowledge | None) -> bool:
    if knowledge is None:
        return False
    if isinstance(knowledge, _MaybeInvariant):
        return knowledge.decide()
    value = knowledge.compute()
    return _invariant_value(None if value is None else np.asarray(value))


def _record(known: dict, out: Any, knowledge: _Knowledge) -> None:
    key = id(out)

    def forget(ref, key=key, known=known):
        if key in known and known[key][0] is ref:
            del known[key]

    known[key] = (weakref.ref(out, forget), knowledge)


def remember(primitive, inputs, params: dict, outputs) -> None:
    """Note what is known of `outputs` (what `primitive` gave for `inputs` and
    `params`, plain arrays only): how to compute them when every input is known
    (unless the operation has an effect), or how to work out whether they are
    scale-invariant. Nothing is computed or checked until a rule asks, so an
    operation costs a lookup per input. Does nothing unless a table is open."""
    known = _known.get()
    if known is None:
        return
    outs = outputs if primitive.multiple_results else [outputs]
    if not any(isinstance(o, jc.Tracer) for o in outs):
        return
    knowledge = [_knowledge(x) for x in inputs]
    if all(isinstance(k, _Computed) for k in knowledge):
        computing = [cast(_Computed, k).compute for k in knowledge]

        @ft.cache
        def evaluate() -> list | None:
            values = [compute() for compute in computing]
            if any(v is None for v in values) or jc.has_effects(primitive, values, params):
                return None
            # At once, whatever trace is current where a rule asks (inside a
            # trace's hook there is none from jax 0.11).
            eager = jc.eager_trace()
            with jax.ensure_compile_time_eval():
                if eager is None:
                    out = primitive.bind(*values, **params)
                else:
                    with jc.set_current_trace(eager):
                        out = primitive.bind(*values, **params)
            return out if primitive.multiple_results else [out]

        for i, out in enumerate(outs):
            if isinstance(out, jc.Tracer):
                _record(known, out, _Computed(lambda i=i: _nth(evaluate(), i)))
        return
    # Some input unknown: only an operation that can show its outputs to be
    # scale-invariant whatever they are, with something known of an input.
    if primitive.name not in _INVARIANT_IF and primitive.name not in _CALLS:
        return
    if all(k is None for k in knowledge):
        return
    out_avals = [jax.typeof(o) for o in outs]

    @_decision
    def decide() -> list[bool]:
        invariant = [_invariant_of(k) for k in knowledge]
        return _invariant_outputs(primitive, params, invariant, out_avals)

    for i, out in enumerate(outs):
        if isinstance(out, jc.Tracer):
            _record(known, out, _MaybeInvariant(lambda i=i: decide()[i]))


def _nth(values: list | None, i: int) -> Any:
    return None if values is None else values[i]


# Primitives whose float output is 0, +-inf or NaN everywhere when the operands
# at the positions given are (`None`: all of them; "any": any one of them),
# whatever the others: `c * (x * z) == (c * x) * z == x * z` for `c > 0`, and
# likewise for the rest. Exact in IEEE arithmetic (0 * inf is NaN, which is
# scale-invariant too).
_INVARIANT_IF: dict[str, Any] = {
    **dict.fromkeys(("mul", "div"), "any"),
    **dict.fromkeys(("add", "sub", "max", "min", "concatenate", "add_any", "pad"), None),
    **dict.fromkeys(
        (
            "neg",
            "abs",
            "broadcast_in_dim",
            "reshape",
            "squeeze",
            "expand_dims",
            "transpose",
            "rev",
            "copy",
            "copy_p",
            "convert_element_type",
            "slice",
            "dynamic_slice",
            "gather",
            "reduce_sum",
            "reduce_max",
            "reduce_min",
            "stop_gradient",
            "optimization_barrier",
        ),
        (0,),
    ),
    "select_n": "cases",
    # Writes: the array and what is written into it (not the indices).
    **dict.fromkeys(("dynamic_update_slice",), (0, 1)),
    **dict.fromkeys(("scatter", "scatter-add", "scatter_add"), (0, 2)),
}


# Calls, loops and branches whose outputs are found scale-invariant by
# following their bodies.
_CALLS = frozenset({"jit", "pjit", "closed_call", "cond", "while", "scan"})


def _invariant_outputs(primitive, params: dict, invariant: list[bool], outs) -> list[bool]:
    """For each output of `primitive` on inputs of which those marked in
    `invariant` are scale-invariant: whether it is so by the operations alone
    (`_INVARIANT_IF`, and through the bodies of calls, loops and branches)."""
    floats = [_is_float(o) for o in outs]
    if primitive.name in _CALLS:
        found = _invariant_through_body(primitive.name, params, invariant)
        if found is None or len(found) != len(outs):
            return [False] * len(outs)
        return [f and is_float for f, is_float in zip(found, floats)]
    if not all(floats):
        return [False] * len(outs)
    how = _INVARIANT_IF.get(primitive.name, False)
    if how is False:
        result = False
    elif how == "any":
        result = any(invariant)
    elif how is None:
        result = all(invariant)
    elif how == "cases":
        result = all(invariant[1:])
    else:
        result = all(invariant[i] for i in how)
    return [result] * len(outs)


def _invariant_through_body(name: str, params: dict, invariant: list[bool]) -> list[bool] | None:
    """`_invariant_outputs` of a call, `cond`, `while` or `scan` equation, by
    its body (`None` where its params are not as expected). A loop's carry is
    invariant after it where it enters so and the body keeps it so, assuming
    the same of the other carries it keeps (the greatest fixed point)."""
    try:
        if name == "cond":
            branches = params["branches"]
            per_branch = [_invariant_in_body(branch, invariant[1:]) for branch in branches]
            return [all(outs) for outs in zip(*per_branch)]
        if name == "while":
            start, count = params["cond_nconsts"], params["body_nconsts"]
            consts, init = invariant[start : start + count], invariant[start + count :]
            body = params["body_jaxpr"]
            return _loop_fixed_point(lambda c: _invariant_in_body(body, consts + c), init)[0]
        if name == "scan":
            num_consts, num_carry = jc.scan_layout(params)
            consts, rest = invariant[:num_consts], invariant[num_consts:]
            init, xs = rest[:num_carry], rest[num_carry:]
            body = params["jaxpr"]
            carry, outs = _loop_fixed_point(
                lambda c: _invariant_in_body(body, consts + c + xs), init
            )
            return carry + outs[num_carry:]  # a stack of invariant slices is invariant
        jaxpr = params.get("jaxpr", params.get("call_jaxpr"))
    except (KeyError, jc.JaxCompatibilityError):  # params of another shape: nothing found
        return None
    return None if jaxpr is None else _invariant_in_body(jaxpr, invariant)


def _loop_fixed_point(body: Callable[[list[bool]], list[bool]], init: list[bool]):
    """The carries invariant at every iteration of a loop whose body maps
    invariant carries to invariant outputs as `body` says (carries first), and
    the body's outputs with those carries."""
    assumed = list(init)
    while True:
        outs = body(assumed)
        kept = [a and o for a, o in zip(assumed, outs)]
        if kept == assumed:
            return assumed, outs
        assumed = kept


def _invariant_in_body(closed_jaxpr, invariant: list[bool]) -> list[bool]:
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    consts = getattr(closed_jaxpr, "consts", ())
    flags: dict = dict(zip(jaxpr.constvars, map(is_scale_invariant, consts)))
    flags.update(zip(jaxpr.invars, invariant))

    def flag(v) -> bool:
        return is_scale_invariant(v.val) if isinstance(v, jc.Literal) else flags.get(v, False)

    for eqn in jaxpr.eqns:
        outs = [v.aval for v in eqn.outvars]
        found = _invariant_outputs(eqn.primitive, eqn.params, list(map(flag, eqn.invars)), outs)
        flags.update(zip(eqn.outvars, found))
    return list(map(flag, jaxpr.outvars))


def _is_float(x) -> bool:
    aval = x if isinstance(x, jc.AbstractValue) else jax.typeof(x)
    return np.issubdtype(getattr(aval, "dtype", np.int32), np.inexact)


def knowledge_of(values) -> list | None:
    """What is known of each of `values` (how to compute it, how to tell whether
    it is scale-invariant, or nothing: `None`), holding no tracer; `None` when
    no table is open. Taken before a boundary where JAX hands a function fresh
    tracers for `values` (see `sharing_knowledge`)."""
    if _known.get() is None:
        return None
    return [_knowledge(x) for x in values]


def sharing_knowledge(inner, knowledge) -> None:
    """Make each of `inner` (fresh tracers for the values `knowledge_of` was
    taken from, position by position) known where its outer value was."""
    known = _known.get()
    if known is None or knowledge is None:
        return
    for x, what in zip(inner, knowledge):
        if what is not None and isinstance(x, jc.Tracer):
            _record(known, x, what)
