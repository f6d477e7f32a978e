"""`quaxify`: run a function with Values lifted into a `QuaxTrace`.

The path of a call, in the order it runs: `Quaxify.__call__` partitions the
arguments (`filter_spec`) and flattens them; `_run_in_new_trace` opens a
`QuaxTrace` over whatever trace is current and lifts each Value into a
`QuaxTracer`; the function runs, and every operation on a tracer goes through
the trace (`_trace`: open, plan, the rule's shortcut, dispatch, wrap); the
outputs are unwrapped back into Values and arrays. `lifted_call` is the same
trace for quaxlike's own rules, without building the wrapper.
"""

import contextvars
import re
import types
from collections.abc import Callable
from typing import Any, cast, Generic, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from . import _instrument, _jax_compat as jc, _known_values
from ._diagnostics import (
    keeping_class,
    messages,
    QuaxlikeError,
    ValueNotConcreteError,
    ValueNotLiftedError,
)
from ._trace import QuaxTrace, QuaxTracer
from ._values import is_value, Value


_Return = TypeVar("_Return")


def _partition(fn, args, kwargs, filter_spec):
    if filter_spec is True:
        return (fn, args, kwargs), None
    try:
        return eqx.partition((fn, args, kwargs), filter_spec, is_leaf=is_value)
    except (ValueError, TypeError) as error:
        raise QuaxlikeError(
            messages.FILTER_SPEC_MISMATCH.format(fn=getattr(fn, "__name__", "fn"), error=error)
        ) from None


_JAX_OPERAND_ERROR = re.compile(
    r"Error interpreting argument to (\S+) as a JAX value.*of type <class '([\w.<>]+)'>"
    r".*at position (\d+)",
    re.DOTALL,
)


# Before jax 0.9 the error names neither the primitive nor the position.
_OLD_JAX_OPERAND_ERROR = re.compile(
    r"Argument '.*' of type '?<class '([\w.<>]+)'>'? is not a valid JAX type", re.DOTALL
)


_PYTHON_OPERATOR_ERROR = re.compile(
    r"unsupported operand type\(s\) for (\S+): '([\w.]+)' and '([\w.]+)'"
)


def _unlifted_value_error(error: TypeError) -> Exception | None:
    """JAX's error for a Value that reached a primitive without being lifted (or
    Python's, for an operator between an array and such a Value), rewritten to
    say why that happens and what to do."""
    known = {cls.__name__ for cls in _value_subclasses()}
    operator = _PYTHON_OPERATOR_ERROR.search(str(error))
    if operator is not None:
        symbol, left, right = operator.groups()
        for position, name in enumerate((left, right)):
            if name.rsplit(".", 1)[-1] in known:
                return keeping_class(
                    ValueNotLiftedError,
                    error,
                    messages.VALUE_NOT_LIFTED.format(
                        primitive=f"operator {symbol}",
                        type_name=name.rsplit(".", 1)[-1],
                        position=position,
                    ),
                )
        return None
    match = _JAX_OPERAND_ERROR.search(str(error))
    if match is not None:
        primitive, qualified_name, position = match.groups()
    else:
        match = _OLD_JAX_OPERAND_ERROR.search(str(error))
        if match is None:
            return None
        (qualified_name,), primitive, position = match.groups(), "a primitive", "unknown"
    type_name = qualified_name.rsplit(".", 1)[-1]
    if type_name not in known:
        return None
    return keeping_class(
        ValueNotLiftedError,
        error,
        messages.VALUE_NOT_LIFTED.format(
            primitive=primitive, type_name=type_name, position=position
        ),
    )


_ABSTRACT_VALUE = re.compile(r"QuaxTracer<([\w.]+): ([^>]*)>")


# JAX's errors for a tracer used where a concrete value is needed.
_TRACER_ERRORS = tuple(
    cls
    for cls in (
        getattr(jax.errors, name, None)
        for name in (
            "ConcretizationTypeError",
            "TracerArrayConversionError",
            "TracerBoolConversionError",
            "TracerIntegerConversionError",
        )
    )
    if isinstance(cls, type)
)
# Modules whose `TypeError` about one of our tracers is about a concrete value
# that was needed: JAX's (`jnp.zeros(n)` raises a plain `TypeError`) and the
# core's (private modules, `internal`, `lax`, `numpy` and the hijax layer). The
# toolkits' rules (`quaxlike.lora`, ...) are user code like any other.
_JAX_MODULES = ("jax.", "jaxlib.")
_CORE_PUBLIC_MODULES = ("internal", "lax", "numpy", "experimental")


