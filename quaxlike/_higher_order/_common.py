"""Helpers shared by the higher-order rules."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import ArrayLike

from .._diagnostics import MaterialisationError
from .._staging import split_arrays, StagedCall
from .._values import materialise_value, Value


AnyValue = ArrayLike | Value


def to_dense(x: Any, primitive) -> Any:
    return materialise_value(x, primitive, fallback=True) if isinstance(x, Value) else x


def to_dense_or_raise(x: Any, needed_by, error_class: type, template: str, **fields):
    """`to_dense(x, needed_by)` (a primitive), where a built-in rule needs `x` dense; if the
    Value refuses, `error_class(template.format(error=..., **fields))` is raised
    instead, from the type's own refusal, which `error` quotes with its class
    name."""
    try:
        return to_dense(x, needed_by)
    except MaterialisationError as error:
        refusal = error.__cause__ if error.__cause__ is not None else error
        quoted = f"{type(refusal).__name__}: {refusal}"
        raise error_class(template.format(error=quoted, **fields)) from refusal


def through_array_leaves(transform: Callable, fn: Callable, args: Sequence[Any]):
    """`transform(body)(...)` where `body` takes only the array leaves of `args`
    (a `StagedCall` made with `transform`, used once).

    JAX transformations (`jax.jit`, `jax.checkpoint`, ...) accept PyTrees of arrays;
    Values are PyTrees, but may hold non-array leaves (Python numbers, strings).
    Those are closed over, and non-array parts of the output are passed back
    outside the transformation, as `eqx.filter_jit` does.
    """
    split = split_arrays(list(args))
    return StagedCall(fn, "body", split, transform)(split.arrays)


def type_signature(x: Any):
    """What must agree between two loop carries or two branch outputs: the PyTree
    structure (including static fields) and the avals of the array leaves."""
    leaves, treedef = jtu.tree_flatten(x)
    return treedef, tuple(
        jax.typeof(leaf).str_short() if eqx.is_array(leaf) else (type(leaf), leaf)
        for leaf in leaves
    )
