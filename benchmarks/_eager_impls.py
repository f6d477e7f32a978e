"""The implementations `eager_ops.py` runs side by side: quaxlike, Quax (when it
is importable) and a minimal forwarding trace, the floor of any trace that
forwards each operation.

For each of quaxlike and Quax this module builds the same small value types from
that library's own base class and `register`, so that both run the same rules:

- `MyArray`: a user value wrapping one array, with rules for `add` and `mul`
  that unwrap, apply the primitive and wrap again (the smallest rule-bearing
  type);
- `Dense`: a value with no rule at all, only `materialise` (every primitive
  takes the default rule: materialise and bind). For quaxlike the benchmark
  uses the library's own `DenseArrayValue` instead, the type the issue's
  targets name; this class is what a Quax user would write for the same thing.

The example types (`Zero`, `Unitful`, `LoraArray`) are each library's own.
"""

# No `from __future__ import annotations`: plum reads the rules' annotations as
# objects, and these classes are local.
import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.extend.core as jexc
import jax.tree_util as jtu


@dataclasses.dataclass
class Impl:
    """One library's entry points and types, as the cases use them.

    **Arguments:**

    - `name`: the column's name in the tables.
    - `quaxify`: the library's `quaxify`.
    - `dense`: wraps an array in a value that has no rule of its own.
    - `my_array`: wraps an array in a value with `add` and `mul` rules.
    - `zero`: builds a symbolic zero of a shape and dtype.
    - `unitful`: `(array, unit name)` to a value with units (`"m"` or `"km"`).
    - `lora`: `(weight, rank, key, allow_materialise)` to a LoRA value.
    """

    name: str
    quaxify: Callable[..., Any]
    dense: Callable[[Any], Any]
    my_array: Callable[[Any], Any]
    zero: Callable[[tuple[int, ...], Any], Any]
    unitful: Callable[[Any, str], Any]
    lora: Callable[..., Any]
    units: tuple[str, ...]


def _value_types(lib: Any) -> tuple[type, type]:
    """`(MyArray, Dense)` built on `lib.ArrayValue`, with `MyArray`'s two rules
    registered through `lib.register`."""

    class MyArray(lib.ArrayValue):
        array: jax.Array

        def aval(self):
            return jax.core.ShapedArray(self.array.shape, self.array.dtype)

        def materialise(self):
            return self.array

    class Dense(lib.ArrayValue):
        array: jax.Array

        def aval(self):
            return jax.core.ShapedArray(self.array.shape, self.array.dtype)

        def materialise(self):
            return self.array

    @lib.register(jax.lax.add_p)
    def _add(x: MyArray, y: MyArray, **params):
        return MyArray(jax.lax.add(x.array, y.array))

    @lib.register(jax.lax.mul_p)
    def _mul(x: MyArray, y: MyArray, **params):
        return MyArray(jax.lax.mul(x.array, y.array))

    return MyArray, Dense


def quaxlike_impl() -> Impl:
    """quaxlike's entry points and types.

    **Returns:** the `Impl`.
    """
    import quaxlike
    from quaxlike import units as unitful
    from quaxlike.lora import LoraArray
    from quaxlike.symbolic.zero import Zero

    my_array, _ = _value_types(quaxlike)
    units = {"m": unitful.m, "km": unitful.km}
    return Impl(
        name="quaxlike",
        quaxify=quaxlike.quaxify,
        dense=quaxlike.DenseArrayValue,
        my_array=my_array,
        zero=Zero,
        unitful=lambda x, unit: unitful.Unitful(x, units[unit]),
        lora=lambda w, rank, key, allow_materialise=False: LoraArray(
            w, rank=rank, key=key, allow_materialise=allow_materialise
        ),
        units=tuple(units),
    )


def quax_available() -> bool:
    """Whether Quax can be imported here (it is not a dependency of quaxlike)."""
    return importlib.util.find_spec("quax") is not None