def _is_core_module(module: str) -> bool:
    package, _, rest = module.partition(".")
    if package != "quaxlike":
        return False
    if module.startswith("quaxlike.experimental.hijax_units"):
        return False
    first = rest.partition(".")[0]
    return first == "" or first.startswith("_") or first in _CORE_PUBLIC_MODULES


def _raised_by_jax(error: TypeError) -> bool:
    """Whether JAX raised `error` (one of its tracer errors, or a `TypeError`
    raised in its code or ours), rather than the user's own code."""
    if isinstance(error, _TRACER_ERRORS):
        return True
    frame, traceback = None, error.__traceback__
    while traceback is not None:
        frame, traceback = traceback.tb_frame, traceback.tb_next
    module = "" if frame is None else str(frame.f_globals.get("__name__", ""))
    return module.startswith(_JAX_MODULES) or _is_core_module(module)


def _concrete_value_error(error: TypeError) -> Exception | None:
    """JAX's error for a traced value used where a concrete one is needed (a
    shape, an index, a Python `bool`), when that value is one of ours; an
    instance of JAX's class too. A `TypeError` the user's own code raised (its
    message may show a tracer) is left as it is."""
    if isinstance(error, QuaxlikeError):
        return None
    match = _ABSTRACT_VALUE.search(str(error))
    if match is None or not _raised_by_jax(error):
        return None
    type_name, aval = match.groups()
    return keeping_class(
        ValueNotConcreteError,
        error,
        messages.VALUE_NOT_CONCRETE.format(type_name=type_name, aval=aval, error=error),
    )


def _value_subclasses():
    pending, seen = [Value], []
    while pending:
        cls = pending.pop()
        seen.append(cls)
        pending.extend(cls.__subclasses__())
    return seen


def _call_in_trace(trace: QuaxTrace, leaves, treedef, static, selected):
    # Runs in its own frame so that no local variable outlives the trace: JAX's
    # leak checker counts any live reference to one of its tracers.
    if selected is None:
        lifted = [trace.lift(x) if is_value(x) else x for x in leaves]
    else:
        lifted = [trace.lift(x) if chosen else x for x, chosen in zip(leaves, selected)]
    dynamic = jtu.tree_unflatten(treedef, lifted)
    fn, args, kwargs = dynamic if static is None else eqx.combine(dynamic, static, is_leaf=is_value)
    tracking = _known_values.opening_for(leaves)
    try:
        out = fn(*args, **kwargs)
    finally:
        _known_values.closing(tracking)
    if type(out) in _LEAF_TYPES:
        return trace.unwrap(out)  # a single leaf: what flattening finds
    # Flatten fully (into Values too) so that a Value built from this trace's
    # tracers comes back as a Value holding Values, not holding tracers.
    out_leaves, out_treedef = jtu.tree_flatten(out)
    return jtu.tree_unflatten(out_treedef, [trace.unwrap(x) for x in out_leaves])


# With JAX's leak checker on, each finished trace is checked for tracers still
# referring to it, which costs a full garbage collection. A `quaxify` nested in
# another (inside a rule, a jit body, an operator) leaves its trace here for
# the outermost call to check, so a whole call pays for one collection.
_unchecked_traces: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "quaxlike_unchecked_traces", default=None
)


def _run_in_new_trace(
    leaves, treedef, static, adopts: tuple[QuaxTrace, ...] = (), selected: list | None = None
):
    """Run `(fn, args, kwargs)`, given as flattened `leaves`, in a new `QuaxTrace`
    that lifts the Values among them, or those marked in `selected` (and takes
    over the tracers of the traces in `adopts`: see `QuaxTrace`)."""
    checking = jc.check_leaks_enabled()
    unchecked = _unchecked_traces.get()
    outermost = checking and unchecked is None
    token = None
    if outermost:
        unchecked = []
        token = _unchecked_traces.set(unchecked)
    try:
        with jc.take_current_trace() as parent:
            trace = QuaxTrace(parent, adopts)
            try:
                with jc.set_current_trace(trace):
                    out = _call_in_trace(trace, leaves, treedef, static, selected)
            finally:
                trace.invalidate()
    finally:
        if token is not None:
            _unchecked_traces.reset(token)
    if checking:
        cast(list, unchecked).append(trace)  # this call's list, or the enclosing one's
        del trace
        if outermost:
            jc.check_no_leaks(unchecked)
    return out


