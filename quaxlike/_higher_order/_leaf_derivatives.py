"""Derivatives between a Value's array leaves and the array it stands for.

A custom derivative rule speaks of the array a Value stands for: a `custom_jvp`
rule takes its tangent, a `custom_vjp` backward pass may return its cotangent as
an ordinary array. JAX differentiates the Value's leaves. Two linear maps join
them, both the derivative of `Value.dense_for_derivatives()` at the leaves:

- `dense_tangent`: leaf tangents to the tangent of the array (a pushforward);
- `leaf_cotangents`: a dense cotangent to cotangents of the leaves (its transpose,
  a pull-back). For LoRA `W + A B`: `ct_A = ct B^T`, `ct_B = A^T ct`.

Both run inside `jax.jit` (`eqx.filter_jit`, so non-array fields stay static),
where XLA drops the dense array itself, which neither map needs; eagerly too,
nothing the size of the dense array is kept but the tangent or cotangent.
"""

from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._diagnostics import MaterialisationError, messages
from .._values import checked_aval, follow_values, Value


def _is_none(x: Any) -> bool:
    return x is None


class _RefusedForDerivative(Exception):
    """Carries a type's refusal out of the jitted function, with the type's name."""

    def __init__(self, type_name: str, error: Exception):
        super().__init__(type_name, error)
        self.type_name, self.error = type_name, error


def _dense_of(value: Value) -> Any:
    """`array_for_derivatives(value)`, a refusal carried out with the type's name."""

    def step(v):
        try:
            return v.dense_for_derivatives()
        except MaterialisationError:
            raise
        except Exception as error:
            raise _RefusedForDerivative(type(v).__name__, error) from error

    return follow_values(value, step)


def _inexact_part(value: Value):
    """`(dynamic, static)`: the Value's inexact array leaves (the ones derivatives
    reach), and the rest."""
    return eqx.partition(value, eqx.is_inexact_array)


@eqx.filter_jit
def _pushforward(value: Value, tangents: Any) -> Any:
    dynamic, static = _inexact_part(value)
    _, tangent = jax.jvp(lambda d: _dense_of(eqx.combine(d, static)), (dynamic,), (tangents,))
    return tangent


@eqx.filter_jit
def _pullback(value: Value, cotangent: Any) -> Any:
    dynamic, static = _inexact_part(value)
    _, vjp = jax.vjp(lambda d: _dense_of(eqx.combine(d, static)), dynamic)
    (leaf_cts,) = vjp(cotangent)
    return leaf_cts


def _refusal(error: _RefusedForDerivative, value: Value, primitive, what: str):
    return MaterialisationError(
        messages.DERIVATIVE_NEEDED_DENSE.format(
            primitive=getattr(primitive, "name", str(primitive)),
            what=what,
            type_name=type(value).__name__,
            refusing=error.type_name,
            error=f"{type(error.error).__name__}: {error.error}",
        )
    )


def _array_slots(value: Value) -> tuple[list, Any]:
    """The Value's leaves with `None` in place of its non-array ones, and the
    structure to rebuild it (`None` included)."""
    arrays = eqx.filter(value, eqx.is_array)
    return jtu.tree_flatten(arrays, is_leaf=_is_none)


def dense_array(value: Value, primitive) -> Any:
    """The array `value` stands for, built by `dense_for_derivatives()`: for a
    tangent or cotangent that a derivative rule gave as a Value, where the
    derivative must be an ordinary array.

    **Arguments:**

    - `value`: the Value.
    - `primitive`: the primitive whose rule needs it, named in errors.

    **Returns:**

    An ordinary array of the value's shape and dtype.
    """
    try:
        return _dense_of(value)
    except _RefusedForDerivative as error:
        what = "the values (a derivative that a rule gave as a Value)"
        raise _refusal(error, value, primitive, what) from error.error


def dense_tangent(value: Value, leaf_tangents: list, primitive) -> Any:
    """The tangent of the array `value` stands for.

    **Arguments:**

    - `value`: the Value (its leaves are the primal point).
    - `leaf_tangents`: one tangent per array leaf of `value`, in the order
        `jtu.tree_leaves(eqx.filter(value, eqx.is_array))` gives them; tangents
        of integer leaves are ignored.
    - `primitive`: the primitive whose rule needs it, named in errors.

    **Returns:**

    An ordinary array of the value's shape: the derivative of
    `value.dense_for_derivatives()` in the direction of `leaf_tangents`.
    """
    slots, treedef = _array_slots(value)
    given = iter(leaf_tangents)
    tangents = []
    for leaf in slots:
        tangent = None if leaf is None else next(given)
        tangents.append(tangent if eqx.is_inexact_array(leaf) else None)
    try:
        return _pushforward(value, jtu.tree_unflatten(treedef, tangents))
    except _RefusedForDerivative as error:
        raise _refusal(error, value, primitive, "the tangent") from error.error


def leaf_cotangents(value: Value, cotangent: Any, primitive) -> list:
    """Cotangents of `value`'s array leaves, pulled back from a cotangent of the
    array it stands for.

    **Arguments:**

    - `value`: the Value (its leaves are the primal point).
    - `cotangent`: an ordinary array of the value's shape and dtype.
    - `primitive`: the primitive whose rule needs it, named in errors.

    **Returns:**

    One cotangent per array leaf of `value` (in the order of `dense_tangent`'s
    `leaf_tangents`), `None` for integer leaves.
    """
    aval = checked_aval(value)
    if getattr(cotangent, "dtype", None) != getattr(aval, "dtype", None):
        cotangent = jax.numpy.asarray(cotangent, aval.dtype)  # pyright: ignore
    try:
        pulled = _pullback(value, cotangent)
    except _RefusedForDerivative as error:
        raise _refusal(error, value, primitive, "a cotangent pulled back to the leaves") from (
            error.error
        )
    slots, _ = _array_slots(value)
    pulled_slots = jtu.tree_leaves(pulled, is_leaf=_is_none)
    return [ct for leaf, ct in zip(slots, pulled_slots) if leaf is not None]
