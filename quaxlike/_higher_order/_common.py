"""Helpers shared by the higher-order rules."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import ArrayLike

from .._staging import join_arrays, split_arrays
from .._values import fallback_materialise, Value


AnyValue = ArrayLike | Value


def to_dense(x: Any, primitive) -> Any:
    return fallback_materialise(x, primitive) if isinstance(x, Value) else x


def through_array_leaves(transform: Callable, fn: Callable, args: Sequence[Any]):
    """Call `transform(body)` where `body` takes only the array leaves of `args`.

    JAX transformations (`jax.jit`, `jax.checkpoint`, ...) accept PyTrees of arrays;
    Values are PyTrees, but may hold non-array leaves (Python numbers, strings).
    Those are closed over, and non-array parts of the output are passed back
    outside the transformation, as `eqx.filter_jit` does.
    """
    arrays, *structure = split_arrays(list(args))
    out_structure: list = []

    def body(*in_arrays):
        out_arrays, *found = split_arrays(fn(*join_arrays(in_arrays, *structure)))
        out_structure[:] = found
        return out_arrays

    out_arrays = transform(body)(*arrays)
    return join_arrays(out_arrays, *out_structure)


def type_signature(x: Any):
    """What must agree between two loop carries or two branch outputs: the PyTree
    structure (including static fields) and the avals of the array leaves."""
    leaves, treedef = jtu.tree_flatten(x)
    return treedef, tuple(
        jax.typeof(leaf).str_short() if eqx.is_array(leaf) else (type(leaf), leaf)
        for leaf in leaves
    )


def describe_type(x: Any) -> str:
    if isinstance(x, Value):
        return f"{type(x).__qualname__}{_aval_text(x)}"
    try:
        return jax.typeof(x).str_short()
    except TypeError:
        return type(x).__qualname__


def _aval_text(x: Value) -> str:
    try:
        return f"[{x.aval().str_short()}]"
    except Exception:  # a broken aval() is reported elsewhere
        return ""
