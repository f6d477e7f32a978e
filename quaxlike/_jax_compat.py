"""Every use of JAX internals lives here, found by probing rather than assumed.

quaxlike needs a few things JAX does not export publicly: the trace API, some
primitives of higher-order operations, and the way `shard_map` talks to a
trace. Each is looked up here when quaxlike is imported, by feature (is the
attribute there, what type does a param have, what does a signature take), so
that a JAX release that moves one breaks nothing at import. What is missing
is replaced by a stand-in that raises `JaxCompatibilityError` when it is
actually needed, naming the JAX version, the tested range and what is missing.
Speed-only shortcuts that depend on a private layout switch themselves off
when their probe fails; the plain path is then used.

Tested with every minor series from jax 0.7.2 to 0.12.0.1 (`TESTED_RANGE`).

Inventory (what, what for, where it exists, fallback):

| name | used for | found in | fallback |
|---|---|---|---|
| `Trace`, `Tracer` | base classes of QuaxTrace/QuaxTracer | `jax._src.core` (all); `jax.core` | public `jax.core`; else stand-in classes, quaxify raises |
| `Tracer.__init__(trace[, aval])` | tracer construction | takes `aval` from 0.10; before, `aval` is the subclass's own slot | `tracer_initialiser` picks the call by the signature; QuaxTracer adds an `aval` slot when the base has none |
| `set_current_trace`, `take_current_trace` | entering/leaving a trace | `jax.extend.core` from 0.9/0.10; `jax._src.core` in all | the other module; else raises |
| `trace_ctx.trace` | reading the current trace cheaply | `jax._src.core` (all) | `current_trace_reader`: `unsafe_get_current_trace()`, then `find_top_trace(())` |
| `EvalTrace` | "is this eager?" | `jax._src.core` (all) | none is eager (always the traced paths) |
| `pytype_aval_mappings` | `jax.typeof` fast path for QuaxTracer | `jax._src.core` (all) | skipped (JAX walks the MRO) |
| `scan_p` params | consts/carry counts | `num_consts`, `num_carry` up to 0.10; `ft_in` flat trees from 0.11 | `scan_layout` reads both; else raises |
| `Primitive.get_bind_params` | re-binding an equation | `(subfuns, params)` up to 0.8; the params alone from 0.9 | `bind_params` returns the pair for both |
| custom_vjp hook's `bwd` output | calling a user's `bwd` on Values | the cotangents up to 0.10; `(cotangents, logs)` from 0.11 (`_flatten_bwd` has `with_logs`) | `custom_vjp_cotangents` unpacks both |
| `jit_p` param `inline` | "inlined at trace time?" | `bool` up to 0.10; `jax.Inline` enum from 0.11 (`JAX_EARLY` inlines) | `jit_inlines_at_trace` normalises both; unknown values count as not inlined |
| `jit_p`, `closed_call_p`, `call_p`, `custom_jvp_call_p`, `custom_vjp_call_p` | higher-order rules | `jax.extend.core.primitives` (all) | `jax._src.pjit` / `jax._src.core` / `jax._src.custom_derivatives`; else an inert stand-in primitive |
| `remat_p` | `jax.checkpoint` rule | `jax.extend.core.primitives` from 0.8; `jax._src.ad_checkpoint` (all) | stand-in |
| `shard_map_p`, `pvary_p`, `sharding_constraint_p` | sharding rules | `jax._src.shard_map`, `jax._src.core`, `jax._src.pjit` | stand-ins (their rules never match) |
| `shard_map` hook protocol | the shard_map rule | <= 0.8: `fun` a `WrappedFun`, `out_specs_thunk` and `manual_axes` params, a list returned; from 0.9: `fun` returns a `FlatTree` with out specs as aux, one returned | `SHARD_MAP_RETURNS_FLAT_TREE` probe; `FlatTree` from `jax._src.tree_util` with `FlatTree.flatten` (0.8-0.10) or `jax._src.flattree` with `flatten` (0.11+) |
| varying manual axes of an aval | shard_map bodies with `check_vma` | `aval.vma` up to 0.9; `aval.mat.varying` / `ManualAxisType` from 0.10 | `varying_axes`/`with_varying_axes` read and write both forms; else no axes |
| `config._check_vma`, `config.disable_jit`, `config.check_tracer_leaks` | reading JAX's switches | `jax._src.config` (all) | treated as off |
| `JaxprEqnContext()` interned | skip entering an equation's context | from 0.10.2 | entered for every equation |
| `ArrayImpl` `.aval`/`.sharding` | cache keys of compiled calls | `jax._src.array` (all) | `jax.typeof` |
| `leaked_tracer_error` | JAX's own leak message | `jax._src.core` (all) | a plain `Exception` with the same facts |
| `source_info_util`, `traceback_util` | hiding quaxlike's frames, finding the user's line | `jax._src` (all) | no filtering; the outermost non-library frame |
| `linear_util.wrap_init`, `api_util.debug_info` | `WrappedFun`s for old-style `shard_map` bodies | `jax._src` (all) | raises when that path is needed |
| `Primitive.bind_with_trace` | running an equation in a given trace | `(trace, args, params)` up to 0.8; `(trace, args, avals, params)` from 0.9 | `binder` picks the call by the signature |
| `custom_jvp_call_p`/`custom_vjp_call_p` param `call_jaxpr` | the eager verdict looks into a custom derivative's primal | a `ClosedJaxpr` in every release tested | `custom_call_primal_jaxpr` returns `None`: such a call is run op by op, as before |
| JAX's typed Python scalars | plum conversions to `jax.Array` (`_plum_types`) | `jax._src.literals`: `typed_scalar_types` (`TypedInt`, `TypedFloat`, `TypedComplex`) from 0.8; `literal_scalar_types` (`LiteralInt`, ...) in 0.7 | `typed_scalar_types_of` finds either; else none (no conversions registered) |
| `Tracer.to_concrete_value`, `core.to_concrete_value` | eager concreteness of a QuaxTracer (`concrete_or_error`, `bool`, `.item()`, boolean masks) | every release tested: JAX asks a tracer's `to_concrete_value()` (`None`: not concrete) | `concreteness_reader` calls the method where `core.to_concrete_value` is missing; a JAX that never asks treats every QuaxTracer as abstract, as before |

A shortcut that a probe turns off is reported by `disabled_shortcuts()`.
"""

