"""Equinox's own primitives and the helpers that define them (see README.md).

Equinox defines primitives for its libraries (lineax's `linear_solve`, the loop
helpers' `select_if_vmap` and `maybe_set`, identities that refuse a
transformation) and "filter primitives", whose operands are the array leaves of
any PyTree. None of this is public API: each name is looked up here, and a
missing one is `None` (or empty), so those primitives simply get no rules and
fall to the default, as before.

JAX's callback primitives are probed here too: a callback equation's host
function is read from its `callback` param.
"""

from typing import Any

from ._probing import _first, _module


_eqx_primitive = _module("equinox.internal._primitive")
_eqx_nontraceable = _module("equinox.internal._nontraceable")
_eqx_loop_common = _module("equinox.internal._loop.common")

# Filter primitives: `create_vprim` makes one (with a batching rule) from its
# impl, abstract evaluation, JVP and transpose rules, and keeps them here.
create_vprim: Any = _first((_eqx_primitive, "create_vprim"))

# The rules of every primitive `create_vprim` made, by primitive.
_registries = {
    name: _first((_eqx_primitive, f"_vprim_{name}_registry"))
    for name in ("impl", "abstract_eval", "jvp", "transpose")
}
# Equinox's own primitive for batching vprims (its params differ).
_batching_vprim: Any = _first((_eqx_primitive, "_vprim_p"))

FILTER_PRIMITIVES_FOUND = (
    all(isinstance(r, dict) for r in _registries.values()) and create_vprim is not None
)


def filter_primitive_rules(primitive) -> tuple[Any, Any, Any, Any] | None:
    """`(impl, abstract_eval, jvp, transpose)` of a primitive made by Equinox's
    `create_vprim` (a filter primitive such as lineax's `linear_solve`, whose
    params are `treedef`, `static` and `flatten`, or one with params of its own
    such as `maybe_set`), or `None` for any other primitive (Equinox's own
    batching primitive among them), or where this Equinox keeps them elsewhere."""
    if not FILTER_PRIMITIVES_FOUND or primitive is _batching_vprim:
        return None
    try:
        return (
            _registries["impl"][primitive],
            _registries["abstract_eval"][primitive],
            _registries["jvp"][primitive],
            _registries["transpose"][primitive],
        )
    except (KeyError, TypeError):
        return None


# Identities that refuse a transformation (differentiation, batching, tracing):
# applied to each array leaf of a Value, the Value keeps its type.
leafwise_identity_primitives: tuple[Any, ...] = tuple(
    p
    for p in (
        _first((_eqx_nontraceable, "nontraceable_p")),
        _first((_eqx_nontraceable, "nondifferentiable_backward_p")),
        _first((_eqx_nontraceable, "nonbatchable_p")),
    )
    if p is not None
)

# `select_if_vmap(pred, x, y)`: `x`, or `lax.select(pred, x, y)` once batched.
select_if_vmap_p: Any = _first((_eqx_loop_common, "select_if_vmap_p"))


def callback_host_function(eqn) -> Any:
    """The host function of a `pure_callback` or `io_callback` equation, taking and
    returning flat arrays (its `callback` param in every release tested), or
    `None` for any other equation or where this JAX keeps it elsewhere."""
    if eqn.primitive.name not in ("pure_callback", "io_callback"):
        return None
    callback = eqn.params.get("callback")
    return callback if callable(callback) else None
