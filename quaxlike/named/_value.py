"""`NamedArray`: an array whose axes carry names, and the errors for mismatches."""

from typing import Any, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

import quaxlike
from quaxlike.internal import ShapedArray, with_leaf_specs

from ._quax_names import Axis


AxisName: TypeAlias = str | Axis | None
"""The label of one axis: a string, an `Axis` object (Quax's form), or `None` for
an unnamed (positional) axis."""


_BAD_AXES_MSG = (
    "NamedArray: got {count} axis names {axes} for an array of shape {shape}; give "
    "exactly one name per dimension (use None for an axis with no name)."
)
_STACKED_MSG = (
    "NamedArray: the array has shape {shape} but there are {count} axis names {axes}. "
    "This happens with a NamedArray that `jax.vmap` stacked (the new leading axis "
    "has no name): map over it with `jax.vmap` again, or name the new axis with "
    "`NamedArray(x.array, ('batch', *x.axes))`."
)
_DUPLICATE_MSG = (
    "NamedArray: the axis name {name!r} appears more than once in {axes}; every name "
    "must be unique (rename one with `rename`)."
)
_BAD_NAME_MSG = (
    "NamedArray: axis names must be strings, `Axis` objects or None; got {name!r} of "
    "type {type_name} in {axes}."
)
_BAD_SIZE_MSG = (
    "NamedArray: axis {position} is labelled {name!r}, which requires length {size}, but "
    "the array has shape {shape}. Label that axis with another `Axis` (or a string), "
    "or pass an array of the right shape."
)
_REFUSE_MSG = (
    "Refusing to materialise a NamedArray with axes {axes} built with "
    "`allow_materialise=False`: the operation has no rule for named axes, and its "
    "result would lose the names. Call `x.enable_materialise()` to allow it (the "
    "result is then a plain array), or apply the operation to `x.array` yourself."
)
_NO_SUCH_AXIS_MSG = (
    "`{where}`: there is no axis named {name!r}; the axes are {axes}. Pick one of "
    "those, or `rename` an axis first."
)


class NamedAxisError(quaxlike.QuaxlikeError, ValueError):
    """Raised when the axis names of `NamedArray`s do not fit an operation: two
    different names meet, or a name is missing or repeated.

    It is also a `ValueError`, the exception Quax's `NamedArray` raises for these
    mistakes, so code that catches that keeps working.

    !!! example

        ```python
        x = NamedArray(jnp.ones((2, 3)), ("batch", "feature"))
        y = NamedArray(jnp.ones((2, 3)), ("batch", "hidden"))
        try:
            quaxlike.quaxify(lambda a, b: a + b)(x, y)
        except NamedAxisError as error:
            print(error)  # position 1 is 'feature' in one and 'hidden' in the other
        ```"""


class NamedContractionError(NamedAxisError, TypeError):
    """Raised when `dot_general` (`@`, `jnp.dot`, `jnp.einsum`, ...) would contract,
    or batch, two axes with different names.

    A `NamedAxisError` that is also a `TypeError`, the exception Quax raises for
    this mistake; its message starts as Quax's does ("Cannot contract mismatched
    dimensions", or "Cannot batch ...").

    !!! example

        ```python
        x = NamedArray(jnp.ones((2, 3)), ("batch", "feature"))
        w = NamedArray(jnp.ones((3, 4)), ("hidden", "out"))
        try:
            quaxlike.quaxify(lambda a, b: a @ b)(x, w)
        except NamedContractionError as error:
            print(error)  # Cannot contract mismatched dimensions ... 'feature' ... 'hidden'
        ```"""


def check_names(axes: tuple) -> None:
    """Every name is a string, an `Axis` or None, and no name appears twice."""
    for name in axes:
        if name is not None and not isinstance(name, (str, Axis)):
            raise NamedAxisError(
                _BAD_NAME_MSG.format(name=name, type_name=type(name).__name__, axes=axes)
            )
    named = [name for name in axes if name is not None]
    for name in named:
        if named.count(name) > 1:
            raise NamedAxisError(_DUPLICATE_MSG.format(name=name, axes=axes))


def check_axes(axes: tuple, shape: tuple[int, ...]) -> None:
    """`axes` are valid names for an array of `shape`: one per dimension, and
    `Axis` labels of a fixed size on dimensions of that length."""
    check_names(axes)
    if len(axes) != len(shape):
        raise NamedAxisError(_BAD_AXES_MSG.format(count=len(axes), axes=axes, shape=shape))
    for position, (name, length) in enumerate(zip(axes, shape)):
        if isinstance(name, Axis) and name.size is not None and name.size != length:
            raise NamedAxisError(
                _BAD_SIZE_MSG.format(position=position, name=name, size=name.size, shape=shape)
            )


