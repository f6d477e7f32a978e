"""Eager concreteness: what a `QuaxTracer` answers when JAX asks for its value.

Some JAX functions need the value of an array, not only its type:
`jnp.trim_zeros`, `jnp.unique`, `jnp.bincount` without `length`, `x.item()`,
`x[mask]` with a boolean mask. JAX asks through `core.concrete_or_error` (or
`core.is_concrete`), which asks a tracer's `to_concrete_value()`; JAX's own
JVP tracer answers with its primal's value. A QuaxTracer answers the same way
with the array its Value stands for, where that array is known (eagerly, no
enclosing `jit`): the call then runs as plain JAX runs it on that array. Under
`jit` the answer is `None` and JAX raises its own error, as for a plain array.

A Value is concrete when all of the following hold:

1. its type opts in (`Value.concrete_eagerly`; `DenseArrayValue` does). JAX
   also asks in passing (dtype promotion asks every operand whether it is
   concrete, to choose between two equivalent paths), and answering means
   materialising: a sparse or low-rank type would be made dense, at full
   cost, on every ordinary operation;
2. every array leaf is concrete (a concrete array, or a tracer that is
   concrete in turn). A tracer of `jit` is not: the answer is `None` at once,
   without running anything;
3. materialising it is allowed: the "allow" `materialise_policy`, or a type
   with `warn_on_materialise = False`;
4. `materialise()`, run under the trace around the quaxified call as the
   default rule runs it, succeeds (a type that refuses to materialise stays
   abstract: JAX then raises its own error, as before) and gives a concrete
   array.
"""

from typing import Any

import jax.tree_util as jtu

from . import _jax_compat as jc, _policy
from ._values import materialise_value, Value


def concrete_value(parent_trace, value: Value, aval) -> Any:
    """The concrete array `value` stands for, or `None` if it is not concrete
    (see the module docstring).

    **Arguments:**

    - `parent_trace`: the trace around the QuaxTrace that holds `value`.
    - `value`: the Value behind the tracer JAX asked.
    - `aval`: the tracer's abstract value (`value.aval()`, checked).

    **Returns:**

    The concrete array, or `None`.
    """
    cls = type(value)
    if not cls.concrete_eagerly:
        return None
    for leaf in jtu.tree_leaves(value):
        if isinstance(leaf, jc.Tracer) and jc.to_concrete_value(leaf) is None:
            return None
    if _policy.current_mode() != "allow" and cls.warn_on_materialise:
        return None
    try:
        with jc.set_current_trace(parent_trace):
            dense = materialise_value(value, aval=aval)
    except Exception:  # a type that refuses to materialise is not concrete
        return None
    return jc.to_concrete_value(dense)
