"""`explain`: what a quaxified function does with its Values, rule by rule."""

import collections
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from . import _instrument, _jax_compat as jc
from ._instrument import Record


class Report:
    """What `explain(fn)(*args)` found while tracing `fn` as `quaxify` would.

    **Attributes:**

    - `records`: one `Record` per primitive applied to a Value, in program order.
        Each has `primitive`, `arg_types`, `handler` (the rule's qualified name, or
        `"default: materialised T"`, or the type's own default), `location` (the
        rule's source file and line), `inside` (the higher-order primitive whose
        body it is in, or `None`) and `children` (for a higher-order primitive,
        the records of its body, traced once).
    - `jaxpr`: the traced program, a `ClosedJaxpr` over the array leaves of the
        arguments; it computes exactly what the quaxified function computes.
    - `out_shape`: the output's structure, as `jax.ShapeDtypeStruct`s.

    `str(report)` is a readable listing with counts per rule and per primitive;
    `report.program()` renders `jaxpr` as Python-like code with the rule that
    emitted each equation as a comment. Reports are made by `quaxlike.explain`,
    not constructed directly.

    !!! example

        ```python
        from quaxlike.symbolic.zero import Zero

        report = quaxlike.explain(lambda z, x: jnp.exp(z * x))(
            Zero((3,), jnp.float32), jnp.ones(3)
        )
        assert report.primitive_counts["mul"] == 1  # `z * x`: a Zero by its rule
        assert len(report.materialised) == 1        # `exp(0)` is 1: materialised
        print(report.program())
        ```
    """

    def __init__(self, name: str, records: list[Record], jaxpr, out_shape):
        self.name = name
        self.records = records
        self.jaxpr = jaxpr
        self.out_shape = out_shape

    def walk(self) -> Iterator[Record]:
        """Every record, depth first (a body's records after their primitive's)."""
        pending = list(reversed(self.records))
        while pending:
            record = pending.pop()
            yield record
            pending.extend(reversed(record.children))

    @property
    def rule_counts(self) -> collections.Counter:
        """How many primitive applications each rule (or default) handled."""
        return collections.Counter(r.handler for r in self.walk())

    @property
    def primitive_counts(self) -> collections.Counter:
        """How many times each primitive was applied to Values."""
        return collections.Counter(r.primitive for r in self.walk())

    @property
    def materialised(self) -> list[Record]:
        """The records where a Value fell back to a dense array."""
        return [r for r in self.walk() if r.materialised]

    def __str__(self) -> str:
        total = sum(1 for _ in self.walk())
        lines = [f"explain({self.name}): {total} primitive application(s) on Values"]

        def emit(records, depth):
            for record in records:
                pad = "  " * (depth + 1)
                inside = f"[inside {record.inside}] " if record.inside else ""
                where = f"  ({record.location})" if record.location else ""
                lines.append(
                    f"{pad}{inside}{record.primitive}({', '.join(record.arg_types)})"
                    f" -> {record.handler}{where}"
                )
                emit(record.children, depth + 1)

        emit(self.records, 0)
        lines.append("rules:")
        lines += [f"  {n:>4}  {rule}" for rule, n in self.rule_counts.most_common()]
        lines.append("primitives:")
        lines += [f"  {n:>4}  {prim}" for prim, n in self.primitive_counts.most_common()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<quaxlike.explain report for {self.name}: {sum(1 for _ in self.walk())} records>"

    def program(self) -> str:
        """The traced program as Python-like code: one assignment per equation,
        nested functions for the bodies of higher-order primitives, and the
        quaxlike rule that emitted each equation as a comment."""
        return _Decompiler().render(self.jaxpr.jaxpr, self.name, self.jaxpr.consts)


def explain(fn: Callable, filter_spec: PyTree[bool | Callable[[Any], bool]] = True):
    """Trace `fn` as `quaxify(fn, filter_spec)` would, and report what happened.

    For every primitive applied to a Value it records the argument types and the
    rule chosen (its qualified name and source location), or how the default
    handled it (`"default: materialised LoraArray"`), nesting the records of the
    bodies of higher-order primitives (`jit`, `scan`, `cond`, ...) under them.
    Nothing is computed: `fn` is traced with `jax.make_jaxpr`, and the traced
    program is kept on the report. `explain` accepts what `quaxify` accepts: any
    PyTrees as positional and keyword arguments (an Equinox model, a Flax
    parameter dict), their array leaves traced and every other leaf (an
    activation function, a Python number) passed as it is, as
    `eqx.filter_make_jaxpr` does. Array leaves may also be
    `jax.ShapeDtypeStruct`s.

    **Arguments:**

    - `fn`: the function to explain.
    - `filter_spec`: as for `quaxify`.

    **Returns:**

    A function taking `fn`'s arguments and returning a `Report`. Print it for a
    listing; call `.program()` for the traced program as readable code.

    !!! example

        ```python
        from quaxlike.lora import LoraArray

        weight = LoraArray(jnp.ones((6, 4)), rank=2, key=jr.key(0))
        model = lambda w, x: jnp.tanh(w @ x)
        report = quaxlike.explain(model)(weight, jnp.ones(4))
        print(report)            # which rule ran for each primitive
        print(report.program())  # the program, annotated with the rules
        assert not report.materialised
        ```
    """
    from ._quaxify import quaxify

    name = getattr(fn, "__name__", type(fn).__name__)
    quaxified = quaxify(fn, filter_spec)

    def run(*args, **kwargs) -> Report:
        recorder = _instrument.Recorder()
        token = _instrument.recorder.set(recorder)
        try:
            jaxpr, out_shape = _make_jaxpr(quaxified, args, kwargs)
        finally:
            _instrument.recorder.reset(token)
        return Report(name, recorder.records, jaxpr, out_shape)

    return run


def _is_traced(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _make_jaxpr(fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """`jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)` for any PyTrees of
    arguments and results, as `eqx.filter_make_jaxpr` does: array leaves (and
    `jax.ShapeDtypeStruct`s) are traced, every other leaf (an Equinox model's
    activation function, a Flax module, a Python number) is passed as it is.

    Returns the `ClosedJaxpr` over the array leaves of `(args, kwargs)`, in
    flattening order, and the result with its array leaves replaced by
    `jax.ShapeDtypeStruct`s (its other leaves kept)."""
    dynamic, static = eqx.partition((args, kwargs), _is_traced)
    leaves, treedef = jtu.tree_flatten(dynamic)
    out_static = []

    def traced(*arrays):
        call_args, call_kwargs = eqx.combine(jtu.tree_unflatten(treedef, arrays), static)
        out_arrays, out_other = eqx.partition(fn(*call_args, **call_kwargs), eqx.is_array)
        out_static.append(out_other)
        return out_arrays

    jaxpr, out_arrays = jax.make_jaxpr(traced, return_shape=True)(*leaves)
    return jaxpr, eqx.combine(out_arrays, out_static[0])


# --- rendering a jaxpr as code ------------------------------------------------


def _sub_jaxprs(value) -> list:
    if isinstance(value, (jc.Jaxpr, jc.ClosedJaxpr)):
        return [value]
    if (
        isinstance(value, (tuple, list))
        and value
        and all(isinstance(v, (jc.Jaxpr, jc.ClosedJaxpr)) for v in value)
    ):
        return list(value)
    return []


def _short(value: Any, limit: int = 60) -> str:
    if hasattr(value, "dtype") and np.ndim(value) == 0:
        text = f"{np.asarray(value).item()!r}:{np.dtype(value.dtype).name}"
    else:
        text = repr(value)
    # One line per equation: multi-line reprs (JAX's wrapped functions) are
    # folded onto one.
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _uninteresting(value) -> bool:
    """Params left out of the rendering: unset options, functions, and tuples of
    nothing but those (a `jit`'s unspecified shardings and layouts)."""
    if value is None or value is False or callable(value) or isinstance(value, jc.WrappedFun):
        return True
    if type(value).__name__ == "UnspecifiedValue":
        return True
    if isinstance(value, tuple):
        return all(_uninteresting(v) for v in value)
    return False


def _rule_comment(eqn) -> str:
    stack = str(getattr(eqn.source_info, "name_stack", ""))
    rules = [part[len("quaxlike:") :] for part in stack.split("/") if part.startswith("quaxlike:")]
    return rules[-1] if rules else ""


class _Decompiler:
    def __init__(self):
        self.names: dict = {}
        self.functions = 0

    def name(self, var) -> str:
        if isinstance(var, jc.Literal):
            return _short(var.val, 30)
        if type(var).__name__ == "DropVar":
            return "_"
        if var not in self.names:
            self.names[var] = f"v{len(self.names)}"
        return self.names[var]

    def render(self, jaxpr, fn_name: str, consts=()) -> str:
        lines: list[str] = []
        self._function(jaxpr, fn_name, lines, 0, consts)
        return "\n".join(lines)

    def _function(self, jaxpr, fn_name, lines, depth, consts=()):
        if isinstance(jaxpr, jc.ClosedJaxpr):
            jaxpr, consts = jaxpr.jaxpr, jaxpr.consts
        pad = "    " * depth
        params = [f"{self.name(v)}: {v.aval.str_short()}" for v in jaxpr.invars]
        lines.append(f"{pad}def {fn_name}({', '.join(params)}):")
        for var, value in zip(jaxpr.constvars, consts):
            lines.append(f"{pad}    {self.name(var)} = {_short(value)}  # constant")
        for eqn in jaxpr.eqns:
            call_params = []
            for key, value in eqn.params.items():
                subs = _sub_jaxprs(value)
                if subs:
                    names = []
                    for sub in subs:
                        self.functions += 1
                        sub_name = f"{eqn.primitive.name}_{key}_{self.functions}"
                        self._function(sub, sub_name, lines, depth + 1)
                        names.append(sub_name)
                    call_params.append(
                        f"{key}={names[0] if len(names) == 1 else '(' + ', '.join(names) + ')'}"
                    )
                elif not _uninteresting(value):
                    call_params.append(f"{key}={_short(value)}")
            outs = ", ".join(self.name(v) for v in eqn.outvars) or "_"
            args = ", ".join([self.name(v) for v in eqn.invars] + call_params)
            types = ", ".join(v.aval.str_short() for v in eqn.outvars)
            rule = _rule_comment(eqn)
            comment = f"  # {types}" + (f"  <- {rule}" if rule else "")
            lines.append(f"{pad}    {outs} = {eqn.primitive.name}({args}){comment}")
        results = ", ".join(self.name(v) for v in jaxpr.outvars)
        lines.append(f"{pad}    return {results}")
