"""The trace API: the base classes of QuaxTrace and QuaxTracer, entering and
reading the current trace, JAX's switches, and binding a jaxpr's equations
(see README.md for the inventory)."""

import gc
from collections.abc import Callable
from typing import Any, TYPE_CHECKING

import jax

from ._probing import (
    _array,
    _config,
    _core,
    _first,
    _literals,
    _lu,
    _source_info_util,
    _unavailable,
    jex_core,
    missing,
    switch_off,
)


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
    switch_off("reading the current trace from trace_ctx")
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


def eager_trace():
    """JAX's trace that executes operations at once, to bind under wherever the
    current trace is (inside a trace's `process_*` hook, none from jax 0.11);
    `None` where this JAX has none (then compute under the current trace)."""
    found = getattr(_core, "eval_trace", None)
    if _EvalTrace is not None and isinstance(found, _EvalTrace):
        return found
    try:
        return _EvalTrace() if _EvalTrace is not None else None
    except Exception:
        return None


_aval_mappings = _first((_core, "pytype_aval_mappings"))


def register_tracer_class(cls: type) -> None:
    """Give `jax.typeof` its one-lookup path for instances of the `Tracer`
    subclass `cls` (JAX's own tracers are registered the same way)."""
    if isinstance(_aval_mappings, dict) and Tracer in _aval_mappings:
        _aval_mappings[cls] = _aval_mappings[Tracer]
    else:
        switch_off("jax.typeof's lookup for QuaxTracer")


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
    switch_off("eager concreteness (JAX never asks a tracer for its value)")


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
    switch_off("skipping interned equation contexts")


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


# The last mesh found empty (meshes are immutable): almost every aval names the
# one empty mesh, and asking it again costs more than the rest of the check.
_empty_mesh: list = [None]


def without_mesh(aval) -> bool:
    """Whether `aval` names no mesh in its sharding (nothing explicitly
    sharded, nothing `bind` would reshard)."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None or mesh is _empty_mesh[0]:
        return True
    if getattr(mesh, "empty", False) is True:
        _empty_mesh[0] = mesh
        return True
    return False


ArrayImpl: Any = _first((_array, "ArrayImpl"))
_ARRAY_CARRIES_AVAL = ArrayImpl is not None and {"aval", "sharding"} <= set(dir(ArrayImpl))
if not _ARRAY_CARRIES_AVAL:
    switch_off("reading a concrete array's aval without jax.typeof")


def aval_key(x) -> Any:
    """What `jax.typeof(x)` says, as a cache key. A concrete array carries its
    aval (without the sharding, which `typeof` folds in) and its sharding as
    attributes, which is a tenth of the cost (where the probe found them)."""
    if _ARRAY_CARRIES_AVAL and type(x) is ArrayImpl:
        return x.aval, x.sharding
    return jax.typeof(x)
