"""Run one function on one column's Values and sort the outcome.

Outcomes (the `status` of a `Cell`):

- `works`: the quaxified call gives what plain JAX gives on the dense arrays
  (`detail` says whether the result is still a Value of the type, `value`, or a
  plain array, `array`);
- `refused`: a `quaxlike.QuaxlikeError` naming the type and the primitive (or
  function) it could not handle (`detail` is the primitive);
- `wrong`: a result that differs from plain JAX's, or has another structure;
- `unclear`: any other error, or a refusal that does not say what and where;
- `n/a`: the column's type cannot stand for any argument of the call (`detail`
  says so), or plain JAX itself refuses the dense arguments.

Each call is traced as `jax.jit` would trace it (the arrays among its arguments
are the traced inputs), so the rules see what they see in a jitted program, and
the traced program is then evaluated equation by equation on the concrete
arrays: only each primitive is compiled, once per shape, which the tiny shapes
make cheap, instead of every cell's program. The slow test runs the same table
with each call compiled by `jax.jit` instead.
"""

import dataclasses
import re
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from _columns import Column, dense_tree
from _signatures import Call, SLOT_ARRAYS

import quaxlike


@dataclasses.dataclass(frozen=True)
class Cell:
    status: str
    detail: str = ""
    error: str = ""  # for a refusal: the class of the error

    def as_json(self) -> list[str]:
        return [self.status, self.detail, self.error] if self.error else [self.status, self.detail]


# Every primitive name JAX defines, to find the one a refusal names.
def _primitive_names() -> frozenset[str]:
    names = {p.name for p in vars(jex.primitives).values() if isinstance(p, jex.Primitive)}
    names |= {p.name for p in vars(jax.lax).values() if isinstance(p, jex.Primitive)}
    return frozenset(names)


_PRIMITIVES = _primitive_names()
_BACKTICKED = re.compile(r"`([\w\-.]+)`")


def _named_primitive(message: str) -> str | None:
    for word in _BACKTICKED.findall(message):
        if word in _PRIMITIVES or word.startswith("jnp."):
            return word
    return None


def classify_error(column: Column, error: BaseException) -> Cell:
    message = str(error)
    primitive = _named_primitive(message)
    said = (message + " " + type(error).__name__).lower()
    names_type = any(name.lower() in said for name in column.names)
    if isinstance(error, quaxlike.QuaxlikeError) and names_type and primitive is not None:
        return Cell("refused", primitive, type(error).__name__)
    return Cell("unclear", f"{type(error).__name__}: {_first_line(message)}")


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line[:160]


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _comparable(tree):
    def leaf(x):
        if _is_key(x):
            return np.asarray(jax.random.key_data(x))
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            return np.asarray(x)
        return x

    return jax.tree.map(leaf, tree)


def _close(got, expected, rtol, atol, atol_of_largest=False) -> bool:
    got_leaves, got_tree = jax.tree.flatten(_comparable(got))
    exp_leaves, exp_tree = jax.tree.flatten(_comparable(expected))
    if got_tree != exp_tree:
        return False
    for a, b in zip(got_leaves, exp_leaves):
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            a, b = np.asarray(a), np.asarray(b)
            if a.shape != b.shape or a.dtype != b.dtype:
                return False
            if a.dtype == bool or np.issubdtype(a.dtype, np.integer):
                if not np.array_equal(a, b):
                    return False
            else:
                finite = np.abs(b[np.isfinite(b)]) if b.size else b
                largest = max(1.0, float(np.max(finite))) if finite.size else 1.0
                scale = largest if atol_of_largest else 1.0
                if not np.allclose(a, b, rtol=rtol, atol=atol * scale, equal_nan=True):
                    return False
        elif a != b:
            return False
    return True


def _arguments(call: Call, column: Column) -> tuple[dict[int, Any], str | None]:
    """The Values for the call's slots (by slot number), or why there are none."""
    values = {}
    for i, slot in enumerate(call.slots()):
        value = column.make(slot.name, SLOT_ARRAYS[slot.name])
        if value is not None:
            values[i] = value
            if column.placement == "first":
                break
    if not values:
        return values, "the type cannot stand for these arguments"
    return values, None


def run_cell(fn: Callable, call: Call, column: Column, jit: bool = False) -> Cell:
    # Warnings are errors, here as in the test suite, so that the table comes
    # out the same wherever it is computed. JAX's filtering of tracebacks is off:
    # it costs more than a small refused call itself.
    filtering = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return _run_cell(fn, call, column, jit)
    finally:
        jax.config.update("jax_traceback_filtering", filtering)