def _call(fn, filter_spec, args, kwargs):
    selected = None
    plain_call = filter_spec is True and not kwargs and type(fn) in _FUNCTION_TYPES
    flat = _flat_call(fn, args) if plain_call else None
    if flat is not None:
        # A plain function of Values, arrays and numbers (every one a leaf):
        # the leaves and structure flattening would find, without flattening.
        (leaves, treedef), static = flat, None
        lifting = any(map(is_value, args))
    elif filter_spec is not True and callable(filter_spec) and _is_single_leaf(filter_spec):
        # One predicate for every leaf: what `eqx.partition` and `eqx.combine`
        # would do with it, in one pass over the leaves instead of four (only
        # Values are asked: nothing else is lifted).
        leaves, treedef = jtu.tree_flatten((fn, args, kwargs), is_leaf=is_value)
        selected = [is_value(x) and bool(filter_spec(x)) for x in leaves]
        static = None
        lifting = any(selected)
    else:
        dynamic, static = _partition(fn, args, kwargs, filter_spec)
        leaves, treedef = jtu.tree_flatten(dynamic, is_leaf=is_value)
        lifting = any(map(is_value, leaves))
    try:
        if not lifting:
            # Nothing to lift: exactly the function itself, at no cost.
            return fn(*args, **kwargs)
        return _run_in_new_trace(leaves, treedef, static, selected=selected)
    except TypeError as error:
        better = _unlifted_value_error(error) or _concrete_value_error(error)
        if better is None:
            raise
        raise better from error


# Types that are always leaves of a PyTree, and functions (leaves too) that
# hold nothing to lift.
_LEAF_TYPES = frozenset(
    {QuaxTracer, *([jc.ArrayImpl] if jc.ArrayImpl else []), np.ndarray, bool, int, float, complex}
)
_FUNCTION_TYPES = (types.FunctionType, types.BuiltinFunctionType)
# `(fn, args, {})`'s structure when every one is a leaf, by the number of args.
_flat_structures: dict[int, Any] = {}


def _flat_call(fn, args) -> tuple[list, Any] | None:
    """`(leaves, treedef)` of `(fn, args, {})` flattened with Values as leaves,
    where `fn` and every argument are leaves: Values, arrays or numbers; else
    `None` (the caller flattens)."""
    for a in args:
        if not (is_value(a) or type(a) in _LEAF_TYPES):
            return None
    treedef = _flat_structures.get(len(args))
    if treedef is None:
        treedef = _flat_structures[len(args)] = jtu.tree_structure((0, (0,) * len(args), {}))
    return [fn, *args], treedef


def _is_single_leaf(x) -> bool:
    # A callable that is also a PyTree with leaves of its own (a `jtu.Partial`)
    # is a prefix of filters to `eqx.partition`, not one filter.
    return jtu.treedef_is_leaf(jtu.tree_structure(x))


def lifted_call(
    fn: Callable[..., _Return], *args: Any, adopts: tuple[QuaxTrace, ...] = ()
) -> _Return:
    """`quaxify(fn)(*args)` for quaxlike's own rules: the same trace, without
    building a `Quaxify` wrapper (an Equinox Module) on every call. With
    `adopts`, the new trace takes over the tracers of those enclosing traces
    (for `shard_map` bodies: see `QuaxTrace`), and runs even with no Value
    among `args`."""
    leaves, treedef = jtu.tree_flatten((fn, args, {}), is_leaf=is_value)
    if not adopts and not any(map(is_value, leaves)):
        return fn(*args)
    return _run_in_new_trace(leaves, treedef, None, adopts)


