"""`jit` (a `jax.jit` inside the quaxified function) and `closed_call`."""

import functools as ft
import weakref

import equinox as eqx
import jax
import jax.tree_util as jtu

from .. import _jax_compat as jc
from .._quaxify import lifted_call
from .._rules import register
from .._trace import inlines
from ._common import AnyValue, through_array_leaves


# One `jax.jit`-wrapped body per (jaxpr, name, non-array parts of the arguments),
# so that calling a jitted function on Values again (an eager `qnp.sin(value)` in
# a loop) hits JAX's compilation cache instead of compiling a fresh function.
# JAX hands out the same jaxpr object for the same function and argument types.
_bodies: "weakref.WeakKeyDictionary[jc.ClosedJaxpr, dict]" = weakref.WeakKeyDictionary()


class _CachedBody:
    def __init__(self, jaxpr, name: str, static):
        self.out_static = None
        # A weak reference: the cache entry must not keep its own key alive. `run`
        # is only traced while the jaxpr is in use.
        jaxpr_ref = weakref.ref(jaxpr)

        def run(dynamic_args):
            body = ft.partial(lifted_call, jc.jaxpr_as_fun(jaxpr_ref()))
            out = body(*eqx.combine(dynamic_args, static))
            dynamic_out, self.out_static = eqx.partition(out, eqx.is_array)
            return dynamic_out

        run.__name__ = run.__qualname__ = name
        self.jitted = jax.jit(run)

    def __call__(self, args):
        dynamic, _ = eqx.partition(list(args), eqx.is_array)
        dynamic_out = self.jitted(dynamic)
        return eqx.combine(dynamic_out, self.out_static)


def _cached_body(jaxpr, name: str, args) -> "_CachedBody | None":
    _, static = eqx.partition(list(args), eqx.is_array)
    leaves, treedef = jtu.tree_flatten(static)
    key = (name, treedef, tuple(leaves))
    try:
        hash(key)
    except TypeError:  # unhashable non-array leaves: no caching
        return None
    per_jaxpr = _bodies.setdefault(jaxpr, {})
    cached = per_jaxpr.get(key)
    if cached is None:
        cached = per_jaxpr[key] = _CachedBody(jaxpr, name, static)
    return cached


@register(jc.jit_p)
@inlines(jc.jit_p, lambda params: params["jaxpr"] if params.get("inline") else None)
def jit_p_values(*args: AnyValue, jaxpr, inline: bool = False, name: str = "jit", **params):
    if inline:
        return lifted_call(jc.jaxpr_as_fun(jaxpr), *args)
    # Keep the jit boundary: the Values' array leaves become the jit's arguments.
    cached = _cached_body(jaxpr, name, args)
    if cached is not None:
        return cached(args)

    def jit_named(fn):
        fn.__name__ = fn.__qualname__ = name
        return jax.jit(fn)

    return through_array_leaves(jit_named, ft.partial(lifted_call, jc.jaxpr_as_fun(jaxpr)), args)


@register(jc.closed_call_p)
@inlines(jc.closed_call_p, lambda params: params["call_jaxpr"])
def closed_call_p_values(*args: AnyValue, call_jaxpr, **params):
    return lifted_call(jc.jaxpr_as_fun(call_jaxpr), *args)