def quax_impl() -> Impl:
    """Quax's entry points and types (Quax must be importable).

    **Returns:** the `Impl`; its name carries Quax's version.
    """
    import quax
    from quax.examples import lora, unitful, zero

    my_array, dense = _value_types(quax)
    version = getattr(quax, "__version__", "")
    return Impl(
        name=f"quax {version}".strip(),
        quaxify=quax.quaxify,
        dense=dense,
        my_array=my_array,
        zero=zero.Zero,
        unitful=lambda x, unit: unitful.Unitful(x, {"m": unitful.meters}[unit]),
        lora=lambda w, rank, key, allow_materialise=False: lora.LoraArray(
            w, rank=rank, key=key, allow_materialise=allow_materialise
        ),
        units=("m",),
    )


# --- a minimal forwarding trace ------------------------------------------------


class _ForwardTracer(jax.core.Tracer):
    """Holds one concrete array of the trace that forwards it."""

    __slots__ = ("val",)

    def __init__(self, trace: "_ForwardTrace", val: Any):
        self._trace = trace
        self.val = val

    @property
    def aval(self):
        return jax.typeof(self.val)


class _ForwardTrace(jax.core.Trace):
    """A trace whose every primitive is bound again, unchanged, on the trace
    below it: the work any Value-interpreting trace does at the least. With
    `compiled`, a `jit` equation (every `jax.numpy` call) is run instead through
    one `jax.jit` of its sub-program, made once and called through JAX's C++
    dispatch: the floor of a trace that runs eager calls as quaxlike's
    `run_compiled` does, with no check of the call's params (the benchmark's
    calls ask for nothing beyond `keep_unused`)."""

    def __init__(self, parent: Any, tag: Any, compiled: bool = False):
        super().__init__()
        self.parent = parent
        self.tag = tag
        self.compiled = compiled

    def _lower(self, x: Any) -> Any:
        return x.val if isinstance(x, _ForwardTracer) and x._trace.tag is self.tag else x

    def process_primitive(self, primitive, tracers, params):
        vals = [self._lower(t) for t in tracers]
        with jexc.set_current_trace(self.parent):
            if self.compiled and primitive is jexc.primitives.jit_p:
                out = _compiled_sub_program(params)(*vals)
            else:
                out = primitive.bind(*vals, **params)
        if primitive.multiple_results:
            return [_ForwardTracer(self, o) for o in out]
        return _ForwardTracer(self, out)


# One `jax.jit` per sub-program (the jaxpr is kept, so its id stays its own).
_compiled: dict[int, tuple[Any, Callable[..., Any]]] = {}


def _compiled_sub_program(params: dict) -> Callable[..., Any]:
    closed_jaxpr = params["jaxpr"]
    entry = _compiled.get(id(closed_jaxpr))
    if entry is None:
        call = jax.jit(jexc.jaxpr_as_fun(closed_jaxpr), keep_unused=params["keep_unused"])
        entry = _compiled[id(closed_jaxpr)] = (closed_jaxpr, call)
    return entry[1]


def forward(fn: Callable[..., Any], compiled: bool = False) -> Callable[..., Any]:
    """`fn` run under a fresh forwarding trace (like `quaxify` with nothing to
    dispatch on).

    **Arguments:**

    - `fn`: a function of arrays.
    - `compiled`: run each `jit` equation through one compiled call (see
      `_ForwardTrace`).

    **Returns:** a function with the same results as `fn`.
    """

    def run(*args: Any) -> Any:
        tag = jexc.TraceTag()
        with jexc.take_current_trace() as parent:
            trace = _ForwardTrace(parent, tag, compiled)
            inputs = jtu.tree_map(lambda a: _ForwardTracer(trace, a), args)
            with jexc.set_current_trace(trace):
                out = fn(*inputs)
            return jtu.tree_map(trace._lower, out)

    return run
