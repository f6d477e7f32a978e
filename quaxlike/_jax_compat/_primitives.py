"""Primitives of higher-order operations, found wherever this JAX keeps them,
and their params whose form changed between releases (see README.md)."""

import operator
from typing import Any

import jax
from jax import lax

from ._probing import (
    _ad_checkpoint,
    _api,
    _core,
    _custom_derivatives,
    _first,
    _module,
    _pjit,
    _prims,
    _shard_map,
    missing,
    switch_off,
)
from ._trace_api import ClosedJaxpr, Primitive


# --- primitives of higher-order operations -----------------------------------


def _stand_in_primitive(name: str) -> Any:
    """An inert primitive for one this JAX lacks: nothing binds it, so its
    rules never run."""
    if Primitive is None:
        return None
    return Primitive(f"quaxlike_missing_{name}")


def _primitive(name: str, *candidates: tuple[Any, str]) -> Any:
    found = _first((_prims, f"{name}_p"), *candidates)
    return found if found is not None else _stand_in_primitive(name)


jit_p = _primitive("jit", (_pjit, "jit_p"), (_pjit, "pjit_p"))
closed_call_p = _primitive("closed_call", (_core, "closed_call_p"))
call_p = _primitive("call", (_core, "call_p"))
cond_p: Any = _first((lax, "cond_p")) or _stand_in_primitive("cond")
while_p: Any = _first((lax, "while_p")) or _stand_in_primitive("while")
scan_p: Any = _first((lax, "scan_p")) or _stand_in_primitive("scan")
remat_p = _primitive("remat", (_ad_checkpoint, "remat_p"))
custom_jvp_call_p = _primitive("custom_jvp_call", (_custom_derivatives, "custom_jvp_call_p"))
custom_vjp_call_p = _primitive("custom_vjp_call", (_custom_derivatives, "custom_vjp_call_p"))
shard_map_p: Any = _first((_shard_map, "shard_map_p")) or _stand_in_primitive("shard_map")
pvary_p: Any = _first((_core, "pvary_p")) or _stand_in_primitive("pvary")
sharding_constraint_p: Any = _first((_pjit, "sharding_constraint_p")) or _stand_in_primitive(
    "sharding_constraint"
)
# `jax.sharding.reshard`: moving an array to another sharding, where mesh axes are
# `Explicit` (its param `dst_sharding` in every release tested).
reshard_p: Any = _first((_pjit, "reshard_p")) or _stand_in_primitive("reshard")


def custom_call_primal_jaxpr(params) -> Any:
    """The primal function of a `custom_jvp_call` or `custom_vjp_call` equation
    (its `call_jaxpr` param, a `ClosedJaxpr` in every release tested), or
    `None` where the params hold none (the trace hooks' params, or a release
    that names it otherwise)."""
    jaxpr = params.get("call_jaxpr")
    return jaxpr if ClosedJaxpr is not None and isinstance(jaxpr, ClosedJaxpr) else None


_Inline = _first((jax, "Inline"), (_api, "Inline"))
_INLINE_EARLY = getattr(_Inline, "JAX_EARLY", None)


def jit_inlines_at_trace(inline) -> bool:
    """Whether a `jit` equation with this `inline` param is inlined where it is
    traced, as `jax.numpy`'s functions are.

    Up to jax 0.10 the param is a bool; from 0.11 it is a `jax.Inline`, and only
    `Inline.JAX_EARLY` inlines at trace time (`inline=True` given to `jax.jit`
    becomes `JAX_LATE`, inlined when lowering). A rule for `jit_p` should ask
    this rather than test the param's truth (every `jax.Inline` is truthy).

    **Arguments:**

    - `inline`: the `inline` param of a `jit_p` equation.

    **Returns:**

    `True` if JAX inlines the call where it is traced.

    !!! example

        ```python
        jaxpr = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x))(1.0)
        (eqn,) = jaxpr.eqns
        assert not quaxlike.internal.jit_inlines_at_trace(eqn.params["inline"])
        ```
    """
    if inline is True or inline is False:
        return inline
    return _INLINE_EARLY is not None and inline is _INLINE_EARLY


_UnspecifiedValue = _first(
    (_module("jax._src.named_sharding"), "UnspecifiedValue"),
    (_module("jax._src.sharding_impls"), "UnspecifiedValue"),
)
# Every param of `jit_p` in the releases tested (0.7.2 to 0.12).
_JIT_PARAMS = frozenset(
    {
        "jaxpr",
        "in_shardings",
        "out_shardings",
        "in_layouts",
        "out_layouts",
        "donated_invars",
        "ctx_mesh",
        "name",
        "keep_unused",
        "inline",
        "compiler_options_kvs",
    }
)
# The params of a `jit_p` equation other than its jaxpr, in a fixed order.
_jit_options = operator.itemgetter(*sorted(_JIT_PARAMS - {"jaxpr"}))
if _UnspecifiedValue is None:
    switch_off("eager jax.numpy calls on Values through a compiled call (no UnspecifiedValue)")


