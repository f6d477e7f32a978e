"""`Axis`: an axis label that is an object, named by its identity, as in Quax.

Quax names the axes of a `NamedArray` with `Axis(size)` objects: two axes are the
same axis when they are the same object. quaxlike accepts them beside string
names, so code written for `quax.examples.named` runs unchanged.
"""

from typing import Any


class Axis:
    """An axis label identified by the object itself, optionally with a fixed size.

    This is Quax's way of naming axes: `Foo = Axis(3)` makes a new axis, distinct
    from every other `Axis` (two `Axis(3)` objects are different axes), and a
    `NamedArray` that uses it must have length 3 along it. It can stand wherever
    a string name can (`NamedArray(x, (Foo, "feature"))`, `sum(x, Foo)`, ...).
    Copies are the same object, so an `Axis` keeps its identity through
    `copy.deepcopy` and PyTree operations.

    **Arguments:**

    - `size`: the length every array axis labelled with it must have, or `None`
        to allow any length.
    - `name`: an optional label, used only when printing the axis (in `repr` and
        in error messages); it does not take part in comparisons.

    !!! example

        ```python
        Batch, Feature = Axis(None), Axis(3)
        x = NamedArray(jnp.ones((2, 3)), (Batch, Feature))
        w = NamedArray(jnp.ones((3, 4)), (Feature, "hidden"))
        y = quaxlike.quaxify(lambda x, w: x @ w)(x, w)
        assert y.axes == (Batch, "hidden")
        ```
    """

    __slots__ = ("_size", "_name")

    def __init__(self, size: int | None = None, name: str | None = None):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise TypeError(f"Axis: `size` must be a non-negative int or None; got {size!r}.")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Axis: `name` must be a string or None; got {name!r}.")
        object.__setattr__(self, "_size", size)
        object.__setattr__(self, "_name", name)

    @property
    def size(self) -> int | None:
        """The required length of an axis with this label (`None`: any length)."""
        return self._size

    @property
    def name(self) -> str | None:
        """The label shown when printing (not used in comparisons)."""
        return self._name

    def __setattr__(self, attr: str, value: Any) -> None:
        raise AttributeError(f"Axis is immutable; cannot set {attr!r}.")

    # Equality and hashing are by identity (object's defaults): the object is the
    # axis. Copying must keep that identity.
    def __copy__(self) -> "Axis":
        return self

    def __deepcopy__(self, memo) -> "Axis":
        return self

    def __reduce__(self):
        # Pickling cannot keep identity across processes; refuse rather than
        # hand back an axis that silently differs from the original.
        raise TypeError(
            "Axis objects are identified by identity and cannot be pickled; use a "
            "string axis name for NamedArrays that must be pickled."
        )

    def __repr__(self) -> str:
        label = f", name={self._name!r}" if self._name is not None else ""
        return f"Axis(size={self._size}{label}, id={id(self):#x})"
