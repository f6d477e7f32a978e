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


def joined_template(sides: list[Any]) -> Value | None:
    """The abstract form (`jax.ShapeDtypeStruct` leaves) that the Values meeting
    at one place take there, `value.joinable_form()`, to build a plain side's
    Value from; `None` where no Value meets there or their joinable forms differ.

    **Arguments:**

    - `sides`: what meets, each a Value (concrete or abstract leaves) or `None`
        for a plain array: a `cond` output in each branch, a loop carry on entry
        and as the body returns it. A Value still standing in
        (`Value.standing_in`) counts as a plain array.

    **Returns:**

    A Value with abstract leaves, or `None`.
    """
    forms = [
        eqx.filter_eval_shape(lambda v: v.joinable_form(), abstract_template(side))
        for side in sides
        if side is not None and not _standing_in(side)
    ]
    if not forms or len({_structure(form) for form in forms}) != 1:
        return None
    return forms[0]


def joined(xs: list[Any]) -> list[Value] | None:
    """`xs`, Values and plain arrays of one shape and dtype meeting in one
    operation (a `select_n` of them, say), as Values of one type and structure:
    the Values in their joinable forms, the plain arrays held by that type;
    `None` where the forms differ or the type does not hold a plain array.

    **Arguments:**

    - `xs`: the operands, in the current trace, at least one a Value.

    **Returns:**

    The joined Values, in the order of `xs`, or `None`.

    !!! example

        ```python
        from quaxlike.lora import LoraArray

        lora = LoraArray(jnp.eye(3), rank=1, key=jax.random.key(0))
        held, same = quaxlike.internal.joined([jnp.ones((3, 3)), lora])
        assert jnp.allclose(held.dense(), jnp.ones((3, 3)))
        assert jnp.allclose(same.dense(), lora.dense())
        ```
    """
    forms = [x.joinable_form() if isinstance(x, Value) else None for x in xs]
    template = next(form for form in forms if form is not None)
    expected = _structure(template)
    out: list[Value] = []
    for x, form in zip(xs, forms):
        value = form if form is not None else template.holding_plain(x)
        if value is None or _structure(value) != expected:
            return None
        out.append(value)
    return out


def join_side(x: Any, template: Value, position: int, where: str, declined: set[int]) -> Any:
    """`x` as it enters the join: a Value takes its joinable form, a plain array
    is held by `template`'s type.

    **Arguments:**

    - `x`: a Value or a plain array (or a Value still standing in, held as one).
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
    if isinstance(x, Value) and not _standing_in(x):
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


def _standing_in(side: Any) -> bool:
    return isinstance(side, Value) and side.standing_in()


def _structure(value: Value):
    leaves, treedef = jtu.tree_flatten(value)
    return treedef, tuple(
        (tuple(leaf.shape), jax.numpy.dtype(leaf.dtype)) if hasattr(leaf, "shape") else repr(leaf)
        for leaf in leaves
    )


def same_structure(a: Value, b: Value) -> bool:
    """Whether two Values (concrete or abstract leaves) have one PyTree structure,
    static fields included, and the same leaf shapes and dtypes."""
    return _structure(a) == _structure(b)
