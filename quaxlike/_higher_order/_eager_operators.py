"""Arithmetic operators on Values in eager code, as one cached compiled call.

Eagerly (a `quaxify`-wrapped function called outside any transformation),
`value + other` calls `jax.numpy`'s jitted `add` with a tracer among its
arguments. JAX then takes the Python path of `jax.jit` (tens of microseconds:
flattening, abstract evaluation of the arguments, binding `jit_p`) before the
built-in `jit` rule runs the body as one compiled call. For the arithmetic
operators, whose `jax.numpy` functions are all jitted with both operands as
arguments, `QuaxTracer`'s operator methods go to such a compiled call directly:
the same program (the operator applied to the Values under `quaxify`,
compiled), keyed like the `jit` rule's compiled bodies on the operands'
structure, non-array fields and avals and on the registered rules.

Only taken where nothing could tell the two apart: the current trace is the
eager `QuaxTrace` itself (not a transformation inside the quaxified function),
`jax.disable_jit` is off, the materialise policy is "allow", nothing is being
explained or checked, every Value's type allows compiling eagerly
(`Value.compile_eagerly`), the other operand is a Value lifted by the same
trace, a concrete array, a NumPy array or a Python number, and the `jit_p`
rule that dispatch would choose for the operands is the built-in one (a
user's own `jit_p` rule for their type still wins). Otherwise the operator
runs as JAX defines it.
"""

import jax
import numpy as np

from .. import _instrument, _jax_compat as jc, _policy
from .._quaxify import lifted_call
from .._rules import chosen_rule, dispatch_kind, rules_generation
from .._staging import split_arrays, StagedCall, staging_key
from .._trace import QuaxTracer
from .._values import is_value, Value
from ._jit import jit_p_values


# Binary operators whose `jax.numpy` function is `jax.jit`-wrapped with both
# operands as traced arguments (a Python number among them is a weakly typed
# scalar argument either way).
_OPERATORS = (
    "add",
    "radd",
    "sub",
    "rsub",
    "mul",
    "rmul",
    "truediv",
    "rtruediv",
    "floordiv",
    "rfloordiv",
    "mod",
    "rmod",
    "matmul",
    "rmatmul",
)

# Operands that `jax.jit` passes to `jit_p` as instances of subclasses of their
# own types, so that dispatch on `jit_p` sees them alike either way. (NumPy
# scalars are not among them: `jax.jit` turns them into NumPy arrays.)
_NUMBERS = (bool, int, float, complex, np.ndarray)

# Compiled calls, dropped all at once past this many (eager code applied to
# ever new shapes must not grow the cache without bound).
_MAX_CACHED = 4096
_calls: dict[tuple, StagedCall] = {}

# Whether this path may apply to operands of these types, which depends on
# nothing else but the registered rules: (type, type) -> bool, valid for the
# rules generation `_applies_generation`.
_applies: dict[tuple[type, type], bool] = {}
_applies_generation = -1


def _is_operand_array(leaf) -> bool:
    # An operand's array leaves, for `split_arrays`: Python numbers and NumPy
    # arrays count (they become traced arguments, as in the jitted `jax.numpy`
    # function).
    return isinstance(leaf, (jax.Array, *_NUMBERS))


def _may_apply(value: Value, other) -> bool:
    if isinstance(other, jc.Tracer) or not isinstance(other, (Value, jax.Array, *_NUMBERS)):
        return False
    operands = [value, other]
    if not all(type(v).compile_eagerly for v in operands if isinstance(v, Value)):
        return False
    kinds = tuple(map(dispatch_kind, operands))
    return chosen_rule(jc.jit_p, operands, kinds) is jit_p_values


def _compiled_operator(tracer: QuaxTracer, name: str, standard, other):
    """`standard(tracer, other)` as one cached compiled call, or `NotImplemented`
    where this path does not apply (see the module docstring)."""
    global _applies_generation
    trace = tracer._trace
    if type(other) is QuaxTracer:
        if other._trace is not trace:
            return NotImplemented
        other = other.value
    elif is_value(other):
        # A Value this trace did not lift (made inside the function): JAX's
        # operator declines it, and the Value's own operators decide.
        return NotImplemented
    if (
        jc.current_trace() is not trace
        or _policy.current_mode() != "allow"
        or _instrument.active()
        or jc.jit_disabled()
    ):
        return NotImplemented
    value = tracer.value
    generation = rules_generation()
    if generation != _applies_generation:
        _applies.clear()
        _applies_generation = generation
    types = (type(value), type(other))
    applies = _applies.get(types)
    if applies is None:
        applies = _applies[types] = _may_apply(value, other)
    if not applies:
        return NotImplemented
    arrays, positions, treedef, others = split_arrays((value, other), _is_operand_array)
    for array in arrays:
        if isinstance(array, jc.Tracer):
            return NotImplemented  # a Value holding another trace's tracer
    try:
        key = (name, *staging_key(arrays, positions, treedef, others))
        call = _calls.get(key)
    except (TypeError, OverflowError):
        # A number JAX cannot represent, or a non-array field that cannot be
        # hashed: JAX's own path raises or copes.
        return NotImplemented
    if call is None:
        if len(_calls) >= _MAX_CACHED:
            _calls.clear()
        call = _calls[key] = StagedCall(_operator_body(standard), name, positions, treedef, others)
    # Called under the parent (eager) trace, so that JAX's C++ dispatch of
    # compiled programs applies.
    with jc.set_current_trace(trace.parent_trace):
        out = call(arrays)
    return trace._wrap_output(out, jc.jit_p, jit_p_values)


def _operator_body(standard):
    def body(value, other):
        return lifted_call(standard, value, other)

    return body


def _install(name: str) -> None:
    dunder = f"__{name}__"
    standard = getattr(jc.Tracer, dunder)

    def operator(self, other):
        if self._trace.eager:
            out = _compiled_operator(self, name, standard, other)
            if out is not NotImplemented:
                return out
        return standard(self, other)

    operator.__name__ = operator.__qualname__ = dunder
    operator.__doc__ = standard.__doc__
    setattr(QuaxTracer, dunder, operator)


for _name in _OPERATORS:
    _install(_name)
