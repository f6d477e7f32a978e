"""`remat2`: `jax.checkpoint` and `eqx.filter_checkpoint`."""

import functools as ft

import jax

from .. import _jax_compat as jc
from .._quaxify import lifted_call
from .._rules import register
from ._common import AnyValue, through_array_leaves


@register(jc.remat_p)
def remat_p_values(*args: AnyValue, jaxpr, prevent_cse: bool = True, policy=None, **params):
    # `jaxpr` is an open Jaxpr: closed-over values arrive as leading operands.
    body = ft.partial(lifted_call, ft.partial(jc.eval_jaxpr, jaxpr, ()))
    checkpoint = ft.partial(jax.checkpoint, prevent_cse=prevent_cse, policy=policy)
    return through_array_leaves(checkpoint, body, args)
