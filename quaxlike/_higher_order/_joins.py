"""Where a plain array meets a Value: a loop carry or a `cond` output of one type.

A loop state often starts as `jnp.zeros` where the loop's body puts a Value (an
ODE solver's first stage, a least-squares solver's Jacobian operator closing
over a LoRA matrix), and a `cond` may return a Value from one branch and a plain
array from another. JAX needs one type there. Before materialising the Value, the
`cond` and loop rules ask its type for one: the Value side takes
`Value.joinable_form()` and the plain side `Value.holding_plain(array)`, a Value of
the same type and PyTree structure standing for exactly that array. A type that
cannot hold the array answers `None`, and the Value is materialised as before.
"""

from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._diagnostics import QuaxlikeError
from .._values import Value
from ._branch_callbacks import abstract_template


_HOLDING_MISMATCH = (
    "{type_name}.holding_plain returned a Value whose PyTree structure or leaf "
    "shapes differ from those of {type_name}.joinable_form() ({got} against "
    "{expected}), where a plain array meets a {type_name} at {where}. A loop carry "
    "and the outputs of a `cond`'s branches must agree exactly: `holding_plain` must "
    "return the structure of the Value it is called on, or `None`."
)


def joined_template(values: list[Value]) -> Value | None:
    """The abstract form (`jax.ShapeDtypeStruct` leaves) that the Values meeting
    at one place take there, `value.joinable_form()`, to build a plain side's
    Value from; `None` unless their joinable forms agree.

    **Arguments:**

    - `values`: the Values meeting (concrete or abstract leaves): a `cond`
        output's in the branches giving a Value, a loop carry on entry and as the
        body returns it.

    **Returns:**

    A Value with abstract leaves, or `None`.
    """
    forms = [
        eqx.filter_eval_shape(lambda v: v.joinable_form(), abstract_template(value))
        for value in values
    ]
    if len({_structure(form) for form in forms}) != 1:
        return None
    return forms[0]


def join_side(x: Any, template: Value, position: int, where: str, declined: set[int]) -> Any:
    """`x` as it enters the join: a Value takes its joinable form, a plain array
    is held by `template`'s type.

    **Arguments:**

    - `x`: a Value or a plain array.
    - `template`: `joined_template` of the Value side.
    - `position`: the carry's or output's index.
    - `where`: what meets, for the error message ("carry 2 of `while`").
    - `declined`: where the type declines to hold the plain array, `position` is
        added here and `x` returned as it is: JAX then rejects the mismatch after
        tracing, and the rule materialises that position instead. (Raising here,
        inside the branch or loop body being traced, would leave that trace's
        tracers referenced from the traceback.)

    **Returns:**

    A Value with `template`'s structure, or `x` where declined.
    """
    if isinstance(x, Value):
        return x.joinable_form()
    held = template.holding_plain(x)
    if held is None:
        declined.add(position)
        return x
    got, expected = _structure(held), _structure(template)
    if got != expected:
        type_name = type(template).__name__
        raise QuaxlikeError(
            _HOLDING_MISMATCH.format(type_name=type_name, got=got, expected=expected, where=where)
        )
    return held


def _structure(value: Value):
    leaves, treedef = jtu.tree_flatten(value)
    return treedef, tuple(
        (tuple(leaf.shape), jax.numpy.dtype(leaf.dtype)) if hasattr(leaf, "shape") else repr(leaf)
        for leaf in leaves
    )
