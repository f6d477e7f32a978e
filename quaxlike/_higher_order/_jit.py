"""`jit` (a `jax.jit` inside the quaxified function) and `closed_call`."""

import jax

from .. import _jax_compat as jc
from .._quaxify import quaxify
from .._rules import register
from ._common import AnyValue, through_array_leaves


@register(jc.jit_p)
def jit_p_values(*args: AnyValue, jaxpr, inline: bool = False, name: str = "jit", **params):
    body = quaxify(jc.jaxpr_as_fun(jaxpr))
    if inline:
        return body(*args)

    def jit_named(fn):
        fn.__name__ = name
        fn.__qualname__ = name
        return jax.jit(fn)

    # Keep the jit boundary: the Values' array leaves become the jit's arguments.
    return through_array_leaves(jit_named, body, args)


@register(jc.closed_call_p)
def closed_call_p_values(*args: AnyValue, call_jaxpr, **params):
    return quaxify(jc.jaxpr_as_fun(call_jaxpr))(*args)