import gc
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any, TYPE_CHECKING

import jax
from jax import lax

from ._diagnostics import JaxCompatibilityError, messages


TESTED_RANGE = ("0.7.2", "0.12.0.1")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


JAX_VERSION = jax.__version__
_JAX_VERSION_TUPLE = _version_tuple(JAX_VERSION)


def beyond_tested_range() -> bool:
    """Whether the installed JAX is newer than the newest release tested."""
    return _JAX_VERSION_TUPLE > _version_tuple(TESTED_RANGE[1])


def _module(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # moved or broken in this release: probed for below
        return None


def _first(*candidates: tuple[Any, str]) -> Any:
    """The first `getattr(module, name)` that exists among `candidates`."""
    for module, name in candidates:
        if module is not None:
            value = getattr(module, name, None)
            if value is not None:
                return value
    return None


def missing(what: str, needed_for: str) -> JaxCompatibilityError:
    """The error for a JAX internal this release does not provide."""
    return JaxCompatibilityError(
        messages.JAX_INTERNAL_MISSING.format(
            what=what,
            needed_for=needed_for,
            version=JAX_VERSION,
            low=TESTED_RANGE[0],
            high=TESTED_RANGE[1],
        )
    )


def _unavailable(what: str, needed_for: str) -> Callable[..., Any]:
    def unavailable(*args, **kwargs):
        raise missing(what, needed_for)

    unavailable.__name__ = what.rsplit(".", 1)[-1]
    return unavailable


_disabled: list[str] = []


def disabled_shortcuts() -> list[str]:
    """Speed-only shortcuts that a failed probe turned off on this JAX."""
    return list(_disabled)


jex_core = _module("jax.extend.core")
_core = _module("jax._src.core")
_config = _module("jax._src.config")
_array = _module("jax._src.array")
_pjit = _module("jax._src.pjit")
_api = _module("jax._src.api")
_lu = _module("jax._src.linear_util")
_api_util = _module("jax._src.api_util")
_source_info_util = _module("jax._src.source_info_util")
_traceback_util = _module("jax._src.traceback_util")
_shard_map = _module("jax._src.shard_map")
_ad_checkpoint = _module("jax._src.ad_checkpoint")
_custom_derivatives = _module("jax._src.custom_derivatives")
_literals = _module("jax._src.literals")
_prims = getattr(jex_core, "primitives", None)


# --- the trace API -----------------------------------------------------------


class _MissingBase:
    """Stands in for a JAX base class this release lacks; using it raises."""

    def __init__(self, *args, **kwargs):
        raise missing("jax._src.core.Trace / Tracer", "quaxify's trace")


if TYPE_CHECKING:  # what the type checker sees: one release's classes
    from jax._src.core import (
        AbstractValue as AbstractValue,
        ShapedArray as ShapedArray,
        Trace as Trace,
        Tracer as Tracer,
    )
else:
    Trace = _first((_core, "Trace"), (jax.core, "Trace")) or _MissingBase
    Tracer = _first((_core, "Tracer"), (jax.core, "Tracer")) or _MissingBase
    AbstractValue = _first((_core, "AbstractValue"), (jax.core, "AbstractValue")) or object
    ShapedArray = _first((_core, "ShapedArray"), (jax.core, "ShapedArray")) or object
# A mutable array reference (`jax.new_ref`): not a `jax.Array`, yet a valid output.
Ref: Any = _first((_core, "Ref")) or ()


def _init_takes_aval(tracer_class) -> bool:
    code = getattr(getattr(tracer_class, "__init__", None), "__code__", None)
    return code is not None and code.co_argcount >= 3


# `Tracer.__init__(self, trace, aval)` from jax 0.10; `(self, trace)` before,
# when the subclass provides `aval` itself.
TRACER_TAKES_AVAL = _init_takes_aval(Tracer)


def _slots_of(cls) -> set:
    names: set = set()
    for klass in getattr(cls, "__mro__", ()):
        slots = vars(klass).get("__slots__", ())
        names.update([slots] if isinstance(slots, str) else slots)
    return names


# Whether a `Tracer` subclass must declare the `aval` slot itself.
TRACER_NEEDS_AVAL_SLOT = "aval" not in _slots_of(Tracer)


def tracer_initialiser(base, takes_aval: bool) -> Callable[[Any, Any, Any], None]:
    """`base.__init__` for a tracer of a subclass, whichever signature it has."""
    if takes_aval:
        return base.__init__
    init = base.__init__

    def init_then_store_aval(tracer, trace, aval):
        init(tracer, trace)
        tracer.aval = aval

    return init_then_store_aval


init_tracer = tracer_initialiser(Tracer, TRACER_TAKES_AVAL)


set_current_trace = _first((jex_core, "set_current_trace"), (_core, "set_current_trace")) or (
    _unavailable("set_current_trace", "running a quaxified function")
)
take_current_trace = _first((jex_core, "take_current_trace"), (_core, "take_current_trace")) or (
    _unavailable("take_current_trace", "running a quaxified function")
)


def current_trace_reader(core, extend_core) -> Callable[[], Any]:
    """A function returning the trace every `bind` would go to right now: the
    `trace_ctx.trace` attribute (all releases tested), else
    `unsafe_get_current_trace()`, else `find_top_trace(())`."""
    ctx = _first((core, "trace_ctx"))
    if ctx is not None and hasattr(ctx, "trace"):
        return lambda: ctx.trace
    _disabled.append("reading the current trace from trace_ctx")
    getter = _first((core, "unsafe_get_current_trace"))
    if getter is not None:
        return getter
    find_top = _first((extend_core, "find_top_trace"), (core, "find_top_trace"))
    if find_top is not None:
        return lambda: find_top(())
    return _unavailable("a way to read the current trace", "running a quaxified function")


current_trace = current_trace_reader(_core, jex_core)


_EvalTrace = _first((_core, "EvalTrace"))


def is_eager(trace) -> bool:
    """Whether `trace` executes operations at once (no transformation, no staging)."""
    return _EvalTrace is not None and isinstance(trace, _EvalTrace)


_aval_mappings = _first((_core, "pytype_aval_mappings"))


def register_tracer_class(cls: type) -> None:
    """Give `jax.typeof` its one-lookup path for instances of the `Tracer`
    subclass `cls` (JAX's own tracers are registered the same way)."""
    if isinstance(_aval_mappings, dict) and Tracer in _aval_mappings:
        _aval_mappings[cls] = _aval_mappings[Tracer]
    else:
        _disabled.append("jax.typeof's lookup for QuaxTracer")


def _config_flag(name: str) -> Callable[[], bool]:
    state = _first((_config, name))
    if state is None or not hasattr(state, "value"):
        return lambda: False
    return lambda: bool(state.value)


jit_disabled = _config_flag("disable_jit")
check_leaks_enabled = _config_flag("check_tracer_leaks")
tracking_varying_axes = _config_flag("_check_vma")
tracking_varying_axes.__doc__ = "Whether JAX checks varying manual axes (a shard_map body)."


def check_no_leaks(traces) -> None:
    """Raise JAX's own leaked-tracer error if any tracer still refers to one of
    `traces` (only called when `jax_check_tracer_leaks` is on). One garbage
    collection for all of them."""
    gc.collect()
    make_error = _first((_core, "leaked_tracer_error"))
    for trace in traces:
        leaked = [r for r in gc.get_referrers(trace) if isinstance(r, Tracer)]
        if leaked:
            if make_error is not None:
                raise make_error("trace", trace, leaked)
            raise Exception(f"Leaked trace {trace}. Leaked tracer(s): {leaked}")


# --- concreteness ------------------------------------------------------------


def concreteness_reader(core) -> Callable[[Any], Any]:
    """`to_concrete_value(x)`: the concrete value JAX knows for `x`, or `None`
    (a tracer with no known value). `core.to_concrete_value` in every release
    tested; else asked of a tracer directly, as JAX's tracers answer it
    (`Tracer.to_concrete_value()`), and `x` itself for anything else."""
    found = _first((core, "to_concrete_value"))
    if found is not None:
        return found

    def ask(x):
        if isinstance(x, Tracer):
            method = getattr(x, "to_concrete_value", None)
            return method() if method is not None else None
        return x

    return ask


to_concrete_value = concreteness_reader(_core)
# Whether JAX asks a tracer for its concrete value (`concrete_or_error`,
# `Tracer.__bool__`, ...): the method on the base class, whose default answers
# `None`. Where it does not, a QuaxTracer stays abstract even eagerly.
TRACERS_ANSWER_CONCRETENESS = callable(getattr(Tracer, "to_concrete_value", None))
if not TRACERS_ANSWER_CONCRETENESS:
    _disabled.append("eager concreteness (JAX never asks a tracer for its value)")


def typed_scalar_types_of(literals) -> tuple[type, ...]:
    """The subclasses of `int`, `float` and `complex` carrying a `dtype` that
    `bind` turns Python scalars into (`TypedInt`, `TypedFloat`, `TypedComplex`
    from jax 0.8, listed in `jax._src.literals.typed_scalar_types`;
    `LiteralInt`, ... in 0.7, in `literal_scalar_types`), by name; `()` where
    neither list exists."""
    for name in ("typed_scalar_types", "literal_scalar_types"):
        found = _first((literals, name))
        if found:
            return tuple(sorted(found, key=lambda t: t.__name__))
    return ()


TYPED_SCALAR_TYPES = typed_scalar_types_of(_literals)


# --- jaxprs ------------------------------------------------------------------

if TYPE_CHECKING:
    from jax.extend.core import (
        ClosedJaxpr as ClosedJaxpr,
        Jaxpr as Jaxpr,
        Literal as Literal,
        Primitive as Primitive,
    )
else:
    Primitive = _first((jex_core, "Primitive"), (_core, "Primitive"))
    ClosedJaxpr = _first((jex_core, "ClosedJaxpr"), (_core, "ClosedJaxpr"))
    Jaxpr = _first((jex_core, "Jaxpr"), (_core, "Jaxpr"))
    Literal = _first((jex_core, "Literal"), (_core, "Literal"))
jaxpr_as_fun = _first((jex_core, "jaxpr_as_fun"), (_core, "jaxpr_as_fun"))
eval_jaxpr = _first((jex_core, "eval_jaxpr"), (_core, "eval_jaxpr"))
jaxprs_in_params = _first((jex_core, "jaxprs_in_params"), (_core, "jaxprs_in_params"))
current_name_stack = _first((_source_info_util, "current_name_stack"))
set_name_stack = _first((_source_info_util, "set_name_stack"))


def _eqn_contexts_interned() -> bool:
    # From jax 0.10.2 `JaxprEqnContext()` builds the current context and equal
    # contexts are one object; before, it needs its fields as arguments.
    try:
        return _core.JaxprEqnContext() is _core.JaxprEqnContext()  # pyright: ignore
    except Exception:
        return False


_EQN_CONTEXTS_INTERNED = _eqn_contexts_interned()
if not _EQN_CONTEXTS_INTERNED:
    _disabled.append("skipping interned equation contexts")


def current_eqn_context():
    """The context that an equation bound now would record, to compare with
    `is` against an equation's `ctx`; `None` where JAX does not intern
    contexts (then every equation's context is entered)."""
    return _core.JaxprEqnContext() if _EQN_CONTEXTS_INTERNED else None  # pyright: ignore


def binder(primitive_class) -> Callable[[Any, Any, list, dict], Any]:
    """`bind(primitive, trace, args, params)`: `primitive.bind(*args, **params)`
    with `trace` current, for arguments that are already canonical JAX values
    (an equation's inputs). `Primitive.bind_with_trace` takes `(trace, args,
    avals, params)` from jax 0.9 and `(trace, args, params)` before."""
    code = getattr(getattr(primitive_class, "bind_with_trace", None), "__code__", None)
    if code is not None and code.co_argcount >= 5:

        def bind_with_avals(primitive, trace, args, params):
            return primitive.bind_with_trace(trace, args, [jax.typeof(a) for a in args], params)

        return bind_with_avals

    def bind(primitive, trace, args, params):
        return primitive.bind_with_trace(trace, args, params)

    return bind


bind_with_trace = binder(Primitive)


def bind_params(primitive, params) -> tuple[list, dict]:
    """`(subfuns, params)` to re-bind an equation of `primitive` with `params`:
    `primitive.bind(*subfuns, *args, **params)`. `get_bind_params` returns that
    pair up to jax 0.8, and the params alone (with any functions inside them)
    from 0.9."""
    out = primitive.get_bind_params(params)
    if isinstance(out, tuple):
        subfuns, new_params = out
        return list(subfuns), new_params
    return [], out


# The one-shot functions JAX hands to trace hooks (`()` when absent, so that
# `isinstance(x, WrappedFun)` is simply False).
WrappedFun: Any = _first((_lu, "WrappedFun")) or ()


def is_primitive(obj) -> bool:
    return isinstance(obj, Primitive)


def without_mesh(aval) -> bool:
    """Whether `aval` names no mesh in its sharding (nothing explicitly
    sharded, nothing `bind` would reshard)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return sharding is None or mesh is None or bool(getattr(mesh, "empty", False))


ArrayImpl: Any = _first((_array, "ArrayImpl"))
_ARRAY_CARRIES_AVAL = ArrayImpl is not None and {"aval", "sharding"} <= set(dir(ArrayImpl))
if not _ARRAY_CARRIES_AVAL:
    _disabled.append("reading a concrete array's aval without jax.typeof")


def aval_key(x) -> Any:
    """What `jax.typeof(x)` says, as a cache key. A concrete array carries its
    aval (without the sharding, which `typeof` folds in) and its sharding as
    attributes, which is a tenth of the cost (where the probe found them)."""
    if _ARRAY_CARRIES_AVAL and type(x) is ArrayImpl:
        return x.aval, x.sharding
    return jax.typeof(x)


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


# --- shard_map -----------------------------------------------------------------

_flattree = _module("jax._src.flattree")
FlatTree: Any = _first((_flattree, "FlatTree"), (_module("jax._src.tree_util"), "FlatTree"))
# Building one from a list: a classmethod `FlatTree.flatten` (jax 0.8 to 0.10),
# a function `jax._src.flattree.flatten` (0.11+).
_flatten_to_flat_tree = _first((FlatTree, "flatten"), (_flattree, "flatten"))


def _takes_subfuns_param(primitive_class) -> bool:
    # From jax 0.9 `shard_map_p.bind_with_trace` takes the body from
    # `params["subfuns"]`, and the body returns a FlatTree; before, the body is
    # the first operand, a `WrappedFun` returning a flat list.
    code = getattr(getattr(primitive_class, "bind_with_trace", None), "__code__", None)
    return code is not None and "subfuns" in code.co_consts + code.co_names + code.co_varnames


SHARD_MAP_RETURNS_FLAT_TREE = _takes_subfuns_param(type(shard_map_p))


def shard_map_body_outputs(
    fun, args, params, *, flat_tree: bool = SHARD_MAP_RETURNS_FLAT_TREE
) -> tuple[list, tuple, Callable[[list], Any]]:
    """Run a `shard_map` body as JAX hands it to a trace hook (with the hook's
    `params`): its flat outputs, their flat out specs, and a function turning
    a list of outputs into what the hook returns (a `FlatTree` like the body's,
    or a list). `flat_tree` says which protocol (see the inventory)."""
    if flat_tree:
        outs, out_specs = fun(*args).unpack_aux()
        # The structure only, not the outputs (tracers that must not outlive
        # their trace).
        template = outs.map(lambda _: None)
        return list(outs.vals), tuple(out_specs), template.update
    outs = list(fun.call_wrapped(*args))
    return outs, tuple(params["out_specs_thunk"]()), list


def map_shard_map_result(result, fn: Callable[[Any], Any]):
    """Apply `fn` to each output in what a `shard_map` hook returns."""
    if isinstance(result, (list, tuple)):
        return [fn(x) for x in result]
    return result.map(fn)


def bind_shard_map(
    body, flat_args, flat_in_specs, flat_out_specs_of, hook_params, *, renamed: bool
):
    """Bind `shard_map_p` on `flat_args` with `body` (a function of per-device
    arrays returning a flat list) and the hook's own `params`, whatever this
    JAX's protocol. `flat_out_specs_of()` gives the body's flat out specs once
    the body has been traced; `renamed` says the arguments no longer match the
    user's (so their names in JAX's debug information are dropped). Returns
    the flat outputs."""
    params: dict[str, Any] = dict(hook_params, in_specs=tuple(flat_in_specs))
    if SHARD_MAP_RETURNS_FLAT_TREE:
        if _flatten_to_flat_tree is None:
            raise missing("a way to build a FlatTree", "shard_map over Values")

        def flat_tree_body(*xs):
            return _flatten_to_flat_tree(body(*xs)).with_aux(tuple(flat_out_specs_of()))

        debug_info = params.get("debug_info")
        if renamed and hasattr(debug_info, "with_unknown_names"):
            params["debug_info"] = debug_info.with_unknown_names()  # pyright: ignore
        return list(shard_map_p.bind(*flat_args, subfuns=(flat_tree_body,), **params).vals)
    if _lu is None or _api_util is None:
        raise missing("jax._src.linear_util.wrap_init", "shard_map over Values")
    debug_info = _api_util.debug_info("shard_map", body, flat_args, {})
    wrapped = _lu.wrap_init(body, debug_info=debug_info)
    params["out_specs_thunk"] = lambda: tuple(flat_out_specs_of())
    return list(shard_map_p.bind(wrapped, *flat_args, **params))


def varying_axes(aval) -> frozenset:
    """The manual mesh axes over which `aval` varies inside a `shard_map` body
    (`aval.mat.varying` from jax 0.10, `aval.vma` before)."""
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


_ManualAxisType = _first((_core, "ManualAxisType"))


def with_varying_axes(aval, axes: frozenset):
    """`aval`, marked as varying over the manual mesh axes `axes` (with the
    current abstract mesh as its sharding's mesh, which JAX checks them against)."""
    sharding = jax.sharding.NamedSharding(
        jax.sharding.get_abstract_mesh(), jax.sharding.PartitionSpec(*[None] * aval.ndim)
    )
    if _ManualAxisType is not None:
        return aval.update(sharding=sharding, manual_axis_type=_ManualAxisType(varying=axes))
    return aval.update(sharding=sharding, vma=axes)


def with_varying_axes_of(aval, leaves):
    """Inside a `shard_map` body with `check_vma=True`, JAX tracks over which
    manual mesh axes each array varies (`float32[2]{V:x}`) and inserts `pvary`
    where an operation mixes varying and invariant operands. A Value's `aval()`
    knows nothing of that, so give it the union of its array leaves' varying
    axes; otherwise user code would skip the `pvary` and the rule's own
    operations would fail JAX's check. Outside such a body: `aval` unchanged.
    """
    if not tracking_varying_axes() or not isinstance(aval, ShapedArray):
        return aval
    varying: frozenset = frozenset()
    for leaf in leaves:
        leaf_aval = getattr(leaf, "aval", None) if isinstance(leaf, Tracer) else None
        if isinstance(leaf_aval, ShapedArray):
            varying |= varying_axes(leaf_aval)
    if not varying or varying == varying_axes(aval):
        return aval
    return with_varying_axes(aval, varying)


# --- pointing at user code ---------------------------------------------------

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Treat quaxlike's own frames like JAX's: left out of JAX's filtered tracebacks,
# and skipped when looking for "the user's line".
for _util in (_source_info_util, _traceback_util):
    if hasattr(_util, "register_exclusion"):
        _util.register_exclusion(_PACKAGE_DIR)  # pyright: ignore
api_boundary = _first((_traceback_util, "api_boundary")) or (lambda fn: fn)
_is_user_filename = _first((_source_info_util, "is_user_filename")) or (
    lambda name: not name.startswith(_PACKAGE_DIR)
)


class SourceLine:
    def __init__(self, filename, lineno, function):
        self.filename, self.lineno, self.function = filename, lineno, function

    @property
    def text(self) -> str:
        if self.filename is None:
            return "an unknown line"
        return f"{self.filename}:{self.lineno} (in {self.function})"


# Libraries between the user's code and a primitive: never "the user's line".
def _library_dirs() -> tuple[str, ...]:
    dirs = [_PACKAGE_DIR]
    for name in ("jax", "jaxlib", "equinox", "plum", "jaxtyping", "beartype"):
        module = _module(name)
        filename = getattr(module, "__file__", None)
        if filename:
            dirs.append(os.path.dirname(os.path.abspath(filename)) + os.sep)
    return tuple(dirs)


_NOT_USER = _library_dirs()


def user_source_line() -> SourceLine:
    """The innermost frame of the current Python stack outside JAX, quaxlike,
    Equinox, plum and the standard library."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if _is_user_filename(filename) and not filename.startswith(_NOT_USER):
            return SourceLine(filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return SourceLine(None, None, None)
