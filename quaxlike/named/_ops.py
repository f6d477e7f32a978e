"""Operations addressed by axis name: `rename`, `align`, `sum`, `dot` and `trace`.

Their array arguments are annotated `NamedArray | ArrayLike` so that a plain
array (or a tracer, inside `quaxify`) reaches the check below and gets an error
that says why it cannot have names there.

They take `NamedArray`s themselves, so they are called outside `quaxify` (and
work under `jax.jit`, `jax.grad` and `jax.vmap`). Each one turns names into
positions and runs the positional operation through `quaxify`, so the rules
check and carry the names as usual.
"""

from collections.abc import Mapping, Sequence
from typing import cast

import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike
from jaxtyping import Array, ArrayLike

import quaxlike

from ._quax_names import Axis
from ._value import AxisName, check_names, NamedArray, NamedAxisError


_NOT_NAMED_MSG = (
    "`{fn}` takes NamedArrays; got {type_name} for `{arg}`. Inside a quaxified "
    "function a NamedArray is seen as a plain array, so `{fn}` cannot read its names "
    "there: call `{fn}` outside `quaxify` (it works under jax.jit, jax.grad and "
    "jax.vmap), or use the positional operation inside (its names are still checked). "
    "To give a plain array names, wrap it: `NamedArray(array, axes)`."
)
_ALIGN_MSG = (
    "`align`: {axes} must list each name of the array's axes {have} exactly once "
    "(and the array can have no unnamed axes)."
)
_TRACE_SAME_MSG = "`trace`: `axis1` and `axis2` are both {name!r}; trace along two different axes."
_DOT_SIZE_MSG = (
    "`dot`: axis {name!r} has length {left} in the left operand and {right} in the "
    "right one; axes with the same name must have the same length."
)


def _require_named(x, fn: str, arg: str) -> NamedArray:
    if not isinstance(x, NamedArray):
        raise NamedAxisError(_NOT_NAMED_MSG.format(fn=fn, arg=arg, type_name=type(x).__name__))
    return x


def _as_names(axis: AxisName | Sequence[AxisName]) -> tuple[AxisName, ...]:
    return (axis,) if isinstance(axis, (str, Axis)) else tuple(axis)  # pyright: ignore[reportArgumentType]


def rename(x: NamedArray | ArrayLike, mapping: Mapping[AxisName, AxisName]) -> NamedArray:
    """Rename some axes of `x`. Costs nothing: the array is unchanged.

    **Arguments:**

    - `x`: a `NamedArray`.
    - `mapping`: old name -> new name (None removes the name).

    **Returns:**

    A `NamedArray` with the same array and the new names.

    !!! example

        ```python
        w = NamedArray(jnp.ones((3, 4)), ("in", "out"))
        rename(w, {"in": "feature"}).axes  # ("feature", "out")
        ```
    """
    x = _require_named(x, "rename", "x")
    for old in mapping:
        x.position(old, "rename")
    # Unnamed axes stay unnamed (`position` above rejects `None` as a key).
    new_axes = tuple(None if name is None else mapping.get(name, name) for name in x.axes)
    return NamedArray(x.array, new_axes, x.allow_materialise)


def align(x: NamedArray | ArrayLike, axes: Sequence[AxisName]) -> NamedArray:
    """Transpose `x` so that its axes come in the order `axes`.

    **Arguments:**

    - `x`: a fully named `NamedArray`.
    - `axes`: its axis names in the wanted order.

    **Returns:**

    The transposed `NamedArray`, with `axes` as its names.

    !!! example

        ```python
        x = NamedArray(jnp.zeros((2, 3)), ("batch", "feature"))
        assert align(x, ("feature", "batch")).shape == (3, 2)
        ```
    """
    x = _require_named(x, "align", "x")
    axes = tuple(axes)
    # Names may be `Axis` objects, which do not sort: compare as sets, with counts.
    if None in x.axes or len(axes) != len(x.axes) or len(set(axes)) != len(axes):
        raise NamedAxisError(_ALIGN_MSG.format(axes=axes, have=x.axes))
    if set(axes) != set(x.axes):
        raise NamedAxisError(_ALIGN_MSG.format(axes=axes, have=x.axes))
    permutation = tuple(x.axes.index(name) for name in axes)
    # The rules for a NamedArray operand give a NamedArray.
    return cast(NamedArray, quaxlike.quaxify(lambda a: jnp.transpose(a, permutation))(x))


