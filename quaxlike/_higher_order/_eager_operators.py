"""Arithmetic operators on Values in eager code, without JAX's Python `jit` path.

Eagerly, `value + other` calls `jax.numpy`'s jitted `add` with a tracer among
its arguments, so JAX takes the Python path of `jax.jit` before the trace sees
the call; where the call only materialises the Values, the `jit` rule's
shortcut then binds it on the dense arrays (see `_jit`). For the arithmetic
operators, `QuaxTracer`'s operator methods take that step directly:
materialise, and apply the operator to the dense arrays through JAX's own fast
path (benchmarks/README.md, item 13).

Only where nothing can tell the two apart: the current trace is the eager
`QuaxTrace` itself, `jax.disable_jit` is off, `shortcuts_apply`, the other
operand is a Value of the same trace, a concrete or NumPy array or a Python
number, the `jit` rule is the built-in one, and the operator's program on
operands of these kinds and avals only materialises the Values. Otherwise the
operator runs as JAX defines it.
"""

import operator
from typing import cast

import jax
import numpy as np

from .. import _jax_compat as jc
from .._rules import on_rules_changed, plan_for, rules_generation, rules_lock
from .._staging import shortcuts_apply
from .._sub_programs import only_materialises
from .._trace import QuaxTracer
from .._values import is_value, materialise_value, Value


# Binary operators whose `jax.numpy` function is `jax.jit`-wrapped with both
# operands as traced arguments, as functions of (this operand, the other).
_OPERATORS = {
    name: getattr(operator, name)
    for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "matmul")
}
# Other operands the shortcut takes: concrete arrays, NumPy arrays, numbers.
_OPERANDS = (jax.Array, bool, int, float, complex, np.ndarray)

# (operator name, operand kinds, operand avals) -> [whether the shortcut applies,
# whether it was used since the last eviction sweep]; at most `_MAX_VERDICTS`
# (the bound of JAX's own caches), emptied when a rule is registered
# (docs/caches.md). Eviction gives a second chance to entries used since the
# last sweep (the "clock" approximation of least recently used): a hit only
# sets a flag, because moving the entry would hash its key again, which costs
# as much as the lookup itself (its avals and shardings).
_applies: dict[tuple, list[bool]] = {}
_MAX_VERDICTS = 4096
on_rules_changed(_applies.clear)


def _remember(key: tuple, applies: bool, generation: int) -> None:
    with rules_lock:
        if generation != rules_generation():
            return  # a rule was registered meanwhile: the verdict may predate it
        while len(_applies) >= _MAX_VERDICTS:
            _evict_one()
        _applies[key] = [applies, False]


def _evict_one() -> None:
    """Drop the oldest entry not used since the last sweep, moving the used ones
    it passes to the back (each at most once per call, so this ends)."""
    for _ in range(len(_applies) + 1):
        try:
            key = next(iter(_applies))
            entry = _applies.pop(key)
        except (StopIteration, RuntimeError, KeyError):
            return
        if not entry[1]:
            return
        entry[1] = False
        _applies[key] = entry


def _operand_key(x, tracer_aval) -> tuple:
    if tracer_aval is not None:
        return type(x), tracer_aval
    if isinstance(x, jax.Array):
        return type(x), jc.aval_key(x)
    if isinstance(x, np.ndarray):
        return type(x), x.shape, x.dtype
    return (type(x),)  # a Python number: a weakly typed scalar


def _applies_to(eager_trace, function, value: Value, aval, other, other_aval) -> bool | None:
    """Whether the shortcut applies to operands like these, or `None` where
    tracing the operator failed for these operands alone (a Python int too
    large for any dtype): not a verdict for every operand with the same key."""
    if plan_for(jc.jit_p, [value, other]).sub_program is None:
        return False  # a rule of the user's own for `jit_p` on these types
    shape_of = lambda x, a: (  # noqa: E731
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) if a is not None else x
    )
    try:
        closed = jax.make_jaxpr(function)(shape_of(value, aval), shape_of(other, other_aval))
    except Exception:  # a number JAX cannot represent, operands that do not fit
        return None
    return only_materialises(closed, [value, other], eager_trace)


def _dense_operator(tracer: QuaxTracer, name: str, function, other):
    """`function(tracer, other)` computed on the dense arrays, or
    `NotImplemented` where this shortcut does not apply (see above)."""
    trace = tracer._trace
    other_aval = None
    if type(other) is QuaxTracer:
        if other._trace is not trace:
            return NotImplemented
        other_aval = other.aval
        other = other.value
    elif is_value(other) or isinstance(other, jc.Tracer) or not isinstance(other, _OPERANDS):
        return NotImplemented
    if jc.current_trace() is not trace or not shortcuts_apply(trace.observing) or jc.jit_disabled():
        return NotImplemented
    value = tracer.value
    try:
        key = (name, _operand_key(value, tracer.aval), _operand_key(other, other_aval))
        entry = _applies.get(key)
    except TypeError:  # an unhashable aval or sharding
        return NotImplemented
    if entry is not None:
        entry[1] = True  # used: kept at the next eviction sweep
        applies = entry[0]
    else:
        generation = rules_generation()
        applies = _applies_to(trace.parent_trace, function, value, tracer.aval, other, other_aval)
        if applies is None:
            return NotImplemented
        _remember(key, applies, generation)
    if not applies:
        return NotImplemented
    with jc.set_current_trace(trace.parent_trace):
        # Materialised plainly: `shortcuts_apply` means the "allow" policy and
        # nothing recording, so there is nothing to warn about or note.
        try:
            dense = materialise_value(value, jc.jit_p, aval=tracer.aval)
            if other_aval is not None:
                other = materialise_value(cast(Value, other), jc.jit_p, aval=other_aval)
        except Exception:
            return NotImplemented  # the ordinary path names the operation that needed it
        return function(dense, other)


def _install(name: str, function, reflected: bool) -> None:
    dunder = f"__r{name}__" if reflected else f"__{name}__"
    standard = getattr(jc.Tracer, dunder)
    apply = (lambda a, b: function(b, a)) if reflected else function

    def method(self, other):
        if self._trace.eager:
            out = _dense_operator(self, dunder, apply, other)
            if out is not NotImplemented:
                return out
        return standard(self, other)

    method.__name__ = method.__qualname__ = dunder
    method.__doc__ = standard.__doc__
    setattr(QuaxTracer, dunder, method)


for _name, _function in _OPERATORS.items():
    _install(_name, _function, reflected=False)
    _install(_name, _function, reflected=True)