def jit_needs_only_keep_unused(params) -> bool:
    """Whether a `jit` equation with these params asks for nothing but its
    jaxpr, its name and `keep_unused`: no sharding or layout of any input or
    output, no donation, no compiler option, no mesh in context, no effect.
    `jax.jit(f, keep_unused=...)` on the jaxpr's function then compiles the
    program JAX's own implementation of `jit` compiles for the equation (how
    `jax.numpy`'s functions are called eagerly). `False` for a param this layer
    does not know, or where this JAX has no `UnspecifiedValue`: the equation is
    then bound as it is.

    **Arguments:**

    - `params`: the params of a `jit_p` equation.

    **Returns:**

    `True` if the equation needs nothing beyond `keep_unused`.
    """
    if _UnspecifiedValue is None or params.keys() != _JIT_PARAMS:
        return False
    unspecified = lambda shardings: all(  # noqa: E731
        isinstance(s, _UnspecifiedValue) for s in shardings
    )
    return (
        unspecified(params["in_shardings"])
        and unspecified(params["out_shardings"])
        and all(layout is None for layout in params["in_layouts"])
        and all(layout is None for layout in params["out_layouts"])
        and not any(params["donated_invars"])
        and not params["compiler_options_kvs"]
        and getattr(params["ctx_mesh"], "empty", False) is True
        and not params["jaxpr"].effects
    )


def jit_options(params) -> tuple | None:
    """The params of a `jit` equation other than its jaxpr, as a tuple in a
    fixed order, or `None` where they are not the ones this layer knows. JAX
    hands the same param objects to every call of one jitted function on
    arguments of one type, so a caller may remember what it learnt from them
    by their identity.

    **Arguments:**

    - `params`: the params of a `jit_p` equation.

    **Returns:**

    The tuple of the other params' values, or `None`.
    """
    if len(params) != len(_JIT_PARAMS):
        return None
    try:
        return _jit_options(params)
    except KeyError:
        return None


def scan_layout(params) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a `scan` equation: params of those names up
    to jax 0.10; from 0.11 the counts are the sizes of the flat trees in
    `ft_in` (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    ft_in = params.get("ft_in")
    if ft_in is not None and hasattr(ft_in, "unpack"):
        consts, carry, _ = ft_in.unpack()
        return len(consts), len(carry)
    raise missing("the consts/carry layout of `scan`'s params", "lax.scan over Values")


def _bwd_returns_logs(custom_derivatives) -> bool:
    # `_flatten_bwd` itself, or (from jax 0.12) inside a `functools.partial`.
    pending = [getattr(custom_derivatives, "_flatten_bwd", None)]
    while pending:
        candidate = pending.pop()
        code = getattr(candidate, "__code__", None)
        if code is not None and code.co_name == "_flatten_bwd":
            return "with_logs" in code.co_varnames
        if hasattr(candidate, "func"):
            pending += [candidate.func, *candidate.args]  # pyright: ignore
    return False


# From jax 0.11 a custom_vjp's `bwd` (as handed to a trace hook) returns
# `(cotangents, logs)`; before, the cotangents alone.
CUSTOM_VJP_BWD_RETURNS_LOGS = _bwd_returns_logs(_custom_derivatives)


def custom_vjp_cotangents(bwd_output, *, with_logs: bool = CUSTOM_VJP_BWD_RETURNS_LOGS) -> list:
    """The input cotangents from what a custom_vjp hook's `bwd` returned."""
    if with_logs:
        cotangents, _logs = bwd_output
        return list(cotangents)
    return list(bwd_output)


# What to pass as `jax.jit(..., inline=)` for a jit that JAX copies into the
# enclosing program where it is traced, as `jax.numpy`'s are.
JIT_INLINE_AT_TRACE: Any = _INLINE_EARLY if _INLINE_EARLY is not None else True


def lax_primitive_by_name(name: str):
    """Look a primitive up by name in `jax.lax` (`"add"` finds `lax.add_p`), then
    in `jax.extend.core.primitives`. Returns `None` when there is none.
    """
    namespaces = [ns for ns in (lax, _prims) if ns is not None]
    for namespace in namespaces:
        candidate = getattr(namespace, f"{name}_p", None)
        if isinstance(candidate, Primitive):
            return candidate
    # Some primitives' attribute names differ from their `.name` (`jit_p` is named
    # "jit", `remat_p` is named "remat2", `scatter_add_p` is named "scatter-add").
    for namespace in namespaces:
        for value in vars(namespace).values():
            if isinstance(value, Primitive) and value.name == name:
                return value
    return None


def has_effects(primitive, inputs, params: dict) -> bool:
    """Whether binding `primitive` on `inputs` with `params` has an effect (a
    callback, state, ordered I/O): its abstract evaluation says so. Where it
    cannot say (a primitive that needs more than avals), `True`.

    **Arguments:**

    - `primitive`: a JAX primitive, bound on plain arrays.
    - `inputs`: its operands (arrays, tracers or numbers).
    - `params`: the params it was bound with.

    **Returns:**

    `False` only where the primitive is known to have no effect.
    """
    try:
        evaluated = primitive.abstract_eval(*map(jax.typeof, inputs), **params)
    except Exception:
        return True
    # `Primitive.abstract_eval` gives `(avals, effects)` in every release tested.
    if isinstance(evaluated, tuple) and len(evaluated) == 2:
        return bool(evaluated[1])
    return True
