"""Callbacks in `cond` branches keep the other branch's types.

A branch may compute an output with a host callback (`jax.pure_callback`,
`io_callback`) where another branch returns a Value: `eqx.error_if` is
`cond(pred, <callback that raises>, lambda: x)`. A callback's result is opaque,
an array of the promised shape, so nothing about it asks for the dense array:
the `cond` rule gives it the other branch's type instead of materialising that
branch's Value. The branch is run again equation by equation with each such
callback re-issued to return the array leaves of that type; its host function
runs the original callback (whose error, if it raises, is the one raised). A
callback that *returns* there has computed a dense array that cannot be made a
Value, so the re-issued callback raises `CallbackResultError` at run time: a
result is never guessed.
"""

from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from .. import _jax_compat as jc
from .._diagnostics import QuaxlikeError
from .._values import Value


class CallbackResultError(QuaxlikeError):
    """A host callback in a `cond` branch returned an array where another branch
    gives a Value, so that its result would have to be that Value's type."""


_CALLBACK_RETURNED = (
    "A host callback (`{callback}`) in a branch of a `cond` returned an array at "
    "output {index} of the `cond`, where another branch returns a {type_name}. "
    "quaxlike gives a callback's result there the other branch's type, which it can "
    "do only for a callback that raises instead of returning (as `eqx.error_if`'s "
    "does): a dense array cannot be turned into a {type_name}. Return the same type "
    "from every branch, e.g. materialise the {type_name} in the other branch."
)


def callback_outputs(closed_jaxpr) -> dict[int, Any]:
    """`{output index: equation}` for the outputs of a branch that a host
    callback equation computes directly."""
    producers = {}
    for eqn in closed_jaxpr.jaxpr.eqns:
        if jc.callback_host_function(eqn) is not None:
            for var in eqn.outvars:
                producers[var] = eqn
    found = {}
    for index, var in enumerate(closed_jaxpr.jaxpr.outvars):
        if isinstance(var, jc.Literal):
            continue
        eqn = producers.get(var)
        if eqn is not None:
            found[index] = eqn
    return found


def abstract_template(value: Value) -> Value:
    """`value` with its array leaves replaced by `jax.ShapeDtypeStruct`s (what a
    callback must return to stand for one)."""
    return jtu.tree_map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) if eqx.is_array(leaf) else leaf,
        value,
    )


def run_retyped(closed_jaxpr, templates: dict[int, Value], *args) -> list:
    """Run the branch `closed_jaxpr` on `args` (under the current trace), with the
    callbacks computing the outputs in `templates` returning Values of the
    template's type there."""
    jaxpr = closed_jaxpr.jaxpr
    wanted = {jaxpr.outvars[index]: (index, t) for index, t in templates.items()}
    env: dict = {}

    def read(var):
        return var.val if isinstance(var, jc.Literal) else env[var]

    for var, const in zip(jaxpr.constvars, closed_jaxpr.consts):
        env[var] = const
    for var, arg in zip(jaxpr.invars, args):
        env[var] = arg
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if any(v in wanted for v in eqn.outvars):
            outs = _retyped_callback(eqn, [wanted.get(v) for v in eqn.outvars], invals)
        else:
            subfuns, params = jc.bind_params(eqn.primitive, eqn.params)
            outs = eqn.primitive.bind(*subfuns, *invals, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for var, out in zip(eqn.outvars, outs):
            env[var] = out
    return [read(v) for v in jaxpr.outvars]


def _retyped_callback(eqn, wanted: list, invals: list) -> list:
    host = jc.callback_host_function(eqn)
    name = getattr(host, "__name__", None) or getattr(
        getattr(host, "callback_func", None), "__name__", "callback"
    )
    shapes: list = []
    for var, item in zip(eqn.outvars, wanted):
        if item is None:
            shapes.append(jax.ShapeDtypeStruct(var.aval.shape, var.aval.dtype))
        else:
            shapes.extend(leaf for leaf in jtu.tree_leaves(item[1]) if _is_struct(leaf))
    first = next(item for item in wanted if item is not None)
    message = _CALLBACK_RETURNED.format(
        callback=name, index=first[0], type_name=type(first[1]).__name__
    )

    def on_host(*arrays):
        host(*arrays)  # the original callback: its own error, if it raises
        raise CallbackResultError(message)

    if eqn.primitive.name == "io_callback":
        from jax.experimental import io_callback

        flat = io_callback(on_host, shapes, *invals, ordered=eqn.params.get("ordered", False))
    else:
        options = {}
        if "vmap_method" in eqn.params:
            options["vmap_method"] = eqn.params["vmap_method"]
        flat = jax.pure_callback(on_host, shapes, *invals, **options)
    flat = iter(flat)
    outs = []
    for item in wanted:
        if item is None:
            outs.append(next(flat))
        else:
            leaves, treedef = jtu.tree_flatten(item[1])
            outs.append(
                jtu.tree_unflatten(
                    treedef, [next(flat) if _is_struct(leaf) else leaf for leaf in leaves]
                )
            )
    return outs


def _is_struct(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)
