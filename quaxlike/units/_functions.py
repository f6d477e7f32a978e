"""Rules for whole `jax.numpy` functions whose code is not written with units in mind.

Most `jax.numpy` functions work on quantities primitive by primitive. A few guard
against dividing by zero with a plain `1` (`jnp.hypot` divides by `where(h == 0,
1, h)`; `jnp.interp` by `where(dx0, 1, dx)`, after comparing `dx` with a plain
epsilon): the plain number meets a quantity, and the primitive rules refuse it,
rightly, since they cannot know that it only stands where the quantity is zero.
Others work on the bits of floats (`copysign`, `signbit`, `ldexp`), or go through
`lu`, whose packed factors one unit cannot describe (`jnp.linalg.det`, `inv`,
`solve`). Such functions get a rule of their own, as astropy has for the NumPy
functions its ufunc rules do not cover: the units of the whole call are checked,
and the function runs on the numbers.

A `jax.numpy` function reaches the rules as a `jit` whose `name` is the function's;
a call is taken to be that function only when its traced program is exactly the
one JAX traces for the function itself on the same argument types (a user's own
`jax.jit` function called `hypot` is not mistaken for `jnp.hypot`), and with the
arguments the rule expects (`jnp.interp` with `left`, `right` or `period` given
is not recognised, and goes primitive by primitive as any other function).

The `jit` rule (`jit_p_unitful`, at the end) is where both meet: a recognised
function goes to its rule here, and any other `jit` runs its body with the
values known while tracing tracked (`Unitful.tracks_known_values`; see
`_constants`).
"""

import functools as ft
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
from jaxtyping import ArrayLike

import quaxlike
from quaxlike.internal import is_known

from ._constants import reading_constants_in_unit
from ._operands import _array_of, _common_unit, _unit_of
from ._value import UnitError, Unitful


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


def _nan_to_num(x: Any) -> list:
    # NaN becomes 0 and +-inf the largest finite numbers, all in `x`'s unit.
    return [Unitful(jnp.nan_to_num(x.array), x.unit)]


def _copysign(x1: Any, x2: Any) -> list:
    # The magnitude of `x1` (and its unit) with the sign of `x2` (any unit).
    out = jnp.copysign(_array_of(x1), _array_of(x2))
    return [Unitful(out, x1.unit) if isinstance(x1, Unitful) else out]


def _signbit(x: Any) -> list:
    return [jnp.signbit(x.array)]


def _ldexp(x: Any, exponent: Any) -> list:
    # `x * 2**exponent`: the exponent is a plain integer.
    if isinstance(exponent, Unitful):
        raise UnitError(
            f"`jnp.ldexp` needs plain integer exponents, but got a quantity in {exponent.unit}."
        )
    return [Unitful(jnp.ldexp(x.array, exponent), x.unit)]


def _det(x: Any) -> list:
    # The product of `n` eigenvalues: the unit to the power `n`.
    return [Unitful(jnp.linalg.det(x.array), x.unit ** x.shape[-1])]


def _inv(x: Any) -> list:
    return [Unitful(jnp.linalg.inv(x.array), x.unit**-1)]


def _solve(a: Any, b: Any) -> list:
    # `a x = b`: `x` in the unit of `b` over that of `a`.
    out = jnp.linalg.solve(_array_of(a), _array_of(b))
    return [Unitful(out, _unit_of(b) / _unit_of(a))]


def _lstsq(a: Any, b: Any) -> list:
    # `x` minimising `|a x - b|`: `x` in b's unit over a's, the residuals in b's
    # squared, the singular values in a's; the rank is a plain number.
    x, residuals, rank, singular = jnp.linalg.lstsq(_array_of(a), _array_of(b))
    a_unit, b_unit = _unit_of(a), _unit_of(b)
    return [
        Unitful(x, b_unit / a_unit),
        Unitful(residuals, b_unit**2),
        rank,
        Unitful(singular, a_unit),
    ]


def _searchsorted(side: str) -> Callable:
    def rule(a: Any, v: Any) -> list:
        # Where `v` would go among the sorted `a`: both in one unit; plain indices.
        (a, v), _ = _common_unit("jnp.searchsorted", (a, v), (0, 1))
        return [jnp.searchsorted(a, v, side=side)]

    return rule


# The `name` of the `jit` -> the variants it may be: (the `jax.numpy` function,
# its rule, the number of arguments the rule takes). `jnp.interp(x, xp, fp,
# left)` passes four arguments; `jnp.searchsorted(..., side="right")` (which
# `jnp.digitize` calls) traces another program than `side="left"`.
_FUNCTIONS: dict[str, list[tuple[Callable, Callable, int]]] = {
    "hypot": [(jnp.hypot, _hypot, 2)],
    "_interp": [(jnp.interp, _interp, 3)],
    "nan_to_num": [(jnp.nan_to_num, _nan_to_num, 1)],
    "copysign": [(jnp.copysign, _copysign, 2)],
    "signbit": [(jnp.signbit, _signbit, 1)],
    "ldexp": [(jnp.ldexp, _ldexp, 2)],
    "det": [(jnp.linalg.det, _det, 1)],
    "inv": [(jnp.linalg.inv, _inv, 1)],
    "solve": [(jnp.linalg.solve, _solve, 2)],
    "_lstsq": [(jnp.linalg.lstsq, _lstsq, 2)],
    "searchsorted": [
        (ft.partial(jnp.searchsorted, side=side), _searchsorted(side), 2)
        for side in ("left", "right")
    ],
}

# jaxpr -> name -> the index of the variant the jaxpr is (None: none of them).
_verdicts: "weakref.WeakKeyDictionary[Any, dict[str, int | None]]" = weakref.WeakKeyDictionary()