def _run_cell(fn: Callable, call: Call, column: Column, jit: bool) -> Cell:
    values, why_not = _arguments(call, column)
    if why_not is not None:
        return Cell("n/a", why_not)
    dense = {i: dense_tree(v) for i, v in values.items()}

    def plain(i, slot):
        return jnp.asarray(SLOT_ARRAYS[slot.name])

    dense_args, dense_kwargs = call.fill(
        lambda i, slot: dense.get(i) if i in dense else plain(i, slot)
    )
    value_args, value_kwargs = call.fill(
        lambda i, slot: values.get(i) if i in values else plain(i, slot)
    )

    try:
        expected = _evaluate(fn, dense_args, dense_kwargs, jit)
    except Exception as error:  # plain JAX refuses the dense arguments too
        return Cell("n/a", f"plain JAX refuses: {type(error).__name__}")
    try:
        got = _evaluate(quaxlike.quaxify(fn), value_args, value_kwargs, jit)
    except Exception as error:
        return classify_error(column, error)
    is_value = any(
        isinstance(x, quaxlike.Value)
        for x in jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, quaxlike.Value))
    )
    rtol, atol = column.tol
    if not _close(dense_tree(got), expected, rtol, atol, column.atol_of_largest):
        return Cell("wrong", "differs from plain JAX on the dense arrays")
    if (
        column.rescale is not None
        and column.canonical is not None
        and fn not in column.unit_dependent
    ):
        # The same Values in another form (quantities in another unit) must
        # give the same result: the numbers alone cannot show a wrong unit.
        rescaled = {i: column.rescale(v) for i, v in values.items()}
        other_args, other_kwargs = call.fill(
            lambda i, slot: rescaled[i] if i in rescaled else plain(i, slot)
        )
        try:
            other = _evaluate(quaxlike.quaxify(fn), other_args, other_kwargs, jit)
        except Exception as error:
            return Cell("wrong", f"fails in another unit: {type(error).__name__}")
        if not _close(column.canonical(other), column.canonical(got), 1e-4, 1e-4):
            return Cell("wrong", "its unit is wrong: in another unit, another result")
    return Cell("works", "value" if is_value else "array")


def _evaluate(fn: Callable, args: tuple, kwargs: dict, jit: bool):
    """`fn(*args, **kwargs)` as `jax.jit` would run it, with the arrays among the
    arguments as the traced inputs (other leaves, such as units, stay static).

    The program is traced once with `jax.make_jaxpr`; then, unless `jit`, its
    equations are evaluated one by one on the concrete inputs (the bodies of
    nested `jit`s inlined), so that only each primitive is compiled, once per
    shape, instead of each cell's whole program."""
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    leaves, treedef = jtu.tree_flatten(dynamic)
    out_static = []

    def traced(*leaves):
        call_args, call_kwargs = eqx.combine(jtu.tree_unflatten(treedef, leaves), static)
        out_arrays, out_other = eqx.partition(fn(*call_args, **call_kwargs), eqx.is_array)
        out_static.append(out_other)
        return out_arrays

    if jit:
        out_arrays = jax.jit(traced)(*leaves)
        return eqx.combine(out_arrays, out_static[-1])
    closed, shapes = jax.make_jaxpr(traced, return_shape=True)(*leaves)
    flat = _interpret(closed.jaxpr, closed.consts, leaves)
    out_arrays = jtu.tree_unflatten(jtu.tree_structure(shapes), flat)
    return jax.block_until_ready(eqx.combine(out_arrays, out_static[-1]))


_INLINED = {
    jex.primitives.jit_p: "jaxpr",
    jex.primitives.closed_call_p: "call_jaxpr",
    jex.primitives.custom_jvp_call_p: "call_jaxpr",
}


def _interpret(jaxpr, consts, args) -> list:
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jex.Literal) else env[v]

    for eqn in jaxpr.eqns:
        inputs = [read(v) for v in eqn.invars]
        inlined = _INLINED.get(eqn.primitive)
        if inlined is not None:
            body = eqn.params[inlined]
            outputs = _interpret(body.jaxpr, body.consts, inputs)
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            if isinstance(params, (tuple, list)):  # before JAX 0.10: (subfuns, params)
                subfuns, params = params
                inputs = [*subfuns, *inputs]
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*inputs, **params)
            outputs = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, outputs))
    return [read(v) for v in jaxpr.outvars]
