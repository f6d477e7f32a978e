"""Every use of JAX internals lives here.

quaxlike needs a handful of things JAX does not export publicly: the stackless
trace API, the primitives of higher-order operations and a few jaxpr helpers.
Keeping them in one module means a JAX release that moves them breaks this file
only. Checked against jax 0.10.x; see `../shared/JAX-INTERNALS.md` for the facts
this module relies on.
"""

import gc
import os
import sys

import jax
import jax.extend.core as jex_core
from jax import lax
from jax._src import (
    array as _array,
    config as _config,
    core as _core,
    linear_util as _lu,
    pjit as _pjit,
    shard_map as _shard_map,
    source_info_util as _source_info_util,
    traceback_util as _traceback_util,
    tree_util as _tree_util,
)


# --- the trace API -----------------------------------------------------------

Trace = _core.Trace
Tracer = _core.Tracer
AbstractValue = _core.AbstractValue
ShapedArray = _core.ShapedArray
# A mutable array reference (`jax.new_ref`); not a `jax.Array`, yet a valid output.
Ref = _core.Ref
set_current_trace = jex_core.set_current_trace
take_current_trace = jex_core.take_current_trace
# The holder of the current trace, for the hottest paths: `trace_ctx.trace` is the
# current trace and `trace_ctx.set_trace(t)` makes `t` current, which is what
# `set_current_trace` does without building a context manager (as JAX's own
# `Primitive.bind` does).
trace_ctx = _core.trace_ctx
# The class of concrete arrays: its instances carry their aval (without the
# sharding, which `jax.typeof` folds in) and sharding as plain attributes.
ArrayImpl = _array.ArrayImpl


def _tracer_init_only_stores() -> bool:
    # In jax 0.10.x `Tracer.__init__(self, trace, aval)` does nothing but store
    # its two arguments.
    code = Tracer.__init__.__code__
    return code.co_names == ("_trace", "aval") and code.co_varnames[:3] == (
        "self",
        "trace",
        "aval",
    )


# Whether a `Tracer` subclass may set `_trace` and `aval` itself instead of
# calling `Tracer.__init__` (which costs a `super()` call per tracer); if a JAX
# release makes `Tracer.__init__` do more, this is False and it is called.
TRACER_INIT_ONLY_STORES = _tracer_init_only_stores()


def register_tracer_class(cls: type) -> None:
    """Give `jax.typeof` its one-lookup path for instances of the `Tracer`
    subclass `cls` (the same answer, `x.aval`, without walking `cls.__mro__`
    on every call, which JAX's own tracers avoid the same way)."""
    _core.pytype_aval_mappings[cls] = _core.pytype_aval_mappings[Tracer]


def jit_disabled() -> bool:
    """Whether `jax.disable_jit()` is in effect."""
    return bool(_config.disable_jit.value)


# --- jaxprs ------------------------------------------------------------------

Primitive = jex_core.Primitive
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
Literal = jex_core.Literal
jaxpr_as_fun = jex_core.jaxpr_as_fun
eval_jaxpr = _core.eval_jaxpr
current_name_stack = _source_info_util.current_name_stack
set_name_stack = _source_info_util.set_name_stack


def _eqn_contexts_interned() -> bool:
    # In jax 0.10.2 `JaxprEqnContext()` builds the current context and equal
    # contexts are one object; in 0.10.0 it needs its fields as arguments.
    try:
        return _core.JaxprEqnContext() is _core.JaxprEqnContext()
    except TypeError:
        return False


_EQN_CONTEXTS_INTERNED = _eqn_contexts_interned()


def current_eqn_context():
    """The context (compute type, abstract mesh, XLA metadata, ...) that an
    equation bound now would record, to compare with `is` against an equation's
    `ctx`; `None` where JAX does not intern contexts (then every equation's
    context is entered)."""
    return _core.JaxprEqnContext() if _EQN_CONTEXTS_INTERNED else None


def without_mesh(aval) -> bool:
    """Whether `aval` names no mesh in its sharding (nothing explicitly
    sharded, nothing `bind` would reshard)."""
    sharding = getattr(aval, "sharding", None)
    return sharding is None or sharding.mesh.empty


wrap_init = _lu.wrap_init
WrappedFun = _lu.WrappedFun


def is_primitive(obj) -> bool:
    return isinstance(obj, _core.Primitive)


def debug_info(name: str, fn, args, kwargs):
    """A `DebugInfo` for `wrap_init`, which JAX requires since 0.5."""
    from jax._src import api_util

    return api_util.debug_info(name, fn, args, kwargs)


def current_trace():
    """The trace every `bind` would go to right now."""
    return _core.trace_ctx.trace


def is_eager(trace) -> bool:
    """Whether `trace` executes operations at once (no transformation, no staging)."""
    return isinstance(trace, _core.EvalTrace)


def check_leaks_enabled() -> bool:
    return bool(_config.check_tracer_leaks.value)