def _argument_type(x: Any) -> jax.ShapeDtypeStruct:
    aval = x.aval() if isinstance(x, Unitful) else jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _reference_program(function: Callable, args: tuple) -> Any:
    """The sub-program of the `jit` that `function` applied to arguments like
    `args` is, or `None`."""
    try:
        traced = jax.make_jaxpr(function)(*map(_argument_type, args))
    except Exception:  # the function does not take these arguments
        return None
    eqns = traced.jaxpr.eqns
    if len(eqns) != 1 or eqns[0].primitive is not jax.extend.core.primitives.jit_p:
        return None
    return eqns[0].params["jaxpr"]


def _which_variant(variants, jaxpr: Any, args: tuple) -> int | None:
    """The index of the variant whose program `jaxpr` is, or `None`. The same
    program does not always print the same from one trace to the next (jax
    0.12 outlines sub-programs, and lowers some operations only for traces such
    as quaxify's), so a program is identified by the source function JAX
    recorded for it, and variants of one function by the primitives they share
    with it."""
    candidates = []
    for i, (function, _, arity) in enumerate(variants):
        reference = None if len(args) != arity else _reference_program(function, args)
        if reference is None:
            continue
        if reference is jaxpr or str(reference) == str(jaxpr):
            return i
        source = _source(reference)
        if source is not None and source == _source(jaxpr):
            candidates.append((i, _primitives(reference)))
    if len(candidates) <= 1:
        return candidates[0][0] if candidates else None
    actual = _primitives(jaxpr)
    scores = [(len(p & actual) - len(p - actual), i) for i, p in candidates]
    best = max(scores)
    return best[1] if [s for s, _ in scores].count(best[0]) == 1 else None


def _source(jaxpr: Any) -> str | None:
    """Where the function traced to `jaxpr` is defined, as JAX records it."""
    debug_info = getattr(getattr(jaxpr, "jaxpr", jaxpr), "debug_info", None)
    return getattr(debug_info, "func_src_info", None)


def _primitives(jaxpr: Any) -> frozenset:
    """The names of the primitives `jaxpr` binds, in it and its sub-programs."""
    names, pending = set(), [getattr(jaxpr, "jaxpr", jaxpr)]
    while pending:
        current = pending.pop()
        for eqn in current.eqns:
            names.add(eqn.primitive.name)
            pending.extend(
                getattr(j, "jaxpr", j) for j in quaxlike.internal.jaxprs_in_params(eqn.params)
            )
    return frozenset(names)


def known_function(name: str, jaxpr: Any, args: tuple) -> Callable | None:
    """The rule for the `jax.numpy` function whose program `jaxpr` is, if any."""
    variants = _FUNCTIONS.get(name)
    if variants is None:
        return None
    verdicts = _verdicts.setdefault(jaxpr, {})
    if name not in verdicts:
        verdicts[name] = _which_variant(variants, jaxpr, args)
    index = verdicts[name]
    return None if index is None else variants[index][1]


# --- the rule for a `jit` ------------------------------------------------------


def _evaluate(jaxpr, *args):
    return jax.extend.core.jaxpr_as_fun(jaxpr)(*args)


# `_evaluate(jaxpr, *args)` with the Values among `args` lifted (one wrapper for
# every call: a `jaxpr` is a leaf, never lifted).
_evaluate_lifted = quaxlike.quaxify(_evaluate)


@quaxlike.register(jax.extend.core.primitives.jit_p)
def jit_p_unitful(*args: Unitful | ArrayLike, jaxpr, inline=False, name="jit", **params):
    function_rule = known_function(name, jaxpr, args)
    if function_rule is not None:
        return function_rule(*args)
    # `inline` is a bool up to jax 0.10 and a `jax.Inline` from 0.11.
    inlined = quaxlike.internal.jit_inlines_at_trace(inline)
    if inlined or any(is_known(a) for a in args if not isinstance(a, Unitful)):
        # Run the body's equations here, in the enclosing program (as the
        # built-in rule does for an inline `jit`), so that what is known outside
        # stays known inside: `jnp.var(x)` hands its `ddof` to its body as a
        # literal, `jnp.where(c, x, jnp.nan)` its NaN. A `jit` is transparent:
        # the values computed are the same either way.
        return _evaluate_lifted(jaxpr, *args)
    # Nothing known among the plain arguments: keep the `jit` boundary, as the
    # built-in rule does. A `Unitful` is a PyTree whose unit is static, so it
    # crosses it as it is. (Inside, every argument is a new tracer, known to
    # nobody, so the body traces the same way every time JAX's cache is hit.)
    return _jitted_body(jaxpr, name)(*args)


# One `jax.jit`-wrapped body per (jaxpr, name), so that JAX's own cache sees the
# same function when the same jitted function is called again. The body holds
# the jaxpr weakly: a cache entry must not keep its key alive.
_jitted_bodies: "weakref.WeakKeyDictionary[Any, dict[tuple[str, bool], Callable]]" = (
    weakref.WeakKeyDictionary()
)


def _jitted_body(jaxpr, name: str) -> Callable:
    # What the body's rules decide depends on `plain_constants_take_units`: a
    # body traced inside it is not reused outside it, nor the other way round.
    per_name = _jitted_bodies.setdefault(jaxpr, {})
    key = (name, reading_constants_in_unit())
    if key not in per_name:
        jaxpr_ref = weakref.ref(jaxpr)

        def body(*args):
            return _evaluate_lifted(jaxpr_ref(), *args)

        body.__name__ = body.__qualname__ = name
        per_name[key] = jax.jit(body)
    return per_name[key]