class Quaxify(eqx.Module, Generic[_Return]):
    """The wrapper `quaxify` returns. An Equinox Module, so it is a PyTree whose
    leaves are those of the wrapped function."""

    fn: Callable[..., _Return]
    filter_spec: PyTree = eqx.field(static=True)
    check: bool | None = eqx.field(static=True, default=None)

    # Plain attribute lookup, as for Values: Equinox's own costs a few
    # microseconds per field read on every call.
    __getattribute__ = object.__getattribute__

    @property
    def __wrapped__(self) -> Callable[..., _Return]:
        return self.fn

    @jc.api_boundary
    def __call__(self, *args: Any, **kwargs: Any) -> _Return:
        # Module-level helpers rather than methods: a method looked up on an
        # Equinox Module instance is rebuilt as a bound-method Module each time.
        fn, filter_spec, check = self.fn, self.filter_spec, self.check
        if check is None:
            return _call(fn, filter_spec, args, kwargs)
        token = _instrument.checking.set(check)
        try:
            return _call(fn, filter_spec, args, kwargs)
        finally:
            _instrument.checking.reset(token)

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return jtu.Partial(self, instance)


def quaxify(
    fn: Callable[..., _Return],
    filter_spec: PyTree[bool | Callable[[Any], bool]] = True,
    *,
    check: bool | None = None,
) -> Callable[..., _Return]:
    """Make `fn` accept Values wherever it accepts arrays.

    On each call, `(fn, args, kwargs)` is split with
    `eqx.partition(..., filter_spec, is_leaf=<is a Value>)`. The selected Values are
    lifted into a new trace and `fn` runs on them as if they were arrays; every JAX
    primitive applied to one of them goes to the rules registered with
    `quaxlike.register`. Values in the output come back as Values, arrays as arrays.

    Leaves that `filter_spec` does not select pass through untouched, so an outer
    `quaxify` can claim them: nesting `quaxify` calls with different `filter_spec`s
    decides which type's rules see an operation first. When no Value is selected,
    `fn` is called directly.

    **Arguments:**

    - `fn`: the function to wrap. It may close over Values or take them as
        arguments, and may be an Equinox Module (a model) holding Values.
    - `filter_spec`: which leaves of `(fn, args, kwargs)` to lift: a bool, a
        callable `leaf -> bool`, or a PyTree prefix of those.
    - `check`: checked mode. `True` compares every rule's outputs with the
        primitive's own abstract evaluation (shapes, dtypes, weak types, number of
        outputs) and raises at the first mismatch, naming the rule; `False` turns
        that off; `None` (the default) keeps what encloses this call (the
        environment variable `QUAXLIKE_CHECK=1` turns it on everywhere).

    **Returns:**

    A wrapper with the same signature as `fn`. It is an `eqx.Module` (so a PyTree),
    keeps `fn`'s name and docstring, exposes it as `__wrapped__`, and binds as a
    method when used as a class attribute.

    !!! example

        ```python
        from quaxlike.lora import LoraArray

        @quaxlike.quaxify
        def f(w, x):
            return w @ x

        lora_weight = LoraArray(jnp.ones((3, 2)), rank=1, key=jr.key(0))
        x = jnp.arange(2.0)
        y = f(lora_weight, x)  # runs the registered `dot_general` rule for LoraArray
        assert jnp.allclose(y, lora_weight.dense() @ x)
        ```
    """
    return _new_quaxify(fn, filter_spec, check)


_WRAPPER_ATTRIBUTES = ("__module__", "__name__", "__qualname__", "__doc__", "__annotations__")


def _new_quaxify(fn, filter_spec, check) -> Quaxify:
    # What `eqx.module_update_wrapper(Quaxify(fn, filter_spec, check))` builds, at
    # a tenth of the cost: rules redispatch through `quaxify` on every primitive
    # they handle, so building the wrapper is on the interpreter's hot path. The
    # fields are set as Equinox's own unflattening sets them.
    wrapper = object.__new__(Quaxify)
    object.__setattr__(wrapper, "fn", fn)
    object.__setattr__(wrapper, "filter_spec", filter_spec)
    object.__setattr__(wrapper, "check", check)
    for name in _WRAPPER_ATTRIBUTES:
        try:
            value = getattr(fn, name)
        except AttributeError:
            continue
        object.__setattr__(wrapper, name, value)
    return wrapper
