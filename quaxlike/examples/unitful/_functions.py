"""Rules for whole `jax.numpy` functions whose code is not written with units in mind.

Most `jax.numpy` functions work on quantities primitive by primitive. A few guard
against dividing by zero with a plain `1` (`jnp.hypot` divides by `where(h == 0,
1, h)`; `jnp.interp` by `where(dx0, 1, dx)`, after comparing `dx` with a plain
epsilon): the plain number meets a quantity, and the primitive rules refuse it,
rightly, since they cannot know that it only stands where the quantity is zero.
Such functions get a rule of their own, as astropy has for the NumPy functions
its ufunc rules do not cover: the units of the whole call are checked, and the
function runs on the numbers.

A `jax.numpy` function reaches the rules as a `jit` whose `name` is the function's;
a call is taken to be that function only when its traced program is exactly the
one JAX traces for the function itself on the same argument types (a user's own
`jax.jit` function called `hypot` is not mistaken for `jnp.hypot`), and with the
arguments the rule expects (`jnp.interp` with `left`, `right` or `period` given
is not recognised, and goes primitive by primitive as any other function).
"""

import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp

from ._rules import _common_unit
from ._value import Unitful


def _hypot(x1: Any, x2: Any) -> list:
    # Both legs in one unit, which the hypotenuse keeps.
    (a, b), unit = _common_unit("jnp.hypot", (x1, x2), (0, 1))
    return [Unitful(jnp.hypot(a, b), unit)]


def _interp(x: Any, xp: Any, fp: Any) -> list:
    # `x` and the sample points `xp` in one unit; the result in that of `fp`.
    (x, xp), _ = _common_unit("jnp.interp", (x, xp), (0, 1))
    if isinstance(fp, Unitful):
        return [Unitful(jnp.interp(x, xp, fp.array), fp.unit)]
    return [jnp.interp(x, xp, fp)]


# The `name` of the `jit` -> (the `jax.numpy` function, its rule, the number of
# arguments the rule takes: `jnp.interp(x, xp, fp, left)` passes four).
_FUNCTIONS: dict[str, tuple[Callable, Callable, int]] = {
    "hypot": (jnp.hypot, _hypot, 2),
    "_interp": (jnp.interp, _interp, 3),
}

# jaxpr -> name -> whether the jaxpr is that function's.
_verdicts: "weakref.WeakKeyDictionary[Any, dict[str, bool]]" = weakref.WeakKeyDictionary()


def _argument_type(x: Any) -> jax.ShapeDtypeStruct:
    aval = x.aval() if isinstance(x, Unitful) else jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _is_program_of(function: Callable, jaxpr: Any, args: tuple) -> bool:
    try:
        traced = jax.make_jaxpr(function)(*map(_argument_type, args))
    except Exception:  # the function does not take these arguments
        return False
    eqns = traced.jaxpr.eqns
    if len(eqns) != 1 or eqns[0].primitive is not jax.extend.core.primitives.jit_p:
        return False
    reference = eqns[0].params["jaxpr"]
    return reference is jaxpr or str(reference) == str(jaxpr)


def known_function(name: str, jaxpr: Any, args: tuple) -> Callable | None:
    """The rule for the `jax.numpy` function whose program `jaxpr` is, if any."""
    entry = _FUNCTIONS.get(name)
    if entry is None:
        return None
    function, rule, arity = entry
    if len(args) != arity:
        return None
    verdicts = _verdicts.setdefault(jaxpr, {})
    if name not in verdicts:
        verdicts[name] = _is_program_of(function, jaxpr, args)
    return rule if verdicts[name] else None
