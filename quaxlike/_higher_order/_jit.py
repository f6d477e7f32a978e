"""`jit` (a `jax.jit` inside the quaxified function) and `closed_call`."""

import functools as ft
import weakref

import jax

from .. import _jax_compat as jc, _policy
from .._quaxify import lifted_call
from .._rules import register
from .._staging import split_arrays, StagedCall, staging_key
from .._trace import inlines
from .._values import Value
from ._common import AnyValue, through_array_leaves


# One `jax.jit`-wrapped body per (jaxpr, name, structure and non-array leaves of
# the arguments, avals of their array leaves), so that calling a jitted function
# on Values again (an eager `qnp.sin(value)` in a loop, or any `jax.numpy`
# function eagerly) goes through JAX's C++ dispatch of one compiled program.
# JAX hands out the same jaxpr object for the same function and argument types.
_bodies: "weakref.WeakKeyDictionary[jc.ClosedJaxpr, dict]" = weakref.WeakKeyDictionary()


def _cached_body(jaxpr, name: str, args) -> "tuple[StagedCall, list] | None":
    # A compiled body runs the rules as they were when it was traced, so its key
    # names the rules (their generation) and checked mode; and under a "warn" or
    # "error" materialise policy every call is traced, so that every fallback
    # is reported. Types may opt out (`Value.compile_eagerly`).
    if _policy.current_mode() != "allow" or not all(
        type(a).compile_eagerly for a in args if isinstance(a, Value)
    ):
        return None
    arrays, positions, treedef, others = split_arrays(list(args))
    key = (name, *staging_key(arrays, positions, treedef, others))
    try:
        hash(key)
    except TypeError:  # unhashable non-array leaves: no caching
        return None
    per_jaxpr = _bodies.setdefault(jaxpr, {})
    cached = per_jaxpr.get(key)
    if cached is None:
        cached = per_jaxpr[key] = StagedCall(
            _body_of(weakref.ref(jaxpr)), name, positions, treedef, others
        )
    return cached, arrays


def _body_of(jaxpr_ref):
    # A weak reference: the cache entry must not keep its own key alive. The
    # body is only traced while the jaxpr is in use.
    def body(*args):
        return lifted_call(jc.jaxpr_as_fun(jaxpr_ref()), *args)

    return body


@register(jc.jit_p)
@inlines(jc.jit_p, lambda params: params["jaxpr"] if params.get("inline") else None)
def jit_p_values(*args: AnyValue, jaxpr, inline: bool = False, name: str = "jit", **params):
    if not inline or jc.is_eager(jc.current_trace()):
        # Keep the jit boundary (or, for an inline jit run eagerly, run it as one
        # compiled call): the Values' array leaves become the jit's arguments.
        cached = _cached_body(jaxpr, name, args)
        if cached is not None:
            body, arrays = cached
            return body(arrays)
    if inline:
        return lifted_call(jc.jaxpr_as_fun(jaxpr), *args)

    def jit_named(fn):
        fn.__name__ = fn.__qualname__ = name
        return jax.jit(fn)

    return through_array_leaves(jit_named, ft.partial(lifted_call, jc.jaxpr_as_fun(jaxpr)), args)


@register(jc.closed_call_p)
@inlines(jc.closed_call_p, lambda params: params["call_jaxpr"])
def closed_call_p_values(*args: AnyValue, call_jaxpr, **params):
    return lifted_call(jc.jaxpr_as_fun(call_jaxpr), *args)