def sum(x: NamedArray | ArrayLike, axis: AxisName | Sequence[AxisName]) -> NamedArray | Array:  # noqa: A001
    """Sum `x` over the named axis or axes.

    **Arguments:**

    - `x`: a `NamedArray`.
    - `axis`: a name, or a sequence of names.

    **Returns:**

    A `NamedArray` with the remaining axes (a plain array when no named axis
    remains).

    !!! example

        ```python
        x = NamedArray(jnp.ones((2, 3)), ("batch", "feature"))
        sum(x, "batch").axes  # ("feature",)
        ```
    """
    x = _require_named(x, "sum", "x")
    positions = tuple(x.position(name, "sum") for name in _as_names(axis))
    return quaxlike.quaxify(lambda a: jnp.sum(a, axis=positions))(x)


def dot(
    x: NamedArray | ArrayLike, y: NamedArray | ArrayLike, axis: AxisName | Sequence[AxisName]
) -> NamedArray | Array:
    """Contract `x` and `y` over the named axis or axes, wherever they are.

    Like `jnp.einsum` with names: the axes in `axis` are summed over; every other
    name the two share becomes a batch axis (matched, not multiplied out); the
    rest are kept. The result's axes are the shared batch names (in `x`'s order),
    then `x`'s other axes, then `y`'s.

    **Arguments:**

    - `x`, `y`: `NamedArray`s; each has every name in `axis`.
    - `axis`: the name, or a sequence of names, to contract.

    **Returns:**

    A `NamedArray` (a plain array when no named axis remains).

    !!! example

        ```python
        x = NamedArray(jnp.ones((2, 3)), ("batch", "feature"))
        w = NamedArray(jnp.ones((4, 3)), ("hidden", "feature"))
        dot(x, w, "feature").axes  # ("batch", "hidden")
        ```
    """
    x = _require_named(x, "dot", "x")
    y = _require_named(y, "dot", "y")
    contract = _as_names(axis)
    check_names(contract)  # no repeats or non-names
    batch = tuple(n for n in x.axes if n is not None and n in y.axes and n not in contract)
    left = tuple(x.position(name, "dot") for name in contract + batch)
    right = tuple(y.position(name, "dot") for name in contract + batch)
    for name, i, j in zip(contract + batch, left, right):
        if x.array.shape[i] != y.array.shape[j]:
            raise NamedAxisError(
                _DOT_SIZE_MSG.format(name=name, left=x.array.shape[i], right=y.array.shape[j])
            )
    k = len(contract)
    dimension_numbers = ((left[:k], right[:k]), (left[k:], right[k:]))
    out = quaxlike.quaxify(lambda a, b: lax.dot_general(a, b, dimension_numbers))(x, y)
    # A full contraction inside `quaxify` is a NamedArray with no axes (as in
    # Quax); `dot` returns a plain array when no named axis remains, as `sum` does.
    return out.array if isinstance(out, NamedArray) and not out.axes else out


def trace(
    array: NamedArray | ArrayLike,
    *,
    offset: int = 0,
    axis1: AxisName,
    axis2: AxisName,
    dtype: DTypeLike | None = None,
) -> NamedArray | Array:
    """The sum along a diagonal of two named axes, as `jnp.trace` with names
    instead of positions (Quax's `named.trace`).

    **Arguments:**

    - `array`: a `NamedArray`.
    - `offset`: which diagonal: 0 for the main one, positive above it, negative
        below it (as for `jnp.trace`).
    - `axis1`, `axis2`: the names of the two axes to trace over (different axes).
    - `dtype`: the dtype of the result and of the accumulator, as for `jnp.trace`.

    **Returns:**

    A `NamedArray` with the other axes, in their order (a plain array when no
    named axis remains).

    !!! example

        ```python
        x = NamedArray(jnp.arange(24.0).reshape(2, 3, 4), ("a", "b", "c"))
        out = trace(x, axis1="a", axis2="c")
        assert out.axes == ("b",)
        assert jnp.array_equal(out.array, jnp.trace(x.array, axis1=0, axis2=2))
        ```
    """
    array = _require_named(array, "trace", "array")
    if axis1 is not None and axis1 == axis2:
        raise NamedAxisError(_TRACE_SAME_MSG.format(name=axis1))
    index1 = array.position(axis1, "trace")
    index2 = array.position(axis2, "trace")
    out = jnp.trace(array.array, offset=offset, axis1=index1, axis2=index2, dtype=dtype)
    axes = tuple(name for i, name in enumerate(array.axes) if i not in (index1, index2))
    if all(name is None for name in axes):
        return out
    return NamedArray(out, axes, array.allow_materialise)