# --- primitives of higher-order operations -----------------------------------

_prims = jex_core.primitives
jit_p = _prims.jit_p
closed_call_p = _prims.closed_call_p
call_p = _prims.call_p
cond_p = lax.cond_p
while_p = lax.while_p
scan_p = lax.scan_p
remat_p = _prims.remat_p
custom_jvp_call_p = _prims.custom_jvp_call_p
custom_vjp_call_p = _prims.custom_vjp_call_p
shard_map_p = _shard_map.shard_map_p
pvary_p = _core.pvary_p
sharding_constraint_p = _pjit.sharding_constraint_p

# `shard_map` bodies return, and its hook returns, this flat container.
FlatTree = _tree_util.FlatTree


def lax_primitive_by_name(name: str):
    """Look a primitive up by name in `jax.lax` (`"add"` finds `lax.add_p`), then
    in `jax.extend.core.primitives`. Returns `None` when there is none.
    """
    for namespace in (lax, _prims):
        candidate = getattr(namespace, f"{name}_p", None)
        if isinstance(candidate, _core.Primitive):
            return candidate
    # Some primitives' attribute names differ from their `.name` (`jit_p` is named
    # "jit", `remat_p` is named "remat2", `scatter_add_p` is named "scatter-add").
    for namespace in (lax, _prims):
        for value in vars(namespace).values():
            if isinstance(value, _core.Primitive) and value.name == name:
                return value
    return None


def known_lax_primitive_names() -> list[str]:
    names = set()
    for namespace in (lax, _prims):
        for attr, value in vars(namespace).items():
            if isinstance(value, _core.Primitive) and attr.endswith("_p"):
                names.add(attr[:-2])
    return sorted(names)


def check_no_leaks(traces) -> None:
    """Raise JAX's own leaked-tracer error if any tracer still refers to one of
    `traces` (only called when `jax_check_tracer_leaks` is on). One garbage
    collection for all of them."""
    gc.collect()
    for trace in traces:
        leaked = [r for r in gc.get_referrers(trace) if isinstance(r, _core.Tracer)]
        if leaked:
            raise _core.leaked_tracer_error("trace", trace, leaked)


# --- shard_map bodies --------------------------------------------------------


def with_varying_axes_of(aval, leaves):
    """Inside a `shard_map` body with `check_vma=True`, JAX tracks over which
    manual mesh axes each array varies (`float32[2]{V:x}`) and inserts `pvary`
    where an operation mixes varying and invariant operands. A Value's `aval()`
    knows nothing of that, so give it the union of its array leaves' varying
    axes; otherwise user code would skip the `pvary` and the rule's own
    operations would fail JAX's check. Outside such a body: `aval` unchanged.
    """
    if not _config._check_vma.value or not isinstance(aval, ShapedArray):
        return aval
    varying = frozenset()
    for leaf in leaves:
        leaf_aval = getattr(leaf, "aval", None) if isinstance(leaf, Tracer) else None
        if isinstance(leaf_aval, ShapedArray):
            varying |= leaf_aval.mat.varying
    if not varying or varying == aval.mat.varying:
        return aval
    sharding = jax.sharding.NamedSharding(
        jax.sharding.get_abstract_mesh(), jax.sharding.PartitionSpec(*[None] * aval.ndim)
    )
    return aval.update(sharding=sharding, manual_axis_type=_core.ManualAxisType(varying=varying))


def tracking_varying_axes() -> bool:
    """Whether JAX is checking varying manual axes (inside a `shard_map` body)."""
    return bool(_config._check_vma.value)


# --- pointing at user code ---------------------------------------------------

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Treat quaxlike's own frames like JAX's: left out of JAX's filtered tracebacks,
# and skipped when looking for "the user's line".
_source_info_util.register_exclusion(_PACKAGE_DIR)
_traceback_util.register_exclusion(_PACKAGE_DIR)
api_boundary = _traceback_util.api_boundary


class SourceLine:
    def __init__(self, filename, lineno, function):
        self.filename, self.lineno, self.function = filename, lineno, function

    @property
    def text(self) -> str:
        if self.filename is None:
            return "an unknown line"
        return f"{self.filename}:{self.lineno} (in {self.function})"


def _package_dir(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


# Libraries between the user's code and a primitive: never "the user's line".
def _library_dirs() -> tuple[str, ...]:
    import importlib

    dirs = []
    for name in ("jax", "jaxlib", "equinox", "plum", "jaxtyping", "beartype"):
        try:
            dirs.append(_package_dir(importlib.import_module(name)))
        except ImportError:
            pass
    return tuple(dirs)


_NOT_USER = _library_dirs()


def user_source_line() -> SourceLine:
    """The innermost frame of the current Python stack outside JAX, quaxlike,
    Equinox, plum and the standard library."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if _source_info_util.is_user_filename(filename) and not filename.startswith(_NOT_USER):
            return SourceLine(filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return SourceLine(None, None, None)