class NamedArray(quaxlike.ArrayValue):
    """An array with a name for each axis.

    Inside `quaxify` a `NamedArray` behaves as its array, and the names ride
    along and are checked:

    - elementwise operations need the operands' names to agree axis by axis
      (an unnamed axis, `None`, agrees with anything). When two fully named
      operands hold the same names in a different order, the second is
      transposed to match the first. Anything else raises `NamedAxisError`.
    - `dot_general` (`@`, `jnp.dot`, `jnp.einsum`, ...) checks that each pair
      of contracted axes has the same name, and the result carries the remaining
      names in order: batch axes, then the left operand's, then the right's.
    - reductions, transposes, `broadcast_in_dim`, `squeeze`, slicing and
      size-1 reshapes move the names with the axes; new axes are unnamed.

    A plain array counts as having no names. A result with no names left is
    returned as a plain array; so is the result of an operation with no rule
    (for example a reshape that merges axes). To work by name rather than by
    position, use `dot`, `sum`, `align` and `rename` on `NamedArray`s outside
    `quaxify` (inside it, a `NamedArray` is seen as an array).

    **Arguments:**

    - `array`: the array.
    - `axes`: one name per dimension: a string, an `Axis` object (Quax's form,
        which may also fix the axis's length), or None for an unnamed axis. Names
        are unique and static (part of the PyTree structure, not traced).
    - `allow_materialise`: whether an operation with no rule may turn the
        `NamedArray` into its plain array (dropping the names). Default `True`;
        with `False` such an operation raises instead, as Quax's `NamedArray`
        does by default. Results of rules allow it only if every `NamedArray`
        operand did.

    !!! example

        ```python
        x = NamedArray(jnp.ones((2, 3)), ("batch", "feature"))
        w = NamedArray(jnp.ones((3, 4)), ("feature", "hidden"))
        y = quaxlike.quaxify(lambda x, w: jnp.tanh(x @ w))(x, w)
        y.axes  # ("batch", "hidden")
        ```
    """

    array: Array
    axes: tuple[AxisName, ...] = eqx.field(static=True)
    allow_materialise: bool = eqx.field(static=True)

    # `axes` is annotated loosely so that bad names get the error below, which
    # says what a name may be, rather than a generic type-check failure.
    def __init__(self, array: ArrayLike, axes: tuple | list, allow_materialise: bool = True):
        array = jnp.asarray(array)
        axes = tuple(axes)
        check_axes(axes, array.shape)
        self.array = array
        self.axes = axes
        self.allow_materialise = bool(allow_materialise)

    def logical_leaf_specs(self, spec: Any) -> "NamedArray":
        """The array has the value's shape (its axes in `axes` order) and follows its sharding (see `quaxlike.leaf_specs`).

        **Arguments:**

        - `spec`: a `PartitionSpec` of the array.

        **Returns:**

        This value with a `PartitionSpec` in place of each leaf.
        """
        return with_leaf_specs(self, array=spec)

    def aval(self) -> ShapedArray:
        aval = jax.typeof(self.array)
        if len(self.axes) != len(aval.shape):
            raise NamedAxisError(
                _STACKED_MSG.format(shape=aval.shape, count=len(self.axes), axes=self.axes)
            )
        return ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type)

    def materialise(self) -> Array:
        if not self.allow_materialise:
            raise RuntimeError(_REFUSE_MSG.format(axes=self.axes))
        return self.array

    def enable_materialise(self, allow_materialise: bool = True) -> "NamedArray":
        """The same `NamedArray` with `allow_materialise` set (Quax's method).

        **Arguments:**

        - `allow_materialise`: the new setting.

        **Returns:**

        A `NamedArray` with the same array and axes.

        !!! example

            ```python
            x = NamedArray(jnp.ones(3), ("feature",), allow_materialise=False)
            assert jnp.array_equal(x.enable_materialise().materialise(), jnp.ones(3))
            ```
        """
        return NamedArray(self.array, self.axes, allow_materialise)

    def position(self, name: AxisName, where: str = "NamedArray.position") -> int:
        """The position of the axis called `name`.

        **Arguments:**

        - `name`: an axis name (a string or an `Axis`).
        - `where`: the function to name in the error if there is no such axis.

        **Returns:**

        Its index in `axes`.
        """
        if name is None or name not in self.axes:
            raise NamedAxisError(_NO_SUCH_AXIS_MSG.format(where=where, name=name, axes=self.axes))
        return self.axes.index(name)

    def axis_size(self, name: AxisName) -> int:
        """The length of the axis called `name`."""
        return self.array.shape[self.position(name, "NamedArray.axis_size")]
